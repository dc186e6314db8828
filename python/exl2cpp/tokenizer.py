"""Tokenizer of a model folder: HF `tokenizers` encode/decode, the model's Jinja chat template, streaming decode.

    >>> tok = Tokenizer("path/to/model")
    >>> ids = tok.encode("Hello")                      # BOS added when the model wants one
    >>> tok.decode(ids)
    >>> prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    >>> dec = StreamDecoder(tok); "".join(dec.push(i) for i in ids) + dec.flush()

Files read from the folder: ``tokenizer.json`` (required), ``tokenizer_config.json`` (bos/eos tokens,
``add_bos_token``, ``chat_template``), ``chat_template.jinja`` / ``chat_template.json`` (newer HF
layout), ``config.json`` and ``generation_config.json`` (``bos_token_id``/``eos_token_id``).
"""

from __future__ import annotations

import datetime
import json
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar

from .errors import InvalidArgumentError, ModelFileError, ModelFormatError

__all__ = ["StreamDecoder", "Tokenizer"]


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
            try:
                return jinja_file.read_text(encoding="utf-8")
            except UnicodeDecodeError as exc:
                raise ModelFormatError(f"{jinja_file}: not valid UTF-8 ({exc})") from exc
        json_file = _read_json(self.model_dir / "chat_template.json")
        if isinstance(json_file, dict) and "chat_template" in json_file:
            return json_file["chat_template"]
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
            cached = _compile_template(source)
            self._template_cache[source] = cached
        return cached

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` with the model's Jinja chat template, as HF transformers does.

        The template sees ``messages``, ``add_generation_prompt``, ``tools``, the special tokens
        (``bos_token``, ``eos_token``, ``pad_token``, ``unk_token``) and every extra keyword
        (e.g. ``documents``, ``enable_thinking``). ``chat_template`` picks one of several named
        templates, or is a template string itself.
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
        try:
            return template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                **context,
            )
        except _TemplateRaise as exc:
            raise InvalidArgumentError(f"chat template: {exc}") from None
        except jinja2.TemplateError as exc:
            raise InvalidArgumentError(f"chat template of {self.model_dir} failed: {exc}") from exc
        except Exception as exc:
            raise InvalidArgumentError(
                f"chat template of {self.model_dir} failed on these messages: "
                f"{type(exc).__name__}: {exc}"
            ) from exc


class _TemplateRaise(Exception):
    """raise_exception() called by a chat template."""


def _compile_template(source: str) -> Any:
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

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

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ModelFormatError(
            f"chat template has a Jinja syntax error (line {exc.lineno}): {exc.message}"
        ) from exc


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
