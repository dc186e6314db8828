"""Engine admission by what a job needs now, and preemption when the page pool runs short: on the CPU backend, a
pool too small for every job's worst case but large enough for each alone runs them all to the same tokens as
alone (greedy and seeded), counts preemptions, picks victims by priority then recency, ends with no page in use;
the Python stream neither repeats nor loses text; banned strings and stop strings survive preemption; a randomized
soak with cancels, rewinds and priorities loses and duplicates no job; the banned-string rewind cap."""

from __future__ import annotations

import exl2cpp
import numpy as np
import pytest
from exl2cpp import _C

torch = pytest.importorskip("torch")
from test_engine import check_pages, greedy
from test_engine import drive as drive_plan
from test_models_hf import make_hf_model

VOCAB = 211  # the tiny models of test_models_hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_preempt")
    make_hf_model("llama", {"max_position_embeddings": 1024}, folder, seed=11)
    return exl2cpp.load(folder)


def drive(core, plan, max_steps=20000, **kw):
    """test_engine's drive with this file's step bound."""
    return drive_plan(core, plan, max_steps=max_steps, **kw)


def seeded(seed):
    return _C.SamplerSettings(temperature=1.0, top_p=0.95, seed=seed)


def alone(model, prompt, page_size=16, **kw):
    core = _C.Engine(model._core, cache_tokens=4096, page_size=page_size, max_batch_tokens=256)
    toks, reasons, _ = drive(core, {0: [("a", prompt, kw)]})
    return toks["a"], reasons["a"]


def assert_drained(core):
    s = core.stats()
    assert s["jobs_active"] == s["jobs_queued"] == 0 and s["pages_reserved"] == 0
    assert (
        s["pages_used"] == s["pages_cached"] == s["pages_evictable"]
    )  # only unreferenced cached pages remain
    core.clear_prefix_cache()
    assert core.stats()["pages_used"] == 0


# ---- tiny random model -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_tiny_small_pool_all_finish_same_as_alone(tiny, prefix_cache):
    rng = np.random.default_rng(0)
    # 10 pages of 16: every job's worst case (<= 9 pages) fits alone, the six together need ~50.
    core = _C.Engine(
        tiny._core, cache_tokens=160, page_size=16, max_batch_tokens=64, prefix_cache=prefix_cache
    )
    jobs = []
    for i in range(6):
        prompt = rng.integers(0, VOCAB, int(rng.integers(3, 40))).tolist()
        sampler = greedy() if i % 2 == 0 else seeded(50 + i)
        jobs.append((i, prompt, {"max_new_tokens": 143 - len(prompt) - i, "sampler": sampler}))
    admitted = []
    toks, reasons, n_fin = drive(
        core,
        {0: jobs},
        check=check_pages,
        on_step=lambda c, _ids: admitted.append(c.stats()["jobs_active"]),
    )
    assert (
        max(admitted) >= 4
    )  # admitted by what they need now, not by their worst case (that admitted one)
    s = core.stats()
    assert s["preemptions"] > 0 and s["tokens_recomputed"] > 0
    for key, prompt, kw in jobs:
        want, why = alone(tiny, prompt, **kw)
        assert toks[key] == want, key  # nothing repeated, nothing lost, same samples
        assert reasons[key] == why == "length" and n_fin[key] == 1
    assert s["jobs_finished"] == s["jobs_submitted"] == len(jobs)
    assert_drained(core)


def test_tiny_every_job_needs_the_whole_pool(tiny):
    """The extreme: each job's worst case is the whole pool. They still all finish, with the tokens of alone."""
    rng = np.random.default_rng(2)
    core = _C.Engine(tiny._core, cache_tokens=64, page_size=16, max_batch_tokens=32)  # 4 pages
    jobs = []
    for i in range(5):
        prompt = rng.integers(0, VOCAB, int(rng.integers(2, 30))).tolist()
        jobs.append(
            (
                i,
                prompt,
                {"max_new_tokens": 65 - len(prompt), "sampler": seeded(i + 1), "priority": i % 2},
            )
        )
    toks, reasons, n_fin = drive(core, {0: jobs}, check=check_pages)
    assert core.stats()["preemptions"] > 0
    for key, prompt, kw in jobs:
        assert (
            toks[key] == alone(tiny, prompt, **kw)[0]
            and reasons[key] == "length"
            and n_fin[key] == 1
        )
    assert_drained(core)


def test_tiny_worst_case_beyond_pool_still_fails_at_submit(tiny):
    core = _C.Engine(tiny._core, cache_tokens=64, page_size=16)  # 4 pages
    with pytest.raises(exl2cpp.OutOfMemoryError, match="cache_tokens"):
        core.submit([1] * 10, max_new_tokens=56)  # positions 0..64: 5 pages
    core.submit([1] * 10, max_new_tokens=55)  # positions 0..63: exactly the pool
    while not core.idle:
        core.step()
    s = core.stats()
    assert s["jobs_finished"] == 1 and s["tokens_out"] == 55 and s["preemptions"] == 0
    assert_drained(core)


def test_tiny_victim_is_lowest_priority_then_most_recent(tiny):
    rng = np.random.default_rng(1)
    core = _C.Engine(
        tiny._core, cache_tokens=128, page_size=16, max_batch_tokens=64, prefix_cache=False
    )
    spec = {"max_new_tokens": 100, "sampler": greedy()}
    # 8 pages; all four are admitted (one page each) and fill the pool at 2 pages each; the longest prompt
    # (high) crosses into its third page first and needs a victim.
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (12, 11, 10, 9)]
    jobs = [
        ("high", prompts[0], {**spec, "priority": 2}),
        ("mid", prompts[1], {**spec, "priority": 1}),
        ("low_old", prompts[2], spec),
        ("low_new", prompts[3], spec),
    ]
    victims = []
    seen = {"n": 0}

    def on_step(c, ids):
        n = c.stats()["preemptions"]
        if n > seen["n"]:  # who lost its pages in this step (queued again with generated tokens)
            lost = [
                key
                for jid, key in ids.items()
                if not c.job_pages(jid) and len(c.job_tokens(jid)) > 12
            ]
            victims.append((n - seen["n"], sorted(lost)))
            seen["n"] = n

    toks, _, _ = drive(core, {0: jobs}, check=check_pages, on_step=on_step)
    assert victims[0] == (1, ["low_new"])  # equal priority: the most recently admitted goes first
    assert victims[1] == (1, ["low_new", "low_old"])  # then the other low one, before mid
    assert all("high" not in v for _, v in victims)  # the highest priority is never preempted
    for key, prompt, kw in jobs:
        assert toks[key] == alone(tiny, prompt, **kw)[0], key
    assert_drained(core)


def test_tiny_randomized_soak_with_preemption(tiny):
    """Hundreds of jobs, random lengths/priorities/cancels/rewinds, shared prefixes, a pool of 24 pages."""
    rng = np.random.default_rng(7)
    prefixes = [rng.integers(0, VOCAB, n).tolist() for n in (16, 35, 50)]
    core = _C.Engine(tiny._core, cache_tokens=384, page_size=16, max_batch_tokens=96, max_jobs=16)
    plan, cancels, rewinds, specs = {}, {}, set(), {}
    for i in range(300):
        prompt = rng.integers(0, VOCAB, int(rng.integers(1, 30))).tolist()
        if rng.random() < 0.5:
            prompt = prefixes[int(rng.integers(0, len(prefixes)))] + prompt
        sampler = greedy() if rng.random() < 0.5 else seeded(1000 + i)
        kw = {
            "max_new_tokens": int(
                rng.integers(0, 380 - len(prompt) if rng.random() < 0.15 else 40)
            ),
            "sampler": sampler,
            "priority": int(rng.integers(0, 3)),
            "stop_tokens": [int(rng.integers(0, VOCAB))] if rng.random() < 0.2 else [],
            "max_rewinds": int(rng.integers(0, 3)),
        }
        step = int(rng.integers(0, 600))
        plan.setdefault(step, []).append((i, prompt, kw))
        specs[i] = (prompt, kw)
        if rng.random() < 0.15:
            cancels.setdefault(step + int(rng.integers(0, 40)), []).append(i)
        if rng.random() < 0.1:
            rewinds.add(i)
    ids, toks, reasons, n_fin, rewound = {}, {}, {}, {}, set()
    step, last = 0, max(list(plan) + list(cancels))
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
            assert n_fin[key] == 0, f"event after the finish of job {key}"
            if token >= 0:
                toks[key].append(token)
            if finished:
                reasons[key] = reason
                n_fin[key] += 1
            elif key in rewinds and len(toks[key]) >= 3 and rng.random() < 0.3:
                keep = int(rng.integers(0, len(toks[key])))
                if core.rewind(jid, keep, toks[key][keep]):
                    del toks[key][keep:]
                    rewound.add(key)
        check_pages(core)
        step += 1
        assert step < 20000, "engine did not finish"
    assert sorted(n_fin) == list(range(300)) and set(n_fin.values()) == {
        1
    }  # none lost, none duplicated
    s = core.stats()
    assert (
        s["jobs_submitted"] == s["jobs_finished"] == 300
        and s["preemptions"] > 0
        and s["rewinds"] > 0
    )
    assert_drained(core)
    for i, (prompt, kw) in specs.items():
        assert len(toks[i]) <= kw["max_new_tokens"]
        if reasons[i] == "length":
            assert len(toks[i]) == kw["max_new_tokens"]
        elif reasons[i] == "stop_token":
            assert toks[i][-1] in kw["stop_tokens"]
        else:
            assert reasons[i] in ("cancelled", "banned_string_limit"), reasons[i]
            assert reasons[i] == "cancelled" or i in rewinds
    # Jobs that ran to the end untouched give the same tokens as alone, preempted or not.
    done = [i for i in specs if reasons[i] in ("length", "stop_token") and i not in rewound]
    for i in rng.choice(done, 10, replace=False):
        prompt, kw = specs[int(i)]
        kw = {k: v for k, v in kw.items() if k != "priority"}
        assert toks[int(i)] == alone(tiny, prompt, **kw)[0], int(i)


def test_tiny_rewind_cap(tiny):
    core = _C.Engine(tiny._core, cache_tokens=512, page_size=16, max_batch_tokens=64)
    with pytest.raises(exl2cpp.InvalidArgumentError, match="max_rewinds"):
        core.submit([1, 2, 3], max_new_tokens=5, max_rewinds=-2)
    prompt = [5, 6, 7, 8]
    for cap in (0, 3):
        jid = core.submit(prompt, max_new_tokens=50, sampler=greedy(), max_rewinds=cap)
        toks, fin = [], {}
        n_ok = 0
        while jid not in fin:
            for j, token, _lp, _top, finished, reason, _err in core.step():
                if token >= 0:
                    toks.append(token)
                if finished:
                    fin[j] = reason
            if jid not in fin and len(toks) >= 2:
                ok = core.rewind(
                    jid, 1, toks[1]
                )  # the model keeps producing what we ban: ban it again
                if ok:
                    n_ok += 1
                    del toks[1:]
                else:
                    assert n_ok == cap
        assert fin[jid] == "banned_string_limit" and n_ok == cap
        assert core.stats()["jobs_active"] == 0
    # unlimited
    jid = core.submit(prompt, max_new_tokens=50, sampler=greedy(), max_rewinds=-1)
    toks, n_ok = [], 0
    while n_ok < 40:
        for _j, token, _lp, _top, finished, _r, _e in core.step():
            assert not finished
            toks.append(token)
        if len(toks) >= 2:
            assert core.rewind(jid, 1, toks[1])
            n_ok += 1
            del toks[1:]
    core.cancel(jid)
    core.step()
    assert core.stats()["rewinds"] == 3 + 40
    assert_drained(core)


def test_tiny_rewind_of_a_preempted_job(tiny):
    """A job waiting in the queue after a preemption can be rewound (tokens only) and resumes from there."""
    rng = np.random.default_rng(3)
    core = _C.Engine(
        tiny._core, cache_tokens=96, page_size=16, max_batch_tokens=64, prefix_cache=False
    )
    a = core.submit(rng.integers(0, VOCAB, 10).tolist(), max_new_tokens=80, sampler=greedy())
    b = core.submit(rng.integers(0, VOCAB, 10).tolist(), max_new_tokens=80, sampler=greedy())
    toks = {a: [], b: []}
    for _ in range(200):
        for jid, token, *_ in core.step():
            toks[jid].append(token)
        if core.stats()["preemptions"] > 0:
            break
    assert core.stats()["preemptions"] == 1 and not core.job_pages(b) and len(toks[b]) > 3
    keep = len(toks[b]) // 2
    assert core.rewind(b, keep, -1)  # no ban: the same tokens come again
    assert len(core.job_tokens(b)) == 10 + keep
    before = list(toks[b])
    del toks[b][keep:]
    while not core.idle:
        for jid, token, *_ in core.step():
            if token >= 0:
                toks[jid].append(token)
    assert toks[b][: len(before)] == before and len(toks[b]) == 80
    assert_drained(core)


# ---- SmolLM2-135M ------------------------------------------------------------------------------------------
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at"]


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    return exl2cpp.load(smollm2_dir, max_seq_len=2048)


def test_smollm2_small_pool_same_as_alone(smol):
    tok = smol.tokenizer
    jobs = []
    for i, text in enumerate(PROMPTS):
        sampler = (
            greedy() if i % 2 == 0 else _C.SamplerSettings(temperature=0.9, top_k=40, seed=21 + i)
        )
        jobs.append((i, tok.encode(text), {"max_new_tokens": 60, "sampler": sampler}))
    # 8 pages of 16 tokens: each job (<= 70 positions, 5 pages) fits alone; the four need 20.
    core = _C.Engine(smol._core, cache_tokens=128, page_size=16, max_batch_tokens=256)
    toks, reasons, n_fin = drive(core, {0: jobs}, check=check_pages)
    assert core.stats()["preemptions"] > 0
    for key, prompt, kw in jobs:
        want, why = alone(smol, prompt, **kw)
        assert toks[key] == want and reasons[key] == why and n_fin[key] == 1, PROMPTS[key]
    assert_drained(core)


def test_smollm2_python_stream_survives_preemption(smol):
    """Streamed text neither repeats nor loses anything across preemptions; stop/banned strings survive."""
    kws = [
        {"temperature": 0.0},
        {"temperature": 0.8, "top_p": 0.9, "seed": 7},
        {"temperature": 0.0, "banned_strings": ["Paris"]},
        {"temperature": 0.8, "seed": 9, "stop": ["\n\n"]},
    ]
    prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[3]]
    with exl2cpp.Engine(smol, cache_tokens=4096, page_size=16) as big:
        want = [
            big.generate(p, max_new_tokens=56, ignore_eos=True, **kw) for p, kw in zip(prompts, kws)
        ]
    with exl2cpp.Engine(smol, cache_tokens=112, page_size=16, max_batch_tokens=256) as eng:
        jobs = [
            eng.submit(p, max_new_tokens=56, ignore_eos=True, **kw) for p, kw in zip(prompts, kws)
        ]
        pieces = [list(j) for j in jobs]
        s = eng.stats()
        assert s["preemptions"] > 0
        for j, ps, w in zip(jobs, pieces, want):
            assert "".join(ps) == j.result() == w
        assert "Paris" not in want[2] and jobs[2].rewinds >= 1
        eng.clear_prefix_cache()
        assert eng.stats()["pages_used"] == 0
