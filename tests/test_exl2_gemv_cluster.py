"""The v4 EXL2 GEMV's cluster split-k (EXL2CPP_GEMV_CLUSTER=1, sm_90+: the k slices of a column block run as one
thread-block cluster and add their partial sums through distributed shared memory, v4_plan_cluster /
v4_cluster_epilogue in cuda/exl2_gemv_v4.cuh) against a float64 reference and the default accumulator path, single
layers and groups of 2-3 layers at 1..16 rows of x, v4 and v4k; bit-exact weights through one-hot rows; the same
output bit for bit on every call (the cluster sums in slice order, unlike the default's fp32 atomics); a fixture
model's logits against the default path and the CPU, eager and with CUDA graphs. Every test checks through
_C.exl2_gemv_cluster_launches() that cluster launches did run. Marked `cuda`; skipped without a GPU, and on GPUs
below sm_90 (no clusters: the switch leaves the default path)."""

from __future__ import annotations

import numpy as np
import pytest
from exl2cpp import _C
from test_exl2_cuda import TOL, reference, rel_l2
from test_exl2_gemv_group import (
    GROUPS,
    assert_near_baseline_and_cpu,
    check_one_hot_rows_exact,
    make_group,
    model_runs,
    run,
    switched_run,
)


def _sm90() -> bool:
    """A CUDA device 0 of compute capability 9.0 or newer (from its name, as test_cuda_graphs decides PDL)."""
    if not (_C.cuda_compiled() and _C.cuda_device_count() > 0):
        return False
    from test_cuda_graphs import hopper_or_newer

    return hopper_or_newer()


HAVE_SM90 = _sm90()


def needs_sm90(f):
    return pytest.mark.cuda(
        pytest.mark.skipif(not HAVE_SM90, reason="needs a CUDA GPU of sm_90 or newer")(f)
    )


@pytest.fixture(params=["v4", "v4k"])
def v4(request, monkeypatch):
    monkeypatch.setenv("EXL2CPP_GEMV", request.param)
    monkeypatch.delenv("EXL2CPP_GEMV_GROUP", raising=False)
    monkeypatch.delenv("EXL2CPP_GEMV_CLUSTER", raising=False)
    return request.param


def cluster_run(monkeypatch, *args, **kw):
    """run() with EXL2CPP_GEMV_CLUSTER=1; returns the outputs, whether it grouped, and the cluster launches made."""
    return switched_run(
        monkeypatch, "EXL2CPP_GEMV_CLUSTER", _C.exl2_gemv_cluster_launches, *args, **kw
    )


@needs_sm90
@pytest.mark.parametrize("gi", range(len(GROUPS)))
@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 16])
@pytest.mark.parametrize("group", [True, False])
def test_cluster_matches_reference_and_default(tmp_path, monkeypatch, v4, gi, m, group):
    n_in, specs = GROUPS[gi]
    rng = np.random.default_rng(500 * gi + m)
    path, layers = make_group(rng, n_in, specs, tmp_path)
    prefixes, outs = list(layers), [s[0] for s in specs]
    x = rng.standard_normal((m, n_in)).astype(np.float16)
    got, grouped, launches = cluster_run(monkeypatch, path, prefixes, x, outs, group=group)
    assert grouped == group
    assert launches >= 1, "no launch used the cluster reduction"
    default, _ = run(path, prefixes, x, outs, group=group)
    again, _, _ = cluster_run(monkeypatch, path, prefixes, x, outs, group=group)
    for p, o, g, d, a in zip(prefixes, outs, got, default, again):
        assert g.shape == (m, o)
        want = reference(layers[p], x, o)
        assert rel_l2(g, want) < TOL, f"{p}: rel L2 {rel_l2(g, want):.2e}"
        assert rel_l2(g, d) < 1e-3, f"{p}: cluster vs default rel L2 {rel_l2(g, d):.2e}"
        np.testing.assert_array_equal(
            g, a, err_msg=f"{p}: the cluster sum must not change between calls"
        )


@needs_sm90
@pytest.mark.parametrize("m", [1, 3, 16])
def test_cluster_one_hot_rows_exact(tmp_path, monkeypatch, v4, m):
    """x = rows of the identity: y = the f16 reference weights bit for bit (the other slices add exact zeros)."""

    def runner(*args):
        ys, _, launches = cluster_run(monkeypatch, *args)
        return ys, launches

    check_one_hot_rows_exact(tmp_path, 300 + m, m, runner)


@needs_sm90
def test_cluster_switch_values(tmp_path, monkeypatch):
    rng = np.random.default_rng(9)
    n_in, specs = GROUPS[1]
    path, layers = make_group(rng, n_in, specs, tmp_path)
    monkeypatch.setenv("EXL2CPP_GEMV", "v4")
    monkeypatch.setenv("EXL2CPP_GEMV_CLUSTER", "2")
    with pytest.raises(Exception, match="EXL2CPP_GEMV_CLUSTER"):
        run(path, list(layers), np.zeros((1, n_in), np.float16), [s[0] for s in specs])
    monkeypatch.setenv("EXL2CPP_GEMV_CLUSTER", "0")
    before = _C.exl2_gemv_cluster_launches()
    run(path, list(layers), np.ones((1, n_in), np.float16), [s[0] for s in specs])
    assert _C.exl2_gemv_cluster_launches() == before


@needs_sm90
@pytest.mark.parametrize("graphs", ["0", "1"])
def test_model_cluster_matches_default_and_cpu(graphs):
    """A fixture model's decode schedule with the cluster reduction: within the default path's run-to-run spread
    (its fp32 atomics; test_exl2_gemv_group uses the same bounds) and as close to the CPU as the default path."""
    pytest.importorskip("torch")
    env = {"EXL2CPP_CUDA_GRAPHS": graphs, "EXL2CPP_GEMV": "v4"}
    default = model_runs({**env, "EXL2CPP_GEMV_CLUSTER": "0"})
    before = _C.exl2_gemv_cluster_launches()
    clus = model_runs({**env, "EXL2CPP_GEMV_CLUSTER": "1"})
    assert _C.exl2_gemv_cluster_launches() > before
    clus2 = model_runs({**env, "EXL2CPP_GEMV_CLUSTER": "1"})
    cpu = model_runs({}, device="cpu")
    assert_near_baseline_and_cpu(default, clus, cpu, 5e-3, "cluster vs default")
    # The cluster path has no atomics; what it leaves nondeterministic is only the 17+-row steps' cuBLAS path,
    # which is deterministic too: the whole schedule repeats bit for bit.
    for i, (b, b2) in enumerate(zip(clus, clus2)):
        np.testing.assert_array_equal(b, b2, err_msg=f"step {i}")


@needs_sm90
def test_model_cluster_with_fused_prologues_and_residual_add():
    """EXL2CPP_GEMV_FUSE=1 (norm / silu_mul prologues, the o and down projections adding into the residual) with the
    cluster reduction: the cluster epilogue must do the residual add as the default epilogue does."""
    pytest.importorskip("torch")
    env = {"EXL2CPP_CUDA_GRAPHS": "1", "EXL2CPP_GEMV": "v4", "EXL2CPP_GEMV_FUSE": "1"}
    default = model_runs({**env, "EXL2CPP_GEMV_CLUSTER": "0"})
    before = _C.exl2_gemv_cluster_launches()
    clus = model_runs({**env, "EXL2CPP_GEMV_CLUSTER": "1"})
    assert _C.exl2_gemv_cluster_launches() > before
    cpu = model_runs({}, device="cpu")
    assert_near_baseline_and_cpu(default, clus, cpu, 5e-3, "fused cluster vs fused default")
