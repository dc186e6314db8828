"""The batching engine: many jobs at once over one paged KV cache, streamed as text (sync or asyncio).

    >>> engine = exl2cpp.Engine(model, cache_tokens=16384, max_batch_tokens=2048)
    >>> job = engine.submit("Once upon a time", max_new_tokens=32, temperature=0.0)
    >>> for chunk in job: print(chunk, end="")
    >>> engine.generate(["Hello", "Goodbye"], max_new_tokens=8)     # list of completions

A background thread runs engine steps (one forward pass each: decode rows of running jobs plus prefill chunks of
new ones) while any job is unfinished; jobs may be submitted and cancelled from any thread at any time. Scheduling,
pages, prefix sharing and sampling live in C++ (cpp/engine/); this module adds text: incremental detokenization,
stop strings (held back until they can no longer match), banned strings (rewinds), and delivery to iterators and
asyncio tasks.

Banned strings (``banned_strings=[...]``, case-sensitive, on the decoded text): text whose tail could still grow
into a banned string is held back (from the start of the token where that tail begins). When a banned string is
completed, the job is rewound to the token where it began (``_C.Engine.rewind``: those tokens and their cache rows
are dropped) and that token is banned at that position, then sampling goes on from there; when the text diverges
instead, the held text is released. A job that ends (length, end-of-sequence) with a banned string completed by
its last tokens is cut before the token where it began. Order with stop strings: on each new piece of text the
earliest complete match wins; a banned string starting before a stop string's match rewinds (the stop string text
goes with it), a stop string starting at or before a banned string's start ends the job there (the banned text,
after the cut, is never shown). Held text is the longest hold of the two. A job rewinds at most ``max_rewinds``
times (default 16, -1 = unlimited); at the next banned string it ends with ``finish_reason ==
"banned_string_limit"`` and its text cut before that string (a model that keeps producing it cannot loop forever).

Memory: a job is admitted when what it needs now (its prompt and first decode row) fits the page pool, not its
worst case; when a running job needs a page and none is free, the engine preempts the lowest-priority, most
recently admitted job: it gives back its pages, keeps its tokens and sampler state, and later resumes by
recomputing its prompt + generated tokens (pages still in the prefix cache are taken back for free). Preemption is
invisible in the output: the stream goes on where it stopped, with the same tokens (seeded sampling included).
``stats()["preemptions"]`` counts them. A job whose prompt + max_new_tokens exceeds the whole pool is refused at
submit (OutOfMemoryError).

Speculative decoding (``Engine(model, ngram_draft=True)`` or ``Engine(model, draft_model=draft, draft_tokens=4)``):
each step a running job proposes up to ``draft_tokens`` tokens (from an earlier occurrence of its last n tokens in
the prompt and output, or from a small draft model of the same tokenizer) and the model verifies them in one
forward pass; greedy jobs produce exactly the tokens of plain decoding, sampled jobs follow the model's
distribution (n-gram drafts: the very tokens of plain decoding for the same seed). The draft length adapts per job
to its acceptance, down to off. Constrained jobs (``constraint``) speculate under their grammar: each draft
position is verified under the mask that plain decoding would use there (``Constraint.draft_masks``). ``stats()`` has
``spec_proposed`` / ``spec_accepted``; each :class:`Job` has its own. docs/engine.md "Speculative decoding".
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import threading
import weakref
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from . import _C
from . import options as _options
from .errors import Exl2Error, InternalError, InvalidArgumentError, ModelFileError, retry_after_collect

__all__ = ["Engine", "Job"]

_MAX_BANNED_STRINGS = 1024  # per job; each string is checked against every new piece of text
_MAX_BANNED_LEN = 512  # characters per banned string
_DEFAULT_MAX_REWINDS = 16  # banned-string rewinds per job before it ends with "banned_string_limit"

_FLOAT_KEYS = (
    "temperature",
    "top_p",
    "min_p",
    "typical",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "smoothing_factor",
    "smoothing_curve",
    "min_temp",
    "max_temp",
    "temp_exponent",
    "top_a",
    "tfs",
    "mirostat_tau",
    "mirostat_eta",
    "xtc_probability",
    "xtc_threshold",
    "dry_multiplier",
    "dry_base",
)
_INT_KEYS = (
    "top_k",
    "penalty_window",
    "min_tokens",
    "mirostat_mode",
    "dry_allowed_length",
    "dry_range",
    "seed",
    "top_logprobs",
)
_TOKEN_LIST_KEYS = ("banned_tokens", "allowed_tokens")
_SAMPLING_KEYS = (
    *_FLOAT_KEYS,
    *_INT_KEYS,
    *_TOKEN_LIST_KEYS,
    "temperature_last",
    "logit_bias",
    "dry_sequence_breakers",
    "penalty_range",  # TabbyAPI's name of penalty_window
)


class Job:
    """A submitted generation. Iterate it (``for chunk in job`` / ``async for chunk in job``) for text chunks, or
    call :meth:`result` for the whole text. After it finishes: ``token_ids``, ``logprobs``, ``top_logprobs``
    (when requested), ``finish_reason`` (``"stop_token"``, ``"stop_string"``, ``"length"``, ``"cancelled"``,
    ``"banned_string_limit"``: more banned strings than ``max_rewinds``, ``"error"``)."""

    def __init__(
        self,
        engine: Engine,
        job_id: int,
        prompt_ids: list[int],
        stop: list[str],
        decoder,
        constraint=None,
        banned: list[str] | None = None,
    ):
        self.engine = engine
        self.constraint = constraint
        self.id = job_id
        self.prompt_ids = prompt_ids
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.finish_reason: str | None = None
        self.error: Exception | None = None
        self._stop = stop
        self._banned = banned or []
        self._decoder = decoder
        # len(_text) after token_ids[i] was decoded (banned strings: text -> token)
        self._ends: list[int] = []
        self.rewinds = 0  # banned-string rewinds so far
        self.spec_proposed = 0  # draft tokens verified for this job (speculative decoding)
        self.spec_accepted = 0  # ... and accepted
        self.cached_tokens = 0  # prompt tokens taken from the prefix cache instead of computed
        self._rewound = False  # a rewind happened while handling this step's events: its later tokens are stale
        self._text = ""  # decoded so far (cut at a stop string)
        self._emitted = 0  # characters of _text handed out as chunks
        self._stopped = False  # a stop string matched: later tokens are ignored
        self._chunks: list[str] = []
        self._done = False
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def __repr__(self) -> str:
        state = self.finish_reason or "running"
        return f"<exl2cpp.Job {self.id} {state}, {len(self.token_ids)} tokens>"

    # ---- called on the engine thread --------------------------------------------------------------------
    def _on_event(
        self, token: int, logprob: float, top, finished: bool, reason: str, error: str
    ) -> None:
        chunk = ""
        if token >= 0 and not self._stopped:
            is_stop_token = finished and reason == "stop_token"
            self.token_ids.append(token)
            self.logprobs.append(logprob)
            if top:
                self.top_logprobs.append(top)
            if self._decoder is not None and not is_stop_token:
                chunk = self._add_text(self._decoder.push(token))
            elif self._banned:
                self._ends.append(len(self._text))
            if self.constraint is not None and not finished and not self._stopped:
                # constrained decoding: the next token of this job is sampled under the new mask (set between steps)
                self.engine._core.set_token_mask(self.id, self.constraint.advance(token))
        if finished:
            if not self._stopped:
                if self._decoder is not None:
                    self._text += self._decoder.flush()
                    if self._banned:
                        self._cut_banned_tail()
                self.finish_reason = reason
            elif self.finish_reason is None:
                self.finish_reason = reason  # a rewind came too late (the job was ending)
            # held text is released: nothing can complete a match now
            chunk += self._text[self._emitted :]
            self._emitted = len(self._text)
            if reason == "error":
                self.error = InternalError(f"job {self.id} failed: {error}")
        self._deliver(chunk, finished)

    def _add_text(self, new: str) -> str:
        if self._banned:
            self._ends.append(len(self._text) + len(new))
        if not new:
            return ""
        self._text += new
        stop = self._stop
        cut = None
        if stop:
            start = max(0, self._emitted - max(len(s) for s in stop))
            for s in stop:
                i = self._text.find(s, start)
                if i >= 0 and (cut is None or i < cut):
                    cut = i
        if self._banned:
            hit = self._find_banned()
            if hit is not None and (cut is None or hit < cut):
                self._rewind(hit)
                return self._release()
        if stop and cut is not None:
            self._text = self._text[:cut]
            self._stopped = True
            self.finish_reason = "stop_string"
            self.engine._core.cancel(
                self.id, "stop_string"
            )  # frees its pages now (we are between steps)
            out = self._text[self._emitted :]
            self._emitted = len(self._text)
            return out
        return self._release()

    def _release(self) -> str:
        """Hand out the text that can no longer become part of a stop or banned string."""
        safe = len(self._text) - _longest_partial(self._text, self._stop)
        k = _longest_partial(self._text, self._banned)
        if k:  # held from the start of the token that produced the partial match's first character
            i = bisect_right(self._ends, len(self._text) - k)
            safe = min(safe, self._ends[i - 1] if i > 0 else 0)
        out = self._text[self._emitted : safe] if safe > self._emitted else ""
        self._emitted = max(self._emitted, safe)
        return out

    def _find_banned(self) -> int | None:
        """Start (in _text) of the earliest complete banned string in the text not handed out yet, or None."""
        hit = None
        for s in self._banned:
            i = self._text.find(s, self._emitted)
            if i >= 0 and (hit is None or i < hit):
                hit = i
        return hit

    def _token_at(self, char: int) -> int:
        """Index (in token_ids) of the token whose decoding produced character `char` of _text."""
        return bisect_right(self._ends, char)

    def _truncate(self, n: int) -> None:
        """Keep the first n generated tokens and their text; rebuild the incremental decoder for them."""
        self._text = self._text[: self._ends[n - 1] if n > 0 else 0]
        del self.token_ids[n:], self.logprobs[n:], self.top_logprobs[n:], self._ends[n:]
        if self._decoder is not None:
            from .tokenizer import StreamDecoder

            self._decoder = StreamDecoder(self._decoder.tokenizer, self._decoder.skip_special)
            self._decoder.push_many(self.token_ids)  # its text is _text already

    def _rewind(self, char: int) -> None:
        """A banned string starts at _text[char]: take back the token that began it and ban it there."""
        i = self._token_at(char)
        ban = self.token_ids[i]
        self._truncate(i)
        if self.engine._core.rewind(self.id, i, ban):
            self.rewinds += 1
            self._rewound = True
        else:
            # the job is ending (cancel requested, or its max_rewinds are used up: it finishes with
            # "banned_string_limit"): keep the text before the banned string, drop the rest
            self._stopped = True

    def _cut_banned_tail(self) -> None:
        """At the end of a job: cut before the token where a banned string (completed by the last tokens) began."""
        hit = self._find_banned()
        if hit is not None:
            self._truncate(self._token_at(hit))

    def _deliver(self, chunk: str, finished: bool) -> None:
        if not chunk and not finished:
            return
        with self._cond:
            if chunk:
                self._chunks.append(chunk)
            if finished:
                self._done = True
            self._cond.notify_all()
            waiters = list(self._waiters)
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the loop was closed; nobody is listening there any more
                pass

    def _fail(self, exc: Exception) -> None:
        self.error = exc
        self.finish_reason = "error"
        self._deliver("", True)

    # ---- consumer side ----------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._done

    def __iter__(self) -> Iterator[str]:
        i = 0
        while True:
            with self._cond:
                while len(self._chunks) <= i and not self._done:
                    self._cond.wait()
                new = self._chunks[i:]
                done = self._done
            i += len(new)
            yield from new
            if done and i >= len(self._chunks):
                break
        if self.error is not None:
            raise self.error

    async def __aiter__(self):
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        with self._cond:
            self._waiters.append((loop, event))
        try:
            i = 0
            while True:
                event.clear()
                with self._cond:
                    new = self._chunks[i:]
                    done = self._done
                i += len(new)
                for chunk in new:
                    yield chunk
                if done and i >= len(self._chunks):
                    break
                if not new:
                    await event.wait()
        finally:
            with self._cond:
                self._waiters.remove((loop, event))
        if self.error is not None:
            raise self.error

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the job finishes (True) or ``timeout`` seconds pass (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._done, timeout)

    def result(self, timeout: float | None = None) -> str:
        """The whole generated text (stop strings and stop tokens excluded), once finished."""
        if not self.wait(timeout):
            raise TimeoutError(f"job {self.id} did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        return self._text

    async def aresult(self) -> str:
        """:meth:`result` for asyncio code."""
        async for _ in self:
            pass
        return self._text

    def cancel(self) -> bool:
        """Stop the job now; its cache pages are freed at once. False when it had already finished."""
        return self.engine._core.cancel(self.id, "cancelled")

    @property
    def text(self) -> str:
        """Text generated so far (including text still held back for a possible stop string)."""
        return self._text


class Engine:
    """Dynamic batching over one paged KV cache for ``model``.

    Parameters
    ----------
    model
        A loaded :class:`exl2cpp.Model`.
    cache_tokens
        KV-cache size in tokens (rounded up to whole pages). Default: on CUDA ``cache_fraction`` of the free device
        memory, on CPU ``max(4096, min(max_seq_len, 32768))``.
    max_batch_tokens
        Rows per forward pass (decode rows + prefill chunk tokens).
    page_size
        Tokens per cache page (the unit of allocation and of prefix sharing).
    max_jobs
        Jobs running at once (each holds pages; at most max_batch_tokens); more wait in the queue.
        0: ``min(128, max_batch_tokens)``.
    prefix_cache
        Share full pages of equal token prefixes between jobs and keep finished jobs' pages for reuse (LRU).
    cache_type
        KV-cache storage: ``"auto"`` (fp32 on CPU, fp16 on CUDA), ``"fp16"``, ``"fp32"``, or the rotated
        block-quantized ``"q8"``, ``"q6"``, ``"q4"`` (8.5, 6.5, 5.0 bits per value; see ``bytes_per_token``).
    draft_model
        Speculative decoding with a draft :class:`exl2cpp.Model` of the same tokenizer (a separately loaded one;
        it gets a KV cache of its own, ``cache_tokens`` long, in ``cache_type``).
    draft_tokens
        Most draft tokens a job proposes per step (1..32; the adaptive length starts there). With drafts,
        ``max_jobs * (draft_tokens + 1) <= max_batch_tokens`` (``max_jobs=0`` picks the most that fit, up to 128).
    ngram_draft
        Speculative decoding with prompt-lookup drafts: the tokens that followed the latest earlier occurrence of
        the job's last n tokens (prompt and output so far). Not with ``draft_model``.
    ngram_sizes
        The n-gram lengths tried for ``ngram_draft``, in order (the first that matches wins), each 1..64.
    options
        Runtime options to set first (docs/options.md; process-wide, see :mod:`exl2cpp.options`), e.g.
        ``{"device_sample": True}``; the cache reads its ``kv_cache`` options when it is made here.
    """

    def __init__(
        self,
        model,
        cache_tokens: int | None = None,
        max_batch_tokens: int = 2048,
        page_size: int = 256,
        max_jobs: int = 0,
        prefix_cache: bool = True,
        cache_fraction: float = 0.9,
        aging_steps: int = 16,
        cache_type: str = "auto",
        draft_model=None,
        draft_tokens: int = 4,
        ngram_draft: bool = False,
        ngram_sizes: Sequence[int] = (4, 3, 2),
        options: Mapping[str, Any] | None = None,
    ):
        if options:
            _options.set(options)
        self.model = model
        self.draft_model = draft_model
        _check_spec_options(model, draft_model, draft_tokens, ngram_draft, ngram_sizes)
        if cache_tokens is None:
            cache_tokens = _default_cache_tokens(model, cache_fraction, cache_type, page_size, max_batch_tokens)
        if not isinstance(cache_tokens, int) or not 0 < cache_tokens < 2**63:
            raise InvalidArgumentError(
                f"cache_tokens must be a positive integer below 2**63, got {cache_tokens!r}"
            )
        self._core = retry_after_collect(lambda: _C.Engine(
            model._core,
            cache_tokens=cache_tokens,
            page_size=page_size,
            max_batch_tokens=max_batch_tokens,
            max_jobs=max_jobs,
            aging_steps=aging_steps,
            prefix_cache=prefix_cache,
            cache_type=cache_type,
            draft_model=draft_model._core if draft_model is not None else None,
            draft_tokens=draft_tokens,
            ngram_draft=ngram_draft,
            ngram_sizes=[int(n) for n in ngram_sizes],
        ))
        try:
            self.tokenizer = model.tokenizer
        except ModelFileError:
            self.tokenizer = None  # token ids in and out only
        self._jobs: dict[int, Job] = {}
        if draft_model is not None or ngram_draft:
            self._core.set_draft_masks(_draft_masks_of(weakref.ref(self)))
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._lock = getattr(model, "_lock", None) or threading.RLock()
        # the draft model's forwards run inside this engine's steps: no other forward of it meanwhile
        self._draft_lock = getattr(draft_model, "_lock", None) if draft_model is not None else None

    # ---- submitting -------------------------------------------------------------------------------------
    def submit(
        self,
        prompt,
        max_new_tokens: int = 256,
        stop: str | Sequence[str] | None = None,
        stop_tokens: Iterable[int] | None = None,
        ignore_eos: bool = False,
        priority: int = 0,
        constraint=None,
        banned_strings: str | Sequence[str] | None = None,
        max_rewinds: int | None = None,
        speculate: bool = True,
        **sampling,
    ) -> Job:
        """Queue a generation and return its :class:`Job`.

        ``prompt`` is text (encoded with the model's tokenizer) or a sequence of token ids. Generation ends at an
        end-of-sequence token (unless ``ignore_eos``), at one of ``stop_tokens``, at a ``stop`` string (excluded
        from the text), or after ``max_new_tokens``. ``sampling`` (docs/engine.md "Sampling" gives the pipeline
        order, each range and default): temperature (0 = greedy), top_k, top_p, min_p, typical, top_a, tfs,
        repetition_penalty, frequency_penalty, presence_penalty, penalty_window (alias penalty_range),
        logit_bias ({id: bias}), banned_tokens, allowed_tokens (only these ids can be sampled), min_tokens (the stop
        tokens, end-of-sequence included, are held back until that many tokens are generated), smoothing_factor
        and smoothing_curve (quadratic sampling), temperature_last, min_temp / max_temp / temp_exponent
        (dynamic temperature, on when max_temp > min_temp), mirostat_mode (2 = mirostat v2) with mirostat_tau and
        mirostat_eta, xtc_probability and xtc_threshold, dry_multiplier / dry_base / dry_allowed_length /
        dry_range / dry_sequence_breakers (strings, each standing for its last token, or token ids), seed (same
        seed, same output, whatever runs alongside), top_logprobs.
        Higher ``priority`` jobs are admitted and prefilled first; waiting jobs gain priority over time.
        ``constraint`` (constrained decoding, e.g. a JSON schema): an object with ``mask()`` (the allowed-token
        bitmask for the first token: a list of uint32 words, bit ``id % 32`` of word ``id // 32``; empty = all) and
        ``advance(token)`` (consume a sampled token, return the mask for the next one); the engine applies the mask
        to the logits before sampling, and calls ``advance`` on its thread between steps. When the engine drafts, a
        constraint that also has ``draft_masks(drafts)`` (the masks after each draft in turn, stopping at the first
        one its grammar refuses, its own state unchanged; :class:`exl2cpp.server.grammar.Constraint` has it)
        speculates: each draft is verified under its position's mask, so the output is that of plain constrained
        decoding (greedy: the same tokens); without ``draft_masks`` the job does not speculate.
        ``banned_strings``: strings (case-sensitive, up to 1024 of up to 512 characters) that never appear in the
        generated text: when one is completed the job rewinds to the token where it began and bans that token
        there (see the module docstring for how text is held back and how stop strings interact).
        ``max_rewinds``: how many such rewinds the job may make (default 16; -1 = unlimited); at the next banned
        string it ends with ``finish_reason == "banned_string_limit"``, its text cut before that string.
        ``speculate=False``: this job decodes one token a step even when the engine drafts.
        """
        bad = set(sampling) - set(_SAMPLING_KEYS)
        if bad:
            raise InvalidArgumentError(
                f"submit: unknown argument(s) {sorted(bad)}; sampling arguments are "
                f"{', '.join(_SAMPLING_KEYS)}"
            )
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise InvalidArgumentError(
                f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}"
            )
        if max_rewinds is None:
            max_rewinds = _DEFAULT_MAX_REWINDS
        if not isinstance(max_rewinds, int) or isinstance(max_rewinds, bool) or max_rewinds < -1:
            raise InvalidArgumentError(
                f"max_rewinds must be an integer >= 0 (or -1 for unlimited), got {max_rewinds!r}"
            )
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise InvalidArgumentError("stop must be a string or a list of non-empty strings")
        banned = _banned_list(banned_strings)
        if banned and constraint is not None:
            raise InvalidArgumentError(
                "banned_strings cannot be combined with constrained decoding (constraint / response_format): "
                "a rewind cannot take back the grammar's state"
            )
        tok = self.tokenizer
        if isinstance(prompt, str):
            if tok is None:
                raise InvalidArgumentError(
                    "this model has no tokenizer.json: pass the prompt as token ids"
                )
            ids = tok.encode(prompt)
        else:
            ids = [int(i) for i in (prompt.tolist() if isinstance(prompt, np.ndarray) else prompt)]
        if stop and tok is None:
            raise InvalidArgumentError(
                "stop strings need a tokenizer; this model has none (use stop_tokens)"
            )
        if banned and tok is None:
            raise InvalidArgumentError(
                "banned_strings need a tokenizer; this model has none (use banned_tokens)"
            )
        stops = [int(t) for t in (stop_tokens or [])]
        if not ignore_eos and tok is not None:
            stops += [t for t in tok.eos_ids if t not in stops]
        settings = _sampler_settings(sampling, tok)
        from .tokenizer import StreamDecoder

        decoder = StreamDecoder(tok) if tok is not None else None
        with self._cv:
            if self._closed:
                raise InvalidArgumentError("submit: the engine is closed")
            job_id = self._core.submit(
                ids,
                max_new_tokens=max_new_tokens,
                stop_tokens=stops,
                sampler=settings,
                priority=int(priority),
                token_mask=list(constraint.mask()) if constraint is not None else [],
                max_rewinds=min(max_rewinds, (1 << 31) - 1),
                speculate=bool(speculate)
                and (constraint is None or hasattr(constraint, "draft_masks")),
                constrained=constraint is not None,
            )
            job = Job(self, job_id, ids, stop, decoder, constraint, banned)
            self._jobs[job_id] = job
            self._ensure_thread()
            self._cv.notify_all()
        return job

    def generate(self, prompts, max_new_tokens: int = 256, **kwargs) -> list[str] | str:
        """Run every prompt as one job at once and return the texts in order (one str for a single prompt)."""
        single = isinstance(prompts, str) or (
            isinstance(prompts, (list, tuple))
            and prompts
            and isinstance(prompts[0], (int, np.integer))
        )
        jobs = [
            self.submit(p, max_new_tokens=max_new_tokens, **kwargs)
            for p in ([prompts] if single else prompts)
        ]
        try:
            out = [j.result() for j in jobs]
        except BaseException:
            for j in jobs:
                j.cancel()
            raise
        return out[0] if single else out

    def stats(self) -> dict[str, Any]:
        """Counters: pages (total/used/free/shared/cached/evictable/reserved), jobs (queued/active/submitted/
        finished), tokens (in/prefilled/reused/out/recomputed), steps, rewinds (banned strings), preemptions
        (jobs sent back to the queue to free pages; ``tokens_recomputed``: rows they forwarded again); speculative
        decoding: ``spec_proposed`` (draft tokens verified), ``spec_accepted`` (of those, accepted),
        ``draft_steps`` (draft model forwards), ``draft_pages_total`` / ``draft_pages_free`` /
        ``draft_pages_cached`` (the draft model's cache); sliding windows: ``layer_groups`` (page tables per job:
        models with sliding-window layers keep one per group of layers sharing a window, so pages hold
        1 / layer_groups of the layers), ``pages_window_freed`` (pages jobs gave back because they fell behind
        their group's window) and ``draft_pages_window_freed`` (draft pages given back behind a draft model's
        window, when every layer of it has one)."""
        return self._core.stats()

    def tokens_needed(self, n_tokens: int) -> int:
        """Cache tokens (of every layer, as ``cache_tokens`` counts them) a job of ``n_tokens`` positions holds at
        most: ``n_tokens`` rounded up to pages, or less for a model with sliding-window layers (those keep about
        their window, plus a margin and a step's rows)."""
        if not isinstance(n_tokens, int) or n_tokens <= 0:
            raise InvalidArgumentError(f"n_tokens must be a positive integer, got {n_tokens!r}")
        return self._core.cache_tokens_needed(n_tokens)

    def jobs_that_fit(self, n_tokens: int) -> int:
        """How many jobs of ``n_tokens`` positions the cache holds at once (prefix sharing aside)."""
        if not isinstance(n_tokens, int) or n_tokens <= 0:
            raise InvalidArgumentError(f"n_tokens must be a positive integer, got {n_tokens!r}")
        return self._core.n_pages // self._core.pages_needed(n_tokens)

    @property
    def cache_type(self) -> str:
        """The KV cache's storage: "fp32", "fp16", "q8", "q6" or "q4"."""
        return self._core.cache_type

    @property
    def bytes_per_token(self) -> int:
        """KV-cache bytes per token (all layers, K and V, scales included)."""
        return self._core.bytes_per_token

    def clear_prefix_cache(self) -> int:
        """Free the cached pages no job uses; returns how many."""
        return self._core.clear_prefix_cache()

    def close(self) -> None:
        """Cancel every job and stop the background thread (it ends after the step it is in; Ctrl-C meanwhile is
        raised once it has)."""
        with self._cv:
            self._closed = True
            for job_id in list(self._jobs):
                self._core.cancel(job_id, "cancelled")
            self._cv.notify_all()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        interrupted = False
        while thread.is_alive():
            try:
                thread.join()
            except KeyboardInterrupt:  # the thread must still be joined: it may be inside a C++ step
                interrupted = True
        if interrupted:
            raise KeyboardInterrupt

    def __enter__(self) -> Engine:  # noqa: PYI034
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the stepping thread ----------------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            # The thread holds the engine only while it steps: an idle engine that nothing else references (a model
            # dropped after generate) is collected, its cache with it, and the thread then ends.
            self._thread = threading.Thread(target=_engine_loop, args=(weakref.ref(self), self._cv),
                                            name="exl2cpp-engine", daemon=True)
            self._thread.start()
            _running.add(self)

    def _wants_step(self) -> bool | None:
        """True: step now; False: wait; None: closed and idle, the thread ends. Called under self._cv."""
        if self._core.idle:
            return None if self._closed else False
        return True

    def _step_once(self) -> None:
        core = self._core
        try:
            with self._lock:
                if self._draft_lock is not None and self._draft_lock is not self._lock:
                    with self._draft_lock:
                        events = core.step(spec_counts=True)
                else:
                    events = core.step(spec_counts=True)
        except Exception as exc:  # noqa: BLE001 - fail every job rather than hang their consumers
            with self._cv:
                jobs = list(self._jobs.values())
                self._jobs.clear()
                for j in jobs:
                    core.cancel(j.id, "error")
            for j in jobs:
                j._fail(exc if isinstance(exc, Exl2Error) else InternalError(str(exc)))
            return
        rewound: list[Job] = []
        for job_id, token, logprob, top, finished, reason, error, proposed, accepted, reused in events:
            job = self._jobs.get(job_id)
            if job is None or (job._rewound and not finished):
                continue  # a banned-string rewind took back the tokens after this one
            job.spec_proposed, job.spec_accepted = proposed, accepted
            job.cached_tokens = min(reused, len(job.prompt_ids))  # a preempted job may adopt its pages again
            try:
                job._on_event(token, logprob, top, finished, reason, error)
                if job._rewound:
                    rewound.append(job)
            except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer failure: that job fails, not the engine
                core.cancel(job_id, "error")
                job._fail(exc)
                finished = True
            if finished:
                with self._cv:
                    self._jobs.pop(job_id, None)
        for job in rewound:
            job._rewound = False


def _engine_loop(ref: weakref.ref, cv: threading.Condition) -> None:
    """The stepping thread of the engine behind `ref`. While idle it holds only the weak reference and the
    condition, waking on notify (submit, close, the engine's collection) or every few seconds to look again."""
    engine = ref()
    if engine is None:
        return
    weakref.finalize(engine, _wake, cv)
    del engine
    while True:
        with cv:
            while True:
                engine = ref()
                if engine is None:
                    return
                want = engine._wants_step()
                if want is None:
                    return
                if want:
                    break
                del engine
                cv.wait(5.0)
        engine._step_once()
        del engine


def _wake(cv: threading.Condition) -> None:
    """Finalizer of a collected engine: wake its thread so it ends (without blocking a collection that runs while
    the thread holds the condition; it then sees the engine gone at its next wake-up)."""
    if cv.acquire(blocking=False):
        try:
            cv.notify_all()
        finally:
            cv.release()


# Engines whose thread was started. The thread is a daemon (an idle engine never holds the process up), and it runs
# steps in C++ without the GIL. A daemon thread that comes back from a step while the interpreter finalizes is ended
# by pthread_exit inside pybind11's GIL guard, and that unwinding through C++ aborts the process ("terminate called
# without an active exception"). So at exit, while the interpreter is still whole, every engine is closed: its jobs
# are cancelled and its thread joined after the step it is in. atexit runs after non-daemon threads are joined and
# before finalization starts.
_running: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _close_engines_at_exit() -> None:
    for engine in list(_running):
        try:
            engine.close()
        except KeyboardInterrupt:  # Ctrl-C during exit: close() has joined the thread; go on with the others
            pass


def _draft_masks_of(engine_ref: weakref.ref):
    """The engine's DraftMaskFn (called on its thread inside a step): the masks of a constrained job's draft
    positions from its constraint. A weak reference: the C++ engine holding it keeps no cycle alive."""

    def draft_masks(job_id: int, drafts: list[int]) -> list[list[int]]:
        engine = engine_ref()
        job = engine._jobs.get(job_id) if engine is not None else None
        c = job.constraint if job is not None else None
        if c is None or job._stopped or not hasattr(c, "draft_masks"):
            return []  # no masks: the job's next token samples as a plain row
        return c.draft_masks(list(drafts))

    return draft_masks


def _longest_partial(text: str, strings: list[str]) -> int:
    """The longest k such that text's last k characters are a proper prefix of one of `strings` (0 if none)."""
    hold = 0
    for s in strings:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold


def _banned_list(banned) -> list[str]:
    banned = [banned] if isinstance(banned, str) else banned
    if banned is None:
        return []
    if not isinstance(banned, (list, tuple)):
        raise InvalidArgumentError(
            f"banned_strings must be a list of non-empty strings, got {type(banned).__name__}"
        )
    if len(banned) > _MAX_BANNED_STRINGS:
        raise InvalidArgumentError(
            f"banned_strings has {len(banned)} entries; at most {_MAX_BANNED_STRINGS} are allowed"
        )
    for i, b in enumerate(banned):
        if not isinstance(b, str) or not b:
            raise InvalidArgumentError(f"banned_strings[{i}] must be a non-empty string, got {b!r}")
        if len(b) > _MAX_BANNED_LEN:
            raise InvalidArgumentError(
                f"banned_strings[{i}] has {len(b)} characters; at most {_MAX_BANNED_LEN} are allowed"
            )
    return list(dict.fromkeys(banned))


def _sampler_settings(sampling: dict, tokenizer=None) -> _C.SamplerSettings:
    """SamplerSettings from Engine.submit's sampling keywords (None = the default), with the types checked here so
    that a wrong one is an InvalidArgumentError naming the keyword."""
    kw = {k: v for k, v in sampling.items() if v is not None}
    if "penalty_range" in kw:
        if "penalty_window" in kw:
            raise InvalidArgumentError(
                "penalty_range and penalty_window are the same setting: pass only one"
            )
        kw["penalty_window"] = kw.pop("penalty_range")
    for k in _FLOAT_KEYS:
        if k in kw:
            kw[k] = _number(k, kw[k], float)
    for k in _INT_KEYS:
        if k in kw:
            kw[k] = _number(k, kw[k], int)
    if "temperature_last" in kw and not isinstance(kw["temperature_last"], bool):
        raise InvalidArgumentError(
            f"temperature_last must be a bool, got {type(kw['temperature_last']).__name__}"
        )
    if "logit_bias" in kw:
        try:
            kw["logit_bias"] = {int(k): float(v) for k, v in dict(kw["logit_bias"]).items()}
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(f"logit_bias must map token ids to numbers: {e}") from None
    for k in _TOKEN_LIST_KEYS:
        if k in kw:
            kw[k] = [_number(f"{k} entry", t, int) for t in _as_list(k, kw[k])]
    if "dry_sequence_breakers" in kw:
        kw["dry_sequence_breakers"] = _breaker_ids(kw["dry_sequence_breakers"], tokenizer)
    return _C.SamplerSettings(**kw)


def _number(name: str, value, kind: type):
    """value as an int or a float; bools and other types are refused (a float must not be an int setting)."""
    ok = (int, np.integer) if kind is int else (int, float, np.integer, np.floating)
    if isinstance(value, bool) or not isinstance(value, ok):
        raise InvalidArgumentError(
            f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}"
        )
    return kind(value)


def _as_list(name: str, value) -> list:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise InvalidArgumentError(f"{name} must be a list, got {type(value).__name__}")
    return list(value)


def _breaker_ids(breakers, tokenizer) -> list[int]:
    """DRY sequence breakers: token ids as given, strings as their last token (as TabbyAPI does)."""
    out: list[int] = []
    for i, b in enumerate(_as_list("dry_sequence_breakers", breakers)):
        if isinstance(b, str):
            if tokenizer is None:
                raise InvalidArgumentError(
                    "dry_sequence_breakers strings need a tokenizer; this model has none (pass token ids)"
                )
            ids = tokenizer.encode(b, add_bos=False, special=False) if b else []
            if not ids:
                raise InvalidArgumentError(
                    f"dry_sequence_breakers[{i}] = {b!r} encodes to no token; pass a non-empty string"
                )
            out.append(ids[-1])
        else:
            out.append(_number(f"dry_sequence_breakers[{i}]", b, int))
    return out


def _check_spec_options(model, draft_model, draft_tokens, ngram_draft, ngram_sizes) -> None:
    """Speculative decoding options: types, and a draft model of the same tokenizer (clear errors here, before C++
    sees only vocabulary sizes)."""
    if not isinstance(draft_tokens, int) or isinstance(draft_tokens, bool) or not 1 <= draft_tokens <= 32:
        raise InvalidArgumentError(f"draft_tokens must be an integer in [1, 32], got {draft_tokens!r}")
    if not isinstance(ngram_draft, bool):
        raise InvalidArgumentError(f"ngram_draft must be a bool, got {ngram_draft!r}")
    sizes = list(ngram_sizes) if isinstance(ngram_sizes, (list, tuple)) else None
    if not sizes or any(not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 64 for n in sizes):
        raise InvalidArgumentError(
            f"ngram_sizes must be a non-empty list of n-gram lengths in [1, 64], got {ngram_sizes!r}"
        )
    if draft_model is None:
        return
    if ngram_draft:
        raise InvalidArgumentError("give ngram_draft=True or a draft_model, not both")
    if not hasattr(draft_model, "_core") or not isinstance(draft_model._core, _C.Model):
        raise InvalidArgumentError(
            f"draft_model must be an exl2cpp.Model (exl2cpp.load(...)), got {type(draft_model).__name__}"
        )
    if draft_model is model or draft_model._core is model._core:
        raise InvalidArgumentError(
            "draft_model is the model itself: load the folder a second time to let a model draft for itself"
        )
    if draft_model.vocab_size != model.vocab_size:
        raise InvalidArgumentError(
            f"draft_model {draft_model.path} has a vocabulary of {draft_model.vocab_size} ids but the model "
            f"{model.path} has {model.vocab_size}; a draft model must use the same tokenizer"
        )
    try:
        a, b = model.tokenizer, draft_model.tokenizer
    except ModelFileError:
        return  # token ids only: the vocabulary sizes above are all there is to compare
    va, vb = a._tk.get_vocab(with_added_tokens=True), b._tk.get_vocab(with_added_tokens=True)
    if va != vb:
        diff = sorted(set(va.items()) ^ set(vb.items()), key=lambda kv: kv[1])[:3]
        raise InvalidArgumentError(
            f"draft_model {draft_model.path} has another tokenizer than the model {model.path} "
            f"(first differing entries {diff}); a draft model must use the same tokenizer"
        )


_CACHE_BITS = {"auto": 16.0, "fp16": 16.0, "f16": 16.0, "q8": 8.5, "q6": 6.5, "q4": 5.0}


def _default_cache_tokens(model, fraction: float, cache_type: str = "auto", page_size: int = 256,
                          max_batch_tokens: int = 2048) -> int:
    device = str(model.device)
    if device.startswith("cuda") and hasattr(_C, "cuda_mem_info"):
        if not 0.0 < fraction <= 1.0:
            raise InvalidArgumentError(f"cache_fraction must be in (0, 1], got {fraction}")
        if getattr(model, "split", False):  # layers on several GPUs: each GPU holds its layers' share
            from .multigpu import default_cache_tokens

            return default_cache_tokens(model, fraction, _CACHE_BITS.get(str(cache_type).lower(), 32.0) / 8)
        index = int(device.split(":")[1]) if ":" in device else 0
        gc.collect()  # memory of dropped models and engines still in reference cycles is free memory here
        free, _total = _C.cuda_mem_info(index)
        bits = _CACHE_BITS.get(str(cache_type).lower(), 32.0)  # codes + f16 scale (Q4: and offset) per 32 values
        from .model import kv_values_per_layer

        c = model.text_config
        per_token = int(c["num_hidden_layers"] * kv_values_per_layer(c) * bits / 8)  # K and V
        return max(256, int(free * fraction) // per_token)
    # CPU: room for one job of max_seq_len (up to 32768) tokens; sliding-window layers hold only their window.
    ctx = min(int(model.max_seq_len), 32768)
    if isinstance(page_size, int) and isinstance(max_batch_tokens, int) and page_size > 0 and max_batch_tokens > 0:
        ctx = min(ctx, _C.engine_cache_tokens(model._core, ctx, page_size, max_batch_tokens))
    return max(4096, ctx)
