"""Server settings: command-line flags, an optional YAML file (``--config serve.yml``) and environment variables,
merged into one :class:`ServeConfig` (flags win over the file, the file over defaults; keys add up).

serve.yml::

    host: 0.0.0.0
    port: 8000
    model: /models/my-exl2        # folder, .gguf or "smollm2"
    model_name: my-model          # the id /v1/models reports (default: the folder name)
    device: cuda:0
    gpu_split: auto               # or [20, 24]: layers split across GPUs (device: cuda)
    tensor_parallel: false        # or all / 2 / [0, 1]: every layer split across GPUs (NCCL)
    max_seq_len: 8192
    cache_tokens: 65536
    cache_type: q8                # KV cache: auto (fp32 on CPU, fp16 on CUDA), fp16, fp32, q8, q6, q4
    max_batch_tokens: 2048
    draft_model: /models/small    # speculative decoding with a draft model of the same tokenizer ...
    draft_tokens: 4               # ... proposing up to this many tokens a step; or ngram_draft: true
    api_keys: [sk-one, sk-two]    # or api_key_file: keys.txt (one per line, # comments)
    admin_key: sk-admin           # or admin_key_file
    default_max_tokens: 512
    max_tokens_limit: 4096
    max_schema_depth: 64          # client JSON schemas: nested levels (following $ref) ...
    max_schema_nodes: 20000       # ... and JSON values, checked before compiling
    template_timeout_s: 5         # one chat-template render: seconds ...
    template_max_chars: 33554432  # ... and characters it may build
    max_body_size: 8388608        # bytes of one request body (413 above)
    timeout_header: 10            # seconds a client has to send a request's line and headers ...
    timeout_body: 60              # ... and its body (408 after)
    timeout_keep_alive: 5         # seconds an idle keep-alive connection stays open
    max_connections: 512          # open connections; one more is answered 503 and closed
    forwarded_allow_ips: [10.0.0.2]  # proxies trusted for X-Forwarded-For/-Proto (default: none)
    timeout_graceful_shutdown: 20 # SIGTERM: seconds running requests have to finish
    model_dir: /models            # TabbyAPI's models folder: /v1/model/list, /v1/model/load, inline loading
    sampler_override_dir: sampler_overrides  # TabbyAPI's sampler presets (NAME.yml) ...
    sampler_preset: safe_defaults            # ... and the one in effect at start
    templates_dir: templates      # prompt templates (NAME.jinja) for /v1/template/switch
    reasoning: auto               # <think>...</think> into reasoning_content: auto (model's markers), true, false
    reasoning_start_token: <think>  # the markers (default: the model's own)
    reasoning_end_token: </think>
    reasoning_budget_tokens: 2048 # reasoning tokens before the end marker is forced (requests may set their own)
    tool_format: auto             # tool calls: auto (from the chat template), hermes, llama3, mistral
    inline_model_loading: false   # a request's "model" from model_dir is loaded (admin key)
    idle_unload_s: 600            # unload after this many idle seconds; the next request loads it again

Environment: EXL2CPP_API_KEYS (comma-separated), EXL2CPP_ADMIN_KEY.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InvalidArgumentError

MAX_TOKENS_SETTING = 2**31 - 1
CACHE_TYPES = ("auto", "fp16", "fp32", "q8", "q6", "q4")  # cache_tokens and max_seq_len (positions are 32-bit)


@dataclass
class ServeConfig:
    model: str | None = "smollm2"
    model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "cpu"
    gpu_split: Any = None  # None, "auto", [GB, GB, ...] or "20,24" (exl2cpp.load's gpu_split)
    tensor_parallel: Any = None  # None/false, "all"/true, N ranks, [0, 1] / "0,1" (tensor_parallel.tensor_parallel_kwargs)
    max_seq_len: int | None = None
    cache_tokens: int | None = None
    max_batch_tokens: int = 2048
    max_jobs: int = 0
    cache_type: str = "auto"  # KV cache: auto (fp32 on CPU, fp16 on CUDA), fp16, fp32, q8, q6, q4
    page_size: int = 256
    # speculative decoding (exl2cpp.Engine's draft_model / draft_tokens / ngram_draft): a draft model folder
    # (loaded on the model's device) or n-gram drafts
    draft_model: str | None = None
    draft_tokens: int = 4
    ngram_draft: bool = False
    api_keys: list[str] = field(default_factory=list)
    admin_key: str | None = None
    default_max_tokens: int = 512
    max_tokens_limit: int = 16384
    max_n: int = 8
    # client JSON schemas (response_format, tool parameters), checked before compiling: nesting depth of subschemas
    # following $ref, and JSON values in the schema (exl2cpp.server.grammar.GrammarLimits)
    max_schema_depth: int = 64
    max_schema_nodes: int = 20_000
    # a model's chat template is untrusted: one render stops past this time or after building this many characters
    # (exl2cpp.tokenizer.TemplateLimits)
    template_timeout_s: float = 5.0
    template_max_chars: int = 32 << 20
    log_level: str = "info"
    cors_origins: list[str] = field(default_factory=list)
    # transport (exl2cpp.server.transport): a request body larger than max_body_size bytes is a 413; a client has
    # timeout_header seconds for a request's line and headers and timeout_body for its body; idle keep-alive
    # connections close after timeout_keep_alive; connections past max_connections are answered 503
    max_body_size: int = 8 << 20
    timeout_header: float = 10.0
    timeout_body: float = 60.0
    timeout_keep_alive: float = 5.0
    max_connections: int = 512
    # proxies (addresses or networks, "*" for any) whose X-Forwarded-For / X-Forwarded-Proto are believed; none by
    # default: the logged client is the peer address
    forwarded_allow_ips: list[str] = field(default_factory=list)
    # SIGTERM: no new requests (503, /health "draining"), running ones get this many seconds to finish, the rest end
    # with an error event
    timeout_graceful_shutdown: float = 20.0
    # TabbyAPI's folders: models (/v1/model/list, /v1/model/load, inline loading), sampler override presets
    # (*.yml), prompt templates (*.jinja)
    model_dir: str | None = None
    sampler_override_dir: str = "sampler_overrides"
    sampler_preset: str | None = None
    templates_dir: str = "templates"
    # reasoning split into reasoning_content: "auto" (when the model's tokens or template name markers), true, false;
    # the markers (default: the model's, else <think> </think>)
    reasoning: Any = "auto"
    reasoning_start_token: str | None = None
    reasoning_end_token: str | None = None
    # reasoning tokens before the end is forced (None: no budget), and the text forced before the end marker
    reasoning_budget_tokens: int | None = None
    reasoning_budget_message: str | None = None
    # tool-call format (exl2cpp.server.tools): auto (read off the chat template), hermes, llama3, mistral
    tool_format: str = "auto"
    # a request's "model" naming another model in model_dir loads it (admin key only), as TabbyAPI's option
    inline_model_loading: bool = False
    # seconds without requests after which the model is unloaded (reloaded by the next request); None: never
    idle_unload_s: float | None = None

    def __repr__(self) -> str:  # never print keys
        d = dataclasses.asdict(self)
        d["api_keys"] = f"<{len(self.api_keys)} keys>"
        d["admin_key"] = "<set>" if self.admin_key else None
        return f"ServeConfig({d})"


def _read_keys(path: str | os.PathLike) -> list[str]:
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidArgumentError(f"cannot read the API key file {p}: {exc.strerror}") from None
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def load_config(path: str | os.PathLike | None = None, **overrides: Any) -> ServeConfig:
    """The YAML file at ``path`` (if any), then ``overrides`` (None values are ignored), then environment keys."""
    data: dict[str, Any] = {}
    if path is not None:
        import yaml

        p = Path(path).expanduser()
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
        except OSError as exc:
            raise InvalidArgumentError(
                f"cannot read the server config {p}: {exc.strerror}"
            ) from None
        except yaml.YAMLError as exc:
            raise InvalidArgumentError(f"server config {p} is not valid YAML: {exc}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise InvalidArgumentError(
                f"server config {p}: expected a mapping of settings at the top"
            )
        data.update(loaded)
    keys: list[str] = []
    for k in ("api_keys", "keys"):
        v = data.pop(k, None)
        if v:
            keys += [v] if isinstance(v, str) else [str(x) for x in v]
    for k in ("api_key", "api_key_file", "admin_key_file"):
        v = data.pop(k, None)
        if v and k == "api_key":
            keys.append(str(v))
        elif v and k == "api_key_file":
            keys += _read_keys(v)
        elif v:
            data["admin_key"] = _read_keys(v)[0] if _read_keys(v) else None
    known = {f.name for f in dataclasses.fields(ServeConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise InvalidArgumentError(
            f"server config: unknown setting(s) {unknown}; known: {sorted(known | {'api_key_file', 'admin_key_file'})}"
        )
    ov = {k: v for k, v in overrides.items() if v is not None}
    keys += list(ov.pop("api_keys", []) or [])
    for f in ov.pop("api_key_files", []) or []:
        keys += _read_keys(f)
    data.update(ov)
    ips = data.get("forwarded_allow_ips")
    if isinstance(ips, str):  # "127.0.0.1,10.0.0.0/8" from the command line
        data["forwarded_allow_ips"] = [x.strip() for x in ips.split(",") if x.strip()]
    env = os.environ.get("EXL2CPP_API_KEYS", "")
    keys += [k.strip() for k in env.split(",") if k.strip()]
    if os.environ.get("EXL2CPP_ADMIN_KEY") and not data.get("admin_key"):
        data["admin_key"] = os.environ["EXL2CPP_ADMIN_KEY"]
    data["api_keys"] = list(dict.fromkeys(keys))
    cfg = ServeConfig(**data)
    if not isinstance(cfg.port, int) or not 0 <= cfg.port < 65536:
        raise InvalidArgumentError(
            f"server config: port must be an integer in [0, 65535], got {cfg.port!r}"
        )
    _check_limits(cfg)
    return cfg


def _check_limits(cfg: ServeConfig) -> None:
    from .grammar import MAX_DEPTH_LIMIT, MAX_NODES_LIMIT

    for name, top in (
        ("max_schema_depth", MAX_DEPTH_LIMIT),
        ("max_schema_nodes", MAX_NODES_LIMIT),
        ("template_max_chars", 1 << 40),
        ("max_body_size", 1 << 40),
        ("max_connections", 1 << 20),
        ("cache_tokens", MAX_TOKENS_SETTING),
        ("max_seq_len", MAX_TOKENS_SETTING),
    ):
        v = getattr(cfg, name)
        if v is None and name in ("cache_tokens", "max_seq_len"):
            continue
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= top:
            raise InvalidArgumentError(
                f"server config: {name} must be an integer in [1, {top}], got {v!r}"
            )
    for name in (
        "template_timeout_s",
        "timeout_header",
        "timeout_body",
        "timeout_keep_alive",
        "timeout_graceful_shutdown",
    ):
        t = getattr(cfg, name)
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 3600:
            raise InvalidArgumentError(
                f"server config: {name} must be a number of seconds in (0, 3600], got {t!r}"
            )
    if not isinstance(cfg.cache_type, str) or cfg.cache_type.lower() not in CACHE_TYPES:
        raise InvalidArgumentError(
            f"server config: cache_type must be one of {', '.join(CACHE_TYPES)}, got {cfg.cache_type!r}"
        )
    cfg.cache_type = cfg.cache_type.lower()
    if cfg.reasoning not in ("auto", True, False):
        raise InvalidArgumentError(f"server config: reasoning must be auto, true or false, got {cfg.reasoning!r}")
    b = cfg.reasoning_budget_tokens
    if b is not None and (isinstance(b, bool) or not isinstance(b, int)):
        raise InvalidArgumentError(f"server config: reasoning_budget_tokens must be an integer, got {b!r}")
    for name in ("reasoning_start_token", "reasoning_end_token", "reasoning_budget_message"):
        v = getattr(cfg, name)
        if v is not None and (not isinstance(v, str) or (not v and name != "reasoning_budget_message")):
            raise InvalidArgumentError(f"server config: {name} must be a non-empty string, got {v!r}")
    if cfg.tool_format not in ("auto", "hermes", "llama3", "mistral"):
        raise InvalidArgumentError(
            f"server config: tool_format must be auto, hermes, llama3 or mistral, got {cfg.tool_format!r}"
        )
    for name in ("inline_model_loading",):
        if not isinstance(getattr(cfg, name), bool):
            raise InvalidArgumentError(f"server config: {name} must be true or false")
    t = cfg.idle_unload_s
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
        raise InvalidArgumentError(f"server config: idle_unload_s must be a positive number of seconds, got {t!r}")
    ips = cfg.forwarded_allow_ips
    if not isinstance(ips, list) or not all(isinstance(x, str) for x in ips):
        raise InvalidArgumentError(
            f"server config: forwarded_allow_ips must be a list of addresses or networks, got {ips!r}"
        )
