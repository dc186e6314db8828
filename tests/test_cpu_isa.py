"""The CPU kernels' run-time ISA choice (backend/cpu/isa.h): build_info reports it, set_cpu_isa forces each ISA
this CPU has, and every dispatched kernel (matmul_nt GEMV/GEMM, attention_paged, kv_write_q, attention_paged_q)
gives the same results on each within the stated bounds:

- f32 outputs: |isa - fp64 reference| <= 2e-6 * sum_k |x_k w_k| (dots; about 30 fp32 ulps of the terms' scale),
  and attention within 2e-6 absolute (values of unit size);
- f16 outputs: within one f16 ulp of the baseline ISA's (the f32 sums round to neighbouring f16 values);
- quantized-cache writes: bit-identical codes and scales (no reduction in them depends on the vector width).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from exl2cpp import _C
from exl2cpp.errors import InvalidArgumentError, UnsupportedError
from test_backend_ops import make_paged, ref_attention
from test_kv_quant import write_case

ISAS = ["baseline", "avx2", "avx512"]


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@pytest.fixture
def restore_isa():
    before = _C.cpu_isa()
    yield
    _C.set_cpu_isa(before)


def run_on(isa: str, fn):
    """fn() with the CPU kernels forced to isa (skips when this CPU lacks it), then the default restored."""
    info = _C.build_info()
    if isa not in info["cpu_isas_supported"]:
        pytest.skip(f"this CPU or build has no {isa} (supported: {info['cpu_isas_supported']})")
    before = _C.cpu_isa()
    _C.set_cpu_isa(isa)
    try:
        assert _C.cpu_isa() == isa
        return fn()
    finally:
        _C.set_cpu_isa(before)


def test_build_info_reports_the_chosen_isa():
    info = _C.build_info()
    assert info["cpu_isa"] == _C.cpu_isa() == info["cpu_isa_best"]
    assert info["cpu_isas_supported"][0] == "baseline"
    assert info["cpu_isas_supported"][-1] == info["cpu_isa_best"]
    assert set(info["cpu_isas_supported"]) <= set(info["cpu_isas_compiled"]) <= set(ISAS)
    assert isinstance(info["native"], bool) and isinstance(info["compiler"], str)
    assert info["cuda"] == _C.cuda_compiled()
    if info["cuda"]:
        assert info["cuda_archs"] and all(isinstance(a, int) and a >= 50 for a in info["cuda_archs"])
    else:
        assert info["cuda_archs"] == []
    flags = cpu_flags()
    if flags and info["cpu_isas_compiled"] == ISAS:  # x86-64: what /proc/cpuinfo says decides the best ISA
        avx2 = {"avx2", "fma", "f16c", "bmi1", "bmi2"} <= flags
        avx512 = avx2 and {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags
        assert info["cpu_isa_best"] == ("avx512" if avx512 else "avx2" if avx2 else "baseline")


def test_set_cpu_isa_rejects_bad_names(restore_isa):
    with pytest.raises(InvalidArgumentError, match="expected 'baseline', 'avx2' or 'avx512'"):
        _C.set_cpu_isa("sse9")
    info = _C.build_info()
    for isa in ISAS:
        if isa not in info["cpu_isas_supported"]:
            with pytest.raises(UnsupportedError, match="not supported by this CPU"):
                _C.set_cpu_isa(isa)


def dot_scale(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n", [1, 3, 4, 5, 37])  # GEMV rows 1..4, GEMM past them (37: a partial micro-tile)
@pytest.mark.parametrize("w_dtype", ["f32", "f16", "bf16"])
def test_matmul_nt_each_isa(isa, n, w_dtype):
    rng = np.random.default_rng(n * 7 + len(w_dtype))
    k_dim, out = 301, 83  # tails past every vector width and micro-tile
    x = rng.standard_normal((n, k_dim)).astype(np.float32)
    w32 = rng.standard_normal((out, k_dim)).astype(np.float32)
    bias = rng.standard_normal(out).astype(np.float32)
    if w_dtype == "bf16":
        bits = (w32.view(np.uint32) >> 16).astype(np.uint16)  # truncated to bf16: exact in f32 below
        w_in, w_ref = bits, (bits.astype(np.uint32) << 16).view(np.float32)
    elif w_dtype == "f16":
        w_in = w_ref = w32.astype(np.float16)
    else:
        w_in = w_ref = w32
    y = run_on(isa, lambda: _C.op_matmul_nt(x, w_in, bias, w_dtype=w_dtype))
    ref = x.astype(np.float64) @ w_ref.astype(np.float64).T + bias
    bound = 2e-6 * (dot_scale(x, w_ref) + np.abs(bias))
    assert np.all(np.abs(y - ref) <= bound), f"{isa}: max err {np.max(np.abs(y - ref) - bound)} past the bound"
    # f16 activations: within one f16 ulp of the baseline's
    xh = x.astype(np.float16)
    yh = run_on(isa, lambda: _C.op_matmul_nt(xh, w_in, bias.astype(np.float16), w_dtype=w_dtype))
    yb = run_on("baseline", lambda: _C.op_matmul_nt(xh, w_in, bias.astype(np.float16), w_dtype=w_dtype))
    assert yh.dtype == np.float16
    ulp = np.spacing(np.maximum(np.abs(yb), np.abs(yh)).astype(np.float16)).astype(np.float32)
    assert np.all(np.abs(yh.astype(np.float32) - yb.astype(np.float32)) <= ulp)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_attention_paged_each_isa(isa, head_dim, softcap):
    rng = np.random.default_rng(head_dim)
    seq_lens, kv, ratio = [37, 5, 70], 2, 3
    k_pages, v_pages, table, k_seq, v_seq = make_paged(rng, seq_lens, 16, kv, head_dim, "f32")
    seq = np.array([0] * 9 + [1] + [2] * 4, dtype=np.int32)
    pos = np.array(list(range(28, 37)) + [4] + [0, 1, 33, 69], dtype=np.int32)
    q = rng.standard_normal((len(seq), kv * ratio, head_dim)).astype(np.float32)
    scale = 2.0 / math.sqrt(head_dim)
    out = run_on(isa, lambda: _C.op_attention_paged(q, k_pages, v_pages, pos, seq, table, scale, softcap=softcap))
    ref = ref_attention(q.astype(np.float64), k_seq, v_seq, pos, seq, scale, 0, softcap)
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-6)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits", [8, 4])
def test_kv_quant_each_isa(isa, bits):
    def write():
        rng = np.random.default_rng(bits)
        mu = (rng.standard_normal((3, 64)) * 0.3).astype(np.float32)
        return write_case(rng, bits, d=64, n_kv=3, k_mean=mu)

    (k, v, pos, seq, table, ps), got = run_on(isa, write)
    _, want = run_on("baseline", write)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)  # codes and scales: bit-identical
    kq, ks, vq, vs = want
    q = np.random.default_rng(5).standard_normal((len(pos), 6, 64)).astype(np.float32)

    def attend():
        return _C.op_attention_paged_q(q, kq, ks, vq, vs, bits, pos, seq, table, 0.125)

    np.testing.assert_allclose(run_on(isa, attend), run_on("baseline", attend), rtol=0, atol=2e-6)


def test_forced_isa_is_used_by_the_kernels(restore_isa):
    """Forcing baseline gives a different f32 rounding than a vector ISA on a long dot (the dispatch is live)."""
    info = _C.build_info()
    vec = [i for i in info["cpu_isas_supported"] if i != "baseline"]
    if not vec:
        pytest.skip("this CPU has only the baseline ISA")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 4099)).astype(np.float32)
    w = rng.standard_normal((64, 4099)).astype(np.float32)
    outs = {isa: run_on(isa, lambda: _C.op_matmul_nt(x, w)) for isa in ["baseline", *vec]}
    assert any(not np.array_equal(outs["baseline"], outs[i]) for i in vec)
