"""Request bodies of the OpenAI-compatible endpoints (pydantic; wrong types give a 422 naming the field) and the
OpenAI-style error body. Unknown fields are ignored, as OpenAI does for fields it does not know."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Req(BaseModel):
    model_config = ConfigDict(extra="ignore")


class SamplingFields(_Req):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
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
