"""Request bodies of the OpenAI-compatible endpoints (pydantic; wrong types give a 422 naming the field) and the
OpenAI-style error body. Unknown fields are ignored, as OpenAI does for fields it does not know.

Types are strict: ``"stream": "yes"``, ``"max_tokens": "2"`` or ``2.0`` and ``"n": true`` are 422s, not coerced (an
integer is still accepted where a float is expected: JSON has one number type). Every string of a body (keys
included) must be Unicode text: Python's JSON decoder turns an escaped lone surrogate such as ``"\\ud800"`` into a
code point that no encoder accepts, so such a body is a 422 naming where the surrogate is.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator
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


def _alias(*names: str) -> AliasChoices:
    return AliasChoices(*names)


def _token_id_list(v: Any) -> Any:
    """TabbyAPI's comma-separated form of a token-id list ("128, 330")."""
    if isinstance(v, str):
        parts = [x.strip() for x in v.split(",") if x.strip()]
        if not all(x.isdigit() for x in parts):
            raise PydanticCustomError(
                "token_id_list",
                "expected token ids: a list of integers or a comma-separated string of them, got {value!r}",
                {"value": v[:80]},
            )
        return [int(x) for x in parts]
    return v


class SamplingFields(_Req):
    """OpenAI's sampling fields, the vLLM / llama.cpp extensions and TabbyAPI's samplers with its aliases
    (``rep_pen``, ``typical_p``, ``dynatemp_low`` ...). A field given under two of its names takes the first of
    the alias list. Range checks that depend on other fields (``min_temp <= max_temp``, ``dry_base >= 1`` when DRY
    is on) are made when the request becomes a job, as 400s naming the field."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0, validation_alias=_alias("max_tokens", "max_length"))
    temperature: float | None = Field(default=None, ge=0.0, le=10.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str | int] | None = Field(default=None, validation_alias=_alias("stop", "stop_sequence"))
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions (vLLM / llama.cpp names); top_k -1 or 0 is off
    top_k: int | None = Field(default=None, ge=-1, le=1 << 30)
    min_p: float | None = Field(default=None, ge=0.0, lt=1.0)
    repetition_penalty: float | None = Field(
        default=None, gt=0.0, validation_alias=_alias("repetition_penalty", "rep_pen")
    )
    ignore_eos: bool = Field(default=False, validation_alias=_alias("ignore_eos", "ban_eos_token"))
    # extension: strings that never appear in the output (the engine rewinds and resamples; see exl2cpp.engine)
    banned_strings: str | list[str] | None = None
    # extension: banned-string rewinds allowed per choice (default 16, -1 = unlimited); at the next banned string the
    # choice ends (finish_reason "stop"; the engine's reason is "banned_string_limit")
    max_rewinds: int | None = Field(default=None, ge=-1, le=1 << 20)
    # TabbyAPI's samplers (docs/engine.md "Sampling" has what each does)
    min_tokens: int | None = Field(default=None, ge=0, validation_alias=_alias("min_tokens", "min_length"))
    banned_tokens: list[int] | None = Field(
        default=None, validation_alias=_alias("banned_tokens", "custom_token_bans")
    )
    allowed_tokens: list[int] | None = Field(
        default=None, validation_alias=_alias("allowed_tokens", "allowed_token_ids")
    )
    temperature_last: bool | None = None
    smoothing_factor: float | None = Field(default=None, ge=0.0)
    smoothing_curve: float | None = Field(default=None, ge=1.0, le=3.0)
    top_a: float | None = Field(default=None, ge=0.0, le=1.0)
    tfs: float | None = Field(default=None, gt=0.0, le=1.0)
    typical: float | None = Field(default=None, gt=0.0, le=1.0, validation_alias=_alias("typical", "typical_p"))
    penalty_range: int | None = Field(
        default=None,
        ge=-1,
        validation_alias=_alias("penalty_range", "repetition_range", "repetition_penalty_range", "rep_pen_range"),
    )
    dry_multiplier: float | None = Field(default=None, ge=0.0)
    dry_base: float | None = Field(default=None, ge=0.0)
    dry_allowed_length: int | None = Field(default=None, ge=0)
    dry_range: int | None = Field(default=None, ge=0, validation_alias=_alias("dry_range", "dry_penalty_last_n"))
    dry_sequence_breakers: list[str | int] | None = None
    xtc_probability: float | None = Field(default=None, ge=0.0, le=1.0)
    xtc_threshold: float | None = Field(default=None, ge=0.0, le=1.0)
    mirostat_mode: int | None = Field(default=None, validation_alias=_alias("mirostat_mode", "mirostat"))
    mirostat_tau: float | None = Field(default=None, ge=0.0)
    mirostat_eta: float | None = Field(default=None, ge=0.0)
    min_temp: float | None = Field(default=None, ge=0.0, validation_alias=_alias("min_temp", "dynatemp_low"))
    max_temp: float | None = Field(default=None, ge=0.0, validation_alias=_alias("max_temp", "dynatemp_high"))
    temp_exponent: float | None = Field(
        default=None, ge=0.0, validation_alias=_alias("temp_exponent", "dynatemp_exponent")
    )
    # TabbyAPI's constrained output besides response_format: a JSON schema, a regular expression, or a Lark or GBNF
    # grammar (at most one of the four)
    json_schema: dict[str, Any] | None = None
    regex_pattern: str | None = None
    grammar_string: str | None = None
    # TabbyAPI: a BOS token before the prompt (None: as the model does)
    add_bos_token: bool | None = None
    # TabbyAPI: stop when the last loop_detect_window tokens are one pattern repeated (0 or 1: off)
    loop_detect_window: int | None = Field(default=None, ge=0, le=1 << 16)
    # TabbyAPI fields this server does not implement: accepted at their neutral value, else a 400 naming them
    token_healing: bool | None = None
    skew: float | None = None
    repetition_decay: int | None = None
    adaptive_target: float | None = None
    adaptive_decay: float | None = None

    @field_validator("banned_tokens", "allowed_tokens", mode="before")
    @classmethod
    def _token_lists(cls, v: Any) -> Any:
        return _token_id_list(v)

    @field_validator("dry_sequence_breakers", mode="before")
    @classmethod
    def _breakers(cls, v: Any) -> Any:
        """TabbyAPI's string form: a JSON array, or its items without the brackets (``"\\n", ":"``)."""
        if not isinstance(v, str):
            return v
        text = v if v.lstrip().startswith("[") else f"[{v}]"
        try:
            out = json.loads(text)
        except ValueError:
            raise PydanticCustomError(
                "breakers",
                "expected a list of strings, or a string holding a JSON array of them, got {value!r}",
                {"value": v[:80]},
            ) from None
        return out


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
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, validation_alias=AliasChoices("chat_template_kwargs", "template_vars")
    )
    # TabbyAPI's reasoning budget: after this many reasoning tokens the message and the end marker are forced
    reasoning_budget_tokens: int | None = Field(
        default=None,
        validation_alias=AliasChoices(
            "reasoning_budget_tokens", "reasoning_budget", "thinking_budget", "thinking_token_budget"
        ),
    )
    reasoning_budget_message: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    response_format: ResponseFormat | None = None


class KoboldGenerateRequest(SamplingFields):
    """The KoboldAI API's generate request as TabbyAPI takes it: a prompt, the sampling fields under their Kobold
    names (``max_length``, ``rep_pen``, ``rep_pen_range``, ``stop_sequence``, ``dynatemp_low`` ...), ``genkey``
    naming the generation for /api/extra/abort and /api/extra/generate/check, ``dynatemp_range`` (temperature
    +- range) and ``use_default_badwordsids`` (the end-of-sequence tokens banned)."""

    prompt: str
    max_tokens: int | None = Field(default=80, ge=0, validation_alias=AliasChoices("max_length", "max_tokens"))
    genkey: str | None = Field(default=None, max_length=256)
    use_default_badwordsids: bool = False
    dynatemp_range: float | None = Field(default=None, ge=0.0)


class KoboldKeyRequest(_Req):
    genkey: str = Field(max_length=256)


class KoboldTokenCountRequest(_Req):
    prompt: str


class TokenizeRequest(_Req):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # messages: passed to the template, as in a chat request
    tools: list[dict[str, Any]] | None = None  # messages: the tool list, rendered as a chat request's is


class DetokenizeRequest(_Req):
    model: str | None = None
    tokens: list[int]


class LoadRequest(_Req):
    model: str
    model_name: str | None = None
    device: str | None = None
    max_seq_len: int | None = Field(default=None, gt=0)
    cache_tokens: int | None = Field(default=None, gt=0)


class TabbyDraftRequest(_Req):
    """TabbyAPI's ``draft_model`` of a load (its DraftModelConfig fields); an unknown key is a 422."""

    model_config = ConfigDict(extra="forbid", strict=True)
    draft_model_name: str | None = Field(default=None, min_length=1)
    draft_mode: str | None = None
    draft_rope_scale: float | None = None
    draft_rope_alpha: float | Literal["auto"] | None = None
    draft_gpu_split: list[float] | None = None
    draft_cache_mode: str | None = None
    draft_num_tokens: int | None = None
    dynamic_draft: bool | None = None
    ngram_match_min: int | None = None


class TabbyLoadRequest(_Req):
    """TabbyAPI's POST /v1/model/load body (docs/server.md says what each field does here)."""

    model_config = ConfigDict(extra="ignore", strict=True, protected_namespaces=())
    model_name: str = Field(min_length=1)
    backend: str | None = None
    max_seq_len: int | None = Field(default=None, ge=-1)
    cache_size: int | None = Field(default=None, gt=0)
    cache_mode: str | None = None
    tensor_parallel: bool | None = None
    tensor_parallel_backend: str | None = None
    gpu_split_auto: bool | None = None
    autosplit_reserve: list[float] | None = None
    gpu_split: list[float] | None = None
    rope_scale: float | None = None
    rope_alpha: float | Literal["auto"] | None = None
    chunk_size: int | None = Field(default=None, gt=0)
    output_chunking: bool | None = None
    max_batch_size: int | None = Field(default=None, gt=0)
    prompt_template: str | None = None
    vision: bool | None = None
    draft_model: TabbyDraftRequest | None = None
    skip_queue: bool | None = None


class TokenEncodeRequest(_Req):
    text: str | list[dict[str, Any]]
    add_bos_token: bool = True
    encode_special_tokens: bool = True
    decode_special_tokens: bool = True
    template_vars: dict[str, Any] | None = Field(
        default=None, validation_alias=AliasChoices("template_vars", "chat_template_kwargs")
    )


class TokenDecodeRequest(_Req):
    tokens: list[int]
    add_bos_token: bool = True
    encode_special_tokens: bool = True
    decode_special_tokens: bool = True


class TemplateSwitchRequest(_Req):
    prompt_template_name: str = Field(min_length=1)


class OverrideSwitchRequest(_Req):
    preset: str | None = None
    overrides: dict[str, Any] | None = None


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
