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
            a = gptq.quantize(w, prep, groups)
            b = gptq.quantize_numpy(w, prep, groups)
            # the NumPy reference sums the scale-search error in fp32 (BLAS order): on a near-tie it may pick the
            # neighbouring grid point for a group, which shifts that group's codes; observed: identical everywhere
            assert np.mean(a.codes != b.codes) <= 0.01, (n_in, n_out, spec)
            ea, eb = recon_err(x, w, a), recon_err(x, w, b)
            assert abs(ea - eb) <= 1e-3 * eb, (n_in, n_out, spec, ea, eb)
            gptq.check_packed(a.pack(), a, "t")  # the runtime's dequantization of the packed result == a.weight


def test_cpu_op_without_feedback_is_round_to_nearest_with_its_scales():
    # U = 1000 * I: no error feedback between rows, so each code is clamp(rint(w / scale) + z) with the runtime
    # scale of its group and column (spec §1.6), which the test recomputes from the returned nibbles/q_scale_max
    rng = np.random.default_rng(3)
    n_in, n_out = 100, 45
    w = rng.normal(0, 0.1, (n_out, n_in)).astype(np.float32)
    prep = gptq.Prepared(np.arange(n_in, dtype=np.int32), np.eye(n_in, dtype=np.float32) * 1e3,
                         np.zeros(n_in, bool))  # fmt: skip
    groups = [(6, 32), (4, 32), (3, 36)]
    q = gptq.quantize(w, prep, groups)
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
    q = gptq.quantize(vals.T, prep, [(2, 32)])
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


@pytest.mark.parametrize("kind", ["llama_bias", "qwen3"])
def test_attention_through_runtime_op_matches_numpy(kind, tmp_path):
    # the CUDA conversion runs the attention core through _C.op_attention_paged (one page per calibration row);
    # its CPU implementation must give the NumPy forward's result (qk-norm, biases, GQA), rel. error < 1e-5
    pytest.importorskip("torch")
    from exl2cpp.convert.layers import SourceModel
    from test_models_hf import make_hf_model

    make_hf_model(kind, {}, tmp_path)
    src = SourceModel(tmp_path)
    w = src.layer(1)
    x = np.random.default_rng(8).normal(0, 1, (3, 45, src.hidden)).astype(np.float32)
    xn = src.norm(x, w["attn_norm"])
    ref = src.attention(xn, w, w["q_proj"], w["k_proj"], w["v_proj"])
    src.attn_op = True
    got = src.attention(xn, w, w["q_proj"], w["k_proj"], w["v_proj"])
    assert np.max(np.abs(got - ref)) <= 1e-5 * np.max(np.abs(ref))


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
@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_op_matches_cpu(n_in, n_out, spec):
    w, x = problem(n_in * 7 + n_out, n_in, n_out, tokens=1500)
    prep = gptq.prepare(x.T @ x)
    groups = QParams.parse(spec).groups(n_in)
    c = gptq.quantize(w, prep, groups, "cpu")
    g = gptq.quantize(w, prep, groups, "cuda")
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
@pytest.mark.parametrize("kind", ["llama_bias", "qwen3"])
def test_cuda_layer_forward_matches_numpy(kind, tmp_path):
    # a CUDA conversion's layer forward (cuBLAS fp32 projections, the runtime's fp32 attention) vs NumPy's
    from exl2cpp.convert.layers import SourceModel
    from test_models_hf import make_hf_model

    make_hf_model(kind, {}, tmp_path)
    cpu, gpu = SourceModel(tmp_path), SourceModel(tmp_path, "cuda")
    w = cpu.layer(1)
    x = np.random.default_rng(8).normal(0, 1, (3, 300, cpu.hidden)).astype(np.float32)
    ref = cpu.mlp_block(cpu.attn_block(x, w), w)
    got = gpu.mlp_block(gpu.attn_block(x, w), w)
    assert np.linalg.norm(got - ref) <= 3e-5 * np.linalg.norm(ref)  # fp32 GEMMs summed in other orders


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


# -- the device-resident layer evaluator (_C.GptqLayerEval) and prepare() ---------------------------------------


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


def _layer_eval_case(kind, tmp_path, device):
    pytest.importorskip("torch")
    from exl2cpp.convert.layers import SourceModel
    from test_models_hf import make_hf_model

    make_hf_model(kind, {}, tmp_path)
    src = SourceModel(tmp_path)
    w = src.layer(1)
    x = np.random.default_rng(8).normal(0, 1, (3, 45, src.hidden)).astype(np.float32)
    cos, sin = src.rope(45)
    ev = _C.GptqLayerEval(x.reshape(-1, src.hidden), np.concatenate([cos, sin], 1), 3, 45, src.n_heads, src.n_kv,
                          src.head_dim, src.eps, device)  # fmt: skip
    return src, w, x, ev


@pytest.mark.parametrize("kind", ["llama_bias", "qwen3"])
def test_layer_eval_matches_numpy_forward(kind, tmp_path):
    # each step of the evaluator (norm, q/k-norm + RoPE + GQA attention with biases, o_proj + residual, SiLU MLP,
    # Hessians, the fp64 row errors) against SourceModel's NumPy forward on the CPU backend
    src, w, x, ev = _layer_eval_case(kind, tmp_path, "cpu")
    f = lambda a: a.reshape(-1, a.shape[-1])
    close = lambda got, ref, tol: np.max(np.abs(got - ref)) <= tol * np.max(np.abs(ref))
    ev.norm(w["attn_norm"])
    xn = src.norm(x, w["attn_norm"])
    assert close(ev.hessian(False), f(xn).T @ f(xn), 1e-5)
    ev.attention(w["q_proj"], w["k_proj"], w["v_proj"], w.get("q_proj.bias"), w.get("k_proj.bias"),
                 w.get("v_proj.bias"), w.get("q_norm"), w.get("k_norm"))  # fmt: skip
    a = src.attention(xn, w, w["q_proj"], w["k_proj"], w["v_proj"])
    assert close(ev.mid(), f(a), 1e-5)
    assert close(ev.hessian(True), f(a).T @ f(a), 1e-5)
    ev.out(w["o_proj"], w.get("o_proj.bias"))
    ev.set_ref()
    assert ev.rel_err() == 0.0
    ref = x + src.linear(a, w["o_proj"], w.get("o_proj.bias"))
    wo = w["o_proj"] * np.float32(1.01)  # a perturbed candidate: error vs the NumPy formula
    ev.out(wo, w.get("o_proj.bias"))
    y = x + src.linear(a, wo, w.get("o_proj.bias"))
    from exl2cpp.convert.measure import rel_err

    assert ev.rel_err() == pytest.approx(rel_err(y, ref), rel=1e-4)
    ev.commit(True)
    assert close(ev.states(), f(ref), 1e-5)
    ev.norm(w["mlp_norm"])
    xn = src.norm(ref, w["mlp_norm"])
    ev.mlp(w["gate_proj"], w["up_proj"], w.get("gate_proj.bias"), w.get("up_proj.bias"))
    assert close(ev.mid(), f(src.mlp_act(xn, w, w["gate_proj"], w["up_proj"])), 1e-5)
    ev.out(w["down_proj"], w.get("down_proj.bias"))
    ev.commit(False)
    assert close(ev.states(), f(src.mlp_block(ref, w)), 1e-5)
    with pytest.raises(InvalidArgumentError, match="GptqLayerEval::out: weight must be"):
        ev.out(w["q_proj"][:, :5].copy())


def test_layer_eval_measurement_and_quant_match_numpy_path(tmp_path):
    # measure_layer / quantize_layer through the evaluator (the CUDA default) vs the NumPy path, same layer and
    # states: the next states agree to fp32 rounding; accuracies within 1e-3 (GPTQ may round a weight the other
    # way when the Hessian's last bits differ); quantization errors of the two paths' weights equal within 1%
    pytest.importorskip("torch")
    from exl2cpp.convert import measure
    from exl2cpp.convert.layers import SourceModel
    from test_models_hf import make_hf_model

    make_hf_model("llama_bias", {}, tmp_path)
    src = SourceModel(tmp_path)
    w = src.layer(0)
    x = src.embed(np.random.default_rng(3).integers(0, 211, size=(3, 40)))
    res = {}
    try:
        for flag in (False, True):
            measure.LAYER_EVAL = flag
            res[flag] = measure.measure_layer(src, 0, w, x)
            groups = {p: [(4, 32)] * (w[p].shape[1] // 32) for p in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                                        "gate_proj", "up_proj", "down_proj")}  # fmt: skip
            res[flag] += measure.quantize_layer(src, 0, w, x, groups)
    finally:
        measure.LAYER_EVAL = None
    (e0, x0, t0, q0), (e1, x1, t1, q1) = res[False], res[True]
    assert np.max(np.abs(x0 - x1)) <= 1e-5 * np.max(np.abs(x0))
    for k in e0:
        assert [r["total_bits"] for r in e0[k]] == [r["total_bits"] for r in e1[k]]
        acc0 = np.array([r["accuracy"] for r in e0[k]])
        acc1 = np.array([r["accuracy"] for r in e1[k]])
        assert np.max(np.abs(acc0 - acc1)) < 1e-3, k
        assert np.all(np.diff(acc0[[0, -1]]) > 0)  # the most bits measure best
    assert sorted(t0) == sorted(t1)
    clean = src.mlp_block(src.attn_block(x, w), w)
    d0, d1 = np.linalg.norm(q0 - clean), np.linalg.norm(q1 - clean)
    assert abs(d0 - d1) <= 0.01 * d0, (d0, d1)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["llama_bias", "qwen3"])
def test_cuda_layer_eval_matches_cpu(kind, tmp_path):
    # the same evaluator steps on CUDA (cuBLAS fp32, the fp32 attention kernel, fp64 error sums on the device)
    src, w, x, ev_c = _layer_eval_case(kind, tmp_path, "cpu")
    cos, sin = src.rope(45)
    ev_g = _C.GptqLayerEval(x.reshape(-1, src.hidden), np.concatenate([cos, sin], 1), 3, 45, src.n_heads, src.n_kv,
                            src.head_dim, src.eps, "cuda")  # fmt: skip
    for ev in (ev_c, ev_g):
        ev.norm(w["attn_norm"])
        ev.attention(w["q_proj"], w["k_proj"], w["v_proj"], w.get("q_proj.bias"), w.get("k_proj.bias"),
                     w.get("v_proj.bias"), w.get("q_norm"), w.get("k_norm"))  # fmt: skip
        ev.out(w["o_proj"], w.get("o_proj.bias"))
        ev.set_ref()
        ev.out(w["o_proj"] * np.float32(1.01), w.get("o_proj.bias"))
    for a, b in ((ev_c.mid(), ev_g.mid()), (ev_c.hessian(True), ev_g.hessian(True)),
                 (ev_c.hessian(False), ev_g.hessian(False))):  # fmt: skip
        assert np.max(np.abs(a - b)) <= 5e-5 * np.max(np.abs(a))
    assert ev_g.rel_err() == pytest.approx(ev_c.rel_err(), rel=1e-3)
    for ev in (ev_c, ev_g):
        ev.commit(False)
        ev.norm(w["mlp_norm"])
        ev.mlp(w["gate_proj"], w["up_proj"], w.get("gate_proj.bias"), w.get("up_proj.bias"))
        ev.out(w["down_proj"], w.get("down_proj.bias"))
        ev.commit(False)
    assert np.max(np.abs(ev_c.states() - ev_g.states())) <= 5e-5 * np.max(np.abs(ev_c.states()))
