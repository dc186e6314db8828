"""Tool calling: the tool list in the prompt, tool calls parsed back out of the model's text, and the grammar that
forces a call (``tool_choice`` "required" or a named function).

Format: the model's own chat template when it renders ``tools``; otherwise (SmolLM2 and other plain ChatML
templates) a system message lists the tools as JSON and asks for ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`` (the Hermes/Qwen convention). Parsing accepts that form, several of them, or a bare JSON object
(or list) with "name" and "arguments"/"parameters", optionally in a ```json fence.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from ..errors import InvalidArgumentError

_TAG = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def check_tools(tools: list[dict] | None) -> list[dict]:
    out = []
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
        if not isinstance(f.get("name"), str) or not f["name"]:
            raise InvalidArgumentError(f"tools[{i}].function.name must be a non-empty string")
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidArgumentError(
                f"tools[{i}].function.parameters must be a JSON schema object"
            )
        out.append({"type": "function", "function": f})
    return out


def system_prompt(tools: list[dict]) -> str:
    listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return (
        "You can call functions. Available functions, one JSON schema per line:\n"
        f"<tools>\n{listing}\n</tools>\n"
        "To call a function, reply with only:\n"
        '<tool_call>{"name": "<function name>", "arguments": {<arguments as JSON>}}</tool_call>'
    )


def _call_text(call: dict) -> str:
    f = call.get("function") or {}
    args = f.get("arguments")
    try:
        args = json.loads(args) if isinstance(args, str) else (args or {})
    except json.JSONDecodeError:
        pass
    return (
        "<tool_call>"
        + json.dumps({"name": f.get("name"), "arguments": args}, ensure_ascii=False)
        + "</tool_call>"
    )


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
    messages: list[dict], tools: list[dict], template_has_tools: bool
) -> list[dict]:
    """Plain {role, content} dicts the chat template can render: text parts joined, assistant tool calls and tool
    results written as text, and (for templates without tool support) the tool list as a system message."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool", "function"):
            raise InvalidArgumentError(
                f"messages[{i}].role {role!r} is not one of system, user, assistant, tool"
            )
        text = content_text(m.get("content"), f"messages[{i}]")
        msg = {"role": "system" if role == "developer" else role, "content": text}
        if role == "assistant" and m.get("tool_calls"):
            _check_calls(m["tool_calls"], f"messages[{i}].tool_calls")
            if template_has_tools:
                msg["tool_calls"] = m["tool_calls"]
            else:
                msg["content"] = (text + "\n" if text else "") + "\n".join(
                    _call_text(c) for c in m["tool_calls"]
                )
        if role in ("tool", "function"):
            if template_has_tools:
                msg["tool_call_id"] = m.get("tool_call_id")
            else:
                msg = {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
        out.append(msg)
    if tools and not template_has_tools:
        prompt = system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _as_calls(obj: Any, names: set[str]) -> list[dict] | None:
    items = obj if isinstance(obj, list) else [obj]
    calls = []
    for it in items:
        if not isinstance(it, dict) or not isinstance(it.get("name"), str):
            return None
        if it["name"] not in names:
            return None
        args = it.get("arguments", it.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        calls.append(
            {
                "id": "call_" + uuid.uuid4().hex[:24],
                "type": "function",
                "function": {"name": it["name"], "arguments": json.dumps(args, ensure_ascii=False)},
            }
        )
    return calls or None


def parse_tool_calls(text: str, tools: list[dict]) -> tuple[str | None, list[dict]]:
    """(remaining content or None, tool calls) from the model's text; no calls found: (text, [])."""
    names = {t["function"]["name"] for t in tools}
    tagged = _TAG.findall(text)
    if tagged:
        calls = []
        for body in tagged:
            try:
                found = _as_calls(json.loads(body), names)
            except json.JSONDecodeError:
                found = None
            if found:
                calls += found
        if calls:
            rest = _TAG.sub("", text).strip()
            return rest or None, calls
        return text, []
    s = text.strip()
    fenced = _FENCE.match(s)
    if fenced:
        s = fenced.group(1)
    if s[:1] in "{[":
        try:
            found = _as_calls(json.loads(s), names)
        except json.JSONDecodeError:
            found = None
        if found:
            return None, found
    return text, []


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


def forced_grammar(tools: list[dict], name: str | None) -> tuple[str, dict]:
    """A Lark grammar (llguidance) for exactly one <tool_call>{json}</tool_call> of tool ``name`` (any tool: None),
    and the JSON schema it embeds (the tools' parameter schemas: the client's, to check against the limits)."""
    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    if not chosen:
        raise InvalidArgumentError(f"tool_choice names function {name!r}, which is not in tools")
    variants = []
    for k, t in enumerate(chosen):
        f = t["function"]
        at = "/properties/arguments" if len(chosen) == 1 else f"/anyOf/{k}/properties/arguments"
        params = _rebase_refs(f.get("parameters") or {"type": "object"}, at)
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = variants[0] if len(variants) == 1 else {"anyOf": variants}
    schema["x-guidance"] = {"whitespace_flexible": False}
    return 'start: "<tool_call>" call "</tool_call>"\ncall: %json ' + json.dumps(schema), schema
