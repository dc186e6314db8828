"""Helpers for the EXL2 tests: where the golden fixtures are, how to read them, and an independent NumPy
reference of the on-disk format (bit streams, fp16 dequantization) that the C++ code is checked against.

The fixtures (ExLlamaV2 0.3.2's own files) are ``exl2-smol4`` in the shared fixtures folder, never committed:
``$EXL2CPP_FIXTURES``, else ``../shared/fixtures`` beside the repository (conftest.fixtures_root).
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import fixtures_root, missing_fixtures

REPO = Path(__file__).resolve().parents[1]
TAGS = ("q25", "q40", "q60")
SUFFIXES = ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm", "q_perm", "bias")


def fixture_dir() -> Path | None:
    """The exl2-smol4 fixture folder, or None when it is not there."""
    d = fixtures_root() / "exl2-smol4"
    return d if (d / "fx_q40.safetensors").is_file() else None


def require_fixtures() -> Path:
    d = fixture_dir()
    if d is None:
        pytest.skip(missing_fixtures(fixtures_root() / "exl2-smol4"))
    return d


@functools.cache
def load_quant(tag: str) -> tuple[dict, dict]:
    """(tensors, config) of fixture quant `tag` (q25/q40/q60), read with the reference safetensors package."""
    from safetensors import safe_open

    with safe_open(str(require_fixtures() / f"fx_{tag}.safetensors"), "np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
        config = json.loads(f.metadata()["config"])
    return tensors, config


def linear_prefixes(tensors: dict) -> list[str]:
    return sorted(k[: -len(".q_weight")] for k in tensors if k.endswith(".q_weight"))


def layer(tensors: dict, prefix: str) -> dict:
    """The EXL2 tensors of one linear, keyed by their full names."""
    return {
        f"{prefix}.{s}": tensors[f"{prefix}.{s}"] for s in SUFFIXES if f"{prefix}.{s}" in tensors
    }


def short(layer_tensors: dict) -> dict:
    """Same tensors keyed by suffix only (q_weight, ...)."""
    return {k.rsplit(".", 1)[1]: v for k, v in layer_tensors.items()}


def exllama_orientation(tensors: dict, prefix: str, w: np.ndarray) -> np.ndarray:
    """ExLlamaV2 reorders the MLP at load (fixture README): with perm_down = argsort(down_proj.q_invperm),
    down_proj stays in packed row order and gate/up output columns are permuted. Apply that to W [in, out]."""
    if not prefix.endswith(("gate_proj", "up_proj", "down_proj")):
        return w
    mlp = prefix.rsplit(".", 1)[0]
    perm_down = np.argsort(tensors[f"{mlp}.down_proj.q_invperm"], kind="stable")
    return w[perm_down] if prefix.endswith("down_proj") else w[:, perm_down]


def assemble_fixture_models() -> Path:
    """Run the fixture's assemble.py once into <repo>/.fixtures/exl2-smol4 (ignored by git) and return that
    folder, which then holds loadable EXL2 models q25/, q40/, q60/. Skips the test when the fixtures are absent."""
    src = require_fixtures()
    out = REPO / ".fixtures" / "exl2-smol4"
    if not all(
        (out / t / "model.safetensors").is_file() and (out / t / "config.json").is_file()
        for t in TAGS
    ):
        out.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, str(src / "assemble.py"), str(out), *TAGS],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return out


# ---- independent NumPy reference of the format (spec §1.5/1.6, fixture README steps 1-8) ----------------------


def np_groups(q_groups: np.ndarray, qrows: int, n_in: int) -> list[tuple[int, int, int, int]]:
    """[(bits, qrow_start, qrows, rows)] per group; the last group ends at q_weight.shape[0] and at n_in."""
    qg = q_groups.astype(np.int64)
    bits, starts = qg[0::2], qg[1::2]
    ends = np.append(starts[1:], qrows)
    out, row = [], 0
    for b, s, e in zip(bits, starts, ends):
        rows = min((e - s) * 32 // b, n_in - row)
        out.append((int(b), int(s), int(e - s), int(rows)))
        row += rows
    return out


def np_unpack_stream(words: np.ndarray, bits: int, rows: int) -> np.ndarray:
    """words uint32 [qrows, cols] -> codes [rows, cols]: per column one little-endian bit stream."""
    cols = words.shape[1]
    by = np.ascontiguousarray(words.astype("<u4").T).view(np.uint8).reshape(cols, -1)
    stream = np.unpackbits(by, axis=1, bitorder="little")[:, : rows * bits].reshape(
        cols, rows, bits
    )
    return (stream.astype(np.int64) << np.arange(bits)).sum(-1).T


def np_pack_stream(codes: np.ndarray, bits: int) -> np.ndarray:
    """codes [rows, cols] -> words uint32 [ceil(rows*bits/32), cols], the inverse of np_unpack_stream."""
    rows, cols = codes.shape
    qrows = -(-rows * bits // 32)
    b = ((codes.astype(np.int64)[:, :, None] >> np.arange(bits)) & 1).astype(
        np.uint8
    )  # [rows, cols, bits]
    stream = np.zeros((cols, qrows * 32), np.uint8)
    stream[:, : rows * bits] = b.transpose(1, 0, 2).reshape(cols, rows * bits)
    by = np.packbits(stream, axis=1, bitorder="little")
    return np.ascontiguousarray(by).view("<u4").reshape(cols, qrows).T.astype(np.uint32)


def np_unpack(t: dict) -> dict:
    """Codes [in, out_pad] (packed row order), nibbles [G, out_pad], groups, perm from suffix-keyed tensors."""
    qw = t["q_weight"].view(np.uint32)
    n_in = t["q_invperm"].shape[0]
    groups = np_groups(t["q_groups"], qw.shape[0], n_in)
    codes = np.concatenate([np_unpack_stream(qw[s : s + q], b, r) for b, s, q, r in groups])
    qs = t["q_scale"].view(np.uint32)
    nib = ((qs[:, :, None] >> (4 * np.arange(8, dtype=np.uint32))) & 15).reshape(qs.shape[0], -1)
    perm = np.argsort(t["q_invperm"], kind="stable")
    return {"codes": codes, "nibbles": nib, "groups": groups, "perm": perm}


def f16_mul(a, b) -> np.ndarray:
    """IEEE fp16 product with one round-to-nearest-even (the fp32 product of two fp16 values is exact)."""
    return (
        np.asarray(a, np.float16).astype(np.float32) * np.asarray(b, np.float16).astype(np.float32)
    ).astype(np.float16)


def np_dequantize(t: dict, prescale: float = 1.0, out_features: int | None = None) -> np.ndarray:
    """float16 W [in, out] in original input order, exactly as ExLlamaV2 (fixture README steps 1-8)."""
    u = np_unpack(t)
    msc = (t["q_scale_max"].astype(np.float32) * np.float32(prescale / 256)).astype(np.float16)
    scale = f16_mul(((u["nibbles"] + 1) ** 2).astype(np.float16), msc[:, None])  # [G, out_pad]
    gidx = np.concatenate([np.full(r, g) for g, (_, _, _, r) in enumerate(u["groups"])])
    zero = np.concatenate([np.full(r, 1 << (b - 1)) for b, _, _, r in u["groups"]])
    q = (u["codes"] - zero[:, None]).astype(np.float16)
    wp = f16_mul(q, scale[gidx])
    w = np.empty_like(wp)
    w[u["perm"]] = wp
    return w[:, : out_features if out_features is not None else w.shape[1]]
