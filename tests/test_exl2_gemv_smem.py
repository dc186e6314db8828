"""The v4 EXL2 GEMV's shared-memory weight copy (EXL2CPP_GEMV_SMEM=<bytes per warp>: before griddepcontrol.wait each
warp copies the first bytes of its k slice into shared memory with cp.async and its chunk loop reads those chunks
from there; the SW kernels of cuda/exl2_gemv_v4.cuh) against a float64 reference and the default path: single layers
and groups of 2-3 layers at 1..16 rows, copies that cover a whole slice, part of one (chunks past the copy come from
global memory) and none; bit for bit against the default under the deterministic cluster reduction (the products are
the same, only where the weights are read from differs); one-hot rows give the weights exactly; the fused decode step
of a fixture model against the default and the CPU. Every test checks through _C.exl2_gemv_smem_launches() that the
SW kernels ran. Marked `cuda`; skipped without a GPU."""

from __future__ import annotations

import numpy as np
import pytest
from exl2cpp import _C
from test_exl2_cuda import TOL, random_layer, reference, rel_l2
from test_exl2_gemv_cluster import needs_sm90
from test_exl2_gemv_group import (
    GROUPS,
    assert_near_baseline_and_cpu,
    make_group,
    model_runs,
    needs_gpu,
    run,
    save_layers,
)

# Bytes per warp: 1040 = a part of every slice (not a whole number of chunks at any width), 8192 = most of a 4-bit
# slice, 16384 = the largest value (every slice of these layers whole).
SIZES = ["1040", "8192", "16384"]


@pytest.fixture(autouse=True)
def _v4(monkeypatch):
    monkeypatch.setenv("EXL2CPP_GEMV", "v4")
    for k in ("EXL2CPP_GEMV_GROUP", "EXL2CPP_GEMV_CLUSTER", "EXL2CPP_GEMV_SMEM"):
        monkeypatch.delenv(k, raising=False)


def smem_run(monkeypatch, size, *args, **kw):
    """run() with EXL2CPP_GEMV_SMEM=size; returns the outputs, whether it grouped, and the SW launches it made."""
    monkeypatch.setenv("EXL2CPP_GEMV_SMEM", size)
    before = _C.exl2_gemv_smem_launches()
    try:
        ys, grouped = run(*args, **kw)
    finally:
        monkeypatch.delenv("EXL2CPP_GEMV_SMEM")
    return ys, grouped, _C.exl2_gemv_smem_launches() - before


@needs_gpu
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("gi", range(len(GROUPS)))
@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 16])
@pytest.mark.parametrize("group", [True, False])
def test_smem_matches_reference_and_default(tmp_path, monkeypatch, size, gi, m, group):
    n_in, specs = GROUPS[gi]
    rng = np.random.default_rng(700 * gi + m)
    path, layers = make_group(rng, n_in, specs, tmp_path)
    prefixes, outs = list(layers), [s[0] for s in specs]
    x = rng.standard_normal((m, n_in)).astype(np.float16)
    got, grouped, launches = smem_run(monkeypatch, size, path, prefixes, x, outs, group=group)
    assert grouped == group
    assert launches >= 1, "no launch used the shared-memory weight copy"
    default, _ = run(path, prefixes, x, outs, group=group)
    for p, o, g, d in zip(prefixes, outs, got, default):
        assert g.shape == (m, o)
        want = reference(layers[p], x, o)
        assert rel_l2(g, want) < TOL, f"{p}: rel L2 {rel_l2(g, want):.2e}"
        assert rel_l2(g, d) < 1e-3, f"{p}: smem vs default rel L2 {rel_l2(g, d):.2e}"


@needs_sm90
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("gi", range(len(GROUPS)))
@pytest.mark.parametrize("m", [1, 3, 16])
def test_smem_bitwise_under_cluster(tmp_path, monkeypatch, size, gi, m):
    """With the cluster reduction (no atomics: deterministic) the copy changes nothing, bit for bit."""
    n_in, specs = GROUPS[gi]
    rng = np.random.default_rng(900 * gi + m)
    path, layers = make_group(rng, n_in, specs, tmp_path)
    prefixes, outs = list(layers), [s[0] for s in specs]
    x = rng.standard_normal((m, n_in)).astype(np.float16)
    monkeypatch.setenv("EXL2CPP_GEMV_CLUSTER", "1")
    base, _ = run(path, prefixes, x, outs)
    got, _, launches = smem_run(monkeypatch, size, path, prefixes, x, outs)
    assert launches >= 1
    for p, b, g in zip(prefixes, base, got):
        np.testing.assert_array_equal(g, b, err_msg=f"{p}: EXL2CPP_GEMV_SMEM={size} changed the result")


@needs_gpu
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("m", [1, 3, 16])
def test_smem_one_hot_rows_exact(tmp_path, monkeypatch, size, m):
    """x = rows of the identity: y = the f16 reference weights bit for bit, every width and a ragged row split."""
    rng = np.random.default_rng(400 + m)
    n_in = 1000
    specs = [(136, [8, 6, 5, 4, 3, 2], [64, 128, 256, 256, 192, 104]), (40, [4, 2], [512, 488])]
    layers = {f"l{i}": random_layer(rng, n_in, o, b, r, qsm_log2=(-16, 0)) for i, (o, b, r) in enumerate(specs)}
    path = save_layers(tmp_path, layers)
    eye = np.eye(n_in, dtype=np.float16)
    sel = rng.choice(n_in, m, replace=False)
    got, _, launches = smem_run(monkeypatch, size, path, list(layers), eye[sel], [s[0] for s in specs])
    assert launches >= 1
    for (p, t), (o, *_), g in zip(layers.items(), specs, got):
        w = _C.exl2_dequantize(t, out_features=o).astype(np.float32)
        np.testing.assert_array_equal(g, w[sel], err_msg=p)


@needs_gpu
def test_smem_switch_values(tmp_path, monkeypatch):
    rng = np.random.default_rng(11)
    n_in, specs = GROUPS[1]
    path, layers = make_group(rng, n_in, specs, tmp_path)
    args = (path, list(layers), np.ones((1, n_in), np.float16), [s[0] for s in specs])
    for bad in ("abc", "-16", "16400"):
        monkeypatch.setenv("EXL2CPP_GEMV_SMEM", bad)
        with pytest.raises(Exception, match="EXL2CPP_GEMV_SMEM"):
            run(*args)
    for off in ("0", "8"):  # 8 rounds down to 0: the default kernels
        monkeypatch.setenv("EXL2CPP_GEMV_SMEM", off)
        before = _C.exl2_gemv_smem_launches()
        run(*args)
        assert _C.exl2_gemv_smem_launches() == before


@needs_gpu
@pytest.mark.parametrize("graphs", ["0", "1"])
def test_model_smem_matches_default_and_cpu(graphs):
    """The fixture model's decode schedule (fused step, the default) with the copy: within the default path's
    run-to-run spread (its fp32 atomics) and as close to the CPU as the default path."""
    pytest.importorskip("torch")
    env = {"EXL2CPP_CUDA_GRAPHS": graphs, "EXL2CPP_GEMV": "v4", "EXL2CPP_GEMV_FUSE": "1"}
    default = model_runs({**env, "EXL2CPP_GEMV_SMEM": "0"})
    before = _C.exl2_gemv_smem_launches()
    smem = model_runs({**env, "EXL2CPP_GEMV_SMEM": "8192"})
    assert _C.exl2_gemv_smem_launches() > before
    cpu = model_runs({}, device="cpu")
    assert_near_baseline_and_cpu(default, smem, cpu, 5e-3, "smem vs default")
