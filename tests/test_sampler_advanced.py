"""Tests of the samplers beyond the plain filters (cpp/engine/sampler.h steps 1-14): DRY, XTC, mirostat v2,
min_tokens, allowed_tokens, dynamic temperature, smoothing, top_a, tfs, temperature_last. Each against a NumPy
reference of the documented algorithm on random logits (exact support, probabilities within 1e-6), hand cases,
validation errors, and through the engine: the seed guarantee with jobs alongside, mirostat's mu across rewinds
and preemption, the device sampling path left to the host for these rows."""

from __future__ import annotations

import math

import numpy as np
import pytest
from exl2cpp import _C
from exl2cpp import options as exl2_options
from exl2cpp.engine import _sampler_settings
from exl2cpp.errors import InvalidArgumentError, UnsupportedError
from test_sampler import rand_logits, settings

DRY_MAX = 256  # SamplerSettings::kDryMaxMatch


# ------------------------------------------------------------------------------------------------
# NumPy reference of steps 1-12
# ------------------------------------------------------------------------------------------------


def ref_processed(
    logits,
    *,
    context=(),
    generated=(),
    allowed_tokens=(),
    banned_tokens=(),
    min_tokens=0,
    stop_tokens=(),
    dry_multiplier=0.0,
    dry_base=1.75,
    dry_allowed_length=2,
    dry_range=0,
    dry_sequence_breakers=(),
):
    l = np.array(logits, dtype=np.float32, copy=True)
    if len(allowed_tokens):
        keep = np.zeros(len(l), bool)
        keep[list(allowed_tokens)] = True
        l[~keep] = -np.inf
    l[list(banned_tokens)] = -np.inf
    if len(generated) < min_tokens:
        l[list(stop_tokens)] = -np.inf
    if dry_multiplier > 0:
        c = list(context)[-dry_range:] if dry_range > 0 else list(context)
        brk = set(dry_sequence_breakers)
        n = len(c)
        best = {}
        if n >= 2 and c[-1] not in brk:
            for i in range(n - 1):
                if c[i] != c[-1] or c[i + 1] in brk:
                    continue
                m = 1
                while (
                    m < DRY_MAX
                    and i - m >= 0
                    and c[i - m] == c[n - 1 - m]
                    and c[n - 1 - m] not in brk
                ):
                    m += 1
                best[c[i + 1]] = max(best.get(c[i + 1], 0), m)
        for t, m in best.items():
            if m >= dry_allowed_length:
                pen = np.float32(dry_multiplier * float(dry_base) ** (m - dry_allowed_length))
                l[t] = np.float32(l[t] - pen)
    return l


def ref_filters(
    l,
    *,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    typical=1.0,
    top_a=0.0,
    tfs=1.0,
    smoothing_factor=0.0,
    smoothing_curve=1.0,
    temperature_last=False,
    min_temp=1.0,
    max_temp=1.0,
    temp_exponent=1.0,
    mirostat_mu=None,
    xtc=False,
    xtc_threshold=0.1,
):
    """Steps 3-12 on processed logits l (f32): the final distribution as float64 [vocab]."""
    p = np.zeros(len(l))
    if temperature == 0:
        p[int(np.argmax(l))] = 1.0
        return p
    f32 = np.float32
    ids = np.nonzero(np.isfinite(l))[0]
    d = (l[ids] - l[ids].max()).astype(f32)
    if smoothing_factor > 0:
        k, c, sf = (
            f32((3 - smoothing_curve) / 2),
            f32((smoothing_curve - 1) / 2),
            f32(smoothing_factor),
        )
        d2 = d * d
        d = -(k * sf * d2) + c * sf * d2 * d
    z = (d / f32(1.0 if temperature_last else temperature)).astype(f32)
    if 0 < top_k < len(ids):
        keep = z >= np.sort(z)[-top_k]
        ids, z = ids[keep], z[keep]
    w = np.exp(z.astype(np.float64) - z.max())

    def prefix(order, mass):  # the shortest prefix of `order` holding `mass` of the weight
        hit = np.cumsum(w[order]) >= mass * w.sum()
        return order[: int(np.argmax(hit)) + 1 if hit.any() else len(order)]

    def likely_order():
        return np.lexsort((ids, -z))  # z desc, ties to the lower id

    def keep_only(mask):
        nonlocal ids, z, w
        ids, z, w = ids[mask], z[mask], w[mask]

    def keep_set(sel):
        mask = np.zeros(len(ids), bool)
        mask[sel] = True
        keep_only(mask)

    if top_p < 1.0 and len(ids) > 1:
        keep_set(prefix(likely_order(), top_p))
    if top_a > 0 and len(ids) > 1:
        keep_only(w >= top_a * w.max() ** 2 / w.sum())
    if min_p > 0:
        keep_only(w >= min_p)
    if tfs < 1.0 and len(ids) >= 3:
        order = likely_order()
        g = np.abs(w[order][:-2] - 2 * w[order][1:-1] + w[order][2:]) / w.sum()
        if g.sum() > 0:
            over = np.cumsum(g / g.sum()) > tfs
            keep_set(order[: 1 + (int(np.argmax(over)) if over.any() else len(g))])
    if typical < 1.0 and len(ids) > 1:
        total = w.sum()
        logp = z.astype(np.float64) - z.max() - np.log(total)
        h = -np.sum(w / total * logp)
        keep_set(prefix(np.lexsort((ids, np.abs(-logp - h))), typical))
    if mirostat_mu is not None and len(ids) > 1:
        mask = w >= 2.0 ** (-mirostat_mu) * w.sum()
        mask[likely_order()[0]] = True
        keep_only(mask)
    dyn = max_temp > min_temp
    if (dyn or (temperature_last and temperature != 1.0)) and len(ids) > 1:
        t = temperature
        if dyn:
            pr = w / w.sum()
            h = -np.sum(pr[pr > 0] * np.log(pr[pr > 0]))
            h_max = math.log(len(ids)) or 1.0
            t = min_temp + (max_temp - min_temp) * (h / h_max) ** temp_exponent
        w = (w / w.max()) ** (1.0 / t)
    if xtc and len(ids) > 1:
        above = (w >= xtc_threshold * w.sum()) & (w > 0)
        if above.sum() >= 2:
            order = [i for i in likely_order() if above[i]]
            above[order[-1]] = False  # the least likely of them stays
            keep_only(~above)
    p[ids] = w / w.sum()
    return p


PROCESS_KEYS = {
    "context",
    "generated",
    "allowed_tokens",
    "banned_tokens",
    "min_tokens",
    "stop_tokens",
    "dry_multiplier",
    "dry_base",
    "dry_allowed_length",
    "dry_range",
    "dry_sequence_breakers",
}


def ref_probs(logits, seed=1234, step=0, **kw):
    """The whole pipeline at step `step` of a fresh job (mu = 2 tau, XTC's coin from the job's RNG)."""
    proc = {k: v for k, v in kw.items() if k in PROCESS_KEYS}
    filt = {k: v for k, v in kw.items() if k not in PROCESS_KEYS}
    if filt.pop("mirostat_mode", 0) == 2:
        filt["mirostat_mu"] = 2 * filt.pop("mirostat_tau", 1.5)
        filt.pop("mirostat_eta", None)
    prob = filt.pop("xtc_probability", 0.0)
    filt["xtc"] = prob > 0 and _C.Sampler.uniform(seed, step, 1) < prob
    return ref_filters(ref_processed(logits, **proc), **filt)


def probs(logits, context=(), generated=(), **kw):
    return _C.sampler_probs(settings(**kw), logits, list(context), list(generated))


def assert_same_distribution(got, want):
    # the exact support (weights below 1e-30 count as zero: f32 exp underflows there, the reference's f64 does not)
    np.testing.assert_array_equal(np.nonzero(got > 1e-30)[0], np.nonzero(want > 1e-30)[0])
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    assert got.sum() == pytest.approx(1.0, abs=1e-9)


CASES = [
    {"top_a": 0.2},
    {"top_a": 0.9, "temperature": 1.5},
    {"tfs": 0.95},
    {"tfs": 0.5, "top_k": 40},
    {"smoothing_factor": 0.3},
    {"smoothing_factor": 0.5, "smoothing_curve": 2.2, "temperature": 0.7, "top_p": 0.9},
    {"smoothing_factor": 1.0, "smoothing_curve": 3.0},
    {"temperature_last": True, "temperature": 1.8, "min_p": 0.05},
    {"temperature_last": True, "temperature": 0.5, "top_p": 0.8, "typical": 0.9},
    {"min_temp": 0.3, "max_temp": 2.0},
    {"min_temp": 0.0, "max_temp": 1.5, "temp_exponent": 2.0, "top_k": 50},
    {"min_temp": 0.5, "max_temp": 1.5, "temperature_last": True, "temperature": 3.0, "min_p": 0.02},
    {"mirostat_mode": 2, "mirostat_tau": 3.0},
    {"mirostat_mode": 2, "mirostat_tau": 1.0, "top_k": 100, "temperature": 1.3},
    {"xtc_probability": 1.0, "xtc_threshold": 0.05, "temperature": 0.5},
    {"xtc_probability": 1.0, "xtc_threshold": 0.0, "top_k": 20},
    {"xtc_probability": 0.5, "xtc_threshold": 0.02, "temperature": 0.4},
    {
        "top_a": 0.1,
        "min_p": 0.01,
        "tfs": 0.9,
        "typical": 0.95,
        "mirostat_mode": 2,
        "mirostat_tau": 4.0,
        "min_temp": 0.5,
        "max_temp": 1.2,
        "xtc_probability": 1.0,
        "xtc_threshold": 0.01,
        "temperature": 0.6,
    },
]


@pytest.mark.parametrize("vocab", [1000, 32003])
@pytest.mark.parametrize("case", CASES, ids=[",".join(c) for c in CASES])
def test_filters_match_reference(vocab, case):
    rng = np.random.default_rng(vocab + len(case))
    for scale in (1.0, 3.0, 8.0):
        l = rand_logits(rng, vocab, scale)
        assert_same_distribution(probs(l, **case), ref_probs(l, **case))


@pytest.mark.parametrize("seed", range(1, 13))
def test_xtc_coin_follows_the_jobs_rng(seed):
    """xtc_probability 0.5: the distribution has XTC applied exactly when uniform(seed, step, 1) < 0.5."""
    l = rand_logits(np.random.default_rng(5), 500, 2.0)
    case = {"xtc_probability": 0.5, "xtc_threshold": 0.01, "temperature": 0.5}
    got = probs(l, seed=seed, **case)
    assert_same_distribution(got, ref_probs(l, seed=seed, **case))
    plain = probs(l, seed=seed, temperature=0.5)
    assert (not np.array_equal(got, plain)) == (_C.Sampler.uniform(seed, 0, 1) < 0.5)


def test_xtc_stream_is_not_the_token_stream():
    u0 = [_C.Sampler.uniform(7, s) for s in range(2000)]
    u1 = [_C.Sampler.uniform(7, s, 1) for s in range(2000)]
    assert abs(np.corrcoef(u0, u1)[0, 1]) < 0.1
    assert abs(np.mean(u1) - 0.5) < 0.03


@pytest.mark.parametrize("window", [0, 5, 40])
def test_dry_matches_reference(window):
    rng = np.random.default_rng(window)
    vocab = 50
    for _ in range(20):
        # a repetitive context: pieces of a short pattern, so matches of many lengths occur
        pattern = rng.integers(0, vocab, 8).tolist()
        context = []
        while len(context) < 60:
            a = int(rng.integers(0, 8))
            context += pattern[a : a + int(rng.integers(1, 8))]
        kw = {
            "dry_multiplier": 0.8,
            "dry_base": 1.6,
            "dry_allowed_length": int(rng.integers(1, 4)),
            "dry_range": window,
            "dry_sequence_breakers": rng.integers(0, vocab, 2).tolist(),
        }
        l = rand_logits(rng, vocab)
        assert_same_distribution(probs(l, context, **kw), ref_probs(l, context=context, **kw))


def test_dry_hand_computed():
    l = np.zeros(10, np.float32)
    ctx = [1, 2, 3, 4, 1, 2, 3]  # "1 2 3" was followed by 4: a match of length 3 before token 4
    got = probs(l, ctx, dry_multiplier=1.0, dry_base=2.0, dry_allowed_length=2)
    want = np.ones(10)
    want[4] = math.exp(-2.0)  # 1 * 2^(3 - 2)
    np.testing.assert_allclose(got, want / want.sum(), atol=1e-7)
    # a breaker inside the match cuts it to length 1 (< allowed_length): no penalty
    got = probs(
        l, ctx, dry_multiplier=1.0, dry_base=2.0, dry_allowed_length=2, dry_sequence_breakers=[2]
    )
    np.testing.assert_allclose(got, np.full(10, 0.1), atol=1e-7)
    # the last token a breaker: no penalty; the range cuts the earlier occurrence off
    assert probs(l, ctx + [5], dry_multiplier=1.0, dry_sequence_breakers=[5])[4] == pytest.approx(
        0.1
    )
    assert probs(l, ctx, dry_multiplier=1.0, dry_range=4)[4] == pytest.approx(0.1)
    # the logprobs are those of the processed logits, DRY included
    s = _C.Sampler(settings(temperature=0.0, dry_multiplier=30.0, dry_base=2.0, top_logprobs=10))
    lg = np.zeros(10, np.float32)
    lg[4] = 5.0
    tok, _lp, top = s.sample(lg, ctx, [])
    assert tok != 4 and dict(top)[4] < -20


def test_xtc_hand_computed():
    p = np.array([0.5, 0.3, 0.15, 0.05])
    l = np.log(p).astype(np.float32)
    np.testing.assert_allclose(
        probs(l, xtc_probability=1.0, xtc_threshold=0.1), [0, 0, 0.75, 0.25], atol=1e-6
    )
    np.testing.assert_allclose(probs(l, xtc_probability=0.0, xtc_threshold=0.1), p, atol=1e-6)
    # only one token at or above the threshold: nothing removed
    np.testing.assert_allclose(probs(l, xtc_probability=1.0, xtc_threshold=0.4), p, atol=1e-6)


def test_top_a_tfs_temperature_last_hand_computed():
    p = np.array([0.5, 0.3, 0.15, 0.05])
    l = np.log(p).astype(np.float32)
    # top_a 1: keep p >= 0.25
    np.testing.assert_allclose(probs(l, top_a=1.0), [0.625, 0.375, 0, 0], atol=1e-6)
    # tfs: second differences |0.5 - 0.6 + 0.15| = 0.05, |0.3 - 0.3 + 0.05| = 0.05, cumulated 0.5, 1.0: keep
    # 1 + (how many cumulated <= tfs); the last is always cut
    np.testing.assert_allclose(probs(l, tfs=0.6), [0.625, 0.375, 0, 0], atol=1e-6)
    np.testing.assert_allclose(probs(l, tfs=0.4), [1, 0, 0, 0], atol=1e-6)
    # min_p 0.7 after T = 2 keeps two tokens; before it (temperature_last) only the first
    lg = np.array([0.0, -0.5, -1.0], np.float32)
    w = np.exp([0.0, -0.25])
    np.testing.assert_allclose(
        probs(lg, temperature=2.0, min_p=0.7), [*(w / w.sum()), 0], atol=1e-6
    )
    np.testing.assert_allclose(
        probs(lg, temperature=2.0, min_p=0.7, temperature_last=True), [1, 0, 0]
    )
    # temperature_last with no filter: the same distribution as softmax(l / T)
    np.testing.assert_allclose(
        probs(lg, temperature=2.0, temperature_last=True), probs(lg, temperature=2.0), atol=1e-7
    )


def test_dynamic_temperature_hand_computed():
    p = np.array([0.7, 0.2, 0.1])
    l = np.log(p).astype(np.float32)
    h = -np.sum(p * np.log(p)) / math.log(3)
    t = 0.5 + (2.0 - 0.5) * h**2
    want = p ** (1 / t)
    np.testing.assert_allclose(
        probs(l, min_temp=0.5, max_temp=2.0, temp_exponent=2.0), want / want.sum(), atol=1e-6
    )
    # min_temp == max_temp: off
    np.testing.assert_allclose(probs(l, min_temp=2.0, max_temp=2.0), p, atol=1e-6)


def test_smoothing_hand_computed():
    l = np.array([2.0, 1.0, 0.0], np.float32)  # d = 0, -1, -2
    want = np.exp([0.0, -0.5, -2.0])  # -(0.5 d^2)
    np.testing.assert_allclose(probs(l, smoothing_factor=0.5), want / want.sum(), atol=1e-6)
    want = np.exp(
        [0.0, -0.5 * 0.5 + 0.5 * 0.5 * -1, -0.5 * 0.5 * 4 + 0.5 * 0.5 * -8]
    )  # curve 2: k = s = 0.5
    np.testing.assert_allclose(
        probs(l, smoothing_factor=0.5, smoothing_curve=2.0), want / want.sum(), atol=1e-6
    )


def test_mirostat_mu_update_and_cut():
    p = np.array([0.6, 0.25, 0.1, 0.04, 0.01])
    l = np.log(p).astype(np.float32)
    tau, eta = 2.0, 0.5
    s = _C.Sampler(settings(mirostat_mode=2, mirostat_tau=tau, mirostat_eta=eta, seed=3))
    assert s.mirostat_mu == pytest.approx(2 * tau)
    mus = [s.mirostat_mu]
    for _ in range(30):
        mu = s.mirostat_mu
        final = s.probs(l)
        cut = p >= 2.0**-mu
        cut[0] = True
        np.testing.assert_allclose(final, np.where(cut, p, 0) / p[cut].sum(), atol=1e-6)
        tok = s.sample(l)[0]
        assert s.mirostat_mu == pytest.approx(mu + eta * (tau + math.log2(final[tok])), abs=1e-5)
        mus.append(s.mirostat_mu)
    assert len(set(np.round(mus, 4))) > 3  # mu moved
    # going back restores the mu of that step; forward is refused (mu unknown there)
    s.step = 7
    assert s.mirostat_mu == pytest.approx(mus[7])
    with pytest.raises(InvalidArgumentError, match="mirostat"):
        s.step = 9
    assert _C.Sampler(settings()).mirostat_mu is None


def test_mirostat_holds_surprise_near_tau():
    rng = np.random.default_rng(2)
    l = rand_logits(rng, 2000, 2.5)
    tau = 3.0
    s = _C.Sampler(settings(mirostat_mode=2, mirostat_tau=tau, mirostat_eta=0.2, seed=11))
    surprises = []  # of each drawn token, under the distribution it was drawn from (the quantity mu steers)
    for _ in range(2000):
        final = s.probs(l)
        tok = s.sample(l)[0]
        surprises.append(-math.log2(final[tok]))
    p = np.exp(l.astype(np.float64) - l.max())
    p /= p.sum()
    plain = -np.sum(p * np.log2(p))  # the mean surprise of plain sampling
    assert plain > tau + 3
    assert abs(np.mean(surprises[200:]) - tau) < 0.3


def test_min_tokens_blocks_stop_tokens_until_reached():
    l = np.array([5.0, 0.0, 0.0, 0.0], np.float32)
    kw = {"min_tokens": 2, "stop_tokens": [0, 3]}
    for gen, blocked in (([], True), ([1], True), ([1, 2], False), ([1, 2, 2], False)):
        p = probs(l, [1] + gen, gen, **kw)
        assert (p[0] == 0 and p[3] == 0) == blocked
        assert_same_distribution(p, ref_probs(l, context=[1] + gen, generated=gen, **kw))
    assert _C.Sampler(settings(temperature=0.0, **kw)).sample(l, [], [])[0] != 0


def test_allowed_tokens():
    rng = np.random.default_rng(4)
    l = rand_logits(rng, 300)
    allowed = [3, 17, 42, 299]
    p = probs(l, allowed_tokens=allowed)
    assert set(np.nonzero(p)[0]) == set(allowed)
    assert_same_distribution(p, ref_probs(l, allowed_tokens=allowed))
    p = probs(l, allowed_tokens=allowed, banned_tokens=[42])  # a ban wins
    assert set(np.nonzero(p)[0]) == {3, 17, 299}
    s = _C.Sampler(settings(temperature=0.0, allowed_tokens=allowed))
    assert s.sample(l)[0] == allowed[int(np.argmax(l[allowed]))]
    with pytest.raises(InvalidArgumentError, match="every token is banned"):
        probs(l, allowed_tokens=[5], banned_tokens=[5])


def test_sampled_tokens_stay_in_support_and_seeds_repeat():
    rng = np.random.default_rng(9)
    l = rand_logits(rng, 400, 2.0)
    case = {
        "xtc_probability": 0.5,
        "xtc_threshold": 0.02,
        "mirostat_mode": 2,
        "mirostat_tau": 3.0,
        "min_temp": 0.5,
        "max_temp": 1.5,
        "dry_multiplier": 1.0,
        "top_a": 0.05,
    }
    runs = []
    for _ in range(2):
        s = _C.Sampler(settings(seed=77, **case))
        ctx, toks = [1, 2, 3], []
        for _ in range(60):
            final = s.probs(l, ctx, toks)  # at this step: its mu and XTC coin
            tok = s.sample(l, ctx, toks)[0]
            assert final[tok] > 0
            ctx.append(tok)
            toks.append(tok)
        runs.append(toks)
    assert runs[0] == runs[1]


# ------------------------------------------------------------------------------------------------
# validation
# ------------------------------------------------------------------------------------------------

BAD = [
    ("min_tokens", -1, "min_tokens"),
    ("smoothing_factor", -0.1, "smoothing_factor"),
    ("smoothing_factor", math.inf, "smoothing_factor"),
    ("smoothing_curve", 0.5, r"smoothing_curve.*\[1, 3\]"),
    ("smoothing_curve", 3.5, "smoothing_curve"),
    ("min_temp", -1.0, "min_temp"),
    ("max_temp", math.nan, "max_temp"),
    ("temp_exponent", -1.0, "temp_exponent"),
    ("top_a", 1.5, r"top_a.*\[0, 1\]"),
    ("tfs", 0.0, r"tfs.*\(0, 1\]"),
    ("mirostat_mode", 3, "mirostat_mode"),
    ("mirostat_tau", -1.0, "mirostat_tau"),
    ("mirostat_eta", math.nan, "mirostat_eta"),
    ("xtc_probability", 1.5, "xtc_probability"),
    ("xtc_threshold", -0.1, "xtc_threshold"),
    ("dry_multiplier", -1.0, "dry_multiplier"),
    ("dry_base", 0.5, r"dry_base.*>= 1"),
    ("dry_allowed_length", 0, "dry_allowed_length"),
    ("dry_range", -1, "dry_range"),
]


@pytest.mark.parametrize("field,value,match", BAD, ids=[f"{f}={v}" for f, v, _ in BAD])
def test_invalid_settings_name_the_field_and_range(field, value, match):
    with pytest.raises(InvalidArgumentError, match=match):
        _C.SamplerSettings(**{field: value})
    with pytest.raises(InvalidArgumentError, match=match):
        _sampler_settings({field: value})


def test_more_validation():
    with pytest.raises(InvalidArgumentError, match="min_temp = 2 is above max_temp = 1"):
        _C.SamplerSettings(min_temp=2.0, max_temp=1.0)
    with pytest.raises(UnsupportedError, match="mirostat v1"):
        _C.SamplerSettings(mirostat_mode=1)
    with pytest.raises(InvalidArgumentError, match="unknown field 'xtc'"):
        _C.SamplerSettings(xtc=1.0)
    with pytest.raises(InvalidArgumentError, match="temperature_last.*wrong type"):
        _C.SamplerSettings(temperature_last="yes")
    for key in ("allowed_tokens", "stop_tokens", "dry_sequence_breakers"):
        with pytest.raises(
            InvalidArgumentError, match=rf"{key}\[1\] = 10, expected a token id in \[0, 10\)"
        ):
            probs(np.zeros(10, np.float32), **{key: [0, 10]})
    # the Python layer: types, the penalty_range alias
    with pytest.raises(InvalidArgumentError, match="temperature_last must be a bool"):
        _sampler_settings({"temperature_last": 1})
    with pytest.raises(InvalidArgumentError, match="dry_allowed_length must be an integer"):
        _sampler_settings({"dry_allowed_length": 2.5})
    with pytest.raises(InvalidArgumentError, match="xtc_threshold must be a number"):
        _sampler_settings({"xtc_threshold": "0.1"})
    with pytest.raises(InvalidArgumentError, match="allowed_tokens must be a list"):
        _sampler_settings({"allowed_tokens": "1,2"})
    with pytest.raises(InvalidArgumentError, match="same setting"):
        _sampler_settings({"penalty_range": 5, "penalty_window": 5})
    assert _sampler_settings({"penalty_range": 64}).penalty_window == 64
    assert _sampler_settings({"dry_sequence_breakers": [3, 4]}).dry_sequence_breakers == [3, 4]
    with pytest.raises(InvalidArgumentError, match="need a tokenizer"):
        _sampler_settings({"dry_sequence_breakers": ["\n"]})


def test_settings_roundtrip_new_attributes():
    kw = {
        "allowed_tokens": [1, 2],
        "min_tokens": 3,
        "stop_tokens": [0],
        "smoothing_factor": 0.25,
        "smoothing_curve": 1.5,
        "temperature_last": True,
        "min_temp": 0.5,
        "max_temp": 1.5,
        "temp_exponent": 2.0,
        "top_a": 0.25,
        "tfs": 0.75,
        "mirostat_mode": 2,
        "mirostat_tau": 4.0,
        "mirostat_eta": 0.125,
        "xtc_probability": 0.5,
        "xtc_threshold": 0.25,
        "dry_multiplier": 0.75,
        "dry_base": 2.0,
        "dry_allowed_length": 3,
        "dry_range": 64,
        "dry_sequence_breakers": [5, 6],
    }
    s = _C.SamplerSettings(**kw)
    for k, v in kw.items():
        assert getattr(s, k) == v, k
    defaults = _C.SamplerSettings()
    assert (defaults.tfs, defaults.top_a, defaults.mirostat_mode, defaults.xtc_probability) == (
        1.0,
        0.0,
        0,
        0.0,
    )
    assert (defaults.dry_multiplier, defaults.dry_base, defaults.dry_allowed_length) == (
        0.0,
        1.75,
        2,
    )


# ------------------------------------------------------------------------------------------------
# through the engine (tiny random model of test_models_hf, CPU backend)
# ------------------------------------------------------------------------------------------------

FANCY = {
    "temperature": 0.9,
    "dry_multiplier": 0.8,
    "dry_allowed_length": 2,
    "xtc_probability": 0.5,
    "xtc_threshold": 0.05,
    "mirostat_mode": 2,
    "mirostat_tau": 3.0,
    "mirostat_eta": 0.5,
    "min_temp": 0.6,
    "max_temp": 1.4,
    "top_a": 0.02,
    "tfs": 0.97,
    "smoothing_factor": 0.2,
    "min_tokens": 5,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("torch")
    import exl2cpp
    from test_models_hf import make_hf_model

    folder = tmp_path_factory.mktemp("tiny_samplers")
    make_hf_model("llama", {"max_position_embeddings": 1024}, folder, seed=5)
    return exl2cpp.load(folder)


def run_core(model, jobs, cache_tokens=4096, page_size=16, on_events=None):
    """Submit `jobs` [(key, prompt, submit kwargs)] at once to a fresh _C.Engine and step it to the end; returns
    tokens per key (on_events(core, ids, events) may act between steps) and the engine."""
    core = _C.Engine(
        model._core, cache_tokens=cache_tokens, page_size=page_size, max_batch_tokens=64
    )
    ids = {core.submit(p, **kw): key for key, p, kw in jobs}
    toks = {key: [] for key, _, _ in jobs}
    for _ in range(5000):
        if core.idle:
            break
        events = core.step()
        for jid, token, _lp, _top, _fin, _reason, error in events:
            assert not error, error
            if token >= 0:
                toks[ids[jid]].append(token)
        if on_events:
            on_events(core, ids, toks, events)
    assert core.idle
    return toks, core


def test_engine_seed_guarantee_with_jobs_alongside(tiny):
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 211, 12).tolist()
    job = (
        "a",
        prompt,
        {"max_new_tokens": 40, "sampler": settings(seed=42, **FANCY), "stop_tokens": [7]},
    )
    alone, _ = run_core(tiny, [job])
    others = [
        (
            f"o{i}",
            rng.integers(0, 211, int(rng.integers(3, 30))).tolist(),
            {
                "max_new_tokens": 30,
                "sampler": settings(seed=100 + i, **(FANCY if i % 2 else {"top_p": 0.9})),
            },
        )
        for i in range(5)
    ]
    together, _ = run_core(tiny, others[:2] + [job] + others[2:])
    assert together["a"] == alone["a"] and len(alone["a"]) >= 5
    # another seed gives another sequence (the test has power)
    other_seed, _ = run_core(
        tiny, [("a", prompt, {**job[2], "sampler": settings(seed=43, **FANCY)})]
    )
    assert other_seed["a"] != alone["a"]


def test_engine_rewind_restores_mirostat_mu(tiny):
    """A rewind without a ban resamples the same tokens: same draws, same logits, and mu as it was at that step."""
    prompt = list(range(20, 32))
    kw = {
        "max_new_tokens": 30,
        "sampler": settings(
            seed=9, temperature=1.2, mirostat_mode=2, mirostat_tau=2.0, mirostat_eta=1.0
        ),
    }
    straight, _ = run_core(tiny, [("a", prompt, kw)])
    rewound = []

    def rewind_once(core, ids, toks, events):
        if not rewound and len(toks["a"]) == 20:
            jid = next(iter(ids))
            assert core.rewind(jid, 6, -1)
            del toks["a"][6:]
            rewound.append(True)

    again, core = run_core(tiny, [("a", prompt, kw)], on_events=rewind_once)
    assert rewound and core.stats()["rewinds"] == 1
    assert again["a"] == straight["a"]


def test_engine_preemption_keeps_mirostat_and_dry_outputs(tiny):
    rng = np.random.default_rng(0)
    jobs = []
    for i in range(6):
        prompt = rng.integers(0, 211, int(rng.integers(3, 40))).tolist()
        jobs.append(
            (
                i,
                prompt,
                {
                    "max_new_tokens": 140 - len(prompt) - i,
                    "sampler": settings(seed=60 + i, **FANCY),
                },
            )
        )
    small, core = run_core(tiny, jobs, cache_tokens=160)
    assert core.stats()["preemptions"] > 0
    for key, prompt, kw in jobs:
        alone, _ = run_core(tiny, [(key, prompt, kw)])
        assert small[key] == alone[key], key


def test_engine_rows_with_new_samplers_stay_on_the_host(tiny, monkeypatch):
    exl2_options.set(device_sample="1")
    prompt = list(range(40, 50))
    plain = [("p", prompt, {"max_new_tokens": 8, "sampler": settings(seed=1, top_p=0.9)})]
    _, core = run_core(tiny, plain)
    assert core.stats()["tokens_device_sampled"] == 8  # the plain row is drawn on the device
    greedy_kw = [("allowed_tokens", [1, 2, 3]), ("min_tokens", 3), ("dry_multiplier", 1.0)]
    for key, value in greedy_kw:
        _, core = run_core(
            tiny,
            [
                (
                    "g",
                    prompt,
                    {
                        "max_new_tokens": 8,
                        "stop_tokens": [0],
                        "sampler": settings(temperature=0.0, **{key: value}),
                    },
                )
            ],
        )
        assert core.stats()["tokens_device_argmax"] == 0, key
    sampled_kw = greedy_kw + [
        ("xtc_probability", 0.5),
        ("mirostat_mode", 2),
        ("min_temp", 0.6),
        ("max_temp", 1.4),
        ("top_a", 0.02),
        ("tfs", 0.97),
        ("smoothing_factor", 0.2),
        ("temperature_last", True),
    ]
    for key, value in sampled_kw:
        _, core = run_core(
            tiny,
            [
                (
                    "s",
                    prompt,
                    {
                        "max_new_tokens": 8,
                        "stop_tokens": [0],
                        "sampler": settings(seed=1, top_p=0.9, **{key: value}),
                    },
                )
            ],
        )
        assert core.stats()["tokens_device_sampled"] == 0, key


def test_engine_min_tokens_holds_back_the_jobs_stop_tokens(tiny):
    prompt = list(range(60, 70))
    first, _ = run_core(
        tiny, [("a", prompt, {"max_new_tokens": 20, "sampler": settings(temperature=0.0)})]
    )
    stop = first["a"][0]  # greedy's first token as a stop token: the job would end at once
    kw = {"max_new_tokens": 20, "stop_tokens": [stop]}
    ended, _ = run_core(tiny, [("a", prompt, {**kw, "sampler": settings(temperature=0.0)})])
    assert ended["a"] == [stop]
    held, _ = run_core(
        tiny, [("a", prompt, {**kw, "sampler": settings(temperature=0.0, min_tokens=4)})]
    )
    assert stop not in held["a"][:4] and len(held["a"]) >= 4


def test_dry_ends_a_repetition_of_greedy(tiny):
    rng = np.random.default_rng(8)
    base = [("a", rng.integers(0, 211, 6).tolist() * 4, {"max_new_tokens": 60})]
    plain, _ = run_core(
        tiny, [(k, p, {**kw, "sampler": settings(temperature=0.0)}) for k, p, kw in base]
    )
    dry, _ = run_core(
        tiny,
        [
            (k, p, {**kw, "sampler": settings(temperature=0.0, dry_multiplier=2.0)})
            for k, p, kw in base
        ],
    )

    def longest_repeat(
        toks,
    ):  # the longest n-gram of the output that also occurs earlier in prompt + output
        seq = base[0][1] + toks
        best = 0
        for i in range(len(base[0][1]), len(seq)):
            for j in range(i):
                m = 0
                while i + m < len(seq) and seq[j + m] == seq[i + m]:
                    m += 1
                best = max(best, m)
        return best

    assert longest_repeat(plain["a"]) >= 10  # the tiny model loops
    assert longest_repeat(dry["a"]) < longest_repeat(plain["a"])
    assert longest_repeat(dry["a"]) <= 4
