"""The EXL2 matmul op (cpp/ops/exl2_matmul.h): its CPU reference against an independent NumPy computation and
hand-checkable cases, its checks, and the planner as a pure function (a table of cases, run on the CPU). The CUDA
cases compare the planned kernels with the reference on awkward shapes."""

from __future__ import annotations

import numpy as np
import pytest
from conftest_exl2 import np_dequantize
from exl2cpp import _C, InvalidArgumentError
from exl2cpp import options as exl2_options
from test_exl2_cuda import save_layer


def random_layer(rng, n_in, n_out, bits, group_rows, bias=False):
    codes = np.concatenate([rng.integers(0, 1 << b, (r, n_out)) for b, r in zip(bits, group_rows)])
    nib = rng.integers(0, 16, (len(bits), n_out))
    qsm = (2.0 ** rng.uniform(-9, 0, len(bits))).astype(np.float16)
    perm = rng.permutation(n_in).astype(np.int32)
    t = _C.exl2_pack(codes.astype(np.uint8), list(bits), list(group_rows), nib.astype(np.uint8), qsm, perm, n_out)
    if bias:
        t["bias"] = rng.standard_normal(n_out).astype(np.float16)
    return t


def want(t, x, n_out):
    w = np_dequantize(t, out_features=n_out).astype(np.float64)  # [in, out], original order
    y = x.astype(np.float64) @ w
    if "bias" in t:
        y += t["bias"].astype(np.float64)
    return y


SHAPES = [
    (96, 33, [8, 4], [32, 64]),
    (160, 100, [6, 5, 3], [32, 64, 64]),
    (224, 64, [8, 6, 5, 4, 3, 2], [32, 32, 32, 32, 64, 32]),
    (64, 7, [2, 2], [32, 32]),
]


@pytest.mark.parametrize("n_in,n_out,bits,rows", SHAPES)
@pytest.mark.parametrize("n", [1, 3, 19])
@pytest.mark.parametrize("bias", [False, True])
def test_reference_matches_numpy(n_in, n_out, bits, rows, n, bias):
    rng = np.random.default_rng(n_in + 3 * n_out + n + bias)
    t = random_layer(rng, n_in, n_out, bits, rows, bias)
    x = rng.standard_normal((n, n_in)).astype(np.float32)
    y = _C.exl2_matmul_reference(t, x, out_features=n_out)
    assert y.dtype == np.float32 and y.shape == (n, n_out)
    ref = want(t, x, n_out)
    err = np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-30)
    assert err < 1e-5


def test_reference_f16_rounds_once():
    rng = np.random.default_rng(7)
    t = random_layer(rng, 96, 33, [8, 4], [32, 64], bias=True)
    x = rng.standard_normal((5, 96)).astype(np.float16)
    y = _C.exl2_matmul_reference(t, x, out_features=33)
    assert y.dtype == np.float16
    ref = want(t, x.astype(np.float32), 33)
    # one rounding of a value accurate to fp32: within half an f16 ulp (plus the fp32 sum's error)
    assert np.all(np.abs(y.astype(np.float64) - ref) <= np.abs(ref) * 2.0**-11 * 1.001 + 2.0**-24)


def test_reference_one_hot_reads_the_weights_back():
    rng = np.random.default_rng(11)
    t = random_layer(rng, 160, 100, [6, 5, 3], [32, 64, 64])
    w = _C.exl2_dequantize(t, out_features=100)  # [in, out] f16, the bit-exact dequantization
    rows = [0, 17, 159]
    x = np.zeros((len(rows), 160), np.float32)
    for i, k in enumerate(rows):
        x[i, k] = 1.0
    y = _C.exl2_matmul_reference(t, x, out_features=100)
    assert np.array_equal(y, w[rows].astype(np.float32))
    # small integer mixes stay exact in fp32: 2 W[a] - 3 W[b]
    x2 = np.zeros((1, 160), np.float32)
    x2[0, 5], x2[0, 6] = 2.0, -3.0
    y2 = _C.exl2_matmul_reference(t, x2, out_features=100)
    exact = 2.0 * w[5].astype(np.float64) - 3.0 * w[6].astype(np.float64)
    assert np.array_equal(y2[0].astype(np.float64), exact.astype(np.float32).astype(np.float64))


def test_reference_checks_x():
    rng = np.random.default_rng(3)
    t = random_layer(rng, 64, 7, [2, 2], [32, 32])
    with pytest.raises(InvalidArgumentError, match="in_features = 64"):
        _C.exl2_matmul_reference(t, np.zeros((2, 63), np.float32), out_features=7)
    with pytest.raises(InvalidArgumentError, match="f16 or f32"):
        _C.exl2_matmul_reference(t, np.zeros((2, 64), np.float64).astype(np.int32), out_features=7)
    assert _C.exl2_matmul_reference(t, np.zeros((0, 64), np.float32), out_features=7).shape == (0, 7)


# ---- the planner: a pure function of (rows, GPU, layer shape, tuning) ------------------------------------------


def plan(rows, f16=True, n_layers=1, fused=False, cc=90, name="NVIDIA H200", sm=132, **tuning):
    return _C.exl2_matmul_plan(rows, 4096, 4096, f16=f16, n_layers=n_layers, fused=fused, gpu_name=name, cc=cc,
                               sm_count=sm, tuning=tuning)


def launches(p):
    return [(l["row0"], l["rows"], l["kernel"], l["m_tile"]) for l in p["launches"]]


@pytest.mark.parametrize(
    "rows,tuning,expect",
    [
        (1, {}, [(0, 1, "gemv_v4", 1)]),
        (2, {}, [(0, 2, "gemv_v4", 2)]),
        (3, {}, [(0, 3, "gemv_v4", 4)]),
        (5, {}, [(0, 5, "gemv_v4", 8)]),
        (9, {}, [(0, 9, "gemv_v4", 16)]),
        (16, {}, [(0, 16, "gemv_v4", 16)]),
        (17, {}, [(0, 16, "gemv_v4", 16), (16, 1, "gemv_v4", 1)]),
        (31, {}, [(0, 16, "gemv_v4", 16), (16, 15, "gemv_v4", 16)]),
        (32, {}, [(0, 16, "gemv_v4", 16), (16, 16, "gemv_v4", 16)]),
        (33, {}, [(0, 33, "dequant_cublas", 0)]),
        (128, {}, [(0, 128, "dequant_cublas", 0)]),
        (17, {"m32": True}, [(0, 17, "gemv_v4", 32)]),
        (32, {"m32": True}, [(0, 32, "gemv_v4", 32)]),
        (8, {"gemv_max_rows": 4}, [(0, 8, "dequant_cublas", 0)]),
        (4, {"gemv_max_rows": 4}, [(0, 4, "gemv_v4", 4)]),
        (1, {"gemv_max_rows": 0}, [(0, 1, "dequant_cublas", 0)]),
        (1, {"reference": True}, [(0, 1, "dequant_cublas", 0)]),
    ],
)
def test_plan_single_layer(rows, tuning, expect):
    p = plan(rows, **tuning)
    assert launches(p) == expect
    assert p["kernel"] == expect[0][2]
    assert p["tuned"] and p["tuned_on"].startswith("NVIDIA H200 (sm_90")


def test_plan_f32_activations_take_the_dequant_path():
    assert launches(plan(1, f16=False)) == [(0, 1, "dequant_cublas", 0)]


@pytest.mark.parametrize(
    "rows,n_layers,fused,tuning,kernel,why",
    [
        (1, 3, False, {}, "gemv_v4", ""),
        (16, 2, False, {}, "gemv_v4", ""),
        (17, 2, False, {}, "none", "more rows"),
        (17, 2, False, {"m32": True}, "gemv_v4", ""),
        (2, 2, False, {"group": False}, "none", "gemv_group is off"),
        (2, 4, False, {}, "none", "1..3 layers"),
        (1, 1, True, {"group": False}, "gemv_v4", ""),  # a fused launch of one layer is no group
        (2, 2, True, {"group": False}, "none", "gemv_group is off"),
        (2, 2, True, {"reference": True}, "none", "cuda_reference"),
        (8, 2, False, {"gemv_max_rows": 4}, "none", "more rows"),
    ],
)
def test_plan_groups_and_fused(rows, n_layers, fused, tuning, kernel, why):
    p = plan(rows, n_layers=n_layers, fused=fused, **tuning)
    assert p["kernel"] == kernel
    assert why in p["note"]
    if kernel == "gemv_v4":
        assert len(p["launches"]) == 1 and p["launches"][0]["rows"] == rows


def test_plan_f32_groups_do_not_qualify():
    assert plan(2, f16=False, n_layers=2)["kernel"] == "none"


@pytest.mark.parametrize("cc,name", [(80, "NVIDIA A100"), (86, "NVIDIA RTX A6000"), (89, "NVIDIA L40S"), (120, "X")])
def test_plan_names_an_untuned_gpu_and_falls_back(cc, name):
    p = plan(5, cc=cc, name=name, sm=84)
    assert not p["tuned"]
    assert f"not tuned for {name} (sm_{cc}, 84 SMs)" in p["note"]
    assert launches(p) == launches(plan(5))  # the H200's choices


def test_plan_carries_the_split_tuning():
    p = plan(1, slices=1, chunks_per_slice=4)
    assert (p["slices"], p["chunks_per_slice"]) == (1, 4)
    with pytest.raises(InvalidArgumentError, match="unknown tuning"):
        plan(1, cluster=True)


def test_plan_follows_the_runtime_options_on_the_cpu_build_too():
    # the op's options -> tuning mapping: gemv_max_rows and gemv_m32 reach the planner
    with exl2_options.scope(gemv_max_rows=4):
        assert exl2_options.get()["gemv_max_rows"] == 4
    assert exl2_options.get()["gemv_max_rows"] == 32


# ---- CUDA: the planned kernels against the reference -------------------------------------------------------------

CUDA_ROWS = [1, 2, 3, 7, 16, 17, 31, 32, 33, 128]
needs_gpu = pytest.mark.skipif(not _C.cuda_compiled() or _C.cuda_device_count() == 0, reason="needs a CUDA GPU")


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("m32", [False, True])
@pytest.mark.parametrize("n_in,n_out,bits,rows", SHAPES[:3] + [(128, 127, [4], [128])])
def test_cuda_matches_reference(tmp_path, n_in, n_out, bits, rows, m32):
    rng = np.random.default_rng(n_in + n_out)
    t = random_layer(rng, n_in, n_out, bits, rows, bias=True)
    path = save_layer(tmp_path, t)
    with exl2_options.scope(gemv_m32=m32):
        for n in CUDA_ROWS:
            x = rng.standard_normal((n, n_in)).astype(np.float16)
            ref = _C.exl2_matmul_reference(t, x.astype(np.float32), out_features=n_out).astype(np.float64)
            got = _C.exl2_linear_forward(path, "layer", x, "cuda", out_features=n_out).astype(np.float64)
            err = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)
            assert err < 2e-3, f"n={n}: rel L2 {err:.2e}"
            again = _C.exl2_linear_forward(path, "layer", x, "cuda", out_features=n_out).astype(np.float64)
            assert np.linalg.norm(again - ref) / max(np.linalg.norm(ref), 1e-30) < 2e-3, f"n={n}: second call"


@pytest.mark.cuda
@needs_gpu
def test_cuda_plan_names_the_device():
    p = _C.exl2_matmul_plan_for_device(0, 1, 4096, 4096)
    assert p["kernel"] == "gemv_v4"
    assert p["tuned_on"].startswith("NVIDIA H200")
    if not p["tuned"]:
        assert "not tuned for" in p["note"]
