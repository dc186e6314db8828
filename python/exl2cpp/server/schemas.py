"""Request bodies of the OpenAI-compatible endpoints (pydantic; wrong types give a 422 naming the field) and the
OpenAI-style error body. Unknown fields are ignored, as OpenAI does for fields it does not know.

Types are strict: ``"stream": "yes"``, ``"max_tokens": "2"`` or ``2.0`` and ``"n": true`` are 422s, not coerced (an
integer is still accepted where a float is expected: JSON has one number type). Every string of a body (keys
included) must be Unicode text: Python's JSON decoder turns an escaped lone surrogate such as ``"\\ud800"`` into a
code point that no encoder accepts, so such a body is a 422 naming where the surrogate is.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate_path(value: Any) -> str | None:
    """Where (``messages[0].content``) the first string or key holding a UTF-16 surrogate code point is, or None.

    Iterative, so a deeply nested body cannot exhaust the stack; a valid surrogate pair never reaches here (the JSON
    decoder joins it into one character)."""
    stack: list[tuple[Any, tuple]] = [(value, ())]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                return _path_text(path)
        elif isinstance(v, dict):
            items = list(v.items())
            for k, x in reversed(items):
                if isinstance(k, str) and _SURROGATE.search(k):
                    return _path_text((*path, k)) + " (a key)"
                stack.append((x, (*path, k)))
        elif isinstance(v, (list, tuple)):
            stack.extend((x, (*path, i)) for i, x in reversed(list(enumerate(v))))
    return None


def _path_text(path: tuple) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out.encode("utf-8", "backslashreplace").decode("utf-8") or "body"


class _Req(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _unicode_text(cls, data: Any) -> Any:
        where = lone_surrogate_path(data)
        if where is not None:
            raise PydanticCustomError(
                "invalid_unicode",
                "{where} holds a lone UTF-16 surrogate (U+D800-U+DFFF, e.g. an unpaired \\ud800 escape), "
                "which is not Unicode text; send valid UTF-8",
                {"where": where},
            )
        return data


class StreamOptions(_Req):
    include_usage: bool = False


class SamplingFields(_Req):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions (vLLM / llama.cpp names)
    top_k: int | None = Field(default=None, ge=-1, le=1 << 30)
    min_p: float | None = Field(default=None, ge=0.0, lt=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    ignore_eos: bool = False
    # extension: strings that never appear in the output (the engine rewinds and resamples; see exl2cpp.engine)
    banned_strings: list[str] | None = None
    # extension: banned-string rewinds allowed per choice (default 16, -1 = unlimited); at the next banned string the
    # choice ends (finish_reason "stop"; the engine's reason is "banned_string_limit")
    max_rewinds: int | None = Field(default=None, ge=-1, le=1 << 20)


class ResponseFormat(_Req):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    response_format: ResponseFormat | None = None


class TokenizeRequest(_Req):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Req):
    model: str | None = None
    tokens: list[int]


class LoadRequest(_Req):
    model: str
    model_name: str | None = None
    device: str | None = None
    max_seq_len: int | None = Field(default=None, gt=0)
    cache_tokens: int | None = Field(default=None, gt=0)


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
