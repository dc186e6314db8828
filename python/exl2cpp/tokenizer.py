"""Tokenizer of a model folder: HF `tokenizers` encode/decode, the model's Jinja chat template, streaming decode.

    >>> tok = Tokenizer("path/to/model")
    >>> ids = tok.encode("Hello")                      # BOS added when the model wants one
    >>> tok.decode(ids)
    >>> prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    >>> dec = StreamDecoder(tok); "".join(dec.push(i) for i in ids) + dec.flush()

Files read from the folder: ``tokenizer.json`` (required), ``tokenizer_config.json`` (bos/eos tokens,
``add_bos_token``, ``chat_template``), ``chat_template.jinja`` / ``chat_template.json`` (newer HF
layout), ``config.json`` and ``generation_config.json`` (``bos_token_id``/``eos_token_id``).

A chat template is code that comes with a downloaded model, so it is rendered in Jinja's immutable sandbox with
bounds (:class:`TemplateLimits`): a render that runs past its time limit or builds more text than its size limit
stops itself with a ModelFormatError naming the template file.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from .errors import InvalidArgumentError, ModelFileError, ModelFormatError

__all__ = ["StreamDecoder", "TemplateLimits", "Tokenizer"]


@dataclass(frozen=True)
class TemplateLimits:
    """Bounds on one chat-template render (``exl2cpp serve``: template_timeout_s, template_max_chars).

    timeout_s: wall time of the render. max_chars: characters (or list items) the template may build in all, its
    output, every intermediate string and every operator or filter result counted. A normal template builds a small
    multiple of its messages' length.
    """

    timeout_s: float = 10.0
    max_chars: int = 32 << 20


def _read_json(path: Path, required: bool = False) -> Any:
    if not path.is_file():
        if required:
            raise ModelFileError(
                f"{path.name} not found in {path.parent}; the model folder needs it"
            )
        return None
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ModelFormatError(f"{path}: not valid UTF-8 ({exc})") from exc
    except json.JSONDecodeError as exc:
        raise ModelFormatError(f"{path}: invalid JSON ({exc})") from exc


def _token_content(value: Any) -> str | None:
    """tokenizer_config tokens are strings or AddedToken dicts ({"content": ...})."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """Tokenizer of a model folder (see the module docstring for the files read)."""

    def __init__(self, model_dir: str | os.PathLike):
        from tokenizers import Tokenizer as _HFTokenizer

        self.model_dir = Path(model_dir)
        if not self.model_dir.is_dir():
            raise ModelFileError(f"tokenizer: model folder {self.model_dir} does not exist")
        tok_path = self.model_dir / "tokenizer.json"
        if not tok_path.is_file():
            raise ModelFileError(
                f"tokenizer.json not found in {self.model_dir}; exl2cpp needs a HF fast tokenizer "
                "(save one with transformers' tokenizer.save_pretrained, or import a GGUF)"
            )
        try:
            self._json = tok_path.read_bytes().decode("utf-8")
            self._tk = _HFTokenizer.from_str(self._json)
        except UnicodeDecodeError as exc:
            raise ModelFormatError(f"{tok_path}: not valid UTF-8 ({exc})") from exc
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON / unknown models
            raise ModelFormatError(f"{tok_path}: cannot load the tokenizer ({exc})") from exc
        self._tk_plain: Any = None  # a copy that treats special-token text as plain text
        self._lock = threading.Lock()

        self.config = _read_json(self.model_dir / "tokenizer_config.json") or {}
        model_cfg = _read_json(self.model_dir / "config.json") or {}
        gen_cfg = _read_json(self.model_dir / "generation_config.json") or {}

        self.chat_template_file: Path | None = None  # where chat_template came from (for errors)
        self.chat_template = self._load_chat_template()
        self.bos_token = _token_content(self.config.get("bos_token"))
        self.eos_token = _token_content(self.config.get("eos_token"))
        self.pad_token = _token_content(self.config.get("pad_token"))
        self.unk_token = _token_content(self.config.get("unk_token"))

        bos = model_cfg.get("bos_token_id", gen_cfg.get("bos_token_id"))
        if isinstance(bos, list):
            bos = bos[0] if bos else None
        if bos is None and self.bos_token is not None:
            bos = self._tk.token_to_id(self.bos_token)
        self.bos_id: int | None = bos
        if self.bos_token is None and bos is not None:
            self.bos_token = self._tk.id_to_token(bos)

        eos_ids: list[int] = []
        for source in (model_cfg.get("eos_token_id"), gen_cfg.get("eos_token_id")):
            for i in source if isinstance(source, list) else [source]:
                if isinstance(i, int) and i not in eos_ids:
                    eos_ids.append(i)
        if self.eos_token is not None:
            i = self._tk.token_to_id(self.eos_token)
            if i is not None and i not in eos_ids:
                eos_ids.append(i)
        self.eos_ids: list[int] = eos_ids
        if self.eos_token is None and eos_ids:
            self.eos_token = self._tk.id_to_token(eos_ids[0])

        add_bos = self.config.get("add_bos_token")
        if add_bos is None:  # no explicit setting: does the tokenizer's post-processor add it?
            probe = self._tk.encode("a", add_special_tokens=True).ids
            add_bos = bool(probe) and self.bos_id is not None and probe[0] == self.bos_id
        self.add_bos_default = bool(add_bos) and self.bos_id is not None
        self._template_cache: dict[str, Any] = {}

    # -- basic -------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (added tokens included)."""
        return self._tk.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int | None:
        return self.eos_ids[0] if self.eos_ids else None

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tk.id_to_token(int(token_id))

    def encode(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Token ids of ``text``.

        add_bos: True/False, or None to follow the model (``add_bos_token`` or its post-processor).
        A BOS is never doubled: text that already starts with the BOS token keeps just that one.
        special: True parses special-token text such as ``<|im_start|>`` into its id; False
        tokenizes it as plain text (for untrusted user input).
        """
        if not isinstance(text, str):
            raise InvalidArgumentError(f"encode: text must be a str, got {type(text).__name__}")
        tk = self._tk if special else self._plain()
        ids = tk.encode(text, add_special_tokens=False).ids
        if add_bos is None:
            add_bos = self.add_bos_default
        if add_bos:
            if self.bos_id is None:
                raise InvalidArgumentError(
                    f"encode: add_bos=True but the model in {self.model_dir} has no BOS token"
                )
            if not ids or ids[0] != self.bos_id:
                ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of ``ids``; ``skip_special`` drops special tokens (BOS, EOS, <|im_start|>...)."""
        ids = [int(i) for i in ids]
        n = self.vocab_size
        bad = [i for i in ids if i < 0 or i >= n]
        if bad:
            raise InvalidArgumentError(f"decode: token id {bad[0]} is out of range [0, {n})")
        return self._tk.decode(ids, skip_special_tokens=skip_special)

    def _plain(self) -> Any:
        with self._lock:
            if self._tk_plain is None:
                from tokenizers import Tokenizer as _HFTokenizer

                tk = _HFTokenizer.from_str(self._json)
                tk.encode_special_tokens = True
                self._tk_plain = tk
        return self._tk_plain

    # -- chat template -----------------------------------------------------------------------

    def _load_chat_template(self) -> Any:
        jinja_file = self.model_dir / "chat_template.jinja"
        if jinja_file.is_file():
            self.chat_template_file = jinja_file
            try:
                return jinja_file.read_text(encoding="utf-8")
            except UnicodeDecodeError as exc:
                raise ModelFormatError(f"{jinja_file}: not valid UTF-8 ({exc})") from exc
        json_file = _read_json(self.model_dir / "chat_template.json")
        if isinstance(json_file, dict) and "chat_template" in json_file:
            self.chat_template_file = self.model_dir / "chat_template.json"
            return json_file["chat_template"]
        if self.config.get("chat_template"):
            self.chat_template_file = self.model_dir / "tokenizer_config.json"
        return self.config.get("chat_template")

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def _select_template(self, tools: Any, chat_template: str | None) -> str:
        templates = self.chat_template
        if isinstance(templates, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in templates if isinstance(t, dict)}
        elif isinstance(templates, dict):
            named = dict(templates)
        else:
            named = {"default": templates} if templates else {}
        if chat_template is not None:
            if chat_template in named:
                return named[chat_template]
            if "{" in chat_template:  # a literal template
                return chat_template
            raise InvalidArgumentError(
                f"chat template {chat_template!r} not found in {self.model_dir} (has: {sorted(named)})"
            )
        if not named:
            raise InvalidArgumentError(
                f"the model in {self.model_dir} has no chat template (tokenizer_config.json 'chat_template'); "
                "use raw prompts or pass chat_template=..."
            )
        if tools and named.get("tool_use"):
            return named["tool_use"]
        if named.get("default"):
            return named["default"]
        if len(named) == 1:
            return next(iter(named.values()))
        raise InvalidArgumentError(
            f"the model in {self.model_dir} has several chat templates {sorted(named)} and no 'default'; "
            "pass chat_template=<name>"
        )

    def _compile(self, source: str) -> Any:
        cached = self._template_cache.get(source)
        if cached is None:
            cached = _compile_template(source, self._template_name())
            self._template_cache[source] = cached
        return cached

    def _template_name(self) -> str:
        return f"the chat template in {self.chat_template_file or self.model_dir}"

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
        template_limits: TemplateLimits | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` with the model's Jinja chat template, as HF transformers does.

        The template sees ``messages``, ``add_generation_prompt``, ``tools``, the special tokens
        (``bos_token``, ``eos_token``, ``pad_token``, ``unk_token``) and every extra keyword
        (e.g. ``documents``, ``enable_thinking``). ``chat_template`` picks one of several named
        templates, or is a template string itself. ``template_limits`` bounds the render (default
        :class:`TemplateLimits`): past them it stops with a ModelFormatError.
        """
        import jinja2

        if not isinstance(messages, (list, tuple)) or not all(
            isinstance(m, dict) for m in messages
        ):
            raise InvalidArgumentError(
                "apply_chat_template: messages must be a list of {'role', 'content'} dicts"
            )
        template = self._compile(self._select_template(tools, chat_template))
        context = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "pad_token": self.pad_token or "",
            "unk_token": self.unk_token or "",
        }
        context.update(kwargs)
        limits = template_limits or TemplateLimits()
        _BUDGET.start(limits)
        try:
            return template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                **context,
            )
        except _TemplateLimit as exc:
            raise ModelFormatError(
                f"{self._template_name()} was stopped: {exc}. A template that loops or recurses without "
                "end, or builds huge strings, is broken (or hostile): fix or replace it"
            ) from None
        except _TemplateRaise as exc:
            raise InvalidArgumentError(f"chat template: {exc}") from None
        except jinja2.TemplateError as exc:
            raise InvalidArgumentError(f"{self._template_name()} failed: {exc}") from exc
        except Exception as exc:
            raise InvalidArgumentError(
                f"{self._template_name()} failed on these messages: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            _BUDGET.stop()


class _TemplateRaise(Exception):
    """raise_exception() called by a chat template."""


class _TemplateLimit(Exception):
    """A render ran past its TemplateLimits (raised inside the template's code, caught by apply_chat_template)."""


class _Budget(threading.local):
    """The running render's limits (one render at a time per thread).

    Every loop iteration, call, operator, filter and output of a template passes through the environment's hooks,
    which ``tick`` (the deadline is checked there: a loop or a recursion without end cannot run on unnoticed) and
    ``spend`` the size of what they built (strings in characters, lists in items). Operations whose size follows
    from their arguments (``'a' * n``, ``center(n)``, ``'%0999999999d' % 1``, ``join``, ``replace``) are checked
    before they run, so the big value is never allocated; the others are at most a few times the budget."""

    limits: TemplateLimits | None = None
    deadline = 0.0
    left = 0

    def start(self, limits: TemplateLimits) -> None:
        self.limits, self.deadline, self.left = (
            limits,
            time.monotonic() + limits.timeout_s,
            int(limits.max_chars),
        )

    def stop(self) -> None:
        self.limits = None

    def tick(self) -> None:
        if self.limits is not None and time.monotonic() > self.deadline:
            raise _TemplateLimit(
                f"it ran longer than {self.limits.timeout_s:g} s (template_timeout_s)"
            )

    def need(self, n: int) -> None:
        if self.limits is not None and n > self.left:
            raise _TemplateLimit(
                f"it built more than {self.limits.max_chars} characters (template_max_chars)"
            )

    def spend(self, value: Any) -> Any:
        n = _size(value)
        self.need(n)
        self.left -= n
        return value


_BUDGET = _Budget()
_DIGITS = re.compile(r"\d+")
_SIZED_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})


def _size(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value.bit_length() // 3 + 1  # about its decimal digits
    try:
        return len(value) if isinstance(value, (str, bytes, list, tuple, dict, set)) else 0
    except TypeError:
        return 0


def _precheck(name: str, target: Any, args: tuple, kwargs: dict) -> None:
    """Refuse, before it runs, a call that would build more than the budget left (see _Budget)."""
    left = _BUDGET.left
    values = (*args, *kwargs.values())
    if any(isinstance(v, int) and not isinstance(v, bool) and v > left for v in values):
        _BUDGET.need(left + 1)  # a width / count argument above the budget
    if name in ("format", "format_map", "strftime_now", "%"):  # widths in a format string
        fmt = target if isinstance(target, str) else (args[0] if args else "")
        if isinstance(fmt, str) and any(len(d) > 7 or int(d) > left for d in _DIGITS.findall(fmt)):
            _BUDGET.need(left + 1)
    elif name == "join":
        items = args[0] if isinstance(target, str) and args else target
        if isinstance(items, (list, tuple)):
            _BUDGET.need(sum(_size(x) for x in items))
    elif name == "replace" and isinstance(target, str) and len(args) >= 2:
        old, new = args[0], args[1]
        if isinstance(old, str) and isinstance(new, str):
            hits = target.count(old) if old else len(target) + 1
            _BUDGET.need(len(target) + hits * len(new))


def _bounded(name: str, fn: Any) -> Any:
    """A filter or global that ticks, is prechecked, and spends its result. It takes the context (as
    ``pass_context``), so Jinja never runs it while compiling (constant folding would bypass the budget)."""
    import functools

    from jinja2 import pass_context

    passes = getattr(getattr(fn, "jinja_pass_arg", None), "name", None)

    @pass_context
    @functools.wraps(fn)
    def wrapper(context: Any, *args: Any, **kwargs: Any) -> Any:
        _BUDGET.tick()
        _precheck(name, args[0] if args else None, args[1:], kwargs)
        if passes is None:
            out = fn(*args, **kwargs)
        else:
            first = {"context": context, "eval_context": context.eval_ctx}.get(
                passes, context.environment
            )
            out = fn(first, *args, **kwargs)
        return _BUDGET.spend(out)

    return wrapper


_ENV_CLASS: Any = None


def _bounded_environment() -> Any:
    """Jinja's ImmutableSandboxedEnvironment with every loop, call, operator, filter, concatenation and output
    passing through _Budget (built once: jinja2 is imported on first use)."""
    global _ENV_CLASS
    if _ENV_CLASS is not None:
        return _ENV_CLASS
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.visitor import NodeTransformer

    class _Unsupported(NodeTransformer):
        """Rejects tags that load other template files; wraps loops' iterables and ``~`` in budget hooks."""

        def visit_For(self, node: Any) -> Any:
            self.generic_visit(node)
            node.iter = nodes.Call(
                nodes.EnvironmentAttribute("exl2_loop"), [node.iter], [], None, None
            ).set_lineno(node.lineno)
            return node

        def visit_Concat(self, node: Any) -> Any:
            self.generic_visit(node)
            return nodes.Call(
                nodes.EnvironmentAttribute("exl2_spend"), [node], [], None, None
            ).set_lineno(node.lineno)

        def _loads(self, node: Any) -> Any:
            tag = {"Include": "include", "Extends": "extends"}.get(type(node).__name__, "import")
            raise _TemplateFeature(tag, node.lineno)

        visit_Include = visit_Extends = visit_Import = visit_FromImport = _loads

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def __init__(self, **kw: Any):
            super().__init__(
                optimized=False, finalize=self._finalize, **kw
            )  # no constant folding at compile
            self.filters = {k: _bounded(k, f) for k, f in self.filters.items()}

        def _parse(self, source: str, name: Any, filename: Any) -> Any:
            return _Unsupported().visit(super()._parse(source, name, filename))

        @staticmethod
        def _finalize(value: Any) -> Any:  # every {{ output }}
            _BUDGET.tick()
            return _BUDGET.spend(value if isinstance(value, str) else str(value))

        def concat(self, parts: Iterable[str]) -> str:  # buffers: {% set %} blocks, macro bodies
            return _BUDGET.spend("".join(parts))

        @staticmethod
        def exl2_loop(iterable: Any) -> Iterator[Any]:
            for x in iterable:
                _BUDGET.tick()
                yield x

        @staticmethod
        def exl2_spend(value: Any) -> Any:
            return _BUDGET.spend(value)

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _BUDGET.tick()
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(n, int) and isinstance(seq, (str, list, tuple)):
                        _BUDGET.need(len(seq) * max(n, 0))
            elif operator == "**" and isinstance(left, int) and isinstance(right, int):
                if right > 0 and abs(left) > 1:
                    _BUDGET.need(abs(left).bit_length() * right // 3)
            elif operator == "%" and isinstance(left, str):
                _precheck("%", left, right if isinstance(right, tuple) else (right,), {})
            return _BUDGET.spend(super().call_binop(context, operator, left, right))

        def getattr(self, obj: Any, attribute: str) -> Any:
            _BUDGET.tick()
            return super().getattr(obj, attribute)

        def getitem(self, obj: Any, argument: Any) -> Any:
            _BUDGET.tick()
            return super().getitem(obj, argument)

        def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
            _BUDGET.tick()
            name = getattr(obj, "__name__", "")
            # a str method, bound, or a sandbox-wrapped str.format (which keeps the bound method as __wrapped__)
            target = getattr(
                obj, "__self__", getattr(getattr(obj, "__wrapped__", None), "__self__", None)
            )
            if isinstance(target, str) and name in (
                "format",
                "format_map",
                "join",
                "replace",
                *_SIZED_METHODS,
            ):
                _precheck(name, target, args, kwargs)
            return _BUDGET.spend(super().call(context, obj, *args, **kwargs))

    _ENV_CLASS = BoundedSandbox
    return _ENV_CLASS


class _TemplateFeature(Exception):
    def __init__(self, tag: str, lineno: int):
        super().__init__(tag)
        self.tag, self.lineno = tag, lineno


def _compile_template(source: str, name: str = "the chat template") -> Any:
    import jinja2
    from jinja2.ext import Extension

    class _Generation(Extension):
        """HF's {% generation %}...{% endgeneration %} (marks assistant text): rendered as its body."""

        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message: str) -> None:
        raise _TemplateRaise(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = _bounded_environment()(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _bounded("tojson", tojson)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _bounded("strftime_now", strftime_now)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ModelFormatError(
            f"{name} has a Jinja syntax error (line {exc.lineno}): {exc.message}"
        ) from exc
    except _TemplateFeature as exc:
        raise ModelFormatError(
            f"{name} uses {{% {exc.tag} %}} (line {exc.lineno}), which loads other template files; exl2cpp "
            "renders a chat template on its own, without a loader: inline what it loads"
        ) from None
    except (RecursionError, MemoryError) as exc:
        raise ModelFormatError(f"{name} cannot be compiled: {type(exc).__name__}") from None


class StreamDecoder:
    """Incremental detokenizer: push token ids one at a time, get back the text they complete.

    Text is returned only once it is complete UTF-8: a character split over several byte tokens
    comes out whole with the token that finishes it. Decoding re-reads a short window of recent
    tokens so that decoders which strip or add leading spaces (SentencePiece) stay right.
    The concatenation of every ``push`` result and ``flush()`` equals ``decode(all ids)``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.ids: list[int] = []
        self._prefix = 0  # start of the window re-decoded for context
        self._read = 0  # tokens before this were already returned as text

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly "")."""
        self.ids.append(int(token_id))
        return self._advance(final=False)

    def push_many(self, ids: Iterable[int]) -> str:
        self.ids.extend(int(i) for i in ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Return whatever is left (an incomplete character comes out as U+FFFD) and reset."""
        text = self._advance(final=True)
        self.reset()
        return text

    def reset(self) -> None:
        self.ids, self._prefix, self._read = [], 0, 0

    def _advance(self, final: bool) -> str:
        if self._read >= len(self.ids):
            return ""
        dec = self.tokenizer.decode
        before = dec(self.ids[self._prefix : self._read], skip_special=self.skip_special)
        now = dec(self.ids[self._prefix :], skip_special=self.skip_special)
        if not final and (now.endswith("\ufffd") or len(now) < len(before)):
            return ""  # waiting for the rest of a multi-byte character
        text = now.removeprefix(before)
        self._prefix, self._read = self._read, len(self.ids)
        return text
