"""The v4 EXL2 layout and GEMV (cuda/exl2_gemv_v4.cuh; the shipped layout) against
the CPU reference: the fused kernel for 1..16 rows of x (one and two mma n-tiles) and the prefill path (dequantize
from the v4 layout + cuBLAS) for 17..300 rows, every bit width alone and mixed, ragged/tiny groups, awkward in/out,
1-, 2- and 4-row scale rows (groups of 128 rows, 64, 32), bias, activations in the thousands, dequantized weights
read back exactly through one-hot rows on both paths (32-, 64- and 128-row groups), f32 activations, a Llama-sized
layer, and the device bytes of each layout (the v4 layout is the layer's only copy). Inputs are fresh random draws.
Reference: _C.exl2_dequantize (bit-exact f16 weights) and a float64 matmul. The kernel multiplies exact (q - z) by x
on tensor cores in fp32 and applies the f16 scale (rebuilt bit-exactly from the file's 4-bit code and the group
maximum) to the fp32 result, so it differs from the f16-rounded weights by their rounding only (TOL as the main
kernels). Skipped without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from exl2cpp import _C
from test_exl2_cuda import (
    DEQUANT,
    FUSED,
    LAYERS,
    TOL,
    check_hand_computed,
    gpu,
    random_layer,
    reference,
    rel_l2,
    save_layer,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not _C.cuda_compiled() or _C.cuda_device_count() == 0, reason="needs a CUDA GPU"
    ),
]


V4_LAYERS = [
    *LAYERS,
    (
        512,
        48,
        [6, 6, 6, 6, 5, 5],
        [64, 64, 64, 64, 128, 128],
    ),  # 64-row groups: 2 scale rows per chunk
    (1024, 80, [3] * 6 + [2] * 10, [64] * 16),  # 2.5 bpw-like: 2 scale rows per chunk in both runs
    (
        224,
        40,
        [4, 4, 4],
        [64, 96, 64],
    ),  # 2-3-2 units: pairs straddle chunks, 4 scale rows per chunk
    (1024, 160, [8, 4, 4, 4, 4, 3, 3], [96, 128, 128, 128, 128, 256, 160]),  # 1 scale row per chunk
    (2048, 96, [2] * 16, [128] * 16),  # many chunks of one width: long runs, k split
]


@pytest.mark.parametrize("n_in,n_out,bits,rows", V4_LAYERS)
def test_v4_random_layers(tmp_path, n_in, n_out, bits, rows):
    rng = np.random.default_rng(n_in * 7907 + n_out)
    t = random_layer(rng, n_in, n_out, bits, rows, bias=n_out % 2 == 1)
    path = save_layer(tmp_path, t)
    for m in range(1, 17):
        x = rng.standard_normal((m, n_in)).astype(np.float16)
        want = reference(t, x, n_out)
        got = gpu(path, x, n_out, FUSED)
        assert got.shape == (m, n_out)
        err = rel_l2(got, want)
        assert err < TOL, f"m={m}: rel L2 {err:.2e}"


@pytest.mark.parametrize("n_in,n_out,bits,rows", V4_LAYERS)
def test_v4_prefill_path(tmp_path, n_in, n_out, bits, rows):
    """Dequantize from the v4 layout + cuBLAS (forced, and by the default threshold), 17..300 rows; f32 x too."""
    rng = np.random.default_rng(n_in * 7901 + n_out)
    t = random_layer(rng, n_in, n_out, bits, rows, bias=n_out % 2 == 0)
    path = save_layer(tmp_path, t)
    for m in (1, 17, 33, 300):
        x = rng.standard_normal((m, n_in)).astype(np.float16)
        want = reference(t, x, n_out)
        for thr in (DEQUANT, -1):
            err = rel_l2(gpu(path, x, n_out, thr), want)
            assert err < TOL, f"m={m} threshold={thr}: rel L2 {err:.2e}"
    x = rng.standard_normal((40, n_in)).astype(np.float32)
    assert rel_l2(gpu(path, x, n_out), reference(t, x, n_out)) < 1e-5


@pytest.mark.parametrize("gs", [64, 128])
@pytest.mark.parametrize("b", [8, 6, 5, 4, 3, 2])
def test_v4_one_hot_group_sizes(tmp_path, b, gs):
    """One-hot rows through 64- and 128-row groups (2 and 1 scale rows per chunk: the scales rebuilt from the 4-bit
    codes and the per-unit maxima, subnormal ones included) and a 32-row tail: the reference f16 weights exactly."""
    rows = [gs, gs, 32]
    n_in = sum(rows)
    rng = np.random.default_rng(300 + 10 * b + gs)
    t = random_layer(rng, n_in, 40, [b] * 3, rows, qsm_log2=(-16, 0))
    path = save_layer(tmp_path, t)
    w = _C.exl2_dequantize(t, out_features=40).astype(np.float32)
    eye = np.eye(n_in, dtype=np.float16)
    for m in (1, 9, 16):
        sel = rng.choice(n_in, m, replace=False)
        np.testing.assert_array_equal(gpu(path, eye[sel], 40, FUSED), w[sel])
    np.testing.assert_array_equal(gpu(path, eye, 40, DEQUANT), w)


@pytest.mark.parametrize("bits", [[8], [6], [5], [4], [3], [2], [8, 6, 5, 4, 3, 2]])
def test_v4_one_hot_rows_exact(tmp_path, bits):
    """x = 1..8 rows of the identity: y = f16(1 * (q - z) * s) = the reference f16 weight, bit for bit."""
    n_in = 32 * len(bits) + (16 if bits[-1] in (2, 4, 8) else 0)
    rows = [32] * len(bits)
    rows[-1] += n_in - sum(rows)
    rng = np.random.default_rng(100 + sum(bits))
    t = random_layer(rng, n_in, 72, bits, rows, qsm_log2=(-16, 0))
    path = save_layer(tmp_path, t)
    w = _C.exl2_dequantize(t, out_features=72).astype(np.float32)
    eye = np.eye(n_in, dtype=np.float16)
    for m in (1, 2, 3, 8, 9, 16):
        sel = rng.choice(n_in, m, replace=False)
        np.testing.assert_array_equal(gpu(path, eye[sel], 72, FUSED), w[sel])
    # the prefill path: every row through the dequantization from the v4 layout, f16 and f32 activations
    np.testing.assert_array_equal(gpu(path, eye, 72, DEQUANT), w)
    np.testing.assert_array_equal(gpu(path, eye.astype(np.float32), 72), w)


def test_v4_large_activations(tmp_path):
    rng = np.random.default_rng(16)
    t = random_layer(rng, 512, 96, [8, 6, 4, 3], [32, 96, 256, 128], bias=True, qsm_log2=(-6, -4))
    path = save_layer(tmp_path, t)
    for m in (1, 4, 8, 16, 40):
        x = rng.uniform(-3000, 3000, (m, 512)).astype(
            np.float16
        )  # outputs up to ~50000: near f16's limit
        want = reference(t, x, 96)
        assert np.abs(want).max() < 60000
        for thr in (FUSED, DEQUANT):
            got = gpu(path, x, 96, thr)
            assert np.isfinite(got).all()
            assert rel_l2(got, want) < TOL


def test_v4_hand_computed(tmp_path):
    """test_exl2_cuda's hand-computed case on 96 rows in groups of 64 and 32 (1- and 4-row scale rows)."""
    check_hand_computed(tmp_path, 96, [64, 32])


@pytest.mark.parametrize(
    "bits,rows",
    [
        ([6, 4, 4, 3], [128, 384, 256, 256]),  # 128-row groups: 1 scale row per chunk
        ([3] * 8 + [2] * 8, [64] * 16),  # 2.5 bpw-like 64-row groups: 2 scale rows per chunk
    ],
)
def test_v4_device_bytes(tmp_path, bits, rows):
    """Device bytes of one layer: the v4 layout is the layer's only copy, a little above the file's q_weight (the
    file's 4-bit scale codes in the stream plus a per-unit table of group maxima and the x map)."""
    rng = np.random.default_rng(21)
    n_in, n_out = 1024, 768
    t = random_layer(rng, n_in, n_out, bits, rows)
    path = save_layer(tmp_path, t)
    dev = _C.exl2_linear_bench(path, "layer", 1, 1)["device_bytes"]
    qw = t["q_weight"].nbytes + t["q_scale"].nbytes
    assert qw < dev < 1.1 * qw, (dev, qw)


@pytest.mark.slow
def test_v4_llama_sized_layer(tmp_path):
    """4096 -> 11008 (Llama-2-7B up_proj) at a 4.0 bpw mix of 32- and 128-row groups."""
    n_in, n_out = 4096, 11008
    bits, rows = [8, 5, 4, 4, 3], [128, 1024, 1280, 1152, 512]
    rng = np.random.default_rng(19)
    t = random_layer(rng, n_in, n_out, bits, rows)
    path = save_layer(tmp_path, t)
    w = _C.exl2_dequantize(t, out_features=n_out).astype(np.float32)
    for m, thr in ((1, FUSED), (2, FUSED), (5, FUSED), (8, FUSED), (16, FUSED), (64, DEQUANT)):
        x = rng.standard_normal((m, n_in)).astype(np.float16)
        assert rel_l2(gpu(path, x, n_out, thr), x.astype(np.float32) @ w) < TOL, m
