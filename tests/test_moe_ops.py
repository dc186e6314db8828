"""The MoE ops (ops/ops.h moe_route / moe_group / moe_combine) against NumPy versions of HF transformers' routers
(MixtralSparseMoeBlock: softmax in fp32, top-k, always renormalised; Qwen2MoeSparseMoeBlock / Qwen3MoeSparseMoeBlock:
renormalised when `norm_topk_prob`, Qwen2-MoE's shared expert gated by sigmoid), grouping invariants, and the
weighted combine; then CUDA against the CPU op on fresh inputs (marker `cuda`).

Tolerances: router weights fp32, rel 1e-6 (expf vs std::exp and the exp-sum order); combine in f32 3e-6 and f16 3e-3
of the largest reference magnitude (one f16 rounding of the output, f16 inputs exact in float64). Ids and the grouping
are integers: exact. Whole MoE blocks of HF transformers (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE) in fp32
against the ops composed on the CPU: rel L2 < 1e-5.
"""

from __future__ import annotations

import numpy as np
import pytest
from exl2cpp import _C
from exl2cpp.errors import InvalidArgumentError

HAVE_GPU = _C.cuda_compiled() and _C.cuda_device_count() > 0
CUDA = pytest.param(
    "cuda:0", marks=[pytest.mark.cuda, pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU")]
)
DEVICES = ["cpu", CUDA]


# ---- NumPy references (the HF code, line by line, in float64) ------------------------------------------------------


def ref_route(logits: np.ndarray, k: int, renormalize: bool):
    """HF: routing_weights = softmax(logits, fp32); topk(routing_weights, k); /= sum if renormalising. Ties: lower id."""
    l = logits.astype(np.float64)
    p = np.exp(l - l.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    # stable sort of -logit: descending, equal values in ascending id (softmax is monotone, so the order of p)
    ids = np.argsort(-l, axis=1, kind="stable")[:, :k].astype(np.int32)
    w = np.take_along_axis(p, ids, axis=1)
    if renormalize:
        w = w / w.sum(axis=1, keepdims=True)
    return ids, w


def ref_group(ids: np.ndarray, n_experts: int):
    flat = ids.reshape(-1)
    perm = np.argsort(flat, kind="stable").astype(np.int32)
    counts = np.bincount(flat, minlength=n_experts)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    inv = np.empty_like(perm)
    inv[perm] = np.arange(flat.size, dtype=np.int32)
    act = np.flatnonzero(counts).astype(np.int32)
    active = np.full(n_experts + 1, -1, np.int32)
    active[: act.size] = act
    active[n_experts] = act.size
    return offsets, perm, inv, active


def ref_combine(eo, weights, inv, shared=None, gate=None, out=None):
    rows, k = weights.shape
    e = eo.astype(np.float64)
    y = np.zeros((rows, eo.shape[1])) if out is None else out.astype(np.float64)
    routed = np.einsum("rk,rkh->rh", weights.astype(np.float64), e[inv.reshape(rows, k)])
    if shared is not None:
        routed += shared.astype(np.float64) / (1.0 + np.exp(-gate.astype(np.float64)))
    return y + routed


def assert_close(out, ref, tol, what):
    out = np.asarray(out, np.float64)
    assert out.shape == ref.shape, f"{what}: shape {out.shape} != {ref.shape}"
    assert np.all(np.isfinite(out)), f"{what}: non-finite"
    err = float(np.max(np.abs(out - ref))) if ref.size else 0.0
    scale = max(float(np.max(np.abs(ref))) if ref.size else 0.0, 1e-30)
    assert err <= tol * scale, f"{what}: max err {err:.3e} > {tol:.0e} * {scale:.3e}"


# ---- router ------------------------------------------------------------------------------------------------------

ROUTE_CASES = [
    (rows, e, k)
    for rows in (1, 7, 33)
    for e, k in ((4, 1), (4, 2), (8, 2), (60, 4), (64, 8), (16, 16))
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("renorm", [False, True], ids=["raw", "renorm"])
@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("rows,n_experts,k", ROUTE_CASES)
def test_route_matches_hf(device, renorm, dtype, rows, n_experts, k):
    rng = np.random.default_rng(rows * 1000 + n_experts * 10 + k)
    logits = (rng.standard_normal((rows, n_experts)) * 2).astype(
        np.float32 if dtype == "f32" else np.float16
    )
    ids, w = _C.op_moe_route(logits, k, renorm, device=device)
    rid, rw = ref_route(logits, k, renorm)
    np.testing.assert_array_equal(ids, rid)
    np.testing.assert_allclose(w, rw, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_route_hand(device):
    # p = (0.1, 0.2, 0.3, 0.4): top-2 = experts 3, 2 with 0.4, 0.3; renormalised 4/7, 3/7
    logits = np.log(np.array([[0.1, 0.2, 0.3, 0.4]], np.float32))
    ids, w = _C.op_moe_route(logits, 2, False, device=device)
    assert ids.tolist() == [[3, 2]]
    np.testing.assert_allclose(w, [[0.4, 0.3]], rtol=1e-6)
    ids, w = _C.op_moe_route(logits, 2, True, device=device)
    np.testing.assert_allclose(w, [[4 / 7, 3 / 7]], rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_route_ties_and_nan(device):
    logits = np.array(
        [
            [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],  # all equal: the lowest ids, equal weights
            [0.0, 2.0, 5.0, 2.0, 5.0, 2.0],  # ties at the top and in the middle
            [np.nan, -np.inf, 3.0, np.nan, -1.0, 3.0],  # NaN below -inf: never before a number
        ],
        np.float32,
    )
    ids, w = _C.op_moe_route(logits, 4, True, device=device)
    assert ids.tolist() == [[0, 1, 2, 3], [2, 4, 1, 3], [2, 5, 4, 1]]
    np.testing.assert_allclose(w[0], [0.25] * 4, rtol=1e-6)
    np.testing.assert_allclose(w[1], ref_route(logits[1:2], 4, True)[1][0], rtol=1e-6)
    ids, _ = _C.op_moe_route(logits[2:], 6, False, device=device)
    assert ids.tolist() == [[2, 5, 4, 1, 0, 3]]


# ---- grouping ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "rows,n_experts,k", [(1, 8, 2), (5, 4, 4), (19, 64, 8), (300, 60, 4), (2, 1024, 1)]
)
def test_group_invariants(device, rows, n_experts, k):
    rng = np.random.default_rng(rows + n_experts + k)
    ids = np.stack([rng.choice(n_experts, k, replace=False) for _ in range(rows)]).astype(np.int32)
    off, perm, inv, active = _C.op_moe_group(ids, n_experts, device=device)
    for got, ref, name in zip(
        (off, perm, inv, active), ref_group(ids, n_experts), ("offsets", "perm", "inv", "active")
    ):
        np.testing.assert_array_equal(got, ref, err_msg=name)
    flat = ids.reshape(-1)
    assert sorted(perm.tolist()) == list(range(flat.size))  # a permutation
    assert np.all(inv[perm] == np.arange(flat.size))
    for e in range(n_experts):  # expert e's run holds exactly its pairs, in token order
        run = perm[off[e] : off[e + 1]]
        assert np.all(flat[run] == e) and np.all(np.diff(run) > 0)


@pytest.mark.parametrize("device", DEVICES)
def test_group_hand(device):
    ids = np.array([[2, 0], [0, 3], [2, 3]], np.int32)  # pairs 0..5 = experts 2 0 0 3 2 3
    off, perm, inv, active = _C.op_moe_group(ids, 5, device=device)
    assert off.tolist() == [0, 2, 2, 4, 6, 6]
    assert perm.tolist() == [1, 2, 0, 4, 3, 5]
    assert inv.tolist() == [2, 0, 1, 4, 3, 5]
    assert active.tolist() == [0, 2, 3, -1, -1, 3]


# ---- combine -----------------------------------------------------------------------------------------------------


def combine_inputs(rng, rows, k, hidden, dtype, n_experts=16):
    npd = np.float32 if dtype == "f32" else np.float16
    ids = np.stack([rng.choice(n_experts, k, replace=False) for _ in range(rows)]).astype(np.int32)
    _, _, inv, _ = ref_group(ids, n_experts)
    w = rng.uniform(0, 1, (rows, k)).astype(np.float32)
    eo = rng.standard_normal((rows * k, hidden)).astype(npd)
    shared = rng.standard_normal((rows, hidden)).astype(npd)
    gate = rng.standard_normal((rows, 1)).astype(np.float32)
    out = rng.standard_normal((rows, hidden)).astype(npd)
    return eo, w, inv, shared, gate, out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("rows,k,hidden", [(1, 2, 64), (7, 4, 257), (33, 8, 576), (3, 1, 1000)])
@pytest.mark.parametrize("mode", ["plain", "shared", "add", "shared_add"])
def test_combine(device, dtype, rows, k, hidden, mode):
    rng = np.random.default_rng(rows * 7 + k + hidden)
    eo, w, inv, shared, gate, out = combine_inputs(rng, rows, k, hidden, dtype)
    kw = {}
    if "shared" in mode:
        kw.update(shared=shared, shared_gate=gate if dtype == "f32" else gate.astype(np.float16))
    if "add" in mode:
        kw.update(out=out)
    got = _C.op_moe_combine(eo, w, inv, hidden=hidden, device=device, **kw)
    ref = ref_combine(eo, w, inv, kw.get("shared"), kw.get("shared_gate"), kw.get("out"))
    assert_close(got, ref, 3e-6 if dtype == "f32" else 3e-3, f"combine {mode}")


@pytest.mark.parametrize("device", DEVICES)
def test_combine_hand(device):
    eo = np.array([[1.0, 2.0], [10.0, 20.0], [100.0, 200.0], [-1.0, 5.0]], np.float32)
    w = np.array([[0.5, 0.25], [1.0, 2.0]], np.float32)
    inv = np.array([2, 0, 3, 1], np.int32)  # row 0 reads positions 2, 0; row 1 reads 3, 1
    got = _C.op_moe_combine(eo, w, inv, hidden=2, device=device)
    np.testing.assert_allclose(got, [[50.25, 100.5], [19.0, 45.0]], rtol=1e-7)
    sh = np.array([[4.0, 8.0], [2.0, 2.0]], np.float32)
    gate = np.array([[0.0], [np.log(3.0)]], np.float32)  # sigmoid 0.5 and 0.75
    got = _C.op_moe_combine(
        eo, w, inv, shared=sh, shared_gate=gate, out=np.ones((2, 2), np.float32), device=device
    )
    np.testing.assert_allclose(got, [[53.25, 105.5], [21.5, 47.5]], rtol=1e-6)


# ---- argument errors ---------------------------------------------------------------------------------------------


def test_errors():
    l = np.zeros((2, 8), np.float32)
    with pytest.raises(InvalidArgumentError, match="k must be in"):
        _C.op_moe_route(l, 9, True)
    with pytest.raises(InvalidArgumentError, match="k must be in"):
        _C.op_moe_route(l, 0, True)
    with pytest.raises(InvalidArgumentError, match="experts"):
        _C.op_moe_route(np.zeros((2, 1025), np.float32), 2, True)
    with pytest.raises(InvalidArgumentError, match=r"ids\[1, 0\] must be an expert in \[0, 8\)"):
        _C.op_moe_group(np.array([[0, 1], [8, 2]], np.int32), 8)
    with pytest.raises(InvalidArgumentError, match="ids must be"):
        _C.op_moe_group(np.zeros((2, 2), np.int16), 8)
    eo = np.zeros((4, 3), np.float32)
    w = np.zeros((2, 2), np.float32)
    with pytest.raises(InvalidArgumentError, match=r"inv\[3\] must be a position"):
        _C.op_moe_combine(eo, w, np.array([0, 1, 2, 4], np.int32), hidden=3)
    with pytest.raises(InvalidArgumentError, match="expert_out must be"):
        _C.op_moe_combine(eo, w, np.arange(4, dtype=np.int32), hidden=5)
    with pytest.raises(InvalidArgumentError, match="given together"):
        _C.op_moe_combine(
            eo, w, np.arange(4, dtype=np.int32), shared=np.zeros((2, 3), np.float32), hidden=3
        )


# ---- CUDA against the CPU op (fresh inputs each run), bitwise repeatable ------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("seed", range(4))
def test_cuda_route_group_combine_vs_cpu(seed):
    rng = np.random.default_rng(np.random.SeedSequence().entropy)  # fresh inputs every run
    rows, n_experts = int(rng.integers(1, 300)), int(rng.choice([8, 60, 64, 128]))
    k = int(rng.integers(1, 9))
    logits = rng.standard_normal((rows, n_experts)).astype(np.float16)
    ids_c, w_c = _C.op_moe_route(logits, k, True, device="cpu")
    ids_g, w_g = _C.op_moe_route(logits, k, True, device="cuda:0")
    np.testing.assert_array_equal(ids_g, ids_c)
    np.testing.assert_allclose(w_g, w_c, rtol=1e-6)
    for a, b in zip(
        _C.op_moe_group(ids_c, n_experts, device="cuda:0"), _C.op_moe_group(ids_c, n_experts)
    ):
        np.testing.assert_array_equal(a, b)
    hidden = int(rng.integers(1, 2000))
    eo, w, inv, shared, gate, out = combine_inputs(rng, rows, k, hidden, "f16", n_experts)
    args = {"shared": shared, "shared_gate": gate, "out": out, "hidden": hidden}
    g1 = _C.op_moe_combine(eo, w, inv, device="cuda:0", **args)
    g2 = _C.op_moe_combine(eo, w, inv, device="cuda:0", **args)
    c = _C.op_moe_combine(eo, w, inv, device="cpu", **args)
    assert g1.tobytes() == g2.tobytes()  # deterministic
    assert_close(g1, ref_combine(eo, w, inv, shared, gate, out), 3e-3, "cuda combine")
    assert_close(g1, c.astype(np.float64), 3e-3, "cuda vs cpu combine")


# ---- the experts of one projection (linear/moe_linear.h MoeExperts) ---------------------------------------------
# Random EXL2 experts (the repo's packer, tests/test_exl2_cuda.py random_layer: each expert its own bit mix, as
# ExLlamaV2 quantizes each expert separately) and dense f16 experts, against float64 NumPy of the (bit-exactly
# dequantized) weights: y[p] = x[src(p)] @ W_e(p), src(p) = perm[p] // k (gather) or p (position order).

EXPERT_BITS = [
    ([4, 3], [128, 128]),
    ([5, 4, 2], [64, 128, 64]),
    ([8, 4], [32, 224]),
    ([6, 3], [96, 160]),
]
# out not a multiple of 32 (the format pads to 32) nor of the kernel's 128 columns
N_IN, N_OUT = 256, 200


def _expert_file(tmp_path_factory, kind: str, n_experts: int, poison: int | None = None):
    from test_exl2_cuda import random_layer, write_safetensors

    rng = np.random.default_rng(n_experts * 31 + (poison or 0) + (kind == "dense"))
    tensors, weights = {}, []
    for e in range(n_experts):
        if kind == "exl2":
            bits, rows = EXPERT_BITS[e % len(EXPERT_BITS)]
            t = random_layer(rng, N_IN, N_OUT, bits, rows)
            tensors.update({f"experts.{e}.{k}": v for k, v in t.items()})
            # [in, out], bit-exact
            weights.append(_C.exl2_dequantize(t, out_features=N_OUT).astype(np.float64))
        else:
            w = (rng.standard_normal((N_OUT, N_IN)) * 0.05).astype(np.float16)
            if e == poison:  # an expert no token chooses: NaN weights must never reach y
                w[:] = np.nan
            tensors[f"experts.{e}.weight"] = w
            weights.append(w.astype(np.float64).T)
    path = tmp_path_factory.mktemp("moe") / f"{kind}{n_experts}.safetensors"
    write_safetensors(path, tensors)
    return str(path), [f"experts.{e}" for e in range(n_experts)], weights


_files: dict = {}


@pytest.fixture(scope="module")
def expert_files(tmp_path_factory):
    def get(kind, n_experts, poison=None):
        key = (kind, n_experts, poison)
        if key not in _files:
            _files[key] = _expert_file(tmp_path_factory, kind, n_experts, poison)
        return _files[key]

    return get


def random_ids(rng, rows, n_experts, k, avoid=None):
    pool = [e for e in range(n_experts) if e != avoid]
    return np.stack([rng.choice(pool, k, replace=False) for _ in range(rows)]).astype(np.int32)


def ref_experts(x, ids, weights, gather):
    k = ids.shape[1]
    _, perm, _, _ = ref_group(ids, len(weights))
    flat = ids.reshape(-1)
    src = perm // k if gather else np.arange(perm.size)
    return np.stack([x[s].astype(np.float64) @ weights[flat[perm[p]]] for p, s in enumerate(src)])


def run_experts(path, prefixes, x, ids, gather, device, repeats=1):
    return _C.moe_experts_forward(
        path, prefixes, x, ids, N_IN, N_OUT, gather=gather, device=device, repeats=repeats
    )


def rel_l2(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("kind", ["exl2", "dense"])
@pytest.mark.parametrize("gather", [True, False], ids=["gather", "positions"])
@pytest.mark.parametrize("rows,n_experts,k", [(1, 4, 1), (5, 8, 2), (19, 16, 4), (7, 8, 8)])
def test_experts_cpu(expert_files, kind, gather, rows, n_experts, k):
    path, prefixes, weights = expert_files(kind, n_experts)
    rng = np.random.default_rng(rows + 10 * k)
    ids = random_ids(rng, rows, n_experts, k)
    x = rng.standard_normal((rows if gather else rows * k, N_IN)).astype(np.float32)
    r = run_experts(path, prefixes, x, ids, gather, "cpu")
    assert r["path"] == "per_expert"
    ref = ref_experts(x, ids, weights, gather)
    assert rel_l2(r["y"], ref) < 1e-6  # fp32 accumulation of exactly dequantized weights
    chosen = np.unique(ids)
    # each chosen expert once, nothing else
    assert r["bytes_read"] == sum(r["weight_bytes"][e] for e in chosen)


def test_experts_hand():
    # a 2-in, 1-out dense expert per id: W_e = [[e, 1]]; y[p] = x[src(p)] @ W_e^T
    import tempfile
    from pathlib import Path

    from test_exl2_cuda import write_safetensors

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "hand.safetensors"
        write_safetensors(path, {f"e.{e}.weight": np.array([[e, 1]], np.float16) for e in range(3)})
        # positions: expert 0: pair 1; expert 1: pair 2; expert 2: pairs 0, 3
        ids = np.array([[2, 0], [1, 2]], np.int32)
        x = np.array([[1.0, 10.0], [3.0, 100.0]], np.float32)
        r = _C.moe_experts_forward(str(path), ["e.0", "e.1", "e.2"], x, ids, 2, 1, device="cpu")
        # p0: row 0 by expert 0 = 10; p1: row 1 by 1 = 103; p2: row 0 by 2 = 12; p3: row 1 by 2 = 106
        np.testing.assert_array_equal(r["y"][:, 0], [10.0, 103.0, 12.0, 106.0])


def test_experts_unchosen_never_read_cpu(expert_files):
    path, prefixes, _ = expert_files("dense", 8, poison=3)
    rng = np.random.default_rng(5)
    ids = random_ids(rng, 9, 8, 2, avoid=3)
    x = rng.standard_normal((9, N_IN)).astype(np.float32)
    r = run_experts(path, prefixes, x, ids, True, "cpu")
    assert np.all(np.isfinite(r["y"]))


def test_experts_errors(expert_files):
    path, prefixes, _ = expert_files("dense", 4)
    x = np.zeros((3, N_IN), np.float32)
    with pytest.raises(InvalidArgumentError, match="k must be in"):
        _C.moe_experts_forward(path, prefixes, x, np.zeros((3, 5), np.int32), N_IN, N_OUT)
    with pytest.raises(InvalidArgumentError, match="position order must have rows"):
        _C.moe_experts_forward(
            path, prefixes, x, np.zeros((3, 2), np.int32), N_IN, N_OUT, gather=False
        )
    with pytest.raises(InvalidArgumentError, match=r"x must be \[rows, 256\]"):
        _C.moe_experts_forward(
            path, prefixes, np.zeros((3, 7), np.float32), np.zeros((3, 1), np.int32), N_IN, N_OUT
        )


# ---- CUDA: the grouped kernels against the CPU op and float64 (fresh inputs), repeatable, chosen experts only -----


def kernel_rows(rows: int) -> int:
    """Rows per block of the grouped EXL2 kernel for a step of `rows` tokens (cuda/moe_exl2.cu)."""
    return 1 if rows == 1 else 2 if rows == 2 else 4 if rows <= 4 else 8 if rows <= 8 else 16


@pytest.mark.cuda
@pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["exl2", "dense"])
@pytest.mark.parametrize("gather", [True, False], ids=["gather", "positions"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13, 16, 17, 40, 64, 65])
@pytest.mark.parametrize("n_experts,k", [(8, 2), (16, 1), (64, 8)])
def test_cuda_experts_vs_cpu(expert_files, kind, gather, rows, n_experts, k):
    path, prefixes, weights = expert_files(kind, n_experts)
    rng = np.random.default_rng(np.random.SeedSequence().entropy)  # fresh inputs every run
    ids = random_ids(rng, rows, n_experts, k)
    x = rng.standard_normal((rows if gather else rows * k, N_IN)).astype(np.float16)
    r = run_experts(path, prefixes, x, ids, gather, "cuda:0", repeats=3)
    ys = r["y"]
    want = ("grouped_exl2" if kind == "exl2" else "grouped_dense") if rows <= 64 else "per_expert"
    assert r["path"] == want
    # the grouped kernels are bitwise repeatable (k slices reduced in order); the per-expert path runs each
    # expert through the dense layers' kernels, whose split-k adds partials with atomics (order varies)
    if r["path"] != "per_expert":
        assert ys[0].tobytes() == ys[1].tobytes() == ys[2].tobytes()
    else:
        assert rel_l2(ys[0], ys[1]) < 1e-3 and rel_l2(ys[0], ys[2]) < 1e-3
    ref = ref_experts(x, ids, weights, gather)
    cpu = run_experts(path, prefixes, x.astype(np.float32), ids, gather, "cpu")["y"]
    assert rel_l2(ys[0], ref) < 2e-3  # f16 output rounding ~3e-4, f16 x (exact in both)
    assert rel_l2(ys[0], cpu) < 2e-3
    if r["path"] == "per_expert":
        return
    # bytes the kernel's blocks streamed: each ACTIVE expert's weights once per row group of its rows, nothing else
    counts = np.bincount(ids.reshape(-1), minlength=n_experts)
    if kind == "exl2":
        m = kernel_rows(rows)
        want_bytes = sum(r["weight_bytes"][e] * -(-int(c) // m) for e, c in enumerate(counts) if c)
    else:
        want_bytes = sum(r["weight_bytes"][e] * -(-int(c) // 8) for e, c in enumerate(counts) if c)
    assert r["bytes_read"] == 3 * want_bytes
    # an inactive expert adds nothing: reading every expert (the inactive ones once) would cost more
    m = kernel_rows(rows) if kind == "exl2" else 8
    every = sum(r["weight_bytes"][e] * max(1, -(-int(c) // m)) for e, c in enumerate(counts))
    assert r["bytes_read"] < 3 * every or len(np.unique(ids)) == n_experts


@pytest.mark.cuda
@pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_cuda_experts_unchosen_never_read(expert_files, rows):
    path, prefixes, _ = expert_files("dense", 8, poison=3)
    rng = np.random.default_rng(rows)
    ids = random_ids(rng, rows, 8, 2, avoid=3)
    x = rng.standard_normal((rows, N_IN)).astype(np.float16)
    r = run_experts(path, prefixes, x, ids, True, "cuda:0")
    assert r["path"] == "grouped_dense" and np.all(np.isfinite(r["y"]))


@pytest.mark.cuda
@pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU")
def test_cuda_batch1_reads_topk_experts_only(expert_files):
    """A batch-1 decode step of a 64-expert, top-8 layer streams exactly the 8 chosen experts' weight bytes."""
    path, prefixes, _ = expert_files("exl2", 64)
    rng = np.random.default_rng(1)
    ids = random_ids(rng, 1, 64, 8)
    x = rng.standard_normal((1, N_IN)).astype(np.float16)
    r = run_experts(path, prefixes, x, ids, True, "cuda:0")
    assert r["path"] == "grouped_exl2"
    assert r["bytes_read"] == sum(r["weight_bytes"][e] for e in ids[0])


@pytest.mark.cuda
@pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["exl2", "dense"])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_cuda_graph_replay_route_group_experts_combine(expert_files, kind, rows):
    """route -> group -> experts -> combine captured once as a CUDA graph (no host sync inside), replayed with new
    router logits: each replay equals the eager step bit for bit and the float64 reference within f16 tolerance."""
    path, prefixes, weights = expert_files(kind, 16)
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, N_IN)).astype(np.float16)
    logits = [rng.standard_normal((rows, 16)).astype(np.float16) for _ in range(4)]
    g_out, e_out = _C.moe_graph_replay(path, prefixes, x, logits, 2, N_IN, N_OUT)
    for l, yg, ye in zip(logits, g_out, e_out):
        assert yg.tobytes() == ye.tobytes()
        ids, w = ref_route(l, 2, True)
        _, _, inv, _ = ref_group(ids, 16)
        eo = ref_experts(x, ids, weights, True)
        assert rel_l2(yg, ref_combine(eo, w, inv)) < 3e-3


# ---- whole MoE blocks of HF transformers (fp32) against the ops composed on the CPU -----------------------------


def _hf_block(arch: str, n_experts: int, k: int, norm: bool, hidden=48, inter=40):
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    if arch == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block

        cfg = tf.MixtralConfig(
            hidden_size=hidden,
            intermediate_size=inter,
            num_local_experts=n_experts,
            num_experts_per_tok=k,
        )
    elif arch == "qwen2_moe":
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock as Block

        cfg = tf.Qwen2MoeConfig(
            hidden_size=hidden,
            moe_intermediate_size=inter,
            num_experts=n_experts,
            num_experts_per_tok=k,
            norm_topk_prob=norm,
            shared_expert_intermediate_size=56,
        )
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block

        cfg = tf.Qwen3MoeConfig(
            hidden_size=hidden,
            moe_intermediate_size=inter,
            num_experts=n_experts,
            num_experts_per_tok=k,
            norm_topk_prob=norm,
        )
    torch.manual_seed(n_experts * 10 + k)
    block = Block(cfg).eval()
    with (
        torch.no_grad()
    ):  # random weights, rounded to f16 values so the f16 files hold them exactly
        for p in block.parameters():
            p.copy_((torch.randn_like(p) * 0.2).half().float())
    return torch, block


@pytest.mark.parametrize(
    "arch,n_experts,k,norm",
    [
        ("mixtral", 8, 2, True),
        ("qwen2_moe", 12, 4, False),
        ("qwen2_moe", 6, 2, True),
        ("qwen3_moe", 16, 8, True),
        ("qwen3_moe", 5, 3, False),
    ],
)
def test_hf_moe_block_composed(tmp_path, arch, n_experts, k, norm):
    from test_exl2_cuda import write_safetensors

    torch, block = _hf_block(arch, n_experts, k, norm)
    rows, hidden = 11, 48
    x = np.random.default_rng(k).standard_normal((rows, hidden)).astype(np.float32)
    with torch.no_grad():
        want = block(torch.from_numpy(x)[None]).numpy()[0].astype(np.float64)
    ex = block.experts
    gate_up = ex.gate_up_proj.detach().numpy()  # [E, 2I, H]
    down = ex.down_proj.detach().numpy()  # [E, H, I]
    inter = gate_up.shape[1] // 2
    files = {}
    for e in range(n_experts):
        files[f"e.{e}.gate.weight"] = gate_up[e, :inter].astype(np.float16)
        files[f"e.{e}.up.weight"] = gate_up[e, inter:].astype(np.float16)
        files[f"e.{e}.down.weight"] = down[e].astype(np.float16)
    path = tmp_path / "experts.safetensors"
    write_safetensors(path, files)
    names = lambda p: [f"e.{e}.{p}" for e in range(n_experts)]

    renorm = True if arch == "mixtral" else norm  # Mixtral always renormalises
    logits = x @ block.gate.weight.detach().numpy().T
    ids, w = _C.op_moe_route(logits.astype(np.float32), k, renorm)
    g = _C.moe_experts_forward(str(path), names("gate"), x, ids, hidden, inter)["y"]
    u = _C.moe_experts_forward(str(path), names("up"), x, ids, hidden, inter)["y"]
    act = _C.op_silu_mul(g, u)
    eo = _C.moe_experts_forward(str(path), names("down"), act, ids, inter, hidden, gather=False)[
        "y"
    ]
    _, _, inv, _ = _C.op_moe_group(ids, n_experts)
    kw = {}
    # Qwen2-MoE: the shared expert is a plain MLP (the decoder's dense ops), its gate a 1-column linear
    if arch == "qwen2_moe":
        se = block.shared_expert
        f = lambda lin, v: v @ lin.weight.detach().numpy().T
        a = f(se.gate_proj, x)
        kw["shared"] = f(se.down_proj, a / (1 + np.exp(-a)) * f(se.up_proj, x)).astype(np.float32)
        kw["shared_gate"] = f(block.shared_expert_gate, x).astype(np.float32)
    got = _C.op_moe_combine(eo, w, inv, hidden=hidden, **kw)
    assert rel_l2(got, want) < 1e-5
