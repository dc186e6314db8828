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

JSON output never repeats a key in one object: llguidance keeps the keys listed in ``properties`` unique, but not
those that ``additionalProperties`` (allowed unless the schema says otherwise) or ``json_object`` admit, and a small
model happily writes ``"city":"New York","city":"New York"``. A :class:`_KeyGuard` follows each job's output and
masks the tokens that would close a key its object already has.
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
        self._keys = _TokenQuotes(self._tok, self.vocab_size)

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

    def submit_grammar(self, kind: str, text: str, what: str, param: str) -> concurrent.futures.Future:
        """A client's regular expression (``kind`` "regex") or grammar ("grammar": Lark or GBNF, told apart by
        llguidance)."""
        return _compiler().submit(self._grammar_text, kind, text, what, param)

    def _grammar_text(self, kind: str, text: str, what: str, param: str) -> Grammar:
        try:
            grammar = self._llg.grammar_from(kind, text)
        except Exception as exc:  # noqa: BLE001 - any failure to read the client's grammar is a 400
            raise GrammarError(f"{what} is not valid: {exc}", param) from None
        return self._compile(grammar, what, param)

    def _json_schema(self, schema: dict[str, Any] | None, what: str) -> Grammar:
        if schema is None:
            schema = {"type": "object"}
        if not isinstance(schema, dict):
            raise GrammarError(f"{what} must be a JSON object")
        check_schema(schema, self.limits, what, "response_format")
        schema = dict(schema)
        schema.setdefault("x-guidance", _NO_WS)
        grammar = self._llg.grammar_from("json_schema", json.dumps(schema))
        return self._compile(grammar, what, "response_format", self._keys)

    def _lark(self, source: str, what: str, schemas: tuple, param: str) -> Grammar:
        for s in schemas:
            check_schema(s, self.limits, what, param)
        # the JSON that a grammar with embedded schemas (a tool call) writes gets unique keys too
        keys = self._keys if schemas else None
        return self._compile(self._llg.grammar_from("lark", source), what, param, keys)

    def _compile(
        self, grammar: str, what: str, param: str, keys: _TokenQuotes | None = None
    ) -> Grammar:
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
        g = Grammar(m, self.vocab_size, what, param, keys)
        g.probe()
        return g


class Grammar:
    """A compiled grammar: ``constraint()`` gives each job its own matcher (a cheap copy)."""

    def __init__(
        self, matcher: Any, vocab_size: int, what: str, param: str, keys: _TokenQuotes | None
    ):
        self._m = matcher
        self.vocab_size = vocab_size
        self.what = what
        self.param = param
        self._keys = keys

    def constraint(self) -> Constraint:
        return Constraint(self._m.deep_copy(), self.vocab_size, self.what, self.param, self._keys)

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
    """One job's grammar state: ``mask()`` for the next token, ``advance(token)`` after each sampled token, and
    ``draft_masks(drafts)`` for speculative decoding (the masks after each draft, on a copy; ``advance`` then takes
    the masks of the drafts that were accepted from there instead of computing them again)."""

    def __init__(
        self,
        matcher: Any,
        vocab_size: int,
        what: str = "grammar",
        param: str = "response_format",
        keys: _TokenQuotes | None = None,
    ):
        import llguidance.numpy as lnp

        self._m = matcher
        self._lnp = lnp
        self._bits = lnp.allocate_token_bitmask(1, vocab_size)
        self.what = what
        self.param = param
        self._guard = _KeyGuard(keys) if keys is not None else None
        self._ahead: list[tuple[int, list[int]]] = []  # (draft, mask after it) from draft_masks, next first
        self._now: list[int] | None = None  # the mask last returned (that of the next token)
        self._spec: tuple[Any, _KeyGuard | None] | None = None  # (matcher, guard) copies at the end of _ahead

    def _check(self) -> None:
        if self._m.is_error():
            raise GrammarError(
                f"{self.what} cannot be decoded: {_llg_message(self._m.get_error())}", self.param
            )

    def mask(self) -> list[int]:
        self._now = self._mask_of(self._m, self._guard)
        return self._now

    def _mask_of(self, matcher: Any, guard: _KeyGuard | None) -> list[int]:
        self._lnp.fill_next_token_bitmask(matcher, self._bits, 0)
        if matcher.is_error():
            raise GrammarError(
                f"{self.what} cannot be decoded: {_llg_message(matcher.get_error())}", self.param
            )
        words = self._bits[0].view(np.uint32)
        if guard is not None:
            guard.filter(words)
        return words.tolist()

    def advance(self, token: int) -> list[int]:
        token = int(token)
        if not self._m.consume_token(token):
            raise GrammarError(
                f"{self.what}: token {token} rejected ({_llg_message(self._m.get_error())})",
                self.param,
            )
        if self._guard is not None:
            self._guard.feed(token)
        if self._ahead and self._ahead[0][0] == token:
            self._now = self._ahead.pop(0)[1]  # computed by draft_masks in this very state
            return self._now
        self._ahead.clear()
        self._spec = None
        return self.mask()

    def draft_masks(self, drafts: list[int]) -> list[list[int]]:
        """The masks after drafts[0], drafts[:2], ... (what ``advance`` would return for each in turn), stopping at
        the first draft the grammar does not accept or that leaves it in error. This state is not changed. Drafts
        that extend those of the last call (a draft model proposing one token at a time) continue from there."""
        drafts = [int(t) for t in drafts]
        n = len(self._ahead)
        k = min(n, len(drafts))
        if self._spec is None or drafts[:k] != [t for t, _m in self._ahead[:k]]:
            self._spec = (self._m.deep_copy(), self._guard.copy() if self._guard is not None else None)
            self._ahead, n = [], 0
        m, guard = self._spec
        allowed = self._ahead[-1][1] if n else self._now if self._now is not None else self.mask()
        for t in drafts[n:]:
            # a draft outside the mask is refused without asking the matcher (which would log a parser error)
            if not (0 <= t < len(allowed) * 32 and allowed[t >> 5] >> (t & 31) & 1):
                break
            if not m.consume_token(t):
                self._spec = None  # the copy is in error: a later call starts from a fresh one
                break
            if guard is not None:
                guard.feed(t)
            try:
                allowed = self._mask_of(m, guard)
            except GrammarError:  # the job meets it when (if) it samples this token
                self._spec = None
                break
            self._ahead.append((t, allowed))
        return [mask for _t, mask in self._ahead[: len(drafts)]]

    @property
    def done(self) -> bool:
        return self._m.is_stopped() or self._m.is_accepting()


# ---- unique keys in JSON output -----------------------------------------------------------------------------------


class _TokenQuotes:
    """Per tokenizer: every token's bytes, and the tokens that contain a double quote (the only ones that can close a
    key), with how many quotes each has."""

    def __init__(self, tok: Any, vocab_size: int):
        self.bytes = [
            b"" if tok.is_special_token(i) else tok.decode_bytes([i]) for i in range(vocab_size)
        ]
        ids = [i for i, b in enumerate(self.bytes) if b'"' in b]
        self.ids = np.array(ids, dtype=np.int64)
        self.quotes = np.array([self.bytes[i].count(b'"') for i in ids], dtype=np.int64)


def _key_text(raw: bytes) -> str:
    """A key as JSON reads it (escapes such as \\u0079 resolved), from its bytes between the quotes."""
    if b"\\" not in raw:
        return raw.decode("utf-8", "replace")
    try:
        return json.loads(b'"' + raw + b'"')
    except ValueError:
        return raw.decode("utf-8", "replace")


class _Obj:
    """An open JSON object: the keys it has, whether a string now would be a key, keys seen by a simulation."""

    __slots__ = ("expect_key", "keys", "tried")

    def __init__(self, keys: set[str] | None = None, expect_key: bool = True) -> None:
        self.keys: set[str] = set() if keys is None else keys
        self.expect_key = expect_key
        self.tried: set[str] = set()


_OBJ, _ARR, _CLOSE, _QUOTE, _ESC, _COMMA = ord("{"), ord("["), b"}]", ord('"'), ord("\\"), ord(",")


class _KeyGuard:
    """Follows a job's JSON output byte by byte (the grammar guarantees it is JSON, so a light scanner suffices:
    containers, strings, which string is a key) and clears from each mask the tokens that would close a key that the
    innermost object already has."""

    def __init__(self, quotes: _TokenQuotes):
        self._q = quotes
        self.stack: list[_Obj | None] = []  # None: an array
        self.in_str = self.is_key = self.esc = False
        self.buf = bytearray()  # the key being written, raw

    def feed(self, token: int) -> None:
        self._scan(self._q.bytes[token], trial=False)

    def copy(self) -> _KeyGuard:
        """An independent copy (its own key sets): fed on speculatively, this one is left as it is."""
        c = _KeyGuard.__new__(_KeyGuard)
        c._q = self._q
        c.stack = [o if o is None else _Obj(set(o.keys), o.expect_key) for o in self.stack]
        c.in_str, c.is_key, c.esc, c.buf = self.in_str, self.is_key, self.esc, bytearray(self.buf)
        return c

    def _scan(self, data: bytes, trial: bool) -> bool:
        """Advance over ``data``. trial (on a copy): stop with True at a key its object already has, and record the
        keys it closes apart (``tried``) so that the real key sets stay as they are."""
        for b in data:
            top = self.stack[-1] if self.stack else None
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif b == _ESC:
                    self.esc = True
                elif b == _QUOTE:
                    self.in_str = False
                    if self.is_key and top is not None:
                        key = _key_text(bytes(self.buf))
                        if trial and (key in top.keys or key in top.tried):
                            return True
                        (top.tried if trial else top.keys).add(key)
                    continue
                if self.is_key:
                    self.buf.append(b)
            elif b == _QUOTE:
                self.in_str, self.esc = True, False
                self.is_key = top is not None and top.expect_key
                if self.is_key:
                    top.expect_key = False
                    self.buf.clear()
            elif b == _OBJ:
                self.stack.append(_Obj())
            elif b == _ARR:
                self.stack.append(None)
            elif b in _CLOSE:
                if self.stack:
                    self.stack.pop()
            elif b == _COMMA and top is not None:
                top.expect_key = True
        return False

    def _trial(self) -> _KeyGuard:
        """A copy to simulate on: its objects share the key sets (read only there), the rest is its own."""
        t = _KeyGuard.__new__(_KeyGuard)
        t._q = self._q
        t.stack = [o if o is None else _Obj(o.keys, o.expect_key) for o in self.stack]
        t.in_str, t.is_key, t.esc, t.buf = self.in_str, self.is_key, self.esc, bytearray(self.buf)
        return t

    def filter(self, words: np.ndarray) -> None:
        """Clear (in place) the bits of allowed tokens that would repeat a key; never all of them."""
        if not any(o is not None and o.keys for o in self.stack):
            return
        q = self._q
        # a token can close a key only with a quote in it: in a key 1, between values 2 (open, close), in a value 3
        need = 1 if self.in_str and self.is_key else (3 if self.in_str else 2)
        cand = q.ids[q.quotes >= need]
        allowed = cand[((words[cand >> 5] >> (cand & 31).astype(np.uint32)) & 1).astype(bool)]
        banned = [int(t) for t in allowed if self._repeats(q.bytes[int(t)])]
        if not banned:
            return
        saved = words.copy()
        for t in banned:
            words[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
        if not words.any():  # the grammar allows nothing else: keep its mask
            words[:] = saved

    def _repeats(self, data: bytes) -> bool:
        """Would ``data`` close a key that its object already has? (this guard is left as it is)"""
        if self.in_str and self.is_key and not self.esc and b"\\" not in data:  # the usual case
            i = data.index(b'"')
            top = self.stack[-1]
            if top is not None and _key_text(bytes(self.buf) + data[:i]) in top.keys:
                return True
            if data.count(b'"', i + 1) < 2:  # no other key can close in this token
                return False
        return self._trial()._scan(data, trial=True)
