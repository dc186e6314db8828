"""Tool calling: the tool list in the prompt, tool calls parsed back out of the model's text (as it streams), and the
grammar that forces a call (``tool_choice`` "required" or a named function).

Three formats, as models write them:

- ``hermes`` (Hermes, Qwen 2.5 / 3, and the fallback): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call;
- ``llama3`` (Llama 3.1 / 3.2 / 3.3 JSON tool calling): ``{"name": ..., "parameters": {...}}``, the whole reply,
  optionally after ``<|python_tag|>``, several calls separated by ``;``; and Llama 3.1's built-in tools after
  ``<|python_tag|>``: ``brave_search.call(query="...")`` (any known tool, keyword arguments of Python literals, as
  Meta's llama-models reference decodes them) and, where ``code_interpreter`` is a known tool, any other text
  there: Python code, the call's ``{"code": ...}``. Built-in tools are the request's
  ``chat_template_kwargs.builtin_tools`` (which Llama 3.1's template renders) or tools of those names;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3 tokenizers), or
  ``[TOOL_CALLS]name[ARGS]{...}`` once per call (v11 and later).

The format is the server's ``tool_format`` setting, or (``auto``) read off the chat template: one that writes
``[TOOL_CALLS]`` is Mistral's, ``<tool_call>`` Hermes', ``<|python_tag|>`` (or ipython tool results) Llama 3's.
A template that does not render ``tools`` (SmolLM2's plain ChatML) gets a system message listing the tools and
asking for the format's call syntax. Whatever the format, a reply that is only a JSON object (or a list of them,
optionally in a ```json fence) with a known "name" and "arguments"/"parameters" is a call too.

:class:`ToolCallParser` reads the reply as it is generated and tells content from calls, so ``tool_calls`` stream as
deltas (the name once it is known, then the arguments as they are written); the non-streamed reply is the same
parser run over the whole text, so the two always agree. Arguments are the JSON the model wrote, verbatim.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgumentError

FORMATS = ("hermes", "llama3", "mistral")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def check_tools(tools: list[dict] | None) -> list[dict]:
    """The request's ``tools``, checked (400 naming the entry): OpenAI's function shape, names of letters, digits,
    ``_.-`` (at most 64, each once), parameters a JSON-schema object."""
    out, seen = [], set()
    for i, t in enumerate(tools or []):
        if (
            not isinstance(t, dict)
            or t.get("type", "function") != "function"
            or not isinstance(t.get("function"), dict)
        ):
            raise InvalidArgumentError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}"
            )
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"tools[{i}].function.name must be a non-empty string")
        if not _NAME.match(name):
            raise InvalidArgumentError(
                f"tools[{i}].function.name {name[:80]!r} must be 1-64 letters, digits, '_', '.' or '-'"
            )
        if name in seen:
            raise InvalidArgumentError(f"tools[{i}].function.name {name!r} is listed twice")
        seen.add(name)
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise InvalidArgumentError(f"tools[{i}].function.description must be a string")
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidArgumentError(
                f"tools[{i}].function.parameters must be a JSON schema object"
            )
        if isinstance(params, dict) and params.get("type", "object") != "object":
            raise InvalidArgumentError(
                f"tools[{i}].function.parameters must be an object schema (\"type\": \"object\"), "
                f"got type {params.get('type')!r}"
            )
        out.append({"type": "function", "function": f})
    return out


def check_builtin_tools(value: Any, param: str = "chat_template_kwargs.builtin_tools") -> list[str]:
    """Llama 3.1's ``builtin_tools`` template argument, checked (400 naming it): a list of tool names."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(n, str) and _NAME.match(n) for n in value):
        raise InvalidArgumentError(
            f"{param} must be a list of tool names (letters, digits, '_', '.' or '-'), "
            f"such as [\"brave_search\", \"wolfram_alpha\", \"code_interpreter\"]"
        )
    return list(dict.fromkeys(value))


def template_format(source: str | None) -> str:
    """The tool-call format a chat template's source writes (``hermes`` when it names none)."""
    s = source or ""
    if "[TOOL_CALLS]" in s:
        return "mistral"
    if "<tool_call>" in s:
        return "hermes"
    if "<|python_tag|>" in s or ("ipython" in s and "parameters" in s):
        return "llama3"
    return "hermes"


_SYNTAX = {
    "hermes": '<tool_call>{"name": "<function name>", "arguments": {<arguments as JSON>}}</tool_call>',
    "llama3": '{"name": "<function name>", "parameters": {<arguments as JSON>}}',
    "mistral": '[TOOL_CALLS][{"name": "<function name>", "arguments": {<arguments as JSON>}}]',
}


def system_prompt(tools: list[dict], fmt: str = "hermes") -> str:
    listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return (
        "You can call functions. Available functions, one JSON schema per line:\n"
        f"<tools>\n{listing}\n</tools>\n"
        "To call a function, reply with only:\n" + _SYNTAX[fmt]
    )


def _arguments(raw: Any) -> Any:
    """A history call's arguments as the object chat templates expect (OpenAI sends a JSON string)."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw if raw is not None else {}


def _call_text(call: dict, fmt: str) -> str:
    f = call.get("function") or {}
    key = "parameters" if fmt == "llama3" else "arguments"
    obj = {"name": f.get("name"), key: _arguments(f.get("arguments"))}
    body = json.dumps(obj, ensure_ascii=False)
    if fmt == "mistral":
        return "[TOOL_CALLS][" + body + "]"
    return body if fmt == "llama3" else "<tool_call>" + body + "</tool_call>"


def content_text(content: Any, where: str) -> str:
    """OpenAI message content: a string, null, or a list of parts ({"type": "text", "text": ...})."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if (
                isinstance(part, dict)
                and part.get("type") in ("text", "input_text")
                and isinstance(part.get("text"), str)
            ):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidArgumentError(
                    f"{where}.content[{j}]: part type {kind!r} is not supported (text only)"
                )
        return "".join(texts)
    raise InvalidArgumentError(f"{where}.content must be a string, null or a list of text parts")


def _check_calls(calls: Any, where: str) -> None:
    """Assistant tool calls in the history: [{"type": "function", "function": {"name", "arguments"}}, ...]."""
    shape = "{'type': 'function', 'function': {'name': str, 'arguments': str or object}}"
    if not isinstance(calls, list):
        raise InvalidArgumentError(f"{where} must be a list of {shape}")
    for k, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if (
            not isinstance(f, dict)
            or not isinstance(f.get("name"), str)
            or not isinstance(f.get("arguments", {}), (str, dict))
        ):
            raise InvalidArgumentError(f"{where}[{k}] must be {shape}")


def prepare_messages(
    messages: list[dict], tools: list[dict], template_has_tools: bool, fmt: str = "hermes"
) -> list[dict]:
    """Plain dicts the chat template can render: text parts joined; for a template that renders tools, assistant
    tool calls with their arguments as objects (as Hugging Face templates read them) and tool results with their
    ``tool_call_id`` / ``name``; for one that does not, calls and results written as text in ``fmt`` and the tool
    list as a system message."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidArgumentError(f"messages[{i}] must be an object with a role")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool", "function"):
            raise InvalidArgumentError(
                f"messages[{i}].role {role!r} is not one of system, user, assistant, tool"
            )
        text = content_text(m.get("content"), f"messages[{i}]")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": text}
        if role == "assistant" and m.get("tool_calls"):
            _check_calls(m["tool_calls"], f"messages[{i}].tool_calls")
            if template_has_tools:
                msg["tool_calls"] = [
                    {
                        "id": c.get("id"),
                        "type": "function",
                        "function": {
                            "name": c["function"]["name"],
                            "arguments": _arguments(c["function"].get("arguments")),
                        },
                    }
                    for c in m["tool_calls"]
                ]
            else:
                msg["content"] = (text + "\n" if text else "") + "\n".join(
                    _call_text(c, fmt) for c in m["tool_calls"]
                )
        if role in ("tool", "function"):
            if template_has_tools:
                msg = {"role": "tool", "content": text, "tool_call_id": m.get("tool_call_id")}
                if isinstance(m.get("name"), str):
                    msg["name"] = m["name"]
            else:
                msg = {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
        out.append(msg)
    if tools and not template_has_tools:
        prompt = system_prompt(tools, fmt)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


# ---- parsing the reply ----------------------------------------------------------------------------------------


@dataclass
class Content:
    text: str


@dataclass
class CallStart:
    index: int
    id: str
    name: str


@dataclass
class CallArgs:
    index: int
    text: str


_MARKERS = {"hermes": "<tool_call>", "llama3": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}
_BUILTIN_CALL = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\.call\(")
CODE_INTERPRETER = "code_interpreter"


def _call_end(text: str, i: int) -> int | None:
    """Index past the ``)`` that closes a Python call whose arguments start at ``text[i]`` (strings, with either
    quote and backslash escapes, and brackets skipped), or None when the text ends first."""
    depth, quote, esc = 0, None, False
    for j in range(i, len(text)):
        c = text[j]
        if quote:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                return j + 1 if c == ")" else None
            depth -= 1
    return None


def _keyword_args(src: str) -> dict | None:
    """``query="x", n=3`` (a call's arguments) as a JSON-able dict, or None unless they are all keyword arguments
    with literal values. Parsed, never run."""
    try:
        node = ast.parse(f"f({src})", mode="eval").body
        if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
            return None
        args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        json.dumps(args)
        return args
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None
_FENCE = re.compile(r"```(?:json)?[ \t]*\n?\s*")
_NAMED = re.compile(r"([A-Za-z0-9_.\-]+)(?:\[CALL_ID\][A-Za-z0-9]*)?\[ARGS\]")
_NAME_CHARS = re.compile(r"[A-Za-z0-9_.\-]*")
_ID_CHARS = re.compile(r"[A-Za-z0-9]*")


def _named_prefix(tail: str) -> bool:
    """Whether ``tail`` (what follows a Mistral call's name so far) can still become ``[CALL_ID]id[ARGS]`` or
    ``[ARGS]``."""
    if "[ARGS]".startswith(tail) or "[CALL_ID]".startswith(tail):
        return True
    if not tail.startswith("[CALL_ID]"):
        return False
    rest = tail[len("[CALL_ID]") :]
    return "[ARGS]".startswith(rest[_ID_CHARS.match(rest).end() :])
_WS = " \t\r\n"


_ID_ALPHABET = string.ascii_letters + string.digits


def call_id(fmt: str) -> str:
    """A fresh tool-call id; Mistral's templates take exactly nine letters and digits."""
    if fmt == "mistral":
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))
    return "call_" + uuid.uuid4().hex[:24]


class _Obj:
    """One JSON object scanned from its opening brace: the raw spans of its top-level values."""

    __slots__ = ("end", "error", "spans")

    def __init__(self) -> None:
        self.end: int | None = None  # index past the closing brace, once it is there
        self.error = False
        self.spans: dict[str, tuple[int, int | None]] = {}  # key -> (value start, value end or None: still open)


def _scan_obj(text: str, i: int) -> _Obj:
    """Scan ``text[i:]`` (``text[i] == "{"``) as far as it goes; values' spans are indices into ``text``."""
    o = _Obj()
    depth, in_str, esc = 1, False, False
    expect = "key"  # at depth 1: key, colon, value, in_value, comma
    key, start = None, i  # the current key, and where its string (or its value) starts
    j, n = i + 1, len(text)
    while j < n:
        c = text[j]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
                if depth == 1 and expect == "key_str":
                    try:
                        key = json.loads(text[start : j + 1])
                    except ValueError:
                        o.error = True
                        return o
                    expect = "colon"
                elif depth == 1 and expect == "in_value":
                    o.spans[key] = (start, j + 1)
                    expect = "comma"
            j += 1
            continue
        if depth > 1:  # inside a nested value
            if c == '"':
                in_str = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 1:
                    o.spans[key] = (start, j + 1)
                    expect = "comma"
            j += 1
            continue
        if expect == "in_value":  # a number, true, false, null
            if c in _WS or c in ",}":
                o.spans[key] = (start, j)
                expect = "comma"
                continue  # the same character again, as after a value
            j += 1
            continue
        if c in _WS:
            pass
        elif expect == "key" and c == '"':
            in_str, start, expect = True, j, "key_str"
        elif expect == "colon" and c == ":":
            expect = "value"
        elif expect == "value":
            start, expect = j, "in_value"
            if c == '"':
                in_str = True
            elif c in "{[":
                depth += 1
                o.spans[key] = (start, None)
        elif expect in ("comma", "key") and c == "}":
            o.end = j + 1
            return o
        elif expect == "comma" and c == ",":
            expect = "key"
        else:
            o.error = True
            return o
        j += 1
    if expect == "in_value" or depth > 1:
        o.spans[key] = (start, None)
    return o


class _Call:
    __slots__ = ("id", "index", "sent")

    def __init__(self, index: int, id_: str) -> None:
        self.index, self.id, self.sent = index, id_, 0  # sent: characters of the arguments streamed so far


class ToolCallParser:
    """Splits a reply into content and tool calls as it arrives: ``push(text)`` and ``finish()`` return
    :class:`Content`, :class:`CallStart` and :class:`CallArgs` events; joined, a call's ``CallArgs`` are its
    arguments. Text that may still turn out to be a call is held back; something that looked like a call but is
    not one (unknown name, not JSON) goes out as content. Whitespace between content and calls is dropped."""

    def __init__(self, fmt: str, names: set[str] | list[str], max_calls: int | None = None):
        if fmt not in FORMATS:
            raise InvalidArgumentError(f"tool format {fmt!r} is not one of {', '.join(FORMATS)}")
        self.fmt, self.names, self.max_calls = fmt, set(names), max_calls
        self.marker = _MARKERS[fmt]
        self.buf = ""
        self.pos = 0  # buf[:pos] is handled
        self.started = False  # a non-space character of content went out (bare JSON calls only open a reply)
        self.calls: list[_Call] = []
        self.section: tuple | None = None  # (kind, start of its body, closing marker or "", calls of this section)
        self.after_call = False
        self._held_ws = ""  # whitespace before the open section (content again if it is no call)

    # -- public --
    def push(self, text: str) -> list:
        self.buf += text
        return self._run(False)

    def finish(self) -> list:
        return self._run(True)

    # -- content --
    def _run(self, final: bool) -> list:
        out: list = []
        while True:
            if self.section is not None:
                if not self._section(out, final):
                    break
                continue
            if not self._content(out, final):
                break
        if final:
            rest = self.buf[self.pos :]
            if rest and not (self.after_call and not rest.strip(_WS)):
                out.append(Content(rest))
            self.pos = len(self.buf)
        if self.pos > 4096 and self.section is None:  # keep the buffer short
            self.buf, self.pos = self.buf[self.pos :], 0
        limit = self.max_calls
        return [
            e
            for e in out
            if not (isinstance(e, Content) and not e.text)
            and (limit is None or isinstance(e, Content) or e.index < limit)  # calls past the limit are dropped
        ]

    def _content(self, out: list, final: bool) -> bool:
        """Content up to the next possible call; True when a section opened."""
        buf, p = self.buf, self.pos
        if self.after_call:  # whitespace after a call is dropped
            while p < len(buf) and buf[p] in _WS:
                p += 1
            self.pos = p
            if p == len(buf):
                return False
            self.after_call = False
        if not self.started:
            q = p
            while q < len(buf) and buf[q] in _WS:
                q += 1
            rest = buf[q:]
            if not rest:
                return False  # only whitespace yet: held
            if not final and self.marker.startswith(rest):
                return False  # may be the marker
            if rest.startswith(self.marker):
                self.started = True
            elif rest[0] in "{[":
                self.pos, self._held_ws = q, buf[p:q]
                self._open("bare", q, "")
                return True
            elif (m := _FENCE.match(rest)) and m.end() < len(rest) and rest[m.end()] in "{[":
                self.pos, self._held_ws = q, buf[p:q]
                self._open("bare", q + m.end(), "```")
                return True
            elif not final and ("```json\n".startswith(rest) or (m and m.end() == len(rest))):
                return False  # may still be a fenced call
            self.started = True
        k = buf.find(self.marker, p)
        if k >= 0:
            body = k + len(self.marker)
            lead = buf[p:k]
            self.pos = k
            out.append(Content(lead.rstrip(_WS)))
            self._held_ws = lead[len(lead.rstrip(_WS)) :]
            self._open("marker", body, "</tool_call>" if self.fmt == "hermes" else "")
            return True
        if final:
            out.append(Content(buf[p:]))
            self.pos = len(buf)
            return False
        # hold back what may begin the marker, and the whitespace before it
        hold = 0
        for n in range(min(len(self.marker) - 1, len(buf) - p), 0, -1):
            if self.marker.startswith(buf[len(buf) - n :]):
                hold = n
                break
        end = len(buf) - hold
        keep = buf[p:end]
        stripped = keep.rstrip(_WS)
        out.append(Content(stripped))
        self.pos = p + len(stripped)
        return False

    def _open(self, kind: str, body: int, close: str) -> None:
        self.section = (kind, body, close, [])

    # -- sections (one marker's calls) --
    def _section(self, out: list, final: bool) -> bool:
        """Go on with the open section; True when it ended (content goes on after it)."""
        kind, body, close, mine = self.section
        buf = self.buf
        j = self._skip(body)
        if j >= len(buf):
            return self._incomplete(out, final, mine)
        if self.fmt == "mistral" and kind == "marker" and buf[j] not in "{[":
            return self._named(out, final, j, mine)
        if self.fmt == "llama3" and kind == "marker" and buf[j] not in "{[":
            return self._builtin(out, final, j, mine)
        array = buf[j] == "["
        if array:
            j = self._skip(j + 1)
        k = 0
        while True:
            if j >= len(buf):
                return self._incomplete(out, final, mine)
            if buf[j] != "{":
                return self._close(out, final, j, close, mine)
            obj = _scan_obj(buf, j)
            if not self._emit(out, buf, obj, j, k, mine):
                return self._fail(out)
            if obj.end is None or obj.error:
                return self._incomplete(out, final, mine)
            j = self._skip(obj.end)
            k += 1
            if j >= len(buf):
                return False if not final else self._close(out, final, j, close, mine)
            if array and buf[j] == ",":
                j = self._skip(j + 1)
            elif array and buf[j] == "]":
                return self._close(out, final, self._skip(j + 1), close, mine)
            elif not array and buf[j] == ";":
                j = self._skip(j + 1)
            else:
                return self._close(out, final, j, close, mine)

    def _named(self, out: list, final: bool, j: int, mine: list) -> bool:
        """Mistral v11: ``name[ARGS]{...}`` (or ``name[CALL_ID]id[ARGS]{...}``) after the marker."""
        buf = self.buf
        m = _NAMED.match(buf, j)
        if m is None:
            rest = buf[j:]
            tail = rest[_NAME_CHARS.match(rest).end() :]
            return self._fail(out) if final or not _named_prefix(tail) else False
        if m.group(1) not in self.names:
            return self._fail(out)
        if not mine:
            self._start(out, m.group(1), mine)
        a = self._skip(m.end())
        if a >= len(buf):
            return self._incomplete(out, final, mine)
        if buf[a] != "{":
            return self._end(out, a)
        obj = _scan_obj(buf, a)
        self._args(out, mine[0], buf[a : obj.end if obj.end is not None else len(buf)])
        if obj.end is None:
            return self._incomplete(out, final, mine)
        return self._end(out, obj.end)

    def _builtin(self, out: list, final: bool, j: int, mine: list) -> bool:
        """Llama 3.1 after ``<|python_tag|>``: ``name.call(key=literal, ...)`` of a known tool, emitted whole once
        its ``)`` is there; else, with code_interpreter known, the rest of the reply is code, streamed as the
        call's ``{"code": ...}`` (trailing whitespace held back); else it was text."""
        buf = self.buf
        rest = buf[j:]
        m = _BUILTIN_CALL.match(buf, j)
        if m and m.group(1) in self.names:
            end = _call_end(buf, m.end())
            if end is None and not final:
                return False
            args = _keyword_args(buf[m.end() : end - 1]) if end is not None else None
            if args is not None:
                self._start(out, m.group(1), mine)
                self._args(out, mine[0], json.dumps(args, ensure_ascii=False))
                return self._end(out, end)
        elif not final and not m and any(
            f"{n}.call(".startswith(rest) for n in self.names
        ):  # may still become a call
            return False
        if CODE_INTERPRETER not in self.names:
            return self._fail(out)
        if not mine:
            self._start(out, CODE_INTERPRETER, mine)
        code = json.dumps(rest.rstrip(_WS), ensure_ascii=False)  # escaped character by character: prefix-stable
        self._args(out, mine[0], '{"code": ' + (code + "}" if final else code[:-1]))
        return self._end(out, len(buf)) if final else False

    def _emit(self, out: list, buf: str, obj: _Obj, j: int, k: int, mine: list) -> bool:
        """Events of the k-th object of the section (at ``j``) so far; False when it is not a call."""
        if obj.end is not None and not obj.error:
            try:
                json.loads(buf[j : obj.end])
            except ValueError:
                obj.error = True
        if obj.error:
            return k < len(mine)
        if k >= len(mine):
            span = obj.spans.get("name")
            if span is None or span[1] is None:
                return obj.end is None  # no name yet: wait; complete without one: not a call
            try:
                name = json.loads(buf[span[0] : span[1]])
            except ValueError:
                return False
            if not isinstance(name, str) or name not in self.names:
                return False
            self._start(out, name, mine)
        call = mine[k]
        key = "arguments" if "arguments" in obj.spans else "parameters" if "parameters" in obj.spans else None
        if key is None:
            if obj.end is not None:
                self._args(out, call, "{}")
            return True
        a, b = obj.spans[key]
        if buf[a] == "{":
            self._args(out, call, buf[a : b if b is not None else len(buf)])
        elif b is not None and obj.end is not None:  # a JSON-encoded string (or another value): whole, at the end
            raw = buf[a:b]
            try:
                v = json.loads(raw)
            except ValueError:
                v = raw
            self._args(out, call, v if isinstance(v, str) else raw)
        return True

    def _start(self, out: list, name: str, mine: list) -> None:
        c = _Call(len(self.calls), call_id(self.fmt))
        self.calls.append(c)
        mine.append(c)
        out.append(CallStart(c.index, c.id, name))

    def _args(self, out: list, call: _Call, text: str) -> None:
        if len(text) > call.sent:
            out.append(CallArgs(call.index, text[call.sent :]))
            call.sent = len(text)

    def _incomplete(self, out: list, final: bool, mine: list) -> bool:
        if not final:
            return False
        if not mine:  # cut before any call was recognised: it was text
            return self._fail(out)
        return self._end(out, len(self.buf), cut=True)

    def _close(self, out: list, final: bool, j: int, close: str, mine: list) -> bool:
        if not mine:
            return self._fail(out)
        buf = self.buf
        if close:
            rest = buf[j:]
            if rest.startswith(close):
                return self._end(out, j + len(close))
            if not final and close.startswith(rest):
                return False
        return self._end(out, j)

    def _end(self, out: list, j: int, cut: bool = False) -> bool:
        """Close the section at ``j``; a complete call that wrote no arguments gets ``{}``, while the last call of a
        reply cut off inside it (``cut``) keeps what it wrote, even nothing: no arguments are made up for it."""
        mine = self.section[3]
        for c in mine[:-1] if cut else mine:
            if c.sent == 0:
                self._args(out, c, "{}")
        self.section = None
        self.pos = j
        self.after_call = True
        self.started = True
        return True

    def _fail(self, out: list) -> bool:
        """Not a call after all: what was held goes out as content, from the marker (or the bare JSON) on."""
        kind, body, _, _ = self.section
        self.section = None
        start = self.pos
        out.append(Content(self._held_ws + self.buf[start:body if kind == "marker" else start + 1]))
        self._held_ws = ""
        self.pos = body if kind == "marker" else start + 1
        self.started = True
        return True

    def _skip(self, j: int) -> int:
        buf = self.buf
        while j < len(buf) and buf[j] in _WS:
            j += 1
        return j


def tool_names(tools: list[dict], builtin: list[str] | tuple = ()) -> set[str]:
    """The names a reply may call: the tools' and the built-in tools'."""
    return {t["function"]["name"] for t in tools} | set(builtin)


def parse_tool_calls(
    text: str,
    tools: list[dict],
    fmt: str = "hermes",
    max_calls: int | None = None,
    builtin: list[str] | tuple = (),
) -> tuple[str | None, list[dict]]:
    """(content or None, tool calls) of a whole reply; no calls: (text, [])."""
    p = ToolCallParser(fmt, tool_names(tools, builtin), max_calls)
    return assemble(p.push(text) + p.finish())


def assemble(events: list) -> tuple[str | None, list[dict]]:
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls: list[dict] = []
    for e in events:
        if isinstance(e, CallStart):
            calls.append({"id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}})
        elif isinstance(e, CallArgs):
            calls[e.index]["function"]["arguments"] += e.text
    if not calls:
        return content, []
    return content or None, calls


def stream_deltas(events: list) -> list[dict]:
    """OpenAI ``delta.tool_calls`` entries of parser events (the first of a call has its id, type and name)."""
    out = []
    for e in events:
        if isinstance(e, CallStart):
            first = {"name": e.name, "arguments": ""}
            out.append({"index": e.index, "id": e.id, "type": "function", "function": first})
        elif isinstance(e, CallArgs):
            out.append({"index": e.index, "function": {"arguments": e.text}})
    return out


# ---- forcing a call -------------------------------------------------------------------------------------------


def _rebase_refs(schema: Any, at: str) -> Any:
    """A copy of ``schema`` whose local ``$ref`` ("#/$defs/x") still point into it once it sits at JSON pointer ``at``
    of a larger schema (a tool's parameters inside the tool-call schema). Iterative: any depth is fine."""
    out: Any = [None]
    stack: list[tuple[Any, Any, Any]] = [(schema, out, 0)]
    while stack:
        v, parent, key = stack.pop()
        if isinstance(v, dict):
            d: dict = {}
            for k, x in v.items():
                if k == "$ref" and isinstance(x, str) and x.startswith("#"):
                    d[k] = "#" + at + x[1:]
                else:
                    stack.append((x, d, k))
            parent[key] = d
        elif isinstance(v, list):
            lst: list = [None] * len(v)
            stack.extend((x, lst, i) for i, x in enumerate(v))
            parent[key] = lst
        else:
            parent[key] = v
    return out[0]


def _lark_literal(text: str, special_id) -> str:
    """A Lark terminal for a marker: its token (``<[id]>``) when the vocabulary has it as one special token, else the
    text."""
    tid = special_id(text) if special_id is not None else None
    return f"<[{tid}]>" if tid is not None else json.dumps(text)


def forced_grammar(
    tools: list[dict], name: str | None, fmt: str = "hermes", special_id=None
) -> tuple[str, dict]:
    """A Lark grammar (llguidance) for exactly one call of tool ``name`` (any tool: None) in format ``fmt``, and the
    JSON schema it embeds (the tools' parameter schemas: the client's, to check against the limits).
    ``special_id(text)``: the id of a special token spelled ``text``, or None."""
    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    if not chosen:
        raise InvalidArgumentError(f"tool_choice names function {name!r}, which is not in tools")
    key = "parameters" if fmt == "llama3" else "arguments"
    variants = []
    for k, t in enumerate(chosen):
        f = t["function"]
        at = f"/properties/{key}" if len(chosen) == 1 else f"/anyOf/{k}/properties/{key}"
        params = _rebase_refs(f.get("parameters") or {"type": "object"}, at)
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, key: params},
                "required": ["name", key],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = variants[0] if len(variants) == 1 else {"anyOf": variants}
    schema["x-guidance"] = {"whitespace_flexible": False}
    call = "call: %json " + json.dumps(schema)
    if fmt == "llama3":
        return "start: call\n" + call, schema
    if fmt == "mistral":
        return f'start: {_lark_literal("[TOOL_CALLS]", special_id)} "[" call "]"\n' + call, schema
    open_, close = _lark_literal("<tool_call>", special_id), _lark_literal("</tool_call>", special_id)
    return f"start: {open_} call {close}\n" + call, schema
