"""The FastAPI application of ``exl2cpp serve``: OpenAI-compatible endpoints over one Engine, health, metrics,
tokenizer and admin endpoints, API-key auth and OpenAI-style error bodies.

Requests turn into Engine jobs (one per choice); responses stream from the jobs' asyncio iterators. A client that
disconnects cancels its jobs (their cache pages are freed at once). Bad input is always a 4xx with
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import Exl2Error, InternalError, InvalidArgumentError, OutOfMemoryError
from . import tools as toolmod
from .auth import KeyChecker, credential
from .config import MAX_TOKENS_SETTING, ServeConfig
from .metrics import CONTENT_TYPE, Metrics
from .presets import Overrides, folder_file
from .reasoning import ReasoningBudget, ReasoningSplitter, model_markers, opens_reasoning
from .reasoning import split as reasoning_split
from .schemas import (
    ChatCompletionRequest,
    OverrideSwitchRequest,
    CompletionRequest,
    DetokenizeRequest,
    KoboldGenerateRequest,
    KoboldKeyRequest,
    KoboldTokenCountRequest,
    LoadRequest,
    ResponseFormat,
    TabbyLoadRequest,
    TemplateSwitchRequest,
    TokenDecodeRequest,
    TokenEncodeRequest,
    TokenizeRequest,
    error_body,
)

log = logging.getLogger("exl2cpp.server")


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = (
            status,
            message,
            type_,
            code,
            param,
        )


# ---- the model slot -------------------------------------------------------------------------------------------


class Flight:
    """The jobs of one generation request while its response is made. ``cut`` is the error the response ends with
    when the server stops the jobs itself (an unload, a reload, a shutdown)."""

    __slots__ = ("cut", "jobs")

    def __init__(self, jobs: list):
        self.jobs = jobs
        self.cut: ApiError | None = None

    def was_cut(self, job) -> bool:
        return self.cut is not None and job.finish_reason == "cancelled"


SHUTTING_DOWN = "server_shutting_down"
# why the server ends requests in flight itself, and the error code it says so with
UNLOADED = ("the model was unloaded (POST /admin/unload)", "model_unloaded")
REPLACED = ("the model was reloaded or replaced (POST /admin/load)", "model_replaced")
SHUTDOWN = ("the server is shutting down", SHUTTING_DOWN)


@dataclass(frozen=True)
class LoadSpec:
    """What one model load was asked for (device, sizes with the server's defaults filled in)."""

    path: str
    name: str | None
    device: str
    max_seq_len: int | None
    cache_tokens: int | None
    # None: the server's setting (ServeConfig)
    cache_type: str | None = None
    max_batch_tokens: int | None = None
    max_jobs: int | None = None
    gpu_split: Any = None
    tensor_parallel: Any = None
    # speculative decoding: None, the server's settings (serve --draft-model ...); else the Engine's options
    # {"draft_model": folder or None, "draft_tokens", "ngram_draft", "ngram_sizes"?} (TabbyAPI's draft_model)
    draft: Any = None


class ModelSlot:
    """The one model + engine being served, with its state: "unloaded", "loading", "ready" or "error"; the
    generation requests in flight (:class:`Flight`); ``draining`` once the server shuts down."""

    def __init__(self, config: ServeConfig):
        self.config = config
        self.state = "unloaded"
        self.error: str | None = None  # the last failed load, for the admin (never on /health)
        self.model = None
        self.engine = None
        self.spec: LoadSpec | None = None
        self.name: str | None = None
        self.loaded_at = 0
        self.flights: set[Flight] = set()
        self.template: tuple[str, str] | None = None  # (name, source): /v1/template/switch over the model's own
        # idle unload: when the last request ended, and the model (with its template) unloaded for idleness,
        # which the next request loads again
        self.last_used = time.monotonic()
        self.sleeping: tuple[LoadSpec, tuple[str, str] | None] | None = None
        self.draining = False
        self._grammar = None
        self._lock = asyncio.Lock()

    def stats(self) -> dict | None:
        eng = self.engine
        return eng.stats() if eng is not None and self.state == "ready" else None

    async def load(self, path: str, *args: Any, **kw: Any) -> None:
        """Load a model (arguments as :meth:`spec_for`) beside the one being served and swap when it is ready; when
        the two do not fit, free the old one first and bring it back if the new one fails too. A failed load leaves
        the old model serving."""
        await self.load_spec(self.spec_for(path, *args, **kw))

    def spec_for(
        self,
        path: str,
        name: str | None = None,
        device: str | None = None,
        max_seq_len: int | None = None,
        cache_tokens: int | None = None,
        **more: Any,
    ) -> LoadSpec:
        """The LoadSpec of a load with the server's defaults filled in, its sizes checked (400 naming the field);
        ``more``: its other fields (cache_type, max_batch_tokens, ...)."""
        cfg = self.config
        spec = LoadSpec(
            path,
            name or cfg.model_name,
            device or cfg.device,
            max_seq_len or cfg.max_seq_len,
            cache_tokens or cfg.cache_tokens,
            **more,
        )
        for field_name in ("cache_tokens", "max_seq_len"):
            v = getattr(spec, field_name)
            if v is not None and not 0 < v <= MAX_TOKENS_SETTING:
                raise ApiError(
                    400,
                    f"{field_name}={v} is out of range: at most {MAX_TOKENS_SETTING}",
                    param=field_name,
                )
        return spec

    async def load_spec(self, spec: LoadSpec, progress=None) -> None:
        """``progress(module, modules, model_type)``: called on the loading thread as modules load (see
        :func:`_load_model`)."""
        path = spec.path
        async with self._lock:
            old = self.spec if self.engine is not None else None
            if old is None:
                self.state = "loading"
            try:
                loaded = await self._load_beside(spec, old is not None, progress)
                if loaded is None:
                    log.warning("no room to load %s beside %s: unloading it first", path, old.path)
                    await self._unload(*REPLACED)
                    self.state = "loading"
                    loaded = await self._load_in_place(spec, old, progress)
            except Exception as exc:
                self.error = f"loading {path} failed: {exc}"
                log.error("loading %s failed: %s", path, exc)
                if self.engine is None:
                    self.state = "error"
                raise
            old_engine = self._serve(spec, *loaded)
            if old_engine is not None:
                await asyncio.to_thread(old_engine.close)
                gc.collect()

    async def _load_beside(self, spec: LoadSpec, beside: bool, progress=None):
        """(model, engine), or None when there is no memory for it beside the model being served."""
        try:
            return await asyncio.to_thread(_load_model, spec, self.config, progress)
        except MemoryError:
            if not beside:
                raise
        return None  # out of the except block: what the failed load held is freed

    async def _load_in_place(self, spec: LoadSpec, old: LoadSpec, progress=None):
        """(model, engine) for ``spec`` where ``old`` was (freed already); when that fails, ``old`` is loaded again
        and the failure raised."""
        try:
            return await asyncio.to_thread(_load_model, spec, self.config, progress)
        except Exception as exc:  # noqa: BLE001 - raised again below
            # without its traceback: the frames in it hold what the failed load allocated
            failure = exc.with_traceback(None)
        gc.collect()
        await self._restore(old)
        raise failure

    def _serve(self, spec: LoadSpec, model, engine):
        """Serve this model from now on; returns the engine it replaces (to close)."""
        old = self.engine
        self.cut(*REPLACED)
        self.model, self.engine, self.spec, self._grammar = model, engine, spec, None
        self.template, self.sleeping, self.last_used = None, None, time.monotonic()
        self.name = spec.name or _default_name(spec.path, model)
        self.loaded_at = int(time.time())
        self.state, self.error = "ready", None
        log.info(
            "serving %s as %r on %s (context %d)",
            model.path,
            self.name,
            model.device,
            model.max_seq_len,
        )
        return old

    async def _restore(self, spec: LoadSpec) -> None:
        try:
            model, engine = await asyncio.to_thread(_load_model, spec, self.config)
        except Exception as exc:  # noqa: BLE001 - the new model's error is the one reported
            log.error("bringing back %s failed too: %s", spec.path, exc)
            return
        self._serve(spec, model, engine)

    async def unload(self, why: tuple[str, str] = UNLOADED) -> None:
        async with self._lock:
            self.sleeping = None
            await self._unload(*why)

    async def sleep_if_idle(self, idle_s: float) -> bool:
        """Unload the model when no request ran for ``idle_s`` seconds; the next request loads it again
        (:meth:`wake`). True if it did."""
        async with self._lock:
            if self.state != "ready" or self.flights or self.draining:
                return False
            if time.monotonic() - self.last_used < idle_s:
                return False
            keep = (self.spec, self.template)
            log.info("unloading %r after %g s without requests", self.name, idle_s)
            await self._unload(*UNLOADED)
            self.sleeping = keep
            return True

    async def wake(self) -> None:
        """Load the model an idle unload took away (once, however many requests wait for it)."""
        if self.sleeping is None or self.state == "ready":
            return
        async with self._lock:
            if self.sleeping is None or self.engine is not None:
                return
            spec, template = self.sleeping
            self.state = "loading"
            try:
                model, engine = await asyncio.to_thread(_load_model, spec, self.config)
            except Exception as exc:
                self.error = f"loading {spec.path} again after an idle unload failed: {exc}"
                self.state = "unloaded"
                raise ApiError(503, self.error, "server_error", "model_not_ready") from None
            self._serve(spec, model, engine)
            self.template = template

    async def _unload(self, why: str, code: str) -> None:
        engine = self.engine
        self.cut(why, code)
        self.model = self.engine = self.spec = self._grammar = None
        self.name = None
        self.state = "unloaded"
        if engine is not None:
            await asyncio.to_thread(engine.close)
        gc.collect()

    # -- requests in flight --
    def submit(self, engine, plan: Plan) -> Flight:
        """The plan's jobs on ``engine`` (the one require() gave), tracked until :meth:`end`."""
        if self.draining:
            raise ApiError(
                503,
                "the server is shutting down and takes no new requests",
                "server_error",
                SHUTTING_DOWN,
            )
        if engine is not self.engine:
            raise ApiError(
                503,
                "the model was unloaded or replaced while this request was prepared; retry",
                "server_error",
                "model_not_ready",
            )
        flight = Flight(_submit(engine, plan))
        self.flights.add(flight)
        self.last_used = time.monotonic()
        return flight

    def end(self, flight: Flight) -> bool:
        """The response is done: forget the flight and stop its jobs; True if some were still running."""
        self.flights.discard(flight)
        self.last_used = time.monotonic()
        stopped = [j.cancel() for j in flight.jobs]  # every job, not up to the first running one
        return any(stopped)

    def cut(self, why: str, code: str) -> None:
        """End every request in flight with an error (503 ``code``) saying ``why``."""
        error = ApiError(
            503, f"{why} while this request ran; its output is incomplete", "server_error", code
        )
        for f in list(self.flights):
            if f.cut is None:
                f.cut = error
                for j in f.jobs:
                    j.cancel()

    async def drain(self, grace: float) -> None:
        """Shutdown: take no new requests, give the running ones ``grace`` seconds, then end the rest."""
        self.draining = True
        loop = asyncio.get_running_loop()
        log.warning(
            "draining: no new requests; %d running have %g s to finish", len(self.flights), grace
        )
        end = loop.time() + grace
        while self.flights and loop.time() < end:
            await asyncio.sleep(0.05)
        if self.flights:
            log.warning("ending %d requests still running after %g s", len(self.flights), grace)
            self.cut(*SHUTDOWN)
            end = loop.time() + 5
            while self.flights and loop.time() < end:
                await asyncio.sleep(0.05)

    async def grammar(self):
        if self._grammar is None:
            from .grammar import GrammarFactory, GrammarLimits

            tok, cfg = self.model.tokenizer, self.config
            limits = GrammarLimits(cfg.max_schema_depth, cfg.max_schema_nodes)
            self._grammar = await asyncio.to_thread(
                GrammarFactory, tok._json, self.model.vocab_size, tok.eos_ids, limits
            )
        return self._grammar

    def require(self, requested: str | None):
        if self.state != "ready":
            raise ApiError(
                503,
                f"no model is ready (state: {self.state}); retry when GET /health says ready",
                "server_error",
                "model_not_ready",
            )
        if requested and requested != self.name:
            raise ApiError(
                404,
                f"The model '{requested}' does not exist; this server serves '{self.name}' "
                "(see GET /v1/models)",
                "invalid_request_error",
                "model_not_found",
                "model",
            )
        return self.model, self.engine


def _load_model(spec: LoadSpec, cfg: ServeConfig, progress=None):
    """(model, engine) of a spec: the draft model first (when there is one), then the model.
    ``progress(module, modules, model_type)`` ("draft", then "model") follows each one's modules (embedding, layers,
    head) as they load."""
    import exl2cpp

    from .. import _C
    from ..models import resolve_model
    from ..tensor_parallel import tensor_parallel_kwargs

    def report(kind: str):
        return None if progress is None else (lambda done, total: progress(done, total, kind))

    folder = resolve_model(spec.path)
    seq = spec.max_seq_len or int(_C.load_config(str(folder))["max_position_embeddings"])
    draft = _draft_options(cfg, _Target(spec.device, seq), spec.draft, report("draft"))
    device = spec.device
    split = spec.gpu_split if spec.gpu_split is not None else cfg.gpu_split
    kw = {"gpu_split": split} if split is not None and str(device).startswith("cuda") else {}
    tp = spec.tensor_parallel if spec.tensor_parallel is not None else cfg.tensor_parallel
    kw.update(tensor_parallel_kwargs(tp))
    model = exl2cpp.load(str(folder), device=device, max_seq_len=spec.max_seq_len, progress=report("model"), **kw)
    _ = model.tokenizer  # fail now, not on the first request
    if spec.cache_tokens is not None:
        _check_cache_could_fit(model, spec.cache_tokens)
    engine = exl2cpp.Engine(
        model,
        cache_tokens=spec.cache_tokens,
        max_batch_tokens=spec.max_batch_tokens or cfg.max_batch_tokens,
        max_jobs=spec.max_jobs if spec.max_jobs is not None else cfg.max_jobs,
        page_size=cfg.page_size,
        cache_type=spec.cache_type or cfg.cache_type,
        **draft,
    )
    return model, engine


@dataclass(frozen=True)
class _Target:
    """Where a draft model goes: the model's device and context."""

    device: str
    max_seq_len: int


def _draft_options(cfg: ServeConfig, model, draft: dict | None = None, progress=None) -> dict:
    """Speculative decoding options of the engine: ``draft`` (a load's own, TabbyAPI's draft_model), else the
    server's (serve --draft-model / --draft-tokens / --ngram-draft); a draft model is loaded on ``model``'s device
    with its context."""
    import exl2cpp

    from ..models import resolve_model

    if draft is None:
        draft = {"draft_model": cfg.draft_model, "draft_tokens": cfg.draft_tokens, "ngram_draft": bool(cfg.ngram_draft)}
    opts = {k: v for k, v in draft.items() if k != "draft_model"}
    if draft.get("draft_model"):
        opts["draft_model"] = exl2cpp.load(
            str(resolve_model(draft["draft_model"])), device=model.device, max_seq_len=model.max_seq_len,
            progress=progress,
        )
    return opts


def _check_cache_could_fit(model, cache_tokens: int) -> None:
    """Refuse a KV cache larger than all the memory of this machine (host and GPUs) even at 16 bits a value: no
    amount of freeing makes room for it, so /admin/load must not unload the serving model to try."""
    from .. import _C
    from ..model import kv_values_per_layer

    c = model.text_config
    need = cache_tokens * c["num_hidden_layers"] * kv_values_per_layer(c) * 2  # K and V
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if str(model.device).startswith("cuda"):
        have += sum(_C.cuda_mem_info(i)[1] for i in range(_C.cuda_device_count()))
    if need > have:
        raise InvalidArgumentError(
            f"cache_tokens={cache_tokens} needs at least {need / 2**30:.0f} GiB of KV-cache memory; "
            f"this machine has {have / 2**30:.0f} GiB in all"
        )


def _default_name(path: str, model) -> str:
    p = str(path)
    return p if "/" not in p and not p.endswith(".gguf") else Path(model.path).name


# ---- request -> jobs ------------------------------------------------------------------------------------------


@dataclass
class Plan:
    prompts: list[list[int]]
    max_new_tokens: int
    n: int
    stop: list[str]
    sampling: dict[str, Any]
    ignore_eos: bool = False
    constraint: Any = None  # callable -> Constraint (one per job), or None
    tools: list[dict] = field(default_factory=list)
    want_logprobs: bool = False
    top_logprobs: int = 0
    stop_tokens: list[int] = field(default_factory=list)
    reasoning: tuple[str, str, bool] | None = None  # (start, end marker, the prompt opened it): split it off
    tool_format: str = "hermes"  # how the model writes tool calls (exl2cpp.server.tools)
    max_calls: int | None = None  # parallel_tool_calls false: 1
    builtin_tools: list[str] = field(default_factory=list)  # Llama 3.1's built-in tools the reply may call


# TabbyAPI fields accepted only at their neutral value (this server has no such sampler)
_NEUTRAL_ONLY = {"token_healing": False, "skew": 0.0, "repetition_decay": 0}


def _sampling(req, tok, vocab: int, max_new: int | None = None) -> dict[str, Any]:
    """The engine's sampling keywords for a request (docs/server.md has the field table). Settings of a sampler
    that is off (DRY without a multiplier, XTC without a probability, mirostat mode 0) are left out, so that the
    neutral values TabbyAPI clients send (``dry_base: 0``) are not range errors; the rest is checked here, each
    error a 400 naming the field."""
    for k, neutral in _NEUTRAL_ONLY.items():
        v = getattr(req, k)
        if v is not None and v != neutral:
            raise ApiError(400, f"{k}={v!r} is not supported by this server (only {neutral!r})", param=k)
    if req.adaptive_target is not None and req.adaptive_target < 1.0:
        raise ApiError(
            400,
            f"adaptive_target={req.adaptive_target!r}: adaptive-P sampling is not implemented (1.0 or more: off)",
            param="adaptive_target",
        )
    s: dict[str, Any] = {
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
    }
    if req.top_k is not None and req.top_k > 0:
        s["top_k"] = req.top_k
    for k in (
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "penalty_range",
        "temperature_last",
        "smoothing_factor",
        "smoothing_curve",
        "top_a",
        "tfs",
        "typical",
        "min_temp",
        "max_temp",
        "temp_exponent",
    ):
        v = getattr(req, k)
        if v is not None:
            s[k] = v
    if req.min_tokens:
        if max_new is not None and req.min_tokens > max_new:
            raise ApiError(
                400, f"min_tokens={req.min_tokens} is above max_tokens={max_new}", param="min_tokens"
            )
        s["min_tokens"] = req.min_tokens
    for k in ("banned_tokens", "allowed_tokens"):
        ids = getattr(req, k)
        if ids:
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ApiError(
                    400, f"{k}: token id {bad[0]} is outside the vocabulary [0, {vocab})", param=k
                )
            s[k] = list(ids)
    if req.dry_multiplier:
        s["dry_multiplier"] = req.dry_multiplier
        for k in ("dry_base", "dry_allowed_length", "dry_range"):
            v = getattr(req, k)
            if v is not None:
                s[k] = v
        if req.dry_sequence_breakers:
            s["dry_sequence_breakers"] = list(req.dry_sequence_breakers)
    if req.xtc_probability:
        s["xtc_probability"] = req.xtc_probability
        if req.xtc_threshold is not None:
            s["xtc_threshold"] = req.xtc_threshold
    if req.mirostat_mode:
        if req.mirostat_mode != 2:
            what = "mirostat v1 is not implemented" if req.mirostat_mode == 1 else "unknown mode"
            raise ApiError(
                400,
                f"mirostat_mode={req.mirostat_mode}: {what}; use 2 (mirostat v2) or 0 (off)",
                param="mirostat_mode",
            )
        s["mirostat_mode"] = 2
        for k in ("mirostat_tau", "mirostat_eta"):
            v = getattr(req, k)
            if v is not None:
                s[k] = v
    if req.logit_bias:
        bias = {}
        for k, v in req.logit_bias.items():
            try:
                tid = int(k)
            except ValueError:
                raise ApiError(
                    400, f"logit_bias key {k!r} is not a token id", param="logit_bias"
                ) from None
            if not 0 <= tid < vocab:
                raise ApiError(
                    400,
                    f"logit_bias token id {tid} is outside the vocabulary [0, {vocab})",
                    param="logit_bias",
                )
            if not -100.0 <= v <= 100.0:
                raise ApiError(
                    400,
                    f"logit_bias value {v} for token {tid} must be in [-100, 100]",
                    param="logit_bias",
                )
            bias[tid] = float("-inf") if v <= -100.0 else v
        s["logit_bias"] = bias
    if req.banned_strings:
        from ..engine import _banned_list

        banned = [req.banned_strings] if isinstance(req.banned_strings, str) else req.banned_strings
        try:
            s["banned_strings"] = _banned_list(banned)
        except InvalidArgumentError as exc:
            raise ApiError(400, str(exc), param="banned_strings") from None
    if req.max_rewinds is not None:
        s["max_rewinds"] = req.max_rewinds
    _check_sampling(s, tok)
    return s


_SETTING_NAME = re.compile(r"SamplerSettings\.(\w+)")


def _check_sampling(s: dict[str, Any], tok) -> None:
    """The engine's own range checks, now: a bad value is a 400 naming the request's field."""
    from ..engine import _sampler_settings

    kw = {k: v for k, v in s.items() if k not in ("banned_strings", "max_rewinds")}
    try:
        _sampler_settings(kw, tok)
    except Exl2Error as exc:
        text = str(exc)
        m = _SETTING_NAME.search(text)
        name = m.group(1) if m else next((k for k in kw if text.startswith(k)), None)
        if name == "penalty_window":
            name = "penalty_range"
        raise ApiError(400, text.replace("SamplerSettings.", ""), param=name) from None


def _stops(stop) -> tuple[list[str], list[int]]:
    """Stop strings and stop token ids (TabbyAPI takes both in ``stop``)."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > 16:
        raise ApiError(400, f"stop has {len(stops)} entries; at most 16", param="stop")
    return [s for s in stops if isinstance(s, str) and s], [s for s in stops if isinstance(s, int)]


def _stop_ids(ids: list[int], vocab: int) -> list[int]:
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"stop: token id {bad[0]} is outside the vocabulary [0, {vocab})", param="stop")
    return ids


def _budget(cfg: ServeConfig, model, n_prompt: int, requested: int | None, what: str) -> int:
    ctx = model.max_seq_len
    if n_prompt >= ctx:
        raise ApiError(
            400,
            f"This model's maximum context length is {ctx} tokens. However, your {what} resulted "
            f"in {n_prompt} tokens. Please reduce the length of the {what}.",
            code="context_length_exceeded",
            param="messages" if what == "messages" else "prompt",
        )
    if requested is None:
        return max(0, min(cfg.default_max_tokens, ctx - n_prompt))
    if requested > cfg.max_tokens_limit:
        raise ApiError(
            400,
            f"max_tokens={requested} is above this server's limit of {cfg.max_tokens_limit}",
            param="max_tokens",
        )
    if n_prompt + requested > ctx:
        raise ApiError(
            400,
            f"This model's maximum context length is {ctx} tokens. However, you requested "
            f"{n_prompt + requested} tokens ({n_prompt} in the {what}, {requested} in the "
            "completion). Please reduce the length of the {what} or the completion.".replace(
                "{what}", what
            ),
            code="context_length_exceeded",
            param="max_tokens",
        )
    return requested


async def _compiled(future, param: str | None = None) -> Any:
    """A grammar compiled on the compiler threads; its errors are the client's (400 naming the grammar, or
    ``param``)."""
    from .grammar import GrammarError

    try:
        return await asyncio.wrap_future(future)
    except GrammarError as exc:
        raise ApiError(400, str(exc), param=param or exc.param) from None


_GRAMMAR_FIELDS = ("json_schema", "regex_pattern", "grammar_string")


def _with_loop_stop(constraint, req, tok, vocab: int):
    """The job's constraint with TabbyAPI's loop detection around it (``loop_detect_window`` > 1)."""
    window = req.loop_detect_window
    if not window or window < 2:
        return constraint
    why = ("ban_eos_token / ignore_eos (a loop ends with EOS)" if req.ignore_eos else
           "banned_strings" if req.banned_strings else None if tok.eos_id is not None else "a model without EOS")
    if why:
        raise ApiError(400, f"loop_detect_window cannot be combined with {why}", param="loop_detect_window")
    from .loop_stop import LoopStop

    eos = tok.eos_id

    def make():
        return LoopStop(window, eos, vocab, constraint() if constraint is not None else None)

    return make


async def _request_constraint(slot: ModelSlot, body) -> Any:
    """The constraint of a request's response_format, or of TabbyAPI's json_schema / regex_pattern /
    grammar_string (a Lark or GBNF grammar): at most one of them."""
    rf = getattr(body, "response_format", None)  # the Kobold routes have none
    given = (["response_format"] if rf is not None and rf.type != "text" else []) + [
        k for k in _GRAMMAR_FIELDS if getattr(body, k) is not None
    ]
    if len(given) > 1:
        raise ApiError(400, f"give one of response_format, {', '.join(_GRAMMAR_FIELDS)}; got {given}", param=given[1])
    if not given or given[0] == "response_format":
        return await _response_constraint(slot, rf)
    field_name = given[0]
    factory = await slot.grammar()
    if field_name == "json_schema":
        future = factory.submit_json_schema(body.json_schema, "json_schema")
    else:
        kind = "regex" if field_name == "regex_pattern" else "grammar"
        future = factory.submit_grammar(kind, getattr(body, field_name), field_name, field_name)
    grammar = await _compiled(future, field_name)
    return grammar.constraint


async def _response_constraint(slot: ModelSlot, rf: ResponseFormat | None):
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        schema = None
    else:
        js = rf.json_schema or {}
        if not isinstance(js.get("schema", {}), dict):
            raise ApiError(
                400,
                "response_format.json_schema.schema must be a JSON schema object",
                param="response_format",
            )
        schema = js.get("schema") or {"type": "object"}
    factory = await slot.grammar()
    grammar = await _compiled(factory.submit_json_schema(schema))
    return grammar.constraint


async def _chat_text(
    cfg: ServeConfig,
    tok,
    messages: list[dict],
    tools: list[dict],
    extra: dict,
    add_generation_prompt: bool,
    template: str | None = None,
    tool_format: str | None = None,
) -> str:
    """A chat rendered with the model's chat template (or ``template``, a template's source), messages prepared
    (tool calls, tool list), off the event loop (a long conversation or a slow template must not stall other
    requests; the render itself stops at cfg's template limits)."""
    from ..tokenizer import TemplateLimits

    source = template if template is not None else tok.chat_template
    source = source if isinstance(source, str) else json.dumps(source)
    template_has_tools = bool(source) and "tools" in source
    limits = TemplateLimits(cfg.template_timeout_s, cfg.template_max_chars)
    fmt = tool_format or _tool_format(cfg, tok, template)

    def render() -> str:
        prepared = toolmod.prepare_messages(messages, tools, template_has_tools, fmt)
        return tok.apply_chat_template(
            prepared,
            add_generation_prompt=add_generation_prompt,
            tools=tools if template_has_tools and tools else None,
            chat_template=template,
            template_limits=limits,
            **extra,
        )

    try:
        return await asyncio.to_thread(render)
    except Exl2Error as exc:
        raise ApiError(400, str(exc), param="messages") from None


_RESERVED_TEMPLATE_KEYS = {"messages", "add_generation_prompt", "tools", "chat_template", "template_limits"}


def _template_kwargs(kwargs: dict | None, param: str) -> dict:
    extra = dict(kwargs or {})
    reserved = sorted(set(extra) & _RESERVED_TEMPLATE_KEYS)
    if reserved:
        raise ApiError(400, f"{param} may not set {reserved}", param=param)
    return extra


def _reasoning_markers(cfg: ServeConfig, tok, template: str | None) -> tuple[str, str] | None:
    """The (start, end) markers to split reasoning at, or None: ``reasoning`` true uses the configured markers
    (default the model's, else <think> </think>); "auto" only a model (or template) that names its markers."""
    if cfg.reasoning is False:
        return None
    found = model_markers(tok, template)
    if found is None and cfg.reasoning == "auto" and not cfg.reasoning_start_token:
        return None
    start, end = found or ("<think>", "</think>")
    return cfg.reasoning_start_token or start, cfg.reasoning_end_token or end


def _tool_format(cfg: ServeConfig, tok, template: str | None) -> str:
    """The tool-call format: the server's setting, or (auto) the one the chat template in use writes."""
    if cfg.tool_format != "auto":
        return cfg.tool_format
    source = template if template is not None else tok.chat_template
    return toolmod.template_format(source if isinstance(source, str) else json.dumps(source))


def _special_id(tok):
    """text -> the id of the special token spelled so, or None (tool-call markers in a forced-call grammar)."""

    special = {t.content: i for i, t in tok._tk.get_added_tokens_decoder().items() if t.special}
    return special.get


def _template_source(slot: ModelSlot) -> str | None:
    return slot.template[1] if slot.template else None


def _template_name(slot: ModelSlot) -> str | None:
    """The prompt template in use: a switched-to file's name, else the file the model's own came from."""
    if slot.template:
        return slot.template[0]
    tok = slot.model.tokenizer if slot.model is not None else None
    if tok is None or not tok.has_chat_template:
        return None
    f = tok.chat_template_file
    return Path(f).stem if f else "chat_template"


def _read_template(cfg: ServeConfig, name: str) -> tuple[str, str]:
    """(name, source) of templates_dir/name.jinja; 400 naming prompt_template_name when there is none."""
    path = folder_file(cfg.templates_dir, name, (".jinja", ""))
    if path is None:
        folder = Path(cfg.templates_dir).expanduser()
        have = sorted(p.stem for p in folder.glob("*.jinja")) if folder.is_dir() else []
        raise ApiError(
            400,
            f"The template name {name!r} doesn't exist in {cfg.templates_dir} (templates: {have})",
            code="template_not_found",
            param="prompt_template_name",
        )
    try:
        return name, path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"template {name!r} cannot be read: {exc}", param="prompt_template_name") from None


def _model_path(cfg: ServeConfig, name: str, param: str = "model_name") -> Path:
    """model_dir/name, a folder; a name that is not one folder name of model_dir (``../x``, ``/abs``) is refused."""
    if not cfg.model_dir:
        raise ApiError(
            400, "this server has no models folder: start it with --model-dir", param=param
        )
    root = Path(cfg.model_dir).expanduser()
    bad = not name or "/" in name or "\\" in name or name in (".", "..") or name.startswith(".")
    if bad:
        raise ApiError(
            400, f"{name!r} is not a model folder name in the models folder", code="model_not_found", param=param
        )
    path = root / name
    if not path.is_dir():
        raise ApiError(
            400,
            f"Could not find the model {name!r} in the models folder (see GET /v1/model/list)",
            code="model_not_found",
            param=param,
        )
    return path


# TabbyAPI's cache_mode (and its k_bits,v_bits pairs where both are equal) -> cache_type
_CACHE_MODES = {m: m for m in ("fp16", "fp32", "q8", "q6", "q4")} | {"8,8": "q8", "6,6": "q6", "4,4": "q4"}


def _tabby_load_fields(body: TabbyLoadRequest, cfg: ServeConfig) -> dict[str, Any]:
    """The LoadSpec fields of a TabbyAPI load request; a field that cannot apply here is a 400 naming it."""

    def no(field: str, why: str) -> ApiError:
        return ApiError(400, f"{field}: {why}", code="unsupported", param=field)

    out: dict[str, Any] = {}
    cuda = str(cfg.device).startswith("cuda")
    if body.backend not in (None, "exl2cpp", "exllamav2"):
        raise no("backend", f"{body.backend!r} is not a backend of this server (exl2cpp runs EXL2 models)")
    if body.cache_mode is not None:
        mode = _CACHE_MODES.get(body.cache_mode.replace(" ", "").lower())
        if mode is None:
            raise no("cache_mode", f"{body.cache_mode!r} is not one of FP16, Q8, Q6, Q4 (or 8,8 / 6,6 / 4,4)")
        out["cache_type"] = mode
    if body.tensor_parallel:
        if not cuda:
            raise no("tensor_parallel", f"needs CUDA GPUs; this server runs on {cfg.device}")
        out["tensor_parallel"] = "all"
    if body.tensor_parallel_backend not in (None, "native", "nccl"):
        raise no("tensor_parallel_backend", f"{body.tensor_parallel_backend!r} is not native or nccl")
    if body.gpu_split:
        if not cuda:
            raise no("gpu_split", f"needs CUDA GPUs; this server runs on {cfg.device}")
        out["gpu_split"] = list(body.gpu_split)
    elif body.gpu_split_auto and cuda and not body.tensor_parallel:
        out["gpu_split"] = "auto"  # on CPU there is nothing to split: ignored, as TabbyAPI does for one GPU
    if body.autosplit_reserve:
        raise no("autosplit_reserve", "not supported: the automatic split keeps its own headroom")
    for field in ("rope_scale", "rope_alpha"):
        v = getattr(body, field)
        if v is not None and v != 1.0:
            raise no(field, f"{v!r}: only the model's own RoPE settings are supported (1.0)")
    if body.chunk_size is not None:
        out["max_batch_tokens"] = body.chunk_size
    if body.max_batch_size is not None:
        out["max_jobs"] = body.max_batch_size
    if body.vision:
        raise no("vision", "this server has no vision models")
    if body.draft_model is not None:
        out["draft"] = _tabby_draft(body.draft_model, cfg, out.get("cache_type") or cfg.cache_type, no)
    return out


def _tabby_draft(d, cfg: ServeConfig, cache_type: str, no) -> dict:
    """The Engine's speculative-decoding options of TabbyAPI's ``draft_model`` (a 400 naming what cannot apply)."""
    mode = d.draft_mode or "model"
    if mode not in ("model", "disabled", "ngram"):
        raise no("draft_model.draft_mode", f"{mode!r}: use model, ngram or disabled (this server has no MTP heads)")
    for field in ("draft_rope_scale", "draft_rope_alpha"):
        v = getattr(d, field)
        if v is not None and v != 1.0:
            raise no(f"draft_model.{field}", f"{v!r}: only the draft model's own RoPE settings are supported (1.0)")
    if d.draft_gpu_split:
        raise no("draft_model.draft_gpu_split", "not supported: the draft model goes on the model's (first) GPU")
    if d.dynamic_draft is False:
        raise no("draft_model.dynamic_draft", "false is not supported: the draft length always adapts per job "
                 "(draft_num_tokens is its ceiling)")
    if d.draft_cache_mode is not None:
        mode_type = _CACHE_MODES.get(d.draft_cache_mode.replace(" ", "").lower())
        own = cache_type if cache_type != "auto" else ("fp16" if str(cfg.device).startswith("cuda") else "fp32")
        if mode_type != own:
            raise no("draft_model.draft_cache_mode", f"{d.draft_cache_mode!r}: the draft's KV cache has the "
                     f"model's type here ({own.upper()}, cache_mode); give that or leave it out")
    tokens = d.draft_num_tokens if d.draft_num_tokens is not None else cfg.draft_tokens
    if not 1 <= tokens <= 32:
        raise no("draft_model.draft_num_tokens", f"{tokens} is out of range: 1 to 32")
    if mode == "ngram":
        least = d.ngram_match_min if d.ngram_match_min is not None else 2
        if not 1 <= least <= 64:
            raise no("draft_model.ngram_match_min", f"{least} is out of range: 1 to 64")
        sizes = list(range(max(4, least), least - 1, -1))  # longest match first, down to the minimum
        return {"draft_model": None, "draft_tokens": tokens, "ngram_draft": True, "ngram_sizes": sizes}
    if mode == "disabled" or not d.draft_model_name:  # TabbyAPI: model mode without a name drafts nothing
        return {"draft_model": None, "draft_tokens": tokens, "ngram_draft": False}
    path = _model_path(cfg, d.draft_model_name, "draft_model.draft_model_name")
    return {"draft_model": str(path), "draft_tokens": tokens, "ngram_draft": False}


def _submit(engine, plan: Plan) -> list:
    jobs = []
    try:
        for ids in plan.prompts:
            for i in range(plan.n):
                sampling = dict(plan.sampling)
                if sampling.get("seed") is not None:
                    sampling["seed"] = (int(sampling["seed"]) + i) % (1 << 63) or 1
                if plan.top_logprobs:
                    sampling["top_logprobs"] = plan.top_logprobs
                jobs.append(
                    engine.submit(
                        ids,
                        max_new_tokens=plan.max_new_tokens,
                        stop=plan.stop or None,
                        stop_tokens=plan.stop_tokens or None,
                        ignore_eos=plan.ignore_eos,
                        constraint=plan.constraint() if plan.constraint else None,
                        **sampling,
                    )
                )
    except OutOfMemoryError as exc:
        for j in jobs:
            j.cancel()
        raise ApiError(
            400, f"request too large for this server's KV cache: {exc}", param="max_tokens"
        ) from None
    except (Exl2Error, TypeError, OverflowError) as exc:  # bad values the schema let through
        for j in jobs:
            j.cancel()
        raise ApiError(400, f"invalid request: {exc}") from None
    return jobs


def _job_error(exc: Exception) -> ApiError:
    """A failed job: a grammar that broke down while decoding is the client's error, anything else the server's."""
    from .grammar import GrammarError

    if isinstance(exc, GrammarError):
        return ApiError(400, str(exc), param=exc.param)
    return ApiError(500, f"generation failed: {exc}", "server_error")


def _tool_delta(events: list) -> dict:
    """The delta of tool-call parser events: their content, and their ``tool_calls`` entries."""
    delta: dict[str, Any] = {}
    text = "".join(e.text for e in events if isinstance(e, toolmod.Content))
    if text:
        delta["content"] = text
    calls = toolmod.stream_deltas(events)
    if calls:
        delta["tool_calls"] = calls
    return delta


def _finish_reason(job, calls: bool = False) -> str:
    """OpenAI's finish_reason: "length" whenever the token limit ended the reply (a call cut off there has
    arguments that may not parse; clients such as langchain-openai read "length" as truncated), else
    "tool_calls" when the reply holds calls, else "stop"."""
    if job.finish_reason == "length":
        return "length"
    return "tool_calls" if calls else "stop"


def _gen_ids(job) -> tuple[list[int], list[float], list]:
    """Generated ids/logprobs/tops without the final stop token."""
    n = len(job.token_ids)
    if job.finish_reason == "stop_token" and n:
        n -= 1
    n = min(n, len(job.logprobs))
    return job.token_ids[:n], job.logprobs[:n], job.top_logprobs[:n]


class _TokStr:
    def __init__(self, tok):
        self.tok = tok
        self.cache: dict[int, str] = {}

    def __call__(self, i: int) -> str:
        s = self.cache.get(i)
        if s is None:
            s = self.cache[i] = self.tok.decode([i])
        return s


def _chat_logprobs(ts: _TokStr, ids, lps, tops) -> dict:
    content = []
    for k, (t, lp) in enumerate(zip(ids, lps)):
        s = ts(t)
        alts = tops[k] if k < len(tops) else []
        content.append(
            {
                "token": s,
                "logprob": float(lp),
                "bytes": list(s.encode("utf-8")),
                "top_logprobs": [
                    {"token": ts(a), "logprob": float(b), "bytes": list(ts(a).encode("utf-8"))}
                    for a, b in alts
                ],
            }
        )
    return {"content": content, "refusal": None}


def _completion_logprobs(ts: _TokStr, ids, lps, tops, offset0: int = 0) -> dict:
    tokens = [ts(t) for t in ids]
    offsets, o = [], offset0
    for s in tokens:
        offsets.append(o)
        o += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": [float(x) for x in lps],
        "top_logprobs": [
            {ts(a): float(b) for a, b in (tops[k] if k < len(tops) else [])}
            for k in range(len(ids))
        ],
        "text_offset": offsets,
    }


async def _merge(jobs):
    """(index, chunk) from every job as they come; (index, None) when a job ends."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, job):
        try:
            async for chunk in job:
                await queue.put((i, chunk))
        except Exception as exc:  # noqa: BLE001 - surfaced to the consumer
            await queue.put((i, exc))
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, j)) for i, j in enumerate(jobs)]
    try:
        left = len(jobs)
        while left:
            item = await queue.get()
            if item[1] is None:
                left -= 1
            yield item
    finally:
        for t in tasks:
            t.cancel()


async def _watch_disconnect(request: Request, jobs, metrics: Metrics) -> None:
    while True:
        await asyncio.sleep(0.2)
        if await request.is_disconnected():
            if any(j.cancel() for j in jobs):
                metrics.cancelled.inc()
            return


# ---- the app --------------------------------------------------------------------------------------------------


def create_app(config: ServeConfig) -> FastAPI:
    slot = ModelSlot(config)
    keys = KeyChecker(config.api_keys, config.admin_key)
    metrics = Metrics(slot.stats)
    overrides = Overrides(config.sampler_override_dir)
    loads: set[asyncio.Task] = set()  # model loads of /v1/model/load (they outlive their request)
    if config.sampler_preset:
        try:
            overrides.load_preset(config.sampler_preset)
        except FileNotFoundError:
            raise InvalidArgumentError(
                f"sampler preset {config.sampler_preset!r} not found in {overrides.folder} "
                f"(has: {overrides.presets()})"
            ) from None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if keys.open:
            log.warning(
                "no API keys configured: the API is open to anyone who can reach %s:%s",
                config.host,
                config.port,
            )
        task = None
        if config.model:
            slot.state = "loading"
            task = asyncio.create_task(_initial_load())
        idle = asyncio.create_task(_idle_unloader()) if config.idle_unload_s else None
        yield
        for t in (task, idle):
            if t is not None and not t.done():
                t.cancel()
        await slot.unload(SHUTDOWN)

    async def _idle_unloader():
        t = float(config.idle_unload_s)
        while True:
            await asyncio.sleep(min(1.0, t / 4))
            try:
                await slot.sleep_if_idle(t)
            except Exception:  # noqa: BLE001 - logged; the next round tries again
                log.exception("idle unload failed")

    async def _initial_load():
        try:
            await slot.load(config.model)
        except Exception as exc:  # noqa: BLE001 - logged by load; serve() exits with it
            failed = getattr(app.state, "on_load_failure", None)
            if failed is not None:
                failed(exc)

    app = FastAPI(
        title="exl2cpp",
        description="OpenAI-compatible API over exl2cpp",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.slot = slot
    app.state.metrics = metrics
    app.state.overrides = overrides
    # set by serve(): the command line's model failing to load stops the server
    app.state.on_load_failure = None
    from .transport import Admission

    app.add_middleware(
        Admission,
        max_body_size=config.max_body_size,
        timeout_body=config.timeout_body,
        draining=lambda: slot.draining,
    )
    if config.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=config.cors_origins,
            allow_methods=["*"],
            allow_headers=["*"],
        )

    # -- errors --
    def err(status: int, message: str, type_: str = "invalid_request_error", code=None, param=None):
        return JSONResponse(error_body(message, type_, code, param), status_code=status)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return err(exc.status, exc.message, exc.type, exc.code, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            e = next(e for e in errors if e.get("type") == "json_invalid")
            detail = (e.get("ctx") or {}).get("error", "")
            return err(
                400,
                f"malformed JSON in the request body: {detail}".rstrip(": "),
                code="invalid_json",
            )
        parts = []
        for e in errors[:5]:
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            parts.append(f"{loc or 'body'}: {e.get('msg')}")
        first = errors[0].get("loc", ()) if errors else ()
        param = ".".join(str(x) for x in first if x != "body") or None
        if param is None and errors:  # a check of the whole body names its field itself
            param = (errors[0].get("ctx") or {}).get("where")
        return err(422, "invalid request: " + "; ".join(parts), code="invalid_value", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return err(
                404, f"unknown endpoint {request.method} {request.url.path}", code="not_found"
            )
        if exc.status_code == 405:
            return err(405, f"method {request.method} is not allowed on {request.url.path}")
        return err(exc.status_code, str(exc.detail))

    @app.exception_handler(Exl2Error)
    async def _exl2(request: Request, exc: Exl2Error):
        return err(400, str(exc))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("internal error on %s", request.url.path)
        return err(500, "internal server error", "server_error")

    app.add_middleware(_CountRequests, metrics=metrics)

    # -- auth --
    def user(request: Request) -> None:
        reason = keys.check_user(credential(request.headers))
        if reason:
            raise ApiError(401, reason, "invalid_request_error", "invalid_api_key")

    def admin(request: Request) -> None:
        bad = keys.check_admin(credential(request.headers))
        if bad:
            raise ApiError(
                bad[0],
                bad[1],
                "invalid_request_error",
                "invalid_api_key" if bad[0] == 401 else "insufficient_permissions",
            )

    # -- plain endpoints --
    @app.get("/health")
    async def health():  # open to anyone: the state only (load errors are in /admin/stats and the log)
        state = "draining" if slot.draining else slot.state
        if state == "unloaded" and slot.sleeping is not None:
            state = "idle"  # unloaded for idleness: the next request loads it again
        return JSONResponse({"status": state}, status_code=200 if state in ("ready", "idle") else 503)

    @app.get("/metrics")
    async def prom():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request):
        user(request)
        data = []
        if slot.state == "ready":
            data.append(
                {
                    "id": slot.name,
                    "object": "model",
                    "created": slot.loaded_at,
                    "owned_by": "exl2cpp",
                    "max_model_len": slot.model.max_seq_len,
                }
            )
        return {"object": "list", "data": data}

    @app.get("/v1/models/{name:path}")
    async def model_info(name: str, request: Request):
        user(request)
        if slot.state != "ready" or name != slot.name:
            raise ApiError(
                404, f"The model '{name}' does not exist", code="model_not_found", param="model"
            )
        return {
            "id": slot.name,
            "object": "model",
            "created": slot.loaded_at,
            "owned_by": "exl2cpp",
            "max_model_len": slot.model.max_seq_len,
        }

    @app.post("/v1/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request):
        user(request)
        model, _ = slot.require(body.model)
        tok = model.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of 'prompt' or 'messages'", param="prompt")
        if body.tools is not None and body.messages is None:
            raise ApiError(400, "'tools' goes with 'messages' (a chat to render), not with 'prompt'", param="tools")
        if body.messages is not None:
            extra = _template_kwargs(body.chat_template_kwargs, "chat_template_kwargs")
            tools = toolmod.check_tools(body.tools)
            text = await _chat_text(
                config, tok, body.messages, tools, extra, body.add_generation_prompt, _template_source(slot)
            )
            ids = await asyncio.to_thread(tok.encode, text)
        else:  # a long prompt takes a while to tokenize: off the event loop
            ids = await asyncio.to_thread(
                tok.encode, body.prompt, None if body.add_special_tokens else False
            )
        return {"tokens": ids, "count": len(ids), "max_model_len": model.max_seq_len}

    @app.post("/v1/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request):
        user(request)
        model, _ = slot.require(body.model)
        return {"prompt": model.tokenizer.decode(body.tokens)}

    # -- admin --
    @app.post("/admin/load")
    async def admin_load(body: LoadRequest, request: Request):
        admin(request)
        try:
            await slot.load(
                body.model, body.model_name, body.device, body.max_seq_len, body.cache_tokens
            )
        except (Exl2Error, MemoryError, OSError) as exc:
            raise _load_error(body.model, exc, slot) from None
        return {"status": slot.state, "model": slot.name}

    @app.post("/admin/unload")
    async def admin_unload(request: Request):
        admin(request)
        await slot.unload()
        return {"status": slot.state}

    @app.get("/admin/stats")
    async def admin_stats(request: Request):
        admin(request)
        return {
            "status": "draining" if slot.draining else slot.state,
            "model": slot.name,
            "engine": slot.stats(),
            "last_load_error": slot.error,
        }

    @app.post("/admin/clear_prefix_cache")
    async def admin_clear(request: Request):
        admin(request)
        _, engine = slot.require(None)
        return {"freed_pages": engine.clear_prefix_cache()}

    # -- TabbyAPI: sampler overrides --
    def permission(request: Request) -> str | None:
        return keys.permission(credential(request.headers))

    @app.get("/v1/sampling/overrides")
    @app.get("/v1/sampling/override/list")
    async def override_list(request: Request):
        user(request)
        return {
            "selected_preset": overrides.selected_preset,
            "overrides": overrides.overrides,
            "presets": overrides.presets() if permission(request) == "admin" else [],
        }

    @app.post("/v1/sampling/override/switch")
    async def override_switch(body: OverrideSwitchRequest, request: Request):
        admin(request)
        try:
            if body.preset:
                try:
                    overrides.load_preset(body.preset)
                except FileNotFoundError:
                    raise ApiError(
                        400,
                        f"Sampler override preset with name {body.preset!r} does not exist "
                        f"(presets: {overrides.presets()})",
                        code="preset_not_found",
                        param="preset",
                    ) from None
            elif body.overrides:
                overrides.set(body.overrides)
            else:
                raise ApiError(
                    400, "A sampler override preset or dictionary wasn't provided", param="preset"
                )
        except InvalidArgumentError as exc:
            raise ApiError(400, str(exc), param="preset" if body.preset else "overrides") from None
        return {"selected_preset": overrides.selected_preset, "overrides": overrides.overrides}

    @app.post("/v1/sampling/override/unload")
    async def override_unload(request: Request):
        admin(request)
        overrides.set({})
        return {"selected_preset": None, "overrides": {}}

    # -- TabbyAPI: model, tokens, templates, auth --
    def model_card(name: str, parameters: dict | None = None) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": slot.loaded_at if parameters is not None else int(time.time()),
            "owned_by": "exl2cpp",
            "logging": None,
            "parameters": parameters,
        }

    @app.get("/v1/model")
    async def tabby_model(request: Request):
        user(request)
        await slot.wake()
        model, engine = slot.require(None)
        spec = slot.spec
        st = engine.stats()
        tmpl = slot.template
        source = tmpl[1] if tmpl else model.tokenizer.chat_template
        return model_card(
            slot.name,
            {
                "max_seq_len": model.max_seq_len,
                "cache_size": st["pages_total"] * config.page_size,
                "cache_mode": engine.cache_type.upper(),
                "rope_scale": 1.0,
                "rope_alpha": 1.0,
                "max_batch_size": (spec.max_jobs if spec.max_jobs is not None else config.max_jobs)
                or min(128, spec.max_batch_tokens or config.max_batch_tokens),
                "chunk_size": spec.max_batch_tokens or config.max_batch_tokens,
                "prompt_template": _template_name(slot),
                "prompt_template_content": source if isinstance(source, str) else json.dumps(source),
                "use_vision": False,
                "draft": draft_card(engine, model),
            },
        )

    def draft_card(engine, model) -> dict | None:
        """The draft model's card, as TabbyAPI gives it (n-gram drafting has no model: None), with the draft length."""
        draft = engine.draft_model
        if draft is None:
            return None
        card = model_card(Path(draft.path).name, {
            "max_seq_len": draft.max_seq_len,
            "rope_scale": 1.0,
            "rope_alpha": 1.0,
            "cache_mode": engine.cache_type.upper(),
            "draft_num_tokens": (slot.spec.draft or {}).get("draft_tokens", config.draft_tokens),
        })  # fmt: skip
        card["created"] = slot.loaded_at
        return card

    @app.get("/v1/model/list")
    async def tabby_model_list(request: Request):
        user(request)
        if permission(request) == "admin" and config.model_dir:
            root = Path(config.model_dir).expanduser()
            names = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        else:
            names = [slot.name] if slot.state == "ready" else []
        return {"object": "list", "data": [model_card(n) for n in names]}

    @app.post("/v1/model/load")
    async def tabby_load(body: TabbyLoadRequest, request: Request):
        admin(request)
        path = _model_path(config, body.model_name)
        more = _tabby_load_fields(body, config)
        template = _read_template(config, body.prompt_template) if body.prompt_template else None
        max_seq_len = body.max_seq_len if body.max_seq_len and body.max_seq_len > 0 else None
        spec = slot.spec_for(str(path), body.model_name, None, max_seq_len, body.cache_size, **more)

        loop = asyncio.get_running_loop()
        progress: asyncio.Queue = asyncio.Queue()

        def report(module: int, modules: int, kind: str) -> None:  # on the loading thread
            loop.call_soon_threadsafe(progress.put_nowait, (module, modules, kind))

        async def run():
            await slot.load_spec(spec, report)
            if template is not None:
                slot.template = template

        task = asyncio.create_task(run())  # not cancelled when the client leaves: the load goes on
        loads.add(task)
        task.add_done_callback(loads.discard)

        def event(module: int, modules: int, kind: str, status: str) -> str:
            return _data({"model_type": kind, "module": module, "modules": modules, "status": status})

        async def events():
            # as TabbyAPI: "processing" after each module (embedding, layers, head) of the draft model, then of the
            # model; "finished" when one is done (the model's once it serves)
            modules = 0
            while True:
                if progress.empty() and task.done():
                    break
                getter = asyncio.ensure_future(progress.get())
                done, _ = await asyncio.wait({task, getter}, timeout=5.0, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    if not done:
                        yield ": ping\n\n"
                    continue
                module, n, kind = getter.result()
                if module:
                    yield event(module, n, kind, "processing")
                if kind == "model":
                    modules = n
                elif module == n:
                    yield event(module, n, kind, "finished")
            exc = task.exception()
            if exc is not None:
                e = (
                    exc
                    if isinstance(exc, ApiError)
                    else _load_error(body.model_name, exc, slot)
                    if isinstance(exc, (Exl2Error, MemoryError, OSError))
                    else ApiError(500, f"loading failed: {exc}", "server_error")
                )
                yield _data(error_body(e.message, e.type, e.code, e.param))
                return
            modules = modules or int(slot.model.text_config["num_hidden_layers"]) + 2
            yield event(modules, modules, "model", "finished")

        return StreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @app.post("/v1/model/unload")
    async def tabby_unload(request: Request):
        admin(request)
        if slot.sleeping is None:
            slot.require(None)
        await slot.unload()
        return {"status": slot.state}

    @app.post("/v1/token/encode")
    async def token_encode(body: TokenEncodeRequest, request: Request):
        user(request)
        await slot.wake()
        model, _ = slot.require(None)
        tok = model.tokenizer
        add_bos = body.add_bos_token and tok.bos_id is not None
        if isinstance(body.text, list):
            extra = _template_kwargs(body.template_vars, "template_vars")
            text = await _chat_text(config, tok, body.text, [], extra, False, _template_source(slot))
            if tok.bos_token and text.startswith(tok.bos_token):
                text = text[len(tok.bos_token) :]  # add_bos_token alone says whether there is a BOS
        else:
            text = body.text
        ids = await asyncio.to_thread(tok.encode, text, add_bos, body.encode_special_tokens)
        return {"tokens": ids, "length": len(ids)}

    @app.post("/v1/token/decode")
    async def token_decode(body: TokenDecodeRequest, request: Request):
        user(request)
        await slot.wake()
        model, _ = slot.require(None)
        try:
            text = model.tokenizer.decode(body.tokens, skip_special=not body.decode_special_tokens)
        except Exl2Error as exc:
            raise ApiError(400, str(exc), param="tokens") from None
        return {"text": text}

    @app.get("/v1/templates")
    @app.get("/v1/template/list")
    async def template_list(request: Request):
        user(request)
        if permission(request) == "admin":
            folder = Path(config.templates_dir).expanduser()
            names = sorted(p.stem for p in folder.glob("*.jinja") if p.is_file()) if folder.is_dir() else []
        else:
            names = [_template_name(slot)] if slot.state == "ready" and _template_name(slot) else []
        return {"object": "list", "data": names}

    @app.post("/v1/template/switch")
    async def template_switch(body: TemplateSwitchRequest, request: Request):
        admin(request)
        model, _ = slot.require(None)
        name, source = _read_template(config, body.prompt_template_name)
        try:
            model.tokenizer._compile(source)
        except Exl2Error as exc:
            raise ApiError(400, f"template {name!r}: {exc}", param="prompt_template_name") from None
        slot.template = (name, source)
        return {"prompt_template": name}

    @app.post("/v1/template/unload")
    async def template_unload(request: Request):
        admin(request)
        slot.require(None)
        slot.template = None
        return {"prompt_template": _template_name(slot)}

    @app.get("/v1/auth/permission")
    async def auth_permission(request: Request):
        user(request)
        return {"permission": permission(request)}

    inline_lock = asyncio.Lock()

    async def model_for(requested: str | None, request: Request) -> None:
        """Before a generation: load the model an idle unload took away, and with inline_model_loading the one
        ``requested`` names in model_dir when it is not the one serving (admin key only, as TabbyAPI)."""
        await slot.wake()
        if not requested or (slot.state == "ready" and requested == slot.name):
            return
        if not config.inline_model_loading or not config.model_dir:
            return  # require() answers 404 model_not_found
        try:
            path = _model_path(config, requested, "model")
        except ApiError:
            return  # not a model of the folder: 404 model_not_found as without inline loading
        if permission(request) != "admin":
            raise ApiError(
                403,
                f"loading the model {requested!r} (inline model loading) needs the admin key",
                code="insufficient_permissions",
                param="model",
            )
        async with inline_lock:
            if slot.state == "ready" and requested == slot.name:
                return  # another request loaded it meanwhile
            try:
                await slot.load(str(path), requested)
            except (Exl2Error, MemoryError, OSError) as exc:
                raise _load_error(requested, exc, slot) from None

    # -- generation --
    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        t0 = time.perf_counter()
        user(request)
        body = overrides.apply(body)
        await model_for(body.model, request)
        model, engine = slot.require(body.model)
        tok = model.tokenizer
        n = _check_n(body.n, config)
        tools = toolmod.check_tools(body.tools)
        extra = _template_kwargs(body.chat_template_kwargs, "chat_template_kwargs")
        builtin = toolmod.check_builtin_tools(extra.get("builtin_tools"))
        choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools or builtin else "none")
        forced: str | None | bool = False  # False: not forced; None: any tool; str: that tool
        if isinstance(choice, dict):
            fn = (
                (choice.get("function") or {}).get("name")
                if choice.get("type") == "function"
                else None
            )
            if not isinstance(fn, str):
                raise ApiError(
                    400,
                    "tool_choice must be 'none', 'auto', 'required' or "
                    "{'type': 'function', 'function': {'name': ...}}",
                    param="tool_choice",
                )
            forced = fn
        elif choice == "required":
            forced = None
        elif choice not in ("none", "auto"):
            raise ApiError(
                400,
                f"tool_choice {choice!r} is not one of none, auto, required",
                param="tool_choice",
            )
        if choice != "none" and not tools and not (choice == "auto" and builtin):
            raise ApiError(400, "tool_choice needs a non-empty 'tools' list", param="tool_choice")
        active_tools = tools if choice != "none" else []
        source = _template_source(slot)
        fmt = _tool_format(config, tok, source)
        prompt = await _chat_text(config, tok, body.messages, active_tools, extra, True, source, fmt)
        ids = await asyncio.to_thread(tok.encode, prompt, body.add_bos_token)
        if body.add_bos_token is False and ids and ids[0] == tok.bos_id:
            ids = ids[1:]  # the template wrote it
        markers = _reasoning_markers(config, tok, source)
        requested = (
            body.max_completion_tokens
            if body.max_completion_tokens is not None
            else body.max_tokens
        )
        max_new = _budget(config, model, len(ids), requested, "messages")
        constraint = None
        if forced is not False:
            lark, schema = toolmod.forced_grammar(active_tools, forced, fmt, _special_id(tok))
            factory = await slot.grammar()
            grammar = await _compiled(
                factory.submit_lark(lark, "tool call grammar", (schema,), "tools")
            )
            constraint = grammar.constraint
        else:
            constraint = await _request_constraint(slot, body)
        budget = (
            body.reasoning_budget_tokens
            if body.reasoning_budget_tokens is not None
            else config.reasoning_budget_tokens
        )
        if budget is not None and budget >= 0:  # negative: no budget (TabbyAPI)
            if markers is None:
                raise ApiError(
                    400,
                    "reasoning_budget_tokens needs a reasoning format: this model names no reasoning markers "
                    "(set the server's reasoning option)",
                    param="reasoning_budget_tokens",
                )
            if constraint is not None:
                raise ApiError(
                    400,
                    "reasoning_budget_tokens cannot be combined with response_format or a forced tool call",
                    param="reasoning_budget_tokens",
                )
            message = body.reasoning_budget_message
            if message is None:
                message = config.reasoning_budget_message or ""
            inside = opens_reasoning(prompt, markers[0])
            start, end = markers
            vocab = model.vocab_size

            def constraint():
                return ReasoningBudget(tok, vocab, start, end, inside, budget, message)

            if body.banned_strings:
                raise ApiError(
                    400,
                    "reasoning_budget_tokens cannot be combined with banned_strings",
                    param="reasoning_budget_tokens",
                )
        sampling = _sampling(body, tok, model.vocab_size, max_new)
        if body.seed is not None:
            sampling["seed"] = body.seed
        constraint = _with_loop_stop(constraint, body, tok, model.vocab_size)
        stop_strings, stop_ids = _stops(body.stop)
        plan = Plan(
            [ids],
            max_new,
            n,
            stop_strings,
            sampling,
            body.ignore_eos,
            constraint,
            active_tools,
            body.logprobs,
            (body.top_logprobs or 0) if body.logprobs else 0,
            _stop_ids(stop_ids, model.vocab_size),
            (*markers, opens_reasoning(prompt, markers[0])) if markers else None,
            fmt,
            1 if body.parallel_tool_calls is False else None,
            builtin if choice != "none" else [],
        )
        flight = slot.submit(engine, plan)
        metrics.prompt_tokens.inc(len(ids))
        rid = "chatcmpl-" + uuid.uuid4().hex
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _sse(
                _chat_stream(rid, slot.name, flight, plan, tok, t0, include_usage, len(ids)),
                flight,
            )
        return await _collect_chat(request, rid, slot.name, flight, plan, tok, t0, len(ids))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        t0 = time.perf_counter()
        user(request)
        body = overrides.apply(body)
        if body.suffix:
            raise ApiError(400, "suffix (fill-in-the-middle) is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise ApiError(400, "best_of other than n is not supported", param="best_of")
        rid = "cmpl-" + uuid.uuid4().hex
        flight, plan, tok, n_prompt, texts = await _start_completion(body, request, body.logprobs)
        echo = texts if body.echo else None
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _sse(
                _completion_stream(
                    rid, slot.name, flight, plan, tok, t0, include_usage, n_prompt, echo
                ),
                flight,
            )
        return await _collect_completion(
            request, rid, slot.name, flight, plan, tok, t0, n_prompt, echo
        )

    async def _start_completion(body, request: Request, lp: int | None, ban_eos: bool = False):
        """The jobs of a text completion (the OpenAI route's, the Kobold routes'; ban_eos: the model's
        end-of-sequence tokens banned): (flight, plan, tokenizer, prompt tokens, prompt texts)."""
        await model_for(body.model, request)
        model, engine = slot.require(body.model)
        tok = model.tokenizer
        n = _check_n(body.n, config)
        p = body.prompt
        if isinstance(p, str) or p and all(isinstance(x, int) for x in p):
            raw = [p]
        else:
            raw = list(p)
        if not raw:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        if len(raw) * n > config.max_n * 4:
            raise ApiError(400, f"too many choices ({len(raw)} prompts x n={n})", param="n")

        def tokenize_all() -> tuple[list[list[int]], list[str]]:  # long prompts: off the event loop
            prompts, texts = [], []
            for item in raw:
                if isinstance(item, str):
                    prompts.append(tok.encode(item, body.add_bos_token))
                    texts.append(item)
                else:
                    bad = [t for t in item if not 0 <= t < model.vocab_size]
                    if bad or not item:
                        raise ApiError(
                            400,
                            f"prompt token ids must be non-empty and in [0, {model.vocab_size})",
                            param="prompt",
                        )
                    prompts.append(list(item))
                    texts.append(tok.decode(item))
            return prompts, texts

        prompts, texts = await asyncio.to_thread(tokenize_all)
        longest = max(len(x) for x in prompts)
        max_new = _budget(
            config, model, longest, body.max_tokens if body.max_tokens is not None else 16, "prompt"
        )
        sampling = _sampling(body, tok, model.vocab_size, max_new)
        if ban_eos:
            try:
                eos = list(tok.eos_ids)
            except Exl2Error:
                eos = []
            sampling["banned_tokens"] = list(sampling.get("banned_tokens") or []) + eos
        if body.seed is not None:
            sampling["seed"] = body.seed
        constraint = _with_loop_stop(await _request_constraint(slot, body), body, tok, model.vocab_size)
        stop_strings, stop_ids = _stops(body.stop)
        plan = Plan(
            prompts,
            max_new,
            n,
            stop_strings,
            sampling,
            body.ignore_eos,
            constraint,
            [],
            lp is not None,
            lp or 0,
            _stop_ids(stop_ids, model.vocab_size),
        )
        flight = slot.submit(engine, plan)
        metrics.prompt_tokens.inc(sum(len(x) for x in prompts))
        return flight, plan, tok, sum(len(x) for x in prompts), texts

    # -- the KoboldAI API, as TabbyAPI serves it (for the front-ends set to it; prefixes /api/v1 and /api/latest)
    kobold_runs: dict[str, dict] = {}  # genkey -> {"flight", "text"} while a Kobold generation runs

    async def _kobold_start(body: KoboldGenerateRequest, request: Request):
        user(request)
        body = overrides.apply(body)
        if body.dynatemp_range:
            t = body.temperature if body.temperature is not None else 1.0
            body.min_temp, body.max_temp = max(t - body.dynatemp_range, 0.0), t + body.dynatemp_range
        if body.n != 1:
            raise ApiError(400, "the Kobold API generates one text: n must be 1", param="n")
        genkey = body.genkey or "KCPP" + uuid.uuid4().hex[:12]
        if genkey in kobold_runs:
            raise ApiError(409, f"a generation with genkey {genkey!r} is running", param="genkey")
        run = {"flight": None, "text": ""}
        kobold_runs[genkey] = run  # before the first await: a second request with this genkey gets the 409
        try:
            flight, plan, tok, n_prompt, _ = await _start_completion(body, request, None, body.use_default_badwordsids)
        except BaseException:
            _kobold_done(genkey, run)
            raise
        run["flight"] = flight
        return genkey, run, flight, plan, tok, n_prompt

    def _kobold_done(genkey: str, run: dict) -> None:
        if kobold_runs.get(genkey) is run:
            del kobold_runs[genkey]

    async def _kobold_pieces(genkey: str, run: dict, flight: Flight, plan, tok, t0, n_prompt):
        """The text pieces of a Kobold generation as they come (an error as its body), from the completion
        stream (its metrics and its ending by the server included); the callers free the genkey."""
        async for event in _completion_stream("kobold-" + genkey, slot.name, flight, plan, tok, t0, False,
                                              n_prompt, None):  # fmt: skip
            if not event.startswith("data: {"):
                continue
            d = json.loads(event[6:])
            if "error" in d:
                yield d
                return
            for ch in d.get("choices", []):
                if ch.get("text"):
                    run["text"] += ch["text"]
                    yield ch["text"]

    for prefix in ("/api/v1", "/api/latest"):

        @app.post(prefix + "/generate")
        async def kobold_generate(body: KoboldGenerateRequest, request: Request):
            t0 = time.perf_counter()
            genkey, run, flight, plan, tok, n_prompt = await _kobold_start(body, request)
            watcher = asyncio.create_task(_watch_disconnect(request, flight.jobs, metrics))
            text = ""
            try:
                async for piece in _kobold_pieces(genkey, run, flight, plan, tok, t0, n_prompt):
                    if isinstance(piece, dict):
                        e = piece["error"]
                        raise ApiError(503, e.get("message", "generation failed"), e.get("type", "server_error"),
                                       e.get("code"))  # fmt: skip
                    text += piece
            finally:
                watcher.cancel()
                _end(flight)
                _kobold_done(genkey, run)
            return {"results": [{"text": text}]}

        @app.get(prefix + "/model")
        async def kobold_model(request: Request):
            user(request)
            slot.require(None)
            return {"result": f"exl2cpp/{slot.name}"}

        @app.get(prefix + "/info/version")
        async def kobold_version(request: Request):
            return {"result": "1.2.5"}  # the KoboldAI United API version the routes follow

    @app.post("/api/extra/generate/stream")
    async def kobold_stream(body: KoboldGenerateRequest, request: Request):
        t0 = time.perf_counter()
        genkey, run, flight, plan, tok, n_prompt = await _kobold_start(body, request)

        async def events():
            async for piece in _kobold_pieces(genkey, run, flight, plan, tok, t0, n_prompt):
                if isinstance(piece, dict):
                    yield "event: error\ndata: " + json.dumps(piece, ensure_ascii=False) + "\n\n"
                    return
                yield "event: message\ndata: " + json.dumps({"token": piece}, ensure_ascii=False) + "\n\n"

        def on_end():  # also when the client left before the first event (the generator never ran)
            _end(flight)
            _kobold_done(genkey, run)

        return _EventStream(events(), on_end)

    @app.post("/api/extra/abort")
    async def kobold_abort(body: KoboldKeyRequest, request: Request):
        user(request)
        run = kobold_runs.get(body.genkey)
        if run is not None and run["flight"] is not None and any(j.cancel() for j in run["flight"].jobs):
            metrics.cancelled.inc()
        return {"success": run is not None}

    @app.api_route("/api/extra/generate/check", methods=["GET", "POST"])
    async def kobold_check(body: KoboldKeyRequest, request: Request):
        user(request)
        run = kobold_runs.get(body.genkey)
        return {"results": [{"text": run["text"]}] if run is not None else []}

    @app.post("/api/extra/tokencount")
    async def kobold_tokencount(body: KoboldTokenCountRequest, request: Request):
        user(request)
        await slot.wake()
        model, _ = slot.require(None)
        ids = await asyncio.to_thread(model.tokenizer.encode, body.prompt)
        return {"value": len(ids), "ids": ids}

    @app.get("/api/extra/version")
    async def kobold_extra_version(request: Request):
        return {"result": "KoboldCpp", "version": "1.61"}  # what TabbyAPI answers: front-ends check for it

    # -- helpers closing over metrics --
    def _record(jobs, t0: float, t_first: float | None) -> int:
        out = sum(len(_gen_ids(j)[0]) for j in jobs)
        metrics.generation_tokens.inc(out)
        now = time.perf_counter()
        metrics.latency.observe(now - t0)
        if t_first is not None:
            metrics.ttft.observe(t_first - t0)
            if out > 1 and now > t_first:
                metrics.tps.observe((out - len(jobs)) / (now - t_first) if out > len(jobs) else 0.0)
        return out

    def _end(flight: Flight) -> None:
        if slot.end(flight):  # the client went away mid-request: its pages are freed now
            metrics.cancelled.inc()

    def _sse(gen, flight: Flight):
        async def body():
            metrics.in_flight.inc()
            try:
                async for event in gen:
                    yield event
            finally:
                metrics.in_flight.dec()

        return _EventStream(body(), lambda: _end(flight))

    def _aborted(flight: Flight, left: set[int], finish) -> list[str]:
        """The end of a stream the server cut: finish_reason "abort" for the choices still open, then the error
        event (and no [DONE])."""
        e = flight.cut
        return [finish(k) for k in sorted(left)] + [
            _data(error_body(e.message, e.type, e.code, e.param))
        ]

    def _data(obj) -> str:
        return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"

    def _usage(n_prompt: int, n_out: int, jobs: list, n: int) -> dict:
        """OpenAI's usage; ``cached_tokens``: the prompt tokens taken from the prefix cache (each prompt's first
        choice, jobs[::n]: its other choices share its pages)."""
        cached = sum(j.cached_tokens for j in jobs[::n])
        return {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_out,
            "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": min(cached, n_prompt)},
        }

    def _timings(usage: dict, out: int, t0: float, t_first: float | None) -> dict:
        """llama.cpp's per-response timings: prompt (from the request to the first token; the cached prompt
        tokens not counted) and generation (first token to last)."""
        now = time.perf_counter()
        t_first = now if t_first is None else t_first
        pn = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
        pms, gms = (t_first - t0) * 1e3, (now - t_first) * 1e3
        return {"prompt_n": pn, "prompt_ms": round(pms, 3), "prompt_per_second": pn / pms * 1e3 if pms > 0 else None,
                "predicted_n": out, "predicted_ms": round(gms, 3),
                "predicted_per_second": (out - 1) / gms * 1e3 if gms > 0 and out > 1 else None}  # fmt: skip

    async def _gather(request: Request, flight: Flight) -> float | None:
        """Wait for every job (cancelling them if the client leaves); returns the time of the first chunk."""
        jobs = flight.jobs
        metrics.in_flight.inc()
        watcher = asyncio.create_task(_watch_disconnect(request, jobs, metrics))
        t_first = None
        try:
            async for _i, chunk in _merge(jobs):
                if isinstance(chunk, Exception):
                    raise _job_error(chunk)
                if chunk and t_first is None:
                    t_first = time.perf_counter()
            if any(flight.was_cut(j) for j in jobs):
                raise flight.cut
        finally:
            watcher.cancel()
            metrics.in_flight.dec()
            slot.end(flight)
        return t_first if t_first is not None else time.perf_counter()

    async def _collect_chat(request, rid, name, flight: Flight, plan: Plan, tok, t0, n_prompt):
        t_first = await _gather(request, flight)
        jobs = flight.jobs
        ts = _TokStr(tok)
        choices = []
        for i, j in enumerate(jobs):
            text = j.text
            thought = None
            if plan.reasoning:
                thought, text = reasoning_split(text, *plan.reasoning)
            calls = []
            if plan.tools or plan.builtin_tools:
                content, calls = toolmod.parse_tool_calls(
                    text, plan.tools, plan.tool_format, plan.max_calls, plan.builtin_tools
                )
            else:
                content = text
            ids, lps, tops = _gen_ids(j)
            msg: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
            if thought is not None:
                msg["reasoning_content"] = thought
            if calls:
                msg["tool_calls"] = calls
            choices.append(
                {
                    "index": i,
                    "message": msg,
                    "finish_reason": _finish_reason(j, bool(calls)),
                    "logprobs": _chat_logprobs(ts, ids, lps, tops) if plan.want_logprobs else None,
                }
            )
        out = _record(jobs, t0, t_first)
        usage = _usage(n_prompt, out, jobs, plan.n)
        return {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": name,
            "choices": choices,
            "usage": usage,
            "timings": _timings(usage, out, t0, t_first),
            "system_fingerprint": "exl2cpp",
        }

    async def _collect_completion(
        request, rid, name, flight: Flight, plan: Plan, tok, t0, n_prompt, echo
    ):
        t_first = await _gather(request, flight)
        jobs = flight.jobs
        ts = _TokStr(tok)
        choices = []
        for i, j in enumerate(jobs):
            prefix = echo[i // plan.n] if echo else ""
            ids, lps, tops = _gen_ids(j)
            choices.append(
                {
                    "index": i,
                    "text": prefix + j.text,
                    "finish_reason": _finish_reason(j),
                    "logprobs": _completion_logprobs(ts, ids, lps, tops, len(prefix))
                    if plan.want_logprobs
                    else None,
                }
            )
        out = _record(jobs, t0, t_first)
        usage = _usage(n_prompt, out, jobs, plan.n)
        return {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": name,
            "choices": choices,
            "usage": usage,
            "timings": _timings(usage, out, t0, t_first),
            "system_fingerprint": "exl2cpp",
        }

    async def _chat_stream(rid, name, flight: Flight, plan: Plan, tok, t0, include_usage, n_prompt):
        jobs = flight.jobs
        left = set(range(len(jobs)))
        created = int(time.time())
        ts = _TokStr(tok)
        base = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": name,
            "system_fingerprint": "exl2cpp",
        }

        def chunk(i, delta, finish=None, logprobs=None):
            return _data(
                {
                    **base,
                    "choices": [
                        {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
                    ],
                }
            )

        for i in range(len(jobs)):
            yield chunk(i, {"role": "assistant", "content": ""})
        t_first = None
        seen = [0] * len(jobs)
        names = toolmod.tool_names(plan.tools, plan.builtin_tools)
        parsers = [toolmod.ToolCallParser(plan.tool_format, names, plan.max_calls) for _ in jobs] if names else None
        splitters = (
            [ReasoningSplitter(*plan.reasoning) for _ in jobs] if plan.reasoning else None
        )
        ended, usage = 0, None  # usage: made with the last choice's final chunk
        async for i, piece in _merge(jobs):
            j = jobs[i]
            if isinstance(piece, Exception):
                e = _job_error(piece)
                yield _data(error_body(e.message, e.type, e.code, e.param))
                return
            if piece is None and flight.was_cut(j):
                for event in _aborted(flight, left, lambda k: chunk(k, {}, "abort")):
                    yield event
                return
            if piece is None:  # this choice ended
                left.discard(i)
                rest = ""
                if splitters:  # what the reasoning split held back
                    thought, rest = splitters[i].flush()
                    if thought:
                        yield chunk(i, {"reasoning_content": thought})
                calls = False
                if parsers:  # what the tool-call parser held back
                    delta = _tool_delta(parsers[i].push(rest) + parsers[i].finish())
                    if delta:
                        yield chunk(i, delta)
                    calls = bool(parsers[i].calls)
                elif rest:
                    yield chunk(i, {"content": rest})
                lp = None
                if plan.want_logprobs:
                    ids, lps, tops = _gen_ids(j)
                    if len(ids) > seen[i]:
                        lp = _chat_logprobs(ts, ids[seen[i] :], lps[seen[i] :], tops[seen[i] :])
                        seen[i] = len(ids)
                ended += 1
                if ended < len(jobs):
                    yield chunk(i, {}, _finish_reason(j, calls), lp)
                    continue
                out = _record(jobs, t0, t_first)
                final = {
                    **base,
                    "choices": [
                        {
                            "index": i,
                            "delta": {},
                            "logprobs": lp,
                            "finish_reason": _finish_reason(j, calls),
                        }
                    ],
                }
                usage = _usage(n_prompt, out, jobs, plan.n)
                final["timings"] = _timings(usage, out, t0, t_first)
                if not include_usage:  # the usage rides on the last chunk (a separate chunk if asked for)
                    final["usage"] = usage
                yield _data(final)
                continue
            if t_first is None and piece:
                t_first = time.perf_counter()
            thought = ""
            if splitters:
                thought, piece = splitters[i].push(piece)
            delta = {"reasoning_content": thought} if thought else {}
            if parsers:  # content and tool-call deltas; what may still be a call is held back
                delta.update(_tool_delta(parsers[i].push(piece)))
            elif piece:
                delta["content"] = piece
            if not delta:
                continue  # held back (a marker may be starting); its logprobs go with the next chunk
            lp = None
            if plan.want_logprobs:
                k = min(len(j.token_ids), len(j.logprobs))
                if k > seen[i]:
                    lp = _chat_logprobs(
                        ts,
                        j.token_ids[seen[i] : k],
                        j.logprobs[seen[i] : k],
                        j.top_logprobs[seen[i] : k],
                    )
                    seen[i] = k
            yield chunk(i, delta, None, lp)
        if include_usage:
            yield _data({**base, "choices": [], "usage": usage})
        yield "data: [DONE]\n\n"

    async def _completion_stream(
        rid, name, flight: Flight, plan: Plan, tok, t0, include_usage, n_prompt, echo
    ):
        jobs = flight.jobs
        left = set(range(len(jobs)))
        created = int(time.time())
        ts = _TokStr(tok)
        base = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": name,
            "system_fingerprint": "exl2cpp",
        }

        def chunk(i, text, finish=None, logprobs=None):
            return _data(
                {
                    **base,
                    "choices": [
                        {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}
                    ],
                }
            )

        if echo:
            for i in range(len(jobs)):
                yield chunk(i, echo[i // plan.n])
        t_first = None
        seen = [0] * len(jobs)
        ended, usage = 0, None  # usage: made with the last choice's final chunk
        async for i, piece in _merge(jobs):
            j = jobs[i]
            if isinstance(piece, Exception):
                e = _job_error(piece)
                yield _data(error_body(e.message, e.type, e.code, e.param))
                return
            if piece is None and flight.was_cut(j):
                for event in _aborted(flight, left, lambda k: chunk(k, "", "abort")):
                    yield event
                return
            lp = None
            if plan.want_logprobs:
                ids, lps, tops = (
                    _gen_ids(j)
                    if piece is None
                    else (
                        j.token_ids[: min(len(j.token_ids), len(j.logprobs))],
                        j.logprobs,
                        j.top_logprobs,
                    )
                )
                k = len(ids)
                if k > seen[i]:
                    lp = _completion_logprobs(
                        ts, ids[seen[i] : k], lps[seen[i] : k], tops[seen[i] : k]
                    )
                    seen[i] = k
            if piece is None:
                left.discard(i)
                ended += 1
                if ended == len(jobs):
                    out = _record(jobs, t0, t_first)
                    final = {
                        **base,
                        "choices": [
                            {
                                "index": i,
                                "text": "",
                                "logprobs": lp,
                                "finish_reason": _finish_reason(j),
                            }
                        ],
                    }
                    usage = _usage(n_prompt, out, jobs, plan.n)
                    final["timings"] = _timings(usage, out, t0, t_first)
                    if not include_usage:
                        final["usage"] = usage
                    yield _data(final)
                else:
                    yield chunk(i, "", _finish_reason(j), lp)
                continue
            if t_first is None and piece:
                t_first = time.perf_counter()
            yield chunk(i, piece, None, lp)
        if include_usage:
            yield _data({**base, "choices": [], "usage": usage})
        yield "data: [DONE]\n\n"

    return app


class _EventStream(StreamingResponse):
    """A server-sent-events response that calls ``on_end`` however it ends (also when the client left before its
    first event)."""

    def __init__(self, content, on_end):
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_end = on_end

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_end()


class _CountRequests:
    """Pure ASGI middleware counting requests by route and status. (Starlette's BaseHTTPMiddleware would wrap
    `receive` and break request.is_disconnected(), which cancels the jobs of clients that hang up.)"""

    def __init__(self, app, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", "other")
            self.metrics.requests.labels(route, str(status[0])).inc()


def _load_error(model: str, exc: BaseException, slot: ModelSlot) -> ApiError:
    """A failed /admin/load as a 400 naming the field at fault (the size a memory error came from)."""
    text = str(exc)
    param = next((f for f in ("cache_tokens", "max_seq_len") if f in text), None)
    if isinstance(exc, MemoryError):
        param = param or "cache_tokens"
        if not isinstance(exc, Exl2Error):  # std::bad_alloc and the like say nothing more
            text = f"not enough memory ({text or type(exc).__name__}); lower cache_tokens or max_seq_len"
    serving = f"; still serving {slot.name!r}" if slot.state == "ready" else ""
    return ApiError(400, f"cannot load {model!r}: {text}{serving}", param=param or "model")


def _check_n(n: int, config: ServeConfig) -> int:
    if n > config.max_n:
        raise ApiError(400, f"n={n} is above this server's limit of {config.max_n}", param="n")
    return n


def serve(config: ServeConfig) -> None:
    """Run the server until interrupted (uvicorn, one process, one engine). SIGTERM drains first (see
    ModelSlot.drain) and returns; a command-line model that fails to load raises its error."""
    import uvicorn

    from . import transport

    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = create_app(config)
    slot: ModelSlot = app.state.slot
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=True,
        http=transport.protocol(config.timeout_header, config.max_connections),
        ws="none",
        lifespan="on",
        timeout_keep_alive=config.timeout_keep_alive,
        proxy_headers=bool(config.forwarded_allow_ips),
        forwarded_allow_ips=config.forwarded_allow_ips or None,
        timeout_graceful_shutdown=5,  # after the drain: connections still writing their last bytes
    )
    logging.getLogger("uvicorn.access").addFilter(transport.RedactCredentials())
    server = transport.Server(uv_config, lambda: slot.drain(config.timeout_graceful_shutdown))
    app.state.on_load_failure = server.fail
    server.run()
    exc = server.error
    if exc is not None:
        if isinstance(exc, (Exl2Error, OSError)):
            raise exc
        raise InternalError(f"cannot load {config.model!r}: {type(exc).__name__}: {exc}") from exc
