"""The converter's C++ GPTQ op (_C.gptq_quantize) and Hessian (_C.gptq_hessian): the CPU op against the NumPy
reference (gptq.quantize_numpy) and hand-derivable cases; on a GPU (marker cuda) the CUDA op against the CPU op on
fresh random data of awkward shapes, and a CUDA conversion end to end.

How CPU and CUDA compare (cpp/quant/gptq.h): the GPTQ arithmetic is specified op by op (no FMA contraction, fp64
scale-search sums in one fixed order), so codes, scale nibbles, q_scale_max and dequantized weights are expected
identical; the tests allow at most 1e-4 of the codes to differ (rounding ties of a libm corner) and require the
reconstruction error ||X W_q^T - X W^T|| to agree within 1e-4 relative. Hessians (cuBLAS vs CPU loops, fp32 sums
in different orders) agree within 5e-5 of their largest entry.
"""

from __future__ import annotations

import numpy as np
import pytest
from exl2cpp import _C, InvalidArgumentError
from exl2cpp.convert import gptq
from exl2cpp.convert.measure import hessian
from exl2cpp.convert.qparams import QParams

HAS_CUDA = _C.cuda_compiled() and _C.cuda_device_count() > 0
cuda = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]


def problem(seed: int, n_in: int, n_out: int, tokens: int = 2000):
    """Weight [out, in], calibration x [tokens, in] with correlated inputs of unequal scales, a few dead inputs."""
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 0.05, (n_out, n_in)).astype(np.float32)
    w[:, rng.integers(0, n_in, 3)] *= 8  # outlier columns
    mix = rng.normal(0, 1, (n_in, n_in)) * (0.5 / np.sqrt(n_in)) + np.eye(n_in)
    x = (rng.normal(0, 1, (tokens, n_in)) @ mix * rng.uniform(0.2, 3, n_in)).astype(np.float32)
    x[:, rng.integers(0, n_in, 2)] = 0.0  # dead inputs
    return w, x


def recon_err(x, w, q) -> float:
    return float(np.linalg.norm(x @ q.weight.T - x @ w.T))


SPECS = ("1:4b_32g", "0.1:8b_32g/0.9:4b_64g", "0.05:6b_32g/0.2:3b_64g/0.75:2b_64g", "0.15:8b_128g/0.85:6b_128g",
         "1:5b_32g")  # fmt: skip


def test_cpu_op_matches_numpy_reference():
    # awkward shapes: out not a multiple of 32 or of the 256-column chunk, in not a multiple of the group size
    for seed, (n_in, n_out) in enumerate(((160, 72), (200, 300), (96, 517))):
        w, x = problem(seed, n_in, n_out)
        prep = gptq.prepare(x.T @ x)
        for spec in SPECS:
            groups = QParams.parse(spec).groups(n_in)
            a = gptq.quantize(w, prep, groups, search="absmax")
            b = gptq.quantize_numpy(w, prep, groups)
            # the NumPy reference sums the scale-search error in fp32 (BLAS order): on a near-tie it may pick the
            # neighbouring grid point for a group, which shifts that group's codes; observed: identical everywhere
            assert np.mean(a.codes != b.codes) <= 0.01, (n_in, n_out, spec)
            ea, eb = recon_err(x, w, a), recon_err(x, w, b)
            assert abs(ea - eb) <= 1e-3 * eb, (n_in, n_out, spec, ea, eb)
            gptq.check_packed(a.pack(), a, "t")  # the runtime's dequantization of the packed result == a.weight


def test_cpu_op_hmse_matches_numpy_reference():
    # the Hessian-weighted search (search="hmse") against quantize_numpy's independent version of it
    for seed, (n_in, n_out) in enumerate(((160, 72), (200, 300))):
        w, x = problem(40 + seed, n_in, n_out)
        prep = gptq.prepare(x.T @ x)
        for spec in SPECS[:3]:
            groups = QParams.parse(spec).groups(n_in)
            a = gptq.quantize(w, prep, groups, search="hmse")
            b = gptq.quantize_numpy(w, prep, groups, search="hmse")
            assert np.mean(a.codes != b.codes) <= 0.01, (n_in, n_out, spec)
            assert np.mean(a.scale_nibbles != b.scale_nibbles) <= 0.01, (n_in, n_out, spec)
            ea, eb = recon_err(x, w, a), recon_err(x, w, b)
            assert abs(ea - eb) <= 1e-3 * eb, (n_in, n_out, spec, ea, eb)
            gptq.check_packed(a.pack(), a, "t")


def weighted_rtn_groups(n: int = 60):
    """Random single groups (w [rows, out], U diagonal: no error feedback, row weights 1 / U[r, r]^2, bits) of
    normal, heavy-tailed and column-scaled weights."""
    rng = np.random.default_rng(0)
    for trial in range(n):
        rows, out = int(rng.choice([32, 64, 128])), int(rng.choice([64, 200, 300]))
        bits = int(rng.choice([2, 3, 4, 5, 6, 8]))
        w = rng.standard_normal((rows, out)).astype(np.float32)
        if trial % 3 == 1:
            w = rng.standard_t(3, (rows, out)).astype(np.float32)
        elif trial % 3 == 2:
            w *= rng.lognormal(0, 1, (1, out)).astype(np.float32)
        d = rng.uniform(0.3, 3, rows).astype(np.float32)
        yield w, np.diag(d).astype(np.float32), gptq.row_weights(np.diag(d), 0, rows), bits


def test_hmse_never_has_higher_weighted_error_than_absmax():
    # without feedback the codes are the rounding of each group with its scales, so the search's objective is the
    # result's: sum_r h_r |w_r - deq_r|^2 with the hmse scales must not exceed the absmax scales' on any group
    ratios = []
    for w, u, h, bits in weighted_rtn_groups():
        e = {}
        for search in ("absmax", "hmse"):
            r = _C.gptq_quantize(w, u, [(bits, w.shape[0])], "cpu", search)
            e[search] = float(h.astype(np.float64) @ np.sum(np.square((w - r["weight"]).astype(np.float64)), 1))
        assert e["hmse"] <= e["absmax"], (w.shape, bits, e)
        ratios.append(e["hmse"] / e["absmax"])
    assert np.median(ratios) < 0.9, np.median(ratios)  # and clearly lower as a rule (observed median 0.82)


def test_hmse_codes_are_each_columns_best():
    # no feedback: each column's nibble is the n in 1..16 whose runtime scale gives the least weighted error
    for k, (w, u, h, bits) in enumerate(weighted_rtn_groups(12)):
        r = _C.gptq_quantize(w, u, [(bits, w.shape[0])], "cpu", "hmse")
        qsm = r["q_scale_max"][0]
        want = gptq.refine_codes(w, bits, qsm, h)
        assert np.array_equal(r["scale_nibbles"][0].astype(np.float32) + 1, want), k


def test_hmse_lowers_gptq_reconstruction_error():
    # with feedback (the real use) over the test problems: lower ||X W_q^T - X W^T|| in most cases and on average
    ratios = []
    for seed, (n_in, n_out) in enumerate(((160, 72), (200, 300), (256, 512))):
        w, x = problem(60 + seed, n_in, n_out)
        prep = gptq.prepare(x.T @ x)
        for spec in SPECS:
            groups = QParams.parse(spec).groups(n_in)
            ea = recon_err(x, w, gptq.quantize(w, prep, groups, search="absmax"))
            eh = recon_err(x, w, gptq.quantize(w, prep, groups, search="hmse"))
            ratios.append(eh / ea)
    assert np.mean(ratios) < 1.0 and np.mean(np.array(ratios) < 1.0) >= 0.7, ratios


def test_scale_search_parameter():
    """The search rides in the preparation (prepare(h, damp, search), as convert passes its scale_search): hmse by
    default, absmax on request, quantize's own search= over it; a bad name is refused naming the parameter."""
    w, x = problem(5, 64, 40)
    h = x.T @ x
    assert gptq.SCALE_SEARCH == "hmse" and gptq.prepare(h).search == "hmse"  # the default (docs/quality.md)
    prep = gptq.prepare(h, search="absmax")
    assert prep.search == "absmax"
    a = gptq.quantize(w, prep, [(3, 64)])
    b = gptq.quantize(w, gptq.prepare(h), [(3, 64)], search="absmax")
    assert np.array_equal(a.codes, b.codes) and np.array_equal(a.scale_nibbles, b.scale_nibbles)
    with pytest.raises(InvalidArgumentError, match="--scale-search must be one of absmax, hmse, got 'mse'"):
        gptq.prepare(h, search="mse")
    with pytest.raises(InvalidArgumentError, match="search must be 'absmax' or 'hmse'"):
        _C.gptq_quantize(np.zeros((64, 8), np.float32), np.eye(64, dtype=np.float32), [(4, 64)], "cpu", "mse")


def test_cpu_op_without_feedback_is_round_to_nearest_with_its_scales():
    # U = 1000 * I: no error feedback between rows, so each code is clamp(rint(w / scale) + z) with the runtime
    # scale of its group and column (spec §1.6), which the test recomputes from the returned nibbles/q_scale_max
    rng = np.random.default_rng(3)
    n_in, n_out = 100, 45
    w = rng.normal(0, 0.1, (n_out, n_in)).astype(np.float32)
    prep = gptq.Prepared(np.arange(n_in, dtype=np.int32), np.eye(n_in, dtype=np.float32) * 1e3,
                         np.zeros(n_in, bool))  # fmt: skip
    groups = [(6, 32), (4, 32), (3, 36)]
    q = gptq.quantize(w, prep, groups, search="absmax")
    a = 0
    for g, (bits, rows) in enumerate(groups):
        scale = gptq.runtime_scale(q.scale_nibbles[g].astype(np.float32) + 1, q.q_scale_max[g])
        z = 2 ** (bits - 1)
        want = np.clip(np.rint(w.T[a : a + rows] / scale) + z, 0, 2**bits - 1)
        assert np.array_equal(q.codes[a : a + rows], want.astype(np.uint8)), g
        dq = ((want - z) * scale).astype(np.float16).astype(np.float32)
        assert np.array_equal(q.weight.T[a : a + rows], dq), g
        # the group's largest scale is q_scale_max/256 * 16^2 = q_scale_max when some column has nibble 15
        assert q.scale_nibbles[g].max() == 15
        a += rows


def test_cpu_op_hand_case_one_column():
    # one column, one 2-bit group of 32 rows of +-0.3 / +-0.1, U = I: base = (0.3 + 1e-12) / 1.5 = 0.2 = smax, so
    # qs = 16 (nibble 15) and the scale is fp16(0.2 * p) * 256/256 for the winning p in [0.70, 1.20]; codes are
    # 0..3 and the dequantized values (code - 2) * scale exactly
    vals = np.tile(np.array([0.3, -0.3, 0.1, -0.1], np.float32), 8)[:, None]  # [32, 1] = W^T
    prep = gptq.Prepared(np.arange(32, dtype=np.int32), np.eye(32, dtype=np.float32), np.zeros(32, bool))
    q = gptq.quantize(vals.T, prep, [(2, 32)], search="absmax")
    assert q.scale_nibbles[0, 0] == 15  # the only column has the group's maximum
    scale = gptq.runtime_scale(np.array([16.0], np.float32), q.q_scale_max[0])[0]
    assert set(np.unique(q.codes)) <= {0, 1, 2, 3}
    assert np.array_equal(q.weight[0], ((q.codes[:, 0].astype(np.float32) - 2) * scale).astype(np.float16))
    # p in [0.70, 1.20] of smax = 0.2: the scale lies in [0.14, 0.24] (fp16 rounding aside)
    assert 0.139 <= float(scale) <= 0.241


def test_cpu_op_same_for_any_thread_count(tmp_path):
    # the pool's workers run with EXL2CPP_NUM_THREADS=1, workers=1 with the whole pool: same bits either way
    import os
    import subprocess
    import sys

    w, x = problem(12, 300, 700)
    prep = gptq.prepare(x.T @ x)
    np.savez(tmp_path / "p.npz", w=w, u=prep.u, perm=prep.perm, dead=prep.dead)
    code = (
        "import sys, numpy as np\n"
        "from exl2cpp.convert import gptq\n"
        "d = np.load(sys.argv[1])\n"
        "p = gptq.Prepared(d['perm'], d['u'], d['dead'])\n"
        "q = gptq.quantize(d['w'], p, [(5, 32), (4, 64), (3, 64), (3, 64), (2, 76)])\n"
        "np.savez(sys.argv[2], codes=q.codes, weight=q.weight)\n"
    )
    res = []
    for threads in ("1", "3"):
        env = {**os.environ, "EXL2CPP_NUM_THREADS": threads}
        out = tmp_path / f"o{threads}.npz"
        subprocess.run([sys.executable, "-c", code, str(tmp_path / "p.npz"), str(out)], env=env, check=True)
        res.append(np.load(out))
    here = gptq.quantize(w, prep, [(5, 32), (4, 64), (3, 64), (3, 64), (2, 76)])
    for r in res:
        assert np.array_equal(r["codes"], here.codes) and np.array_equal(r["weight"], here.weight)


def test_cpu_hessian_matches_numpy():
    rng = np.random.default_rng(4)
    x = rng.normal(0, 1, (3, 257, 67)).astype(np.float32)
    x[..., 5] = 0.0
    h = hessian(x, "cpu")
    f = x.reshape(-1, 67).astype(np.float64)
    ref = f.T @ f
    h2 = _C.gptq_hessian(x.reshape(-1, 67), "cpu")
    assert np.max(np.abs(h2 - ref)) <= 1e-5 * np.max(np.abs(ref))
    assert np.max(np.abs(h - ref)) <= 1e-5 * np.max(np.abs(ref))


def test_op_errors():
    w = np.zeros((64, 8), np.float32)
    u = np.eye(64, dtype=np.float32)
    with pytest.raises(InvalidArgumentError, match="sum to 32"):
        _C.gptq_quantize(w, u, [(4, 32)], "cpu")
    with pytest.raises(InvalidArgumentError, match="7 bits"):
        _C.gptq_quantize(w, u, [(7, 64)], "cpu")
    with pytest.raises(InvalidArgumentError, match="u must be"):
        _C.gptq_quantize(w, u[:32], [(4, 64)], "cpu")
    with pytest.raises(InvalidArgumentError, match="beyond fp16"):
        _C.gptq_quantize(np.full((32, 4), 1e6, np.float32), u[:32, :32], [(2, 32)], "cpu")
    if not _C.cuda_compiled():
        with pytest.raises(Exception, match="CUDA"):
            _C.gptq_quantize(w, u, [(4, 64)], "cuda")


# ---- CUDA ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n_in", "n_out", "spec"),
    [
        (200, 300, "0.05:6b_32g/0.2:3b_64g/0.75:2b_64g"),  # last group clipped, out not a multiple of 32
        (576, 1031, "0.1:8b_32g/0.9:4b_64g"),  # several 256-column chunks + a partial one
        (1000, 333, "0.15:8b_128g/0.85:6b_128g"),  # 128-row groups, long trailing updates
        (96, 5003, "0.3:4b_32g/0.7:2b_32g"),  # head-like: wide and short
        (77, 64, "1:5b_32g"),  # in not a multiple of 32
    ],
)
@pytest.mark.parametrize("search", gptq.SCALE_SEARCHES)
@pytest.mark.parametrize("smem", [True, False])
@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_op_matches_cpu(n_in, n_out, spec, search, smem, options):
    options(gptq_rowloop_smem=smem)
    w, x = problem(n_in * 7 + n_out, n_in, n_out, tokens=1500)
    prep = gptq.prepare(x.T @ x)
    groups = QParams.parse(spec).groups(n_in)
    c = gptq.quantize(w, prep, groups, "cpu", search=search)
    g = gptq.quantize(w, prep, groups, "cuda", search=search)
    frac = float(np.mean(c.codes != g.codes))
    assert frac <= 1e-4, f"{frac:.2e} of the codes differ"
    assert np.array_equal(c.scale_nibbles, g.scale_nibbles)
    assert np.array_equal(c.q_scale_max.view(np.uint16), g.q_scale_max.view(np.uint16))
    same = c.codes == g.codes
    assert np.array_equal(c.weight.T[same], g.weight.T[same])
    ec, eg = recon_err(x, w, c), recon_err(x, w, g)
    assert abs(ec - eg) <= 1e-4 * ec, (ec, eg)
    gptq.check_packed(g.pack(), g, "t")


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_op_is_deterministic_and_checks_overflow():
    w, x = problem(9, 300, 700)
    prep = gptq.prepare(x.T @ x)
    groups = QParams.parse("0.1:5b_64g/0.9:3b_64g").groups(300)
    a = gptq.quantize(w, prep, groups, "cuda")
    b = gptq.quantize(w, prep, groups, "cuda")
    assert np.array_equal(a.codes, b.codes) and np.array_equal(a.weight, b.weight)
    with pytest.raises(InvalidArgumentError, match="group 0 .*beyond fp16"):
        _C.gptq_quantize(np.full((32, 4), 1e6, np.float32), np.eye(32, dtype=np.float32), [(2, 32)], "cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_hessian_matches_cpu():
    rng = np.random.default_rng(6)
    x = rng.normal(0, 1, (9000, 131)).astype(np.float32)  # > 8192 tokens: two device chunks
    x[:, 3] = 0.0
    hc = _C.gptq_hessian(x, "cpu")
    hg = _C.gptq_hessian(x, "cuda")
    assert np.max(np.abs(hc - hg)) <= 5e-5 * np.max(np.abs(hc))  # 9000-term fp32 sums in two orders
    assert np.all(hg[3] == 0) and np.all(hg[:, 3] == 0)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_convert_matches_cpu_quality(tmp_path):
    import exl2cpp
    from exl2cpp import convert as conv
    from test_convert import SMALL, add_tokenizer, kl_mean
    from test_models_hf import make_hf_model

    src = tmp_path / "src"
    src.mkdir()
    make_hf_model("llama", SMALL, src)
    add_tokenizer(src)
    ids = np.random.default_rng(11).integers(3, 211, size=200).tolist()
    ref = exl2cpp.load(src).forward(ids)
    kls = {}
    for device in ("cpu", "cuda"):
        out = conv.convert(src, tmp_path / device, bits=4.0, rows=8, length=96, measure_rows=4, progress=False,
                           device=device, workers=1)  # fmt: skip
        info = exl2cpp.load(out).info()
        assert 3.98 <= info["bpw_layers"] <= 4.0 + 1e-9
        kls[device] = kl_mean(ref, exl2cpp.load(out).forward(ids))
    # same algorithm; the model-generated calibration rows (sampled on the device) and the fp32 GEMMs differ, so
    # equal quality within calibration noise
    assert kls["cuda"] <= 1.5 * kls["cpu"] + 1e-4, kls


# -- prepare() ----------------------------------------------------------------------------------------------------


def test_prepare_is_the_cholesky_factor_of_the_damped_inverse():
    # U from one Cholesky + triangular inverse (reversal trick) == ExLlamaV2's chol(inv(H + damp))^T; hand case:
    # H = diag(4, 1) (act order keeps it), damp = 0.12 * 2.5 = 0.3 -> U = diag(1/sqrt(4.3), 1/sqrt(1.3))
    p = gptq.prepare(np.diag([4.0, 1.0]).astype(np.float32))
    assert np.allclose(p.u, np.diag([1 / np.sqrt(4.3), 1 / np.sqrt(1.3)]), rtol=1e-6, atol=0)
    for seed, n in ((1, 77), (2, 300)):  # 300 > the 128-row block of the blocked triangular inverse
        _, x = problem(seed, n, 8, tokens=3 * n)
        h = (x.T @ x).astype(np.float64)
        p = gptq.prepare(h)
        hp = h[np.ix_(p.perm, p.perm)]
        hp[p.dead[p.perm], p.dead[p.perm]] = 1.0
        hd = hp + np.eye(n) * 0.12 * np.mean(np.diag(hp))
        old = np.linalg.cholesky(np.linalg.inv(hd)).T  # the former route
        assert np.max(np.abs(p.u - old)) <= 1e-5 * np.max(np.abs(old))
        assert np.allclose(np.triu(p.u), p.u) and np.all(np.diag(p.u) > 0)
        assert np.max(np.abs(p.u.astype(np.float64).T @ p.u @ hd - np.eye(n))) < 1e-4
