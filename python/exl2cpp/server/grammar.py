"""Constrained decoding for the server: JSON-schema / Lark grammars compiled by llguidance into per-token bitmasks
that the engine applies to the logits before sampling (see Engine.submit's ``constraint``).

llguidance is torch-free, reads the model's tokenizer.json directly and computes a mask in ~1 ms. A schema is the
client's input, so before llguidance sees it the schema is bounded (:class:`GrammarLimits`: nesting depth following
``$ref``, and size), and compiling runs on threads with a large stack: llguidance's compiler recurses once per
schema level (about 8 KiB of stack a level, 0.3 KiB per property of a flat object, measured with llguidance 1.9)
and a chain of 1,000 ``$ref`` objects overflowed the 8 MiB main thread (SIGSEGV). A compiled :class:`Grammar` is
probed once (first mask, then the tokens it forces) so that a grammar that cannot be decoded (a recursive required
property, a huge ``const``) is a :class:`GrammarError` before any job runs; each job gets a copy as a
:class:`Constraint`.
"""

from __future__ import annotations

import concurrent.futures
import json
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import numpy as np

from ..errors import InvalidArgumentError

_NO_WS = {
    "whitespace_flexible": False
}  # compact JSON: a small model cannot wander off into endless whitespace

# Compiler threads' stack: at the largest limits load_config accepts (depth 1024, 100,000 values) the measured use
# is about 8 MiB + 30 MiB; 128 MiB of address space (touched only as used) leaves more than 3x.
_STACK_BYTES = 128 << 20
_COMPILER_THREADS = 2
# forced tokens consumed by Grammar.probe (a grammar failing after them still fails as a 400, while decoding)
_PROBE_TOKENS = 256
MAX_DEPTH_LIMIT = 1024
MAX_NODES_LIMIT = 100_000


class GrammarError(InvalidArgumentError):
    """A client's grammar or schema that cannot be compiled or decoded (the client's error: a 400)."""

    def __init__(self, message: str, param: str = "response_format"):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on a client's JSON schema before it is compiled (ServeConfig max_schema_depth / max_schema_nodes).

    max_depth: nested subschemas (properties, items, anyOf/allOf/oneOf members, ...), each ``$ref`` followed (a
    recursive ``$ref`` counts once). max_nodes: JSON values in the schema document.
    """

    max_depth: int = 64
    max_nodes: int = 20_000


# ---- schema bounds ------------------------------------------------------------------------------------------------

# subschema keywords ($defs / definitions are reached through $ref)
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "dependentSchemas"})
_SCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})
_SCHEMA_ONE = frozenset(
    {
        "items",
        "additionalItems",
        "additionalProperties",
        "unevaluatedItems",
        "unevaluatedProperties",
        "propertyNames",
        "contains",
        "not",
        "if",
        "then",
        "else",
        "contentSchema",
    }
)


def _resolve(root: Any, ref: str) -> Any:
    """The subschema a local ``$ref`` ("#", "#/$defs/a") points at, or None (llguidance reports the others)."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in unquote(ref[1:]).split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _subschemas(schema: dict, root: Any) -> Iterator[tuple[dict, int]]:
    """(subschema, levels it adds): a keyword's subschema is one level down, a ``$ref`` target is the same level."""
    for key, v in schema.items():
        if key in _SCHEMA_MAPS and isinstance(v, dict):
            yield from ((x, 1) for x in v.values() if isinstance(x, dict))
        elif key in _SCHEMA_LISTS or key in _SCHEMA_ONE:
            if isinstance(v, dict):
                yield v, 1
            elif isinstance(v, list):  # "items": [...] of older drafts too
                yield from ((x, 1) for x in v if isinstance(x, dict))
        elif key == "$ref" and isinstance(v, str):
            target = _resolve(root, v)
            if isinstance(target, dict):
                yield target, 0


def _count_values(doc: Any, limit: int) -> int:
    n, stack = 0, [doc]
    while stack and n <= limit:
        v = stack.pop()
        n += 1
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return n


def schema_depth(schema: Any, limit: int) -> int:
    """Nesting depth of ``schema``'s subschemas, following local ``$ref`` (a referring schema and its target are one
    level; a ``$ref`` back into the current path, i.e. recursion, adds nothing); stops once past ``limit``.
    Iterative: no schema can exhaust our stack. A leaf schema is depth 1."""
    if not isinstance(schema, dict):
        return 0
    memo: dict[int, int] = {}  # depth of the subtree below a finished subschema
    on_path = {id(schema)}
    # a frame: [subschema, its subschemas, depth of the path down to it, levels added by its parent, its depth so far]
    stack: list[list[Any]] = [[schema, _subschemas(schema, schema), 1, 0, 1]]
    while stack:
        top = stack[-1]
        child, inc = next(top[1], (None, 0))
        if child is None:
            stack.pop()
            on_path.discard(id(top[0]))
            memo[id(top[0])] = top[4]
            if stack:
                stack[-1][4] = max(stack[-1][4], top[4] + top[3])
            continue
        cid = id(child)
        if cid in on_path:
            continue
        below = memo.get(cid)
        if below is not None:
            top[4] = max(top[4], below + inc)
            if top[2] - 1 + top[4] > limit:
                return top[2] - 1 + top[4]
        elif top[2] + inc > limit:
            return top[2] + inc
        else:
            on_path.add(cid)
            stack.append([child, _subschemas(child, schema), top[2] + inc, inc, 1])
    return memo[id(schema)]


def check_schema(schema: Any, limits: GrammarLimits, what: str, param: str) -> None:
    """Raise a GrammarError naming the limit if ``schema`` is deeper or larger than ``limits`` allow."""
    n = _count_values(schema, limits.max_nodes)
    if n > limits.max_nodes:
        raise GrammarError(
            f"{what} has more than {limits.max_nodes} JSON values, above this server's limit "
            "(max_schema_nodes)",
            param,
        )
    depth = schema_depth(schema, limits.max_depth)
    if depth > limits.max_depth:
        raise GrammarError(
            f"{what} nests subschemas more than {limits.max_depth} levels deep (counting each $ref), above "
            "this server's limit (max_schema_depth)",
            param,
        )


# ---- compiling on large-stack threads -----------------------------------------------------------------------------


class _CompilerThreads:
    """A few daemon threads with a large stack that run the compiler (see the module docstring)."""

    def __init__(self, n: int, stack_bytes: int):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        with _STACK_LOCK:
            old = threading.stack_size(stack_bytes)
            try:
                for i in range(n):
                    threading.Thread(
                        target=self._work, name=f"exl2cpp-grammar-{i}", daemon=True
                    ).start()
            finally:
                threading.stack_size(old)

    def submit(self, fn, *args) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fut, fn, args))
        return fut

    def _work(self) -> None:
        while True:
            fut, fn, args = self._jobs.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                fut.set_exception(exc)


_STACK_LOCK = (
    threading.Lock()
)  # threading.stack_size is process-wide: set it only around our threads' start
_CREATE_LOCK = threading.Lock()
_THREADS: _CompilerThreads | None = None


def _compiler() -> _CompilerThreads:
    global _THREADS
    with _CREATE_LOCK:
        if _THREADS is None:
            _THREADS = _CompilerThreads(_COMPILER_THREADS, _STACK_BYTES)
        return _THREADS


def _llg_message(text: str) -> str:
    return text.split("\n<non-verbose/>")[0].split("\n<state>")[0].strip()


class GrammarFactory:
    """Compiles grammars for one tokenizer (the llguidance tokenizer is built once, ~0.5 s).

    ``json_schema`` / ``lark`` compile on the compiler threads and wait; ``submit_json_schema`` / ``submit_lark``
    return a future instead (the server awaits it, so compiling never runs on the event loop)."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_ids: list[int],
        limits: GrammarLimits | None = None,
    ):
        import llguidance as llg

        self._llg = llg
        self.vocab_size = int(vocab_size)
        self.limits = limits or GrammarLimits()
        self._tok = llg.LLTokenizer(
            tokenizer_json, n_vocab=self.vocab_size, eos_token=eos_ids[0] if eos_ids else None
        )
        self._parser_limits = llg.LLParserLimits(verbose_errors=False)

    def json_schema(
        self, schema: dict[str, Any] | None, what: str = "response_format json schema"
    ) -> Grammar:
        """Output must be one JSON value matching ``schema`` (None / {}: any JSON object)."""
        return self.submit_json_schema(schema, what).result()

    def lark(
        self, source: str, what: str = "grammar", schemas: tuple = (), param: str = "tools"
    ) -> Grammar:
        """A Lark grammar; ``schemas`` are the JSON schemas it embeds (``%json``), checked against the limits."""
        return self.submit_lark(source, what, schemas, param).result()

    def submit_json_schema(
        self, schema: dict[str, Any] | None, what: str = "response_format json schema"
    ) -> concurrent.futures.Future:
        return _compiler().submit(self._json_schema, schema, what)

    def submit_lark(
        self, source: str, what: str = "grammar", schemas: tuple = (), param: str = "tools"
    ) -> concurrent.futures.Future:
        return _compiler().submit(self._lark, source, what, schemas, param)

    def _json_schema(self, schema: dict[str, Any] | None, what: str) -> Grammar:
        if schema is None:
            schema = {"type": "object"}
        if not isinstance(schema, dict):
            raise GrammarError(f"{what} must be a JSON object")
        check_schema(schema, self.limits, what, "response_format")
        schema = dict(schema)
        schema.setdefault("x-guidance", _NO_WS)
        grammar = self._llg.grammar_from("json_schema", json.dumps(schema))
        return self._compile(grammar, what, "response_format")

    def _lark(self, source: str, what: str, schemas: tuple, param: str) -> Grammar:
        for s in schemas:
            check_schema(s, self.limits, what, param)
        return self._compile(self._llg.grammar_from("lark", source), what, param)

    def _compile(self, grammar: str, what: str, param: str) -> Grammar:
        llg = self._llg
        is_err, messages = llg.LLMatcher.validate_grammar_with_warnings(
            grammar, self._tok, limits=self._parser_limits
        )
        if is_err:
            raise GrammarError(
                f"{what} is not supported: {'; '.join(_llg_message(m) for m in messages)}", param
            )
        m = llg.LLMatcher(self._tok, grammar, limits=self._parser_limits)
        if m.is_error():
            raise GrammarError(f"{what} is not supported: {_llg_message(m.get_error())}", param)
        g = Grammar(m, self.vocab_size, what, param)
        g.probe()
        return g


class Grammar:
    """A compiled grammar: ``constraint()`` gives each job its own matcher (a cheap copy)."""

    def __init__(self, matcher: Any, vocab_size: int, what: str, param: str):
        self._m = matcher
        self.vocab_size = vocab_size
        self.what = what
        self.param = param

    def constraint(self) -> Constraint:
        return Constraint(self._m.deep_copy(), self.vocab_size, self.what, self.param)

    def probe(self) -> None:
        """Decode as far as the grammar forces, on a copy: a grammar whose forced text never ends (a required property
        that refers to itself) or whose lexer blows up (a 10^6-character const) fails here with llguidance's message.
        The first mask is computed on the original first so that every copy starts from its warm lexer."""
        Constraint(self._m, self.vocab_size, self.what, self.param).mask()
        c = self.constraint()
        forced = c._m.compute_ff_tokens()
        c._check()
        if forced and not c._m.consume_tokens(forced[:_PROBE_TOKENS]):
            c._check()
            raise GrammarError(
                f"{self.what} cannot be decoded: its forced tokens were rejected", self.param
            )
        c.mask()


class Constraint:
    """One job's grammar state: ``mask()`` for the next token, ``advance(token)`` after each sampled token."""

    def __init__(
        self, matcher: Any, vocab_size: int, what: str = "grammar", param: str = "response_format"
    ):
        import llguidance.numpy as lnp

        self._m = matcher
        self._lnp = lnp
        self._bits = lnp.allocate_token_bitmask(1, vocab_size)
        self.what = what
        self.param = param

    def _check(self) -> None:
        if self._m.is_error():
            raise GrammarError(
                f"{self.what} cannot be decoded: {_llg_message(self._m.get_error())}", self.param
            )

    def mask(self) -> list[int]:
        self._lnp.fill_next_token_bitmask(self._m, self._bits, 0)
        self._check()
        return self._bits[0].view(np.uint32).tolist()

    def advance(self, token: int) -> list[int]:
        if not self._m.consume_token(int(token)):
            raise GrammarError(
                f"{self.what}: token {token} rejected ({_llg_message(self._m.get_error())})",
                self.param,
            )
        return self.mask()

    @property
    def done(self) -> bool:
        return self._m.is_stopped() or self._m.is_accepting()
