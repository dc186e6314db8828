"""The CUDA EXL2 linear (cuda/exl2_gemm.cu) against the CPU reference: random layers packed by our packer (every
bit width, mixed widths, tiny/ragged groups, awkward in/out, bias, activations in the thousands) for row counts
1..300 through both paths (fused GEMV and dequantize + cuBLAS, forced by the threshold), bit-exact dequantized
weights read back through one-hot inputs (fp16-subnormal scales included), and every linear of the three
ExLlamaV2 fixture quants. Reference: _C.exl2_dequantize (bit-exact) and a float64 matmul. Skipped without a GPU.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from exl2cpp import _C, InvalidArgumentError

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not _C.cuda_compiled() or _C.cuda_device_count() == 0, reason="needs a CUDA GPU"
    ),
]

REPO = Path(__file__).resolve().parents[1]
FUSED, DEQUANT = 1 << 20, 0  # thresholds that force one path
TOL = 2e-3  # rel L2 vs float64 (f16 output rounding is ~3e-4)


# ---- helpers -----------------------------------------------------------------------------------------------------


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Minimal safetensors writer (little-endian, C order)."""
    names = {np.dtype("int32"): "I32", np.dtype("int16"): "I16", np.dtype("float16"): "F16"}
    header, blobs, off = {}, [], 0
    for k, a in tensors.items():
        a = np.ascontiguousarray(a)
        b = a.tobytes()
        header[k] = {
            "dtype": names[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [off, off + len(b)],
        }
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def random_layer(rng, n_in, n_out, bits, rows, *, bias=False, qsm_log2=(-12, -2)):
    """Suffix-keyed EXL2 tensors of a random layer (codes uniform, scale nibbles uniform, random perm)."""
    assert sum(rows) == n_in
    codes = np.concatenate([rng.integers(0, 1 << b, (r, n_out)) for b, r in zip(bits, rows)])
    nib = rng.integers(0, 16, (len(bits), n_out)).astype(np.uint8)
    qsm = (2.0 ** rng.uniform(*qsm_log2, len(bits))).astype(np.float16)
    perm = rng.permutation(n_in).astype(np.int32)
    t = _C.exl2_pack(codes.astype(np.uint8), list(bits), list(rows), nib, qsm, perm, n_out)
    if bias:
        t["bias"] = rng.uniform(-1, 1, n_out).astype(np.float16)
    return t


def save_layer(tmp_path: Path, t: dict, prefix="layer") -> str:
    path = tmp_path / f"{prefix}.safetensors"
    write_safetensors(path, {f"{prefix}.{k}": v for k, v in t.items()})
    return str(path)


def reference(t: dict, x: np.ndarray, n_out: int) -> np.ndarray:
    w = _C.exl2_dequantize(t, out_features=n_out).astype(np.float64)  # [in, out], bit-exact
    y = x.astype(np.float64) @ w
    if "bias" in t:
        y += t["bias"].astype(np.float64)
    return y


def rel_l2(a, b) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def gpu(path, x, n_out, threshold=-1, prefix="layer"):
    return _C.exl2_linear_forward(path, prefix, x, "cuda", out_features=n_out, threshold=threshold)


# ---- random layers, both paths -------------------------------------------------------------------------------------

LAYERS = [
    # (in, out, bits per group, rows per group)
    *[(160, 100, [b], [160]) for b in (2, 3, 4, 5, 6, 8)],
    (224, 7, [8, 6, 5, 4, 3, 2], [32, 32, 32, 32, 64, 32]),
    (96, 257, [6, 3, 2], [32, 32, 32]),
    (48, 40, [4, 2], [32, 16]),  # a 16-row 2-bit group
    (100, 31, [4, 4, 4, 4], [32, 32, 32, 4]),  # ragged last group
    (70, 50, [3, 3], [64, 6]),  # ragged 3-bit tail
    (44, 64, [8, 6, 2], [4, 16, 24]),  # 4-row 8-bit and 16-row 6-bit groups
    (1000, 1100, [8, 6, 5, 4, 4, 3, 2], [32, 64, 128, 256, 256, 128, 136]),
]
ROWS = [1, 2, 3, 7, 9, 12, 16, 17, 33, 128, 300]


@pytest.mark.parametrize("n_in,n_out,bits,rows", LAYERS)
def test_random_layers_both_paths(tmp_path, n_in, n_out, bits, rows):
    rng = np.random.default_rng(n_in * 7919 + n_out)
    t = random_layer(rng, n_in, n_out, bits, rows, bias=n_out % 2 == 1)
    path = save_layer(tmp_path, t)
    for m in ROWS:
        x = rng.standard_normal((m, n_in)).astype(np.float16)
        want = reference(t, x, n_out)
        for thr in (FUSED, DEQUANT, -1):
            got = gpu(path, x, n_out, thr)
            assert got.shape == (m, n_out) and got.dtype == np.float32
            err = rel_l2(got, want)
            assert err < TOL, f"m={m} threshold={thr}: rel L2 {err:.2e}"


def test_f32_activations(tmp_path):
    """f32 x goes through dequantize + SGEMM (no f16 rounding anywhere but W): much tighter."""
    rng = np.random.default_rng(5)
    t = random_layer(rng, 224, 70, [8, 6, 5, 4, 3, 2], [32, 32, 32, 32, 64, 32], bias=True)
    path = save_layer(tmp_path, t)
    for m in (1, 5, 40, 300):
        x = rng.standard_normal((m, 224)).astype(np.float32)
        assert rel_l2(gpu(path, x, 70), reference(t, x, 70)) < 1e-5


def test_large_activations_do_not_overflow(tmp_path):
    """Activations of a few thousand: fp32 accumulation keeps y finite and accurate."""
    rng = np.random.default_rng(6)
    t = random_layer(rng, 512, 96, [6, 4, 3], [128, 256, 128], bias=True, qsm_log2=(-6, -4))
    path = save_layer(tmp_path, t)
    x = rng.uniform(-4000, 4000, (16, 512)).astype(np.float16)
    want = reference(t, x, 96)
    assert np.abs(want).max() < 60000
    for thr in (FUSED, DEQUANT):
        got = gpu(path, x, 96, thr)
        assert np.isfinite(got).all()
        assert rel_l2(got, want) < TOL


def check_hand_computed(tmp_path, n_in: int, group_rows: list[int]) -> None:
    """4-bit groups of group_rows, every code z+1 and nibble 15: s = 256 * (1/256) = 1, so W = 1 and
    y = sum(x) + bias, exact in fp32: 3 rows of x through both paths, 12 rows through the 9-16-row kernels."""
    n_out = 40
    codes = np.full((n_in, n_out), 9, np.uint8)  # q - 8 = 1
    nib = np.full((len(group_rows), n_out), 15, np.uint8)
    t = _C.exl2_pack(codes, [4] * len(group_rows), group_rows, nib, np.ones(len(group_rows), np.float16),
                     np.arange(n_in)[::-1].copy(), n_out)  # fmt: skip
    t["bias"] = np.full(n_out, 0.5, np.float16)
    path = save_layer(tmp_path, t)
    x = np.zeros((3, n_in), np.float16)
    x[0] = 1
    x[1, :10] = 2
    x[2, 5] = -3
    want = np.array([n_in + 0.5, 20.5, -2.5])[:, None] * np.ones((1, n_out))
    for thr in (FUSED, DEQUANT):
        np.testing.assert_array_equal(gpu(path, x, n_out, thr), want)
    np.testing.assert_array_equal(gpu(path, np.tile(x, (4, 1)), n_out, FUSED), np.tile(want, (4, 1)))


def test_hand_computed(tmp_path):
    check_hand_computed(tmp_path, 64, [32, 32])


@pytest.mark.parametrize("bits", [[8], [6], [5], [4], [3], [2], [8, 6, 5, 4, 3, 2]])
def test_dequantized_weights_bit_exact(tmp_path, bits):
    """x = identity reads W back row by row: y[k] = f16(1 * W[k]) exactly, for both paths; scales span the
    fp16-subnormal range of msc (q_scale_max < 2^-6)."""
    n_in = 32 * len(bits) + (16 if bits[-1] in (2, 4, 8) else 0)
    rows = [32] * len(bits)
    rows[-1] += n_in - sum(rows)
    rng = np.random.default_rng(sum(bits))
    t = random_layer(rng, n_in, 72, bits, rows, qsm_log2=(-16, 0))
    path = save_layer(tmp_path, t)
    w = _C.exl2_dequantize(t, out_features=72).astype(np.float32)
    x = np.eye(n_in, dtype=np.float16)
    for thr in (FUSED, DEQUANT):
        np.testing.assert_array_equal(gpu(path, x, 72, thr), w)


def test_rejects_bad_input(tmp_path):
    rng = np.random.default_rng(7)
    t = random_layer(rng, 64, 32, [4], [64])
    path = save_layer(tmp_path, t)
    with pytest.raises(InvalidArgumentError):
        gpu(path, np.zeros((2, 63), np.float16), 32)


@pytest.mark.slow
def test_llama_sized_layer(tmp_path):
    """A 4096 -> 11008 layer (Llama-2-7B up_proj) at a realistic 4.0 bpw mix."""
    n_in, n_out = 4096, 11008
    bits, rows = [8, 5, 4, 3], [128, 1024, 2432, 512]
    rng = np.random.default_rng(8)
    t = random_layer(rng, n_in, n_out, bits, rows)
    path = save_layer(tmp_path, t)
    w = _C.exl2_dequantize(t, out_features=n_out).astype(np.float32)
    for m in (1, 4, 12, 16, 33, 128, 300):
        x = rng.standard_normal((m, n_in)).astype(np.float16)
        want = x.astype(np.float32) @ w
        for thr in (FUSED, DEQUANT):
            assert rel_l2(gpu(path, x, n_out, thr), want) < TOL, (m, thr)


# ---- the ExLlamaV2 fixture quants ----------------------------------------------------------------------------------


def fixture_files() -> list[Path]:
    """fx_q25/q40/q60.safetensors from <fixtures>/exl2-smol4 (conftest.fixtures_root) or the model folders
    assemble_fixture_models writes to .fixtures/exl2-smol4."""
    from conftest import fixtures_root

    cands = [fixtures_root() / "exl2-smol4", REPO / ".fixtures/exl2-smol4"]
    for c in cands:
        raw = [c / f"fx_{t}.safetensors" for t in ("q25", "q40", "q60")]
        if all(p.is_file() for p in raw):
            return raw
        built = [c / t / "model.safetensors" for t in ("q25", "q40", "q60")]
        if all(p.is_file() for p in built):
            return built
    return []


@pytest.mark.parametrize("which", [0, 1, 2], ids=["q25", "q40", "q60"])
def test_fixture_linears(which):
    files = fixture_files()
    if not files:
        from conftest import fixtures_root, missing_fixtures

        pytest.skip(missing_fixtures(fixtures_root() / "exl2-smol4"))
    path = str(files[which])
    tensors = _C.read_safetensors(path)
    prefixes = sorted(k[: -len(".q_weight")] for k in tensors if k.endswith(".q_weight"))
    assert len(prefixes) >= 28
    rng = np.random.default_rng(which)
    for prefix in prefixes:
        t = {
            s: tensors[f"{prefix}.{s}"]
            for s in ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm", "bias")
            if f"{prefix}.{s}" in tensors
        }
        n_in, n_out = (
            t["q_invperm"].shape[0],
            t["q_weight"].shape[1],
        )  # fixture outs are multiples of 32
        for m in (1, 7, 12, 40):
            x = rng.standard_normal((m, n_in)).astype(np.float16)
            want = reference(t, x, n_out)
            for thr in (FUSED, DEQUANT):
                err = rel_l2(gpu(path, x, n_out, thr, prefix=prefix), want)
                assert err < TOL, f"{prefix} m={m} threshold={thr}: rel L2 {err:.2e}"
