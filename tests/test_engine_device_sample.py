"""The engine's device sampling (option device_sample, engine.cpp device_sample_enabled, default off): rows of plain
sampled jobs (temperature > 0 with any of top_k / top_p / min_p; no typical, bias, bans, penalties, top_logprobs,
token mask or rewind ban) are drawn on the logits' device by ops::sample_logprob with the host's uniform draw
u = Sampler.uniform(seed, step), and only (token, logprob) comes back. Checked here: the op on the CPU bit for bit
against the host sampler for many settings and draws (ties, -inf entries, top_k past the vocab, tiny top_p, min_p,
awkward vocab sizes), a few hand-computed draws, the error codes and argument checks; the engine's tokens and
logprobs bit-identical with the switch on and off for steps mixing sampled, greedy, top-logprob, penalized and
masked jobs, the tokens_device_sampled counter, and a bad switch value. The cuda-marked twins compare the CUDA op
with the CPU one and the engine on and off on the GPU (run by the lead: pytest -m cuda on this file)."""

from __future__ import annotations

import exl2cpp
import numpy as np
import pytest
from exl2cpp import _C
from test_engine_device_argmax import (  # noqa: F401  (smol_cuda is a fixture)
    NONDETERMINISTIC,
    has_cuda,
    mixed_jobs,
    prompts,
    run_with_env,
    smol_cuda,
)

SWITCH = "device_sample"  # the option (exl2cpp.options)

# (temperature, top_k, top_p, min_p): every filter alone and together, the edges of each
SETTINGS = [
    (1.0, 0, 1.0, 0.0),
    (0.7, 0, 1.0, 0.0),
    (1.0, 1, 1.0, 0.0),
    (1.3, 5, 1.0, 0.0),
    (0.8, 50, 1.0, 0.0),
    (1.0, 10**6, 1.0, 0.0),  # top_k larger than the vocab: off
    (1.0, 0, 0.9, 0.0),
    (0.6, 0, 0.5, 0.0),
    (1.0, 0, 1e-6, 0.0),  # tiny top_p: the most likely token (ties: the lowest id)
    (2.0, 0, 0.999, 0.0),
    (1.0, 0, 1.0, 0.05),
    (0.9, 0, 1.0, 0.5),
    (1.0, 40, 0.95, 0.05),
    (0.5, 3, 0.7, 0.2),
    (1e-3, 0, 0.9, 0.0),  # tiny temperature: z spans a huge range, exp underflows to 0 for most ids
    (0.0, 7, 0.5, 0.1),  # greedy: the filters are ignored
]


def rows_for(rng, vocab, n):
    """Random rows with the awkward parts: exact ties at the top and inside the tail, -inf entries, a row half
    -inf, a flat row, a row with a huge finite maximum."""
    x = (rng.standard_normal((n, vocab)) * rng.uniform(0.5, 6.0, (n, 1))).astype(np.float32)
    if vocab > 8:
        x[0, [vocab // 3, vocab - 1, 1]] = x[0].max() + 0.5  # a three-way tie at the top
        x[1 % n, rng.integers(0, vocab, vocab // 4)] = -np.inf
        x[2 % n, : vocab // 2] = -np.inf
        x[3 % n, :] = 1.25  # all equal
        x[4 % n, vocab - 2] = 1e30
        q = np.round(x[5 % n] * 2) / 2  # many ties everywhere (values on a 0.5 grid)
        x[5 % n] = q
    return x


def host_sample(row, t, k, p, mp, seed, step):
    s = _C.Sampler(_C.SamplerSettings(temperature=t, top_k=k, top_p=p, min_p=mp, seed=seed))
    s.step = step
    tok, lp, top = s.sample(row, [], [])
    assert top == [] and s.step == step + 1
    return tok, lp


def op(x, params, device="cpu"):
    """params: [(temperature, top_k, top_p, min_p, u)] per row."""
    t, k, p, mp, u = (list(c) for c in zip(*params)) if params else ([], [], [], [], [])
    return _C.op_sample_logprob(x, t, k, p, mp, u, device=device)


def case_params(rng, n_rows, n_draws):
    """(row, (temperature, top_k, top_p, min_p), seed, step) for every row x setting x a few draws."""
    out = []
    for r in range(n_rows):
        for s in SETTINGS:
            for _ in range(n_draws):
                out.append((r, s, int(rng.integers(1, 2**63)), int(rng.integers(0, 10**6))))
    return out


@pytest.mark.parametrize("vocab", [1, 7, 64, 1031, 49152, 49159])
def test_op_matches_host_sampler_bit_for_bit(vocab):
    rng = np.random.default_rng(vocab)
    x = rows_for(rng, vocab, 6)
    cases = case_params(rng, x.shape[0], 3 if vocab < 40000 else 1)
    rows = np.stack([x[r] for r, _, _, _ in cases])
    params = [(*s, _C.Sampler.uniform(seed, step)) for _, s, seed, step in cases]
    idx, lp = op(rows, params)
    seen = set()
    for i, (r, (t, k, p, mp), seed, step) in enumerate(cases):
        tok, slp = host_sample(x[r], t, k, p, mp, seed, step)
        assert idx[i] == tok, (vocab, r, (t, k, p, mp), seed, step, idx[i], tok)
        assert np.float32(slp).tobytes() == np.float32(lp[i]).tobytes(), (
            r,
            (t, k, p, mp),
            slp,
            lp[i],
        )
        seen.add((r, tok))
    if vocab >= 64:
        assert len(seen) > 3 * x.shape[0]  # the draws do spread over several tokens per row


def test_op_draws_follow_the_host_distribution():
    """Many draws of one row: the op's tokens are the host's (same u), all inside the host's support, and their
    frequencies follow sampler_probs (a wrong inversion order would still pass the support check, not this)."""
    rng = np.random.default_rng(7)
    row = (rng.standard_normal(300) * 2).astype(np.float32)
    settings = _C.SamplerSettings(temperature=0.9, top_k=40, top_p=0.8, min_p=0.02, seed=1)
    probs = _C.sampler_probs(settings, row)
    n = 4000
    us = [_C.Sampler.uniform(99, s) for s in range(n)]
    idx, _ = op(np.repeat(row[None], n, 0), [(0.9, 40, 0.8, 0.02, u) for u in us])
    assert np.all(probs[idx] > 0)
    freq = np.bincount(idx, minlength=300) / n
    assert np.abs(freq - probs).max() < 4 * np.sqrt(probs.max() / n)
    # the inversion runs in id order: sorted u give non-decreasing ids
    order = np.argsort(us)
    assert np.all(np.diff(idx[order]) >= 0)


def test_op_hand_cases():
    # probabilities 1/6, 2/6, 3/6 at temperature 1
    row = np.log(np.array([1.0, 2.0, 3.0], np.float32)).astype(np.float32)
    cases = [
        ((1.0, 0, 1.0, 0.0, 0.1), 0),  # cdf 1/6, 1/2, 1
        ((1.0, 0, 1.0, 0.0, 0.2), 1),
        ((1.0, 0, 1.0, 0.0, 0.6), 2),
        ((1.0, 2, 1.0, 0.0, 0.3), 1),  # top-2: 2/5, 3/5
        ((1.0, 2, 1.0, 0.0, 0.5), 2),
        ((1.0, 0, 0.45, 0.0, 0.01), 2),  # top-p 0.45: {2}
        ((1.0, 0, 0.6, 0.0, 0.3), 1),  # top-p 0.6: {2, 1}, in id order 1 then 2
        ((1.0, 0, 1.0, 0.5, 0.39), 1),  # min-p 0.5: p >= 0.5 * 1/2: {1, 2}, then 2/5, 3/5
        ((1.0, 0, 1.0, 0.5, 0.41), 2),
        ((0.0, 0, 1.0, 0.0, 0.99), 2),  # greedy
    ]
    x = np.repeat(row[None], len(cases), 0)
    idx, lp = op(x, [c for c, _ in cases])
    assert idx.tolist() == [t for _, t in cases]
    np.testing.assert_allclose(lp, np.log(np.array([1, 2, 3]) / 6.0)[idx], atol=1e-6)
    # top-k keeps the boundary ties: top_k 1 on a tie at the top draws from both
    tie = np.array([[0.0, 2.0, -1.0, 2.0]], np.float32)
    got = {int(op(tie, [(1.0, 1, 1.0, 0.0, u)])[0][0]) for u in (0.1, 0.9)}
    assert got == {1, 3}


def test_op_special_rows_use_the_sampler_codes():
    x = np.zeros((3, 9), np.float32)
    x[0, 4] = np.nan
    x[0, 8] = np.inf
    x[1, 2] = np.inf
    x[2, :] = -np.inf
    idx, lp = op(x, [(0.8, 3, 0.9, 0.1, 0.5)] * 3)
    assert idx.tolist() == [-2 - 4, -2 - 2, -1]
    assert np.isnan(lp[0]) and lp[1] == np.inf and lp[2] == -np.inf
    for r in range(3):
        with pytest.raises(exl2cpp.InvalidArgumentError):
            host_sample(x[r], 0.8, 3, 0.9, 0.1, 1, 0)


def test_op_checks_its_arguments():
    x = np.zeros((2, 5), np.float32)
    good = (1.0, 0, 1.0, 0.0, 0.5)
    for bad in [
        (1.0, 0, 1.0, 0.0, 1.0),
        (1.0, 0, 0.0, 0.0, 0.5),
        (1.0, 0, 1.0, 1.0, 0.5),
        (-1.0, 0, 1.0, 0.0, 0.5),
        (1.0, -1, 1.0, 0.0, 0.5),
        (np.inf, 0, 1.0, 0.0, 0.5),
    ]:
        with pytest.raises(exl2cpp.InvalidArgumentError, match="sample_logprob"):
            op(x, [good, bad])
    with pytest.raises(exl2cpp.InvalidArgumentError, match="one entry per row"):
        op(x, [good])
    idx, lp = op(np.zeros((0, 5), np.float32), [])
    assert idx.shape == (0,) and lp.shape == (0,)


# ---------------------------------------------------------------------------------------------------------------
# the engine
# ---------------------------------------------------------------------------------------------------------------

SAMPLED = [  # plain sampled settings (drawn on the device when the switch is on)
    {"temperature": 0.8, "top_p": 0.9, "seed": 11},
    {"temperature": 1.0, "top_k": 1, "seed": 12},
    {"temperature": 1.1, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "seed": 13},
    {"temperature": 0.6, "min_p": 0.1, "seed": 14},
    {"temperature": 1.0, "seed": 15},
]
NOT_PLAIN = [  # sampled, but something else reads the logits on the host
    {"temperature": 0.8, "top_p": 0.9, "top_logprobs": 2, "seed": 21},
    {"temperature": 0.8, "repetition_penalty": 1.2, "seed": 22},
    {"temperature": 0.8, "typical": 0.9, "seed": 23},
    {"temperature": 0.8, "logit_bias": [(5, 1.0)], "seed": 24},
    {"temperature": 0.8, "presence_penalty": 0.3, "seed": 25},
]


def run(
    model, jobs, monkeypatch, on: bool, argmax: bool = True, max_new_tokens=8, max_batch_tokens=256
):
    """jobs: [(prompt, settings dict, mask or None)] submitted at once, option device_sample on or off (and the
    device argmax). Returns ({index: [(token, logprob bytes, top)]}, stats)."""
    env = {SWITCH: "1" if on else "0", "device_argmax": "1" if argmax else "0"}
    return run_with_env(model, jobs, monkeypatch, env, max_new_tokens, max_batch_tokens)


def plain_sampled(job):
    s = job[1]
    return (
        job[2] is None
        and s["temperature"] > 0
        and set(s) <= {"temperature", "top_k", "top_p", "min_p", "seed"}
    )


def plain_greedy(job):
    return job[2] is None and job[1] == {"temperature": 0.0}


def sampled_jobs(rng, vocab, n):
    """Plain sampled, not-plain sampled and the device-argmax file's mixed jobs (greedy, masked, penalized, ...)."""
    jobs = mixed_jobs(rng, vocab, n)
    pool = SAMPLED + NOT_PLAIN
    for i in range(0, n, 2):  # every other job sampled
        jobs[i] = (jobs[i][0], pool[(i // 2) % len(pool)], None)
    return jobs


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    return exl2cpp.load(smollm2_dir, max_seq_len=1024)


def check_on_off(model, jobs, monkeypatch, argmax=True, **kw):
    on, s_on = run(model, jobs, monkeypatch, True, argmax, **kw)
    off, s_off = run(model, jobs, monkeypatch, False, argmax, **kw)
    assert on == off  # tokens, logprob bits and top alternatives
    n = kw.get("max_new_tokens", 8)
    assert all(len(v) == n for v in on.values())
    assert s_off["tokens_device_sampled"] == 0
    assert s_on["tokens_device_sampled"] == n * sum(plain_sampled(j) for j in jobs)
    greedy = n * sum(plain_greedy(j) for j in jobs) if argmax else 0
    assert s_on["tokens_device_argmax"] == greedy and s_off["tokens_device_argmax"] == greedy
    return on


def test_sampled_jobs_same_with_switch_on_and_off(smol, monkeypatch):
    rng = np.random.default_rng(1)
    vocab = smol.vocab_size
    ps = prompts(rng, 2, vocab)
    # the same prompts under every plain setting and several seeds: the seeds must give different samples
    jobs = [
        (p, dict(s, seed=s["seed"] + 100 * k), None) for p in ps for s in SAMPLED for k in range(3)
    ]
    out = check_on_off(smol, jobs, monkeypatch, max_new_tokens=10)
    assert len({tuple(t for t, _, _ in v) for v in out.values()}) > len(jobs) // 2


def test_mixed_step_same_with_switch_on_and_off(smol, monkeypatch):
    rng = np.random.default_rng(2)
    jobs = sampled_jobs(rng, smol.vocab_size, 24)
    assert sum(plain_sampled(j) for j in jobs) >= 5 and sum(plain_greedy(j) for j in jobs) >= 1
    check_on_off(smol, jobs, monkeypatch)
    check_on_off(smol, jobs, monkeypatch, argmax=False)  # the two switches are independent


def test_many_logit_rows_and_prefill_chunks(smol, monkeypatch):
    """72 jobs whose first tokens come from one step of 72 logit rows (more than a CUDA workspace keeps), and
    long prompts in chunks of 48 rows (prefill-only steps between)."""
    rng = np.random.default_rng(3)
    vocab = smol.vocab_size
    many = [
        (p, SAMPLED[i % len(SAMPLED)], None) for i, p in enumerate(prompts(rng, 72, vocab, 1, 4))
    ]
    many[5] = (many[5][0], {"temperature": 0.0}, None)
    check_on_off(smol, many, monkeypatch, max_new_tokens=2, max_batch_tokens=512)
    long_jobs = [(p, SAMPLED[i], None) for i, p in enumerate(prompts(rng, 3, vocab, 100, 160))]
    check_on_off(smol, long_jobs, monkeypatch, max_new_tokens=4, max_batch_tokens=48)


def test_switch_rejects_bad_values(smol):
    with pytest.raises(exl2cpp.InvalidArgumentError, match=f"{SWITCH} must be true or false"):
        exl2cpp.options.set({SWITCH: "maybe"})
    exl2cpp.options.set({SWITCH: True})
    eng = _C.Engine(smol._core, cache_tokens=256, page_size=16)
    eng.submit([1, 2, 3], max_new_tokens=1, stop_tokens=[], sampler=_C.SamplerSettings(**SAMPLED[0]))
    events = eng.step()
    assert any(e[4] for e in events) and all(not e[6] for e in events)
    assert eng.stats()["tokens_device_sampled"] == 1

def test_default_is_off(smol, monkeypatch):
    exl2cpp.options.set({SWITCH: exl2cpp.options.defaults()[SWITCH]})
    eng = _C.Engine(smol._core, cache_tokens=256, page_size=16)
    eng.submit(
        [1, 2, 3], max_new_tokens=2, stop_tokens=[], sampler=_C.SamplerSettings(**SAMPLED[0])
    )
    while not eng.idle:
        eng.step()
    assert eng.stats()["tokens_device_sampled"] == 0 and eng.stats()["tokens_out"] == 2


# ---------------------------------------------------------------------------------------------------------------
# the same on the GPU (run by the lead on the device: pytest -m cuda tests/test_engine_device_sample.py)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [1, 7, 1031, 49152, 49159, 128256, 151936])
@pytest.mark.cuda
@pytest.mark.skipif(not has_cuda, reason="no CUDA device")
def test_cuda_op_matches_cpu(vocab):
    """The CUDA op against the CPU one: >= 99% identical tokens, every token inside the CPU's support (the host
    sampler's final distribution), logprobs within 1e-4 of the CPU's for the same token, the same error codes."""
    rng = np.random.default_rng(vocab)
    x = rows_for(rng, vocab, 6)
    cases = case_params(rng, x.shape[0], 4 if vocab < 100000 else 2)
    rows = np.stack([x[r] for r, _, _, _ in cases])
    params = [(*s, _C.Sampler.uniform(seed, step)) for _, s, seed, step in cases]
    ci, cl = op(rows, params, "cpu")
    gi, gl = op(rows, params, "cuda:0")
    same = gi == ci
    assert same.mean() >= 0.99, (same.mean(), np.flatnonzero(~same)[:10])
    np.testing.assert_allclose(gl[same], cl[same], atol=1e-4, rtol=0)
    for i in np.flatnonzero(~same):
        r, (t, k, p, mp), _, _ = cases[i]
        probs = _C.sampler_probs(
            _C.SamplerSettings(temperature=t, top_k=k, top_p=p, min_p=mp), x[r]
        )
        assert probs[gi[i]] > 0 or (p < 1 and gi[i] >= 0), (
            i,
            gi[i],
            ci[i],
        )  # a top-p boundary element at worst
    bad = np.zeros((3, max(vocab, 3)), np.float32)[:, :vocab]
    bad[0, vocab // 2] = np.nan
    bad[1, vocab - 1] = np.inf
    bad[2, :] = -np.inf
    ci, _ = op(bad, [(0.8, 3, 0.9, 0.1, 0.5)] * 3, "cpu")
    gi, _ = op(bad, [(0.8, 3, 0.9, 0.1, 0.5)] * 3, "cuda:0")
    np.testing.assert_array_equal(gi, ci)


def check_on_off_cuda(model, jobs, monkeypatch, **kw):
    """GPU: the same batches give the same logits with the switch on and off (q40 under the cluster reduction),
    so the same draws but where one lands within rounding of a boundary (ops.h sample_logprob): nearly every job
    identical, the logprobs of identical tokens within 1e-4."""
    on, s_on = run(model, jobs, monkeypatch, True, **kw)
    off, s_off = run(model, jobs, monkeypatch, False, **kw)
    n = kw.get("max_new_tokens", 8)
    assert s_on["tokens_device_sampled"] == n * sum(plain_sampled(j) for j in jobs)
    assert s_off["tokens_device_sampled"] == 0
    identical = 0
    for i in on:
        t_on, t_off = [t for t, _, _ in on[i]], [t for t, _, _ in off[i]]
        k = next(
            (j for j in range(n) if t_on[j] != t_off[j]), n
        )  # compare up to the first differing draw
        identical += k == n
        lp_on = np.frombuffer(b"".join(b for _, b, _ in on[i][:k]), np.float32)
        lp_off = np.frombuffer(b"".join(b for _, b, _ in off[i][:k]), np.float32)
        tol = 4e-2 if id(model) in NONDETERMINISTIC else 1e-4
        np.testing.assert_allclose(lp_on, lp_off, atol=tol, rtol=1e-5)
    assert identical >= 0.9 * len(on), (identical, len(on))


@pytest.mark.cuda
def test_cuda_engine_sampled_and_mixed_same_with_switch_on_and_off(smol_cuda, monkeypatch):  # noqa: F811
    rng = np.random.default_rng(5)
    vocab = smol_cuda.vocab_size
    jobs = [(p, s, None) for p in prompts(rng, 2, vocab) for s in SAMPLED]
    check_on_off_cuda(
        smol_cuda, jobs, monkeypatch, max_new_tokens=12
    )  # decode steps: CUDA graph buckets
    check_on_off_cuda(smol_cuda, sampled_jobs(rng, vocab, 24), monkeypatch)
    many = [
        (p, SAMPLED[i % len(SAMPLED)], None) for i, p in enumerate(prompts(rng, 72, vocab, 1, 4))
    ]
    check_on_off_cuda(
        smol_cuda, many, monkeypatch, max_new_tokens=2, max_batch_tokens=512
    )  # per-call buffers
