"""The batching engine on the CPU backend: batched == alone (greedy and seeded), prefix sharing (page counts and
identical tokens), cancel returns pages, priorities without starvation, a randomized soak that ends with no page
in use and every job finished exactly once, and the Python layer (streaming text, stop strings, asyncio)."""

from __future__ import annotations

import asyncio
import threading

import exl2cpp
import numpy as np
import pytest
from exl2cpp import _C

torch = pytest.importorskip("torch")
from test_models_hf import make_hf_model

VOCAB = 211  # the tiny models of test_models_hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_engine")
    make_hf_model("llama", {"max_position_embeddings": 1024}, folder, seed=3)
    return exl2cpp.load(folder)


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    return exl2cpp.load(smollm2_dir, max_seq_len=2048)


def greedy(**kw):
    return _C.SamplerSettings(temperature=0.0, **kw)


def drive(core, plan, cancels=None, max_steps=100000, check=None, on_step=None):
    """Step `core` until idle. plan: {step: [(key, prompt, submit kwargs)]} submitted before that step;
    cancels: {step: [key]}; check(core) and on_step(core, {job id: key}) after every step. Returns (tokens per
    key, finish reason per key, finished-event count per key)."""
    cancels = cancels or {}
    ids, toks, reasons, n_fin = {}, {}, {}, {}
    last = max(list(plan) + list(cancels) + [0])
    step = 0
    while step <= last or not core.idle:
        for key, prompt, kw in plan.get(step, []):
            ids[core.submit(prompt, **kw)] = key
            toks[key], n_fin[key] = [], 0
        for key in cancels.get(step, []):
            jid = next(j for j, k in ids.items() if k == key)
            core.cancel(jid)
        for jid, token, _lp, _top, finished, reason, error in core.step():
            key = ids[jid]
            assert not error, error
            if token >= 0:
                toks[key].append(token)
            if finished:
                reasons[key] = reason
                n_fin[key] += 1
        if check:
            check(core)
        if on_step:
            on_step(core, ids)
        step += 1
        assert step < max_steps, "engine did not finish"
    return toks, reasons, n_fin


def alone(model, prompt, **kw):
    core = _C.Engine(
        model._core, cache_tokens=kw.pop("cache_tokens", 2048), page_size=kw.pop("page_size", 16)
    )
    toks, reasons, _ = drive(core, {0: [("a", prompt, kw)]})
    return toks["a"], reasons["a"]


def check_pages(core):
    s = core.stats()
    assert (
        0 <= s["pages_used"] <= s["pages_total"]
        and s["pages_used"] + s["pages_free"] == s["pages_total"]
    )
    assert 0 <= s["pages_reserved"] <= s["pages_free"] + s["pages_evictable"]
    assert s["pages_used"] >= s["pages_cached"] >= s["pages_evictable"]


# ---- tiny random model: fast, exact --------------------------------------------------------------------------
def test_tiny_batched_equals_alone_greedy_and_seeded(tiny):
    rng = np.random.default_rng(0)
    jobs = []
    for i in range(16):
        prompt = rng.integers(0, VOCAB, int(rng.integers(1, 90))).tolist()
        sampler = (
            greedy() if i % 2 == 0 else _C.SamplerSettings(temperature=1.0, top_p=0.9, seed=100 + i)
        )
        jobs.append(
            (f"j{i}", prompt, {"max_new_tokens": int(rng.integers(1, 25)), "sampler": sampler})
        )
    plan = {}
    for i, job in enumerate(jobs):  # staggered: a new job every other step
        plan.setdefault(2 * (i // 2) + (i % 3), []).append(job)
    core = _C.Engine(tiny._core, cache_tokens=4096, page_size=16, max_batch_tokens=64)
    toks, reasons, n_fin = drive(core, plan, check=check_pages)
    for key, prompt, kw in jobs:
        want, why = alone(tiny, prompt, **kw)
        assert toks[key] == want, key
        assert reasons[key] == why == "length" and len(want) == kw["max_new_tokens"]
        assert n_fin[key] == 1
    s = core.stats()
    assert s["jobs_finished"] == s["jobs_submitted"] == 16 and s["pages_used"] == s["pages_cached"]
    assert core.clear_prefix_cache() == s["pages_cached"]
    assert core.stats()["pages_used"] == 0


def test_tiny_prefix_sharing_counts_pages_and_matches(tiny):
    rng = np.random.default_rng(1)
    prefix = rng.integers(0, VOCAB, 100).tolist()  # 6 full pages of 16 + 4
    a = prefix + rng.integers(0, VOCAB, 7).tolist()
    b = prefix + rng.integers(0, VOCAB, 12).tolist()
    kw = {"max_new_tokens": 10, "sampler": greedy()}
    results = {}
    for share in (False, True):
        core = _C.Engine(
            tiny._core, cache_tokens=1024, page_size=16, max_batch_tokens=256, prefix_cache=share
        )
        peak = []
        toks, _, _ = drive(
            core,
            {0: [("a", a, kw), ("b", b, kw)]},
            check=lambda c, peak=peak: peak.append(
                c.stats()["pages_used"] - c.stats()["pages_evictable"]
            ),
        )
        results[share] = (toks, max(peak), core.stats())
    (t0, peak0, s0), (t1, peak1, s1) = results[False], results[True]
    assert t0 == t1
    assert s1["tokens_reused"] == 6 * 16 and s0["tokens_reused"] == 0
    assert peak0 - peak1 == 6  # the 6 shared pages are held once
    assert s1["tokens_prefilled"] == s0["tokens_prefilled"] - 96


def test_tiny_prefix_cache_across_time_and_eviction(tiny):
    rng = np.random.default_rng(2)
    prefix = rng.integers(0, VOCAB, 64).tolist()
    core = _C.Engine(tiny._core, cache_tokens=256, page_size=16, max_batch_tokens=128)  # 16 pages
    kw = {"max_new_tokens": 4, "sampler": greedy()}
    first, _, _ = drive(core, {0: [("a", prefix + [5], kw)]})
    assert core.stats()["pages_evictable"] >= 4  # the finished job's full pages stay cached
    again, _, _ = drive(core, {0: [("a", prefix + [5], kw)]})
    assert again == first and core.stats()["tokens_reused"] == 64
    # A job that needs the whole pool forces the cached pages out, LRU-first.
    big = rng.integers(0, VOCAB, 250).tolist()
    toks, reasons, _ = drive(core, {0: [("big", big, {"max_new_tokens": 6, "sampler": greedy()})]})
    assert (
        reasons["big"] == "length"
        and toks["big"] == alone(tiny, big, max_new_tokens=6, sampler=greedy())[0]
    )


def test_tiny_cancel_returns_pages(tiny):
    rng = np.random.default_rng(3)
    core = _C.Engine(
        tiny._core, cache_tokens=2048, page_size=16, max_batch_tokens=40, prefix_cache=False
    )
    long_prompt = rng.integers(0, VOCAB, 200).tolist()  # prefills over 5 steps
    ids = [
        core.submit(long_prompt, max_new_tokens=50, sampler=greedy()),
        core.submit(rng.integers(0, VOCAB, 10).tolist(), max_new_tokens=50, sampler=greedy()),
        core.submit(rng.integers(0, VOCAB, 10).tolist(), max_new_tokens=50, sampler=greedy()),
    ]
    events = []
    for _ in range(3):
        events += core.step()
    assert len(core.job_pages(ids[0])) >= 2  # mid-prefill
    used = core.stats()["pages_used"]
    held = len(core.job_pages(ids[0]))
    assert core.cancel(ids[0]) and not core.cancel(ids[0])
    assert core.stats()["pages_used"] == used - held  # at once, before the next step
    for _ in range(5):
        events += core.step()
    assert core.cancel(ids[1], "client gone") and core.cancel(ids[2])  # mid-decode
    assert core.stats()["pages_used"] == 0
    events += core.step()
    fin = {e[0]: e[5] for e in events if e[4]}
    assert fin == {ids[0]: "cancelled", ids[1]: "client gone", ids[2]: "cancelled"}
    assert core.idle and core.step() == []


def test_tiny_priority_and_no_starvation(tiny):
    rng = np.random.default_rng(4)
    core = _C.Engine(
        tiny._core, cache_tokens=1024, page_size=16, max_batch_tokens=64, max_jobs=1, aging_steps=4
    )
    kw = {"max_new_tokens": 3, "sampler": greedy()}
    low = core.submit(rng.integers(0, VOCAB, 5).tolist(), priority=0, **kw)
    high = core.submit(rng.integers(0, VOCAB, 5).tolist(), priority=5, **kw)
    order = []
    for step in range(200):
        core.submit(
            rng.integers(0, VOCAB, 5).tolist(), priority=5, **kw
        )  # a steady stream of urgent work
        for e in core.step():
            if e[4]:
                order.append(e[0])
        if low in order:
            break
    assert order[0] == high  # higher priority first
    assert low in order  # but the low-priority job is not starved


def test_tiny_randomized_soak(tiny):
    """Hundreds of jobs: random lengths, shared prefixes, cancels, priorities, stop tokens, a small pool."""
    rng = np.random.default_rng(5)
    prefixes = [rng.integers(0, VOCAB, int(n)).tolist() for n in (16, 40, 70, 33)]
    core = _C.Engine(tiny._core, cache_tokens=1024, page_size=16, max_batch_tokens=96, max_jobs=24)
    plan, cancels, specs = {}, {}, {}
    for i in range(300):
        prompt = rng.integers(0, VOCAB, int(rng.integers(1, 40))).tolist()
        if rng.random() < 0.6:
            prompt = prefixes[int(rng.integers(0, len(prefixes)))] + prompt
        sampler = (
            greedy() if rng.random() < 0.5 else _C.SamplerSettings(temperature=0.8, seed=int(i + 1))
        )
        kw = {
            "max_new_tokens": int(rng.integers(0, 24)),
            "sampler": sampler,
            "priority": int(rng.integers(0, 3)),
            "stop_tokens": [int(rng.integers(0, VOCAB))] if rng.random() < 0.3 else [],
        }
        step = int(rng.integers(0, 150))
        plan.setdefault(step, []).append((i, prompt, kw))
        specs[i] = (prompt, kw)
        if rng.random() < 0.15:
            cancels.setdefault(step + int(rng.integers(0, 30)), []).append(i)
    toks, reasons, n_fin = drive(core, plan, cancels, check=check_pages)
    assert sorted(n_fin) == list(range(300)) and set(n_fin.values()) == {
        1
    }  # none lost, none duplicated
    s = core.stats()
    assert (
        s["jobs_submitted"] == s["jobs_finished"] == 300
        and s["jobs_active"] == s["jobs_queued"] == 0
    )
    assert (
        s["pages_used"] == s["pages_cached"] and s["pages_reserved"] == 0 and s["tokens_reused"] > 0
    )
    core.clear_prefix_cache()
    assert core.stats()["pages_used"] == 0
    for i, (prompt, kw) in specs.items():
        assert len(toks[i]) <= kw["max_new_tokens"]
        if reasons[i] == "length":
            assert len(toks[i]) == kw["max_new_tokens"]
        elif reasons[i] == "stop_token":
            assert toks[i][-1] in kw["stop_tokens"]
        else:
            assert reasons[i] == "cancelled", reasons[i]
    # Jobs that ran to the end give the same tokens as when run alone (shared pages held the right K/V).
    done = [i for i in specs if reasons[i] != "cancelled"]
    for i in rng.choice(done, 12, replace=False):
        prompt, kw = specs[int(i)]
        assert toks[int(i)] == alone(tiny, prompt, **kw)[0], int(i)


def test_submit_errors(tiny):
    core = _C.Engine(tiny._core, cache_tokens=64, page_size=16)
    with pytest.raises(exl2cpp.InvalidArgumentError, match="vocabulary"):
        core.submit([VOCAB], max_new_tokens=1)
    with pytest.raises(exl2cpp.InvalidArgumentError, match="at least one token"):
        core.submit([], max_new_tokens=1)
    with pytest.raises(exl2cpp.OutOfMemoryError, match="cache_tokens"):
        core.submit([1] * 60, max_new_tokens=10)
    with pytest.raises(exl2cpp.InvalidArgumentError, match="max_jobs"):
        _C.Engine(tiny._core, max_batch_tokens=8, max_jobs=9)
    j = core.submit([1, 2], max_new_tokens=0)  # nothing to do: finished at once
    assert core.step() == [(j, -1, 0.0, [], True, "length", "")]


def test_dropped_model_and_engine_are_collected_and_the_thread_ends(tmp_path):
    """A model used through generate (its default engine's thread started) and then dropped, as a notebook does when
    it loads another model over it: the model, the engine and its cache are freed (after a collection: model and
    engine reference each other) and the stepping thread ends; before, the idle thread kept them alive for good."""
    import gc
    import weakref

    make_hf_model("llama", {"max_position_embeddings": 256}, tmp_path, seed=4)
    model = exl2cpp.load(tmp_path)
    assert len(model.generate_ids([1, 2, 3], max_new_tokens=4, temperature=0.0)) == 4
    engine = model.engine()
    thread = engine._thread
    assert thread is not None and thread.is_alive()
    refs = [weakref.ref(model), weakref.ref(engine), weakref.ref(engine._core)]
    del model, engine
    gc.collect()
    assert [r() for r in refs] == [None, None, None]
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_out_of_memory_retries_once_after_a_collection(monkeypatch):
    """retry_after_collect: a MemoryError is retried once when a collection freed something, and raised at once when
    it found nothing (a real shortage is not loaded twice)."""
    import gc

    from exl2cpp.errors import OutOfMemoryError, retry_after_collect

    calls = []

    def make():
        calls.append(1)
        if len(calls) == 1:
            raise OutOfMemoryError("out of memory")
        return "ok"

    monkeypatch.setattr(gc, "collect", lambda: 3)
    assert retry_after_collect(make) == "ok" and len(calls) == 2
    calls.clear()
    monkeypatch.setattr(gc, "collect", lambda: 0)
    with pytest.raises(OutOfMemoryError):
        retry_after_collect(make)
    assert len(calls) == 1


def test_tensor_parallel_load_retries_after_a_collection(tiny, monkeypatch):
    """The tensor-parallel load (CPU ranks here) goes through the same retry as the one-device load: a first
    out-of-memory is retried after a collection that freed something."""
    import gc

    from exl2cpp import model as model_mod
    from exl2cpp.errors import OutOfMemoryError

    real = model_mod._C.Model.load
    calls = []

    class FakeModel:  # _C.Model with a load that runs out of memory once
        @staticmethod
        def load(*args, **kwargs):
            calls.append(kwargs.get("tp_devices"))
            if len(calls) == 1:
                raise OutOfMemoryError("out of memory (test)")
            return real(*args, **kwargs)

    class FakeC:
        def __getattr__(self, name):
            return FakeModel if name == "Model" else getattr(_C, name)

    monkeypatch.setattr(model_mod, "_C", FakeC())
    monkeypatch.setattr(gc, "collect", lambda: 1)
    m = exl2cpp.load(tiny.path, device="cpu", tensor_parallel=2)
    assert len(calls) == 2 and calls[1] is not None and len(calls[1]) == 2
    assert m.generate_ids([1, 2, 3], max_new_tokens=3, temperature=0.0) == tiny.generate_ids(
        [1, 2, 3], max_new_tokens=3, temperature=0.0)


def test_python_engine_ids_and_threads(tiny):
    """The Python layer on a model without a tokenizer: ids in, ids out; submits from several threads."""
    eng = exl2cpp.Engine(tiny, cache_tokens=2048, page_size=16, max_batch_tokens=128)
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, VOCAB, int(rng.integers(1, 50))).tolist() for _ in range(12)]
    jobs = [None] * 12

    def worker(k):
        for i in range(k, 12, 3):
            jobs[i] = eng.submit(prompts[i], max_new_tokens=8, temperature=0.0)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for job, prompt in zip(jobs, prompts):
        assert job.result(timeout=60) == ""
        assert job.token_ids == alone(tiny, prompt, max_new_tokens=8, sampler=greedy())[0]
        assert job.finish_reason == "length"
    eng.close()


# ---- SmolLM2-135M: the acceptance checks ---------------------------------------------------------------
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "Water boils at",
    "1, 2, 3, 4,",
    "The best way to learn",
    "Q: What is 2+2?\nA:",
    "In 1492,",
    "Roses are red,",
    "import numpy as np\n",
    "The quick brown fox",
    "My favourite food is",
    "Dear Sir,",
    "The mitochondria is",
    "Hello, my name is",
    "Translate to French: cat ->",
]


@pytest.mark.slow
def test_smollm2_16_staggered_equals_alone(smol):
    tok = smol.tokenizer
    jobs = []
    for i, text in enumerate(PROMPTS):
        sampler = (
            greedy() if i % 2 == 0 else _C.SamplerSettings(temperature=0.9, top_k=50, seed=7 + i)
        )
        jobs.append((i, tok.encode(text), {"max_new_tokens": 6 + i % 5, "sampler": sampler}))
    plan = {}
    for i, job in enumerate(jobs):
        plan.setdefault(i // 2, []).append(job)  # two new jobs per step while others decode
    core = _C.Engine(smol._core, cache_tokens=4096, page_size=256, max_batch_tokens=2048)
    toks, _, n_fin = drive(core, plan, check=check_pages)
    for i, prompt, kw in jobs:
        assert toks[i] == alone(smol, prompt, page_size=256, **kw)[0], PROMPTS[i]
        assert n_fin[i] == 1


@pytest.mark.slow
def test_smollm2_shared_1000_token_prefix(smol):
    with open("/usr/share/common-licenses/GPL-3", encoding="utf-8") as f:
        text = f.read()
    prefix = smol.tokenizer.encode(text)[:1000]
    a = prefix + smol.tokenizer.encode(" Summary:", add_bos=False)
    b = prefix + smol.tokenizer.encode(" In other words, the", add_bos=False)
    kw = {"max_new_tokens": 6, "sampler": greedy()}
    out = {}
    for share in (False, True):
        core = _C.Engine(
            smol._core, cache_tokens=8192, page_size=256, max_batch_tokens=2048, prefix_cache=share
        )
        seen = []

        def check(c, seen=seen):
            s = c.stats()
            seen.append((s["pages_used"] - s["pages_evictable"], s["pages_shared"]))

        toks, _, _ = drive(core, {0: [("a", a, kw), ("b", b, kw)]}, check=check)
        out[share] = (toks, seen, core.stats())
    (t0, seen0, _s0), (t1, seen1, s1) = out[False], out[True]
    assert t1 == t0
    assert s1["tokens_reused"] == 3 * 256  # 3 full pages of the prefix computed once
    assert max(p for p, _ in seen0) - max(p for p, _ in seen1) == 3
    assert max(sh for _, sh in seen1) == 3 and max(sh for _, sh in seen0) == 0


@pytest.mark.slow
def test_smollm2_python_api(smol):
    eng = smol.engine()
    ref = smol.generate("The capital of France is", max_new_tokens=12, temperature=0.0)
    chunks = list(smol.stream("The capital of France is", max_new_tokens=12, temperature=0.0))
    assert "".join(chunks) == ref and len(chunks) > 1
    assert (
        smol.generate(
            ["The capital of France is", "Once upon a time"], max_new_tokens=12, temperature=0.0
        )[0]
        == ref
    )
    # A stop string in the middle of the greedy text: the result is what came before it.
    stop = ref[len(ref) // 2 : len(ref) // 2 + 3]
    job = eng.submit(
        "The capital of France is", max_new_tokens=12, temperature=0.0, stop=[stop, "never-seen"]
    )
    pieces = list(job)
    assert (
        "".join(pieces) == job.result() == ref[: ref.index(stop)]
        and job.finish_reason == "stop_string"
    )
    # asyncio streaming of several jobs at once.

    async def collect():
        jobs = [
            eng.submit(p, max_new_tokens=8, temperature=0.0, top_logprobs=2) for p in PROMPTS[:3]
        ]

        async def one(j):
            return "".join([c async for c in j])

        return jobs, await asyncio.gather(*(one(j) for j in jobs))

    jobs, texts = asyncio.run(collect())
    for j, t in zip(jobs, texts):
        assert (
            t == j.result()
            and len(j.top_logprobs) == len(j.token_ids)
            and len(j.top_logprobs[0]) == 2
        )
        assert j.logprobs[0] <= 0.0
    assert texts[0] == smol.generate(PROMPTS[0], max_new_tokens=8, temperature=0.0)
    # Cancel mid-way from the consumer; every page comes back.
    job = eng.submit("Once upon a time", max_new_tokens=200, temperature=0.0)
    next(iter(job))
    job.cancel()
    job.wait(30)
    assert job.finish_reason == "cancelled"
    eng.clear_prefix_cache()
    assert eng.stats()["pages_used"] == 0
