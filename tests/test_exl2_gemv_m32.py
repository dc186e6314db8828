"""The v4 EXL2 GEMV's 32-row kernel (option gemv_m32: 17..32 rows of x in one launch with four mma n-tiles,
instead of two 16-row launches that each stream the weights; cuda/exl2_gemv_v4.cuh v4_ntiles, cpp/ops/exl2_matmul.cpp
plan_exl2_matmul) against a float64 reference and the default two-launch path: single layers and groups of 2-3
layers at 17..32 rows, the fused prologues, one-hot rows exact, and a fixture
model's decode schedule (steps of 17-20 rows) against the default and the CPU, eager and with CUDA graphs. Every
test checks through _C.exl2_gemv_m32_launches() that the 32-row kernel ran (or, for <= 16 rows, did not).
Marked `cuda`; skipped without a GPU. The host check dev/kernels/exl2_decode_check.sh emulates the kernel's
fragment bookkeeping at 20 and 32 rows."""

from __future__ import annotations

import numpy as np
import pytest
from exl2cpp import _C, InvalidArgumentError
from test_exl2_cuda import TOL, reference, rel_l2
from test_exl2_gemv_group import (
    GROUPS,
    assert_near_baseline_and_cpu,
    check_one_hot_rows_exact,
    make_group,
    model_runs,
    needs_gpu,
    run,
    switched_run,
)


@pytest.fixture(autouse=True)
def _clean(options):
    options(gemv_group=True, gemv_m32=False)


def m32_run(*args, **kw):
    """run() with option gemv_m32 on; returns the outputs, whether it grouped, and the 32-row launches it made."""
    return switched_run("gemv_m32", _C.exl2_gemv_m32_launches, *args, **kw)


@needs_gpu
@pytest.mark.parametrize("gi", range(len(GROUPS)))
@pytest.mark.parametrize("m", [17, 20, 31, 32, 45])
@pytest.mark.parametrize("group", [True, False])
def test_m32_matches_reference_and_default(tmp_path, gi, m, group):
    """45 rows: past one launch; the threshold (32) sends them to dequantize + cuBLAS either way, no 32-row launch."""
    n_in, specs = GROUPS[gi]
    rng = np.random.default_rng(3000 * gi + m)
    path, layers = make_group(rng, n_in, specs, tmp_path)
    prefixes, outs = list(layers), [s[0] for s in specs]
    for _ in range(
        2
    ):  # fresh x; the second call also checks that the first left acc and counters zero
        x = rng.standard_normal((m, n_in)).astype(np.float16)
        got, grouped, launches = m32_run(path, prefixes, x, outs, group=group)
        if m <= 32:
            assert grouped == group
            assert launches >= 1, "no launch used the 32-row kernel"
        else:
            assert launches == 0
        default, _ = run(path, prefixes, x, outs, group=group)
        for p, o, g, d in zip(prefixes, outs, got, default):
            assert g.shape == (m, o)
            want = reference(layers[p], x, o)
            assert rel_l2(g, want) < TOL, f"{p}: rel L2 {rel_l2(g, want):.2e}"
            assert rel_l2(g, d) < 1e-3, (
                f"{p}: 32-row vs two 16-row launches rel L2 {rel_l2(g, d):.2e}"
            )


@needs_gpu
@pytest.mark.parametrize("m", [17, 24, 32])
def test_m32_one_hot_rows_exact(tmp_path, m):
    """x = rows of the identity: y = the f16 reference weights bit for bit (split-k adds zeros), every width."""

    def runner(*args):
        ys, _, launches = m32_run(*args)
        return ys, launches

    check_one_hot_rows_exact(tmp_path, 600 + m, m, runner)


@needs_gpu
def test_m32_not_for_few_rows(tmp_path, options):
    """<= 16 rows never take the 32-row kernel; a bad option value raises, naming the option."""
    rng = np.random.default_rng(21)
    n_in, specs = GROUPS[1]
    path, layers = make_group(rng, n_in, specs, tmp_path)
    prefixes, outs = list(layers), [s[0] for s in specs]
    x16 = rng.standard_normal((16, n_in)).astype(np.float16)
    _, _, launches = m32_run(path, prefixes, x16, outs)
    assert launches == 0
    with pytest.raises(InvalidArgumentError, match="gemv_m32"):
        options(gemv_m32=2)


@needs_gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_model_m32_matches_default_and_cpu(graphs):
    """The q40 fixture's decode schedule (fused step; steps of 17-20 rows take the 32-row kernel): within the
    default path's run-to-run spread (its fp32 atomics) and as close to the CPU as the default path."""
    pytest.importorskip("torch")
    env = {"cuda_graphs": graphs}
    default = model_runs({**env, "gemv_m32": False})
    before = _C.exl2_gemv_m32_launches()
    m32 = model_runs({**env, "gemv_m32": True})
    assert _C.exl2_gemv_m32_launches() > before
    cpu = model_runs({}, device="cpu")
    assert_near_baseline_and_cpu(default, m32, cpu, 5e-3, "32-row vs default")
