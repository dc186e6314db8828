"""Every op of cpp/ops/ops.h on every backend against float64 NumPy references written here.

A registry of cases (awkward shapes, dtypes, GQA ratios, paged layouts) plus one checker; a few hand-computed
cases so a wrong oracle cannot hide; and argument errors that must raise InvalidArgumentError.

Tolerances are relative to the largest reference magnitude of each output: ``|out - ref| <= tol * max|ref|``
elementwise, with tol = 3e-5 for f32 activations (fp32 accumulation over K <= 1536 terms) and 3e-3 for f16
activations (f16 rounding of inputs/outputs, half an ulp = 4.9e-4 relative, plus accumulation).
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass, field

import numpy as np
import pytest
from exl2cpp import _C
from exl2cpp.errors import InvalidArgumentError


def _cuda_count() -> int:
    fn = getattr(_C, "cuda_device_count", None)
    try:
        return int(fn()) if fn else 0
    except Exception:  # noqa: BLE001 - a build without CUDA may raise instead of returning 0
        return 0


CUDA = pytest.param(
    "cuda:0",
    marks=[pytest.mark.cuda, pytest.mark.skipif(_cuda_count() == 0, reason="no CUDA device")],
)
DEVICES = ["cpu", CUDA]

TOL = {"f32": 3e-5, "f16": 3e-3}
NP_ACT = {"f32": np.float32, "f16": np.float16}


# ---- dtype helpers ----------------------------------------------------------------------------------------


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest-even), returned as uint16 raw bits."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_bits_to_f64(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def make_float(rng, shape, dtype: str, scale=1.0):
    """Random tensor in `dtype` ('f32'|'f16'|'bf16'): (array to pass, dtype override arg, exact float64 values)."""
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    if dtype == "bf16":
        bits = f32_to_bf16_bits(x)
        return bits, "bf16", bf16_bits_to_f64(bits)
    arr = x.astype(np.float16) if dtype == "f16" else x
    return arr, "", arr.astype(np.float64)


def as_f64(out: np.ndarray, dtype: str) -> np.ndarray:
    return bf16_bits_to_f64(out) if dtype == "bf16" else out.astype(np.float64)


def assert_close(out, ref, tol, what):
    out = np.asarray(out, dtype=np.float64)
    assert out.shape == ref.shape, f"{what}: shape {out.shape} != {ref.shape}"
    assert np.all(np.isfinite(out)), f"{what}: non-finite output"
    scale = max(float(np.max(np.abs(ref))) if ref.size else 0.0, 1e-30)
    err = float(np.max(np.abs(out - ref))) if ref.size else 0.0
    assert err <= tol * scale, f"{what}: max abs err {err:.3e} > {tol:.1e} * max|ref| {scale:.3e}"


# ---- references (float64) ---------------------------------------------------------------------------------


def ref_rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def ref_rope_table(max_pos, head_dim, theta=10000.0):
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ang = np.arange(max_pos, dtype=np.float64)[:, None] * inv[None, :]
    return np.concatenate([np.cos(ang), np.sin(ang)], axis=1).astype(np.float32)


def ref_rope(x, positions, cos_sin):
    half = x.shape[-1] // 2
    cs = cos_sin.astype(np.float64)[positions]  # [n, head_dim]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def ref_silu_mul(g, u):
    return g / (1.0 + np.exp(-g)) * u


def ref_gelu_tanh_mul(g, u):
    return 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g**3))) * u


def ref_layer_norm(x, w, eps):
    c = x - x.mean(axis=-1, keepdims=True)
    return c / np.sqrt(np.mean(c * c, axis=-1, keepdims=True) + eps) * w


def ref_attention(q, k_seq, v_seq, positions, seq_of_token, scale, window=0, softcap=0.0):
    """q [n, H, D]; k_seq/v_seq: per sequence [L, Hkv, D] (float64). window > 0: the row at position p sees keys
    p - window + 1 .. p; softcap > 0: scores softcap * tanh(score / softcap)."""
    n, n_heads, _ = q.shape
    out = np.zeros_like(q)
    for t in range(n):
        first = max(0, positions[t] + 1 - window) if window > 0 else 0
        k = k_seq[seq_of_token[t]][first : positions[t] + 1]
        v = v_seq[seq_of_token[t]][first : positions[t] + 1]
        group = n_heads // k.shape[1]
        for h in range(n_heads):
            s = k[:, h // group, :] @ q[t, h] * scale
            if softcap > 0:
                s = softcap * np.tanh(s / softcap)
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ v[:, h // group, :]
    return out


# ---- paged layout builder ---------------------------------------------------------------------------------


def make_paged(rng, seq_lens, page_size, n_heads_kv, head_dim, cache_dtype, spare_pages=3):
    """Random per-sequence K/V, scattered into shuffled pages. Returns (k_pages, v_pages, page_table, k_seq,
    v_seq) with k_seq/v_seq the float64 values the cache holds (after rounding to the cache dtype)."""
    pages_per_seq = max(math.ceil(max(seq_lens) / page_size), 1) + 1
    n_pages = len(seq_lens) * pages_per_seq + spare_pages
    perm = rng.permutation(n_pages).astype(np.int32)
    page_table = perm[: len(seq_lens) * pages_per_seq].reshape(len(seq_lens), pages_per_seq).copy()
    npd = NP_ACT[cache_dtype]
    k_pages = (rng.standard_normal((n_pages, page_size, n_heads_kv, head_dim)) * 9).astype(
        npd
    )  # garbage
    v_pages = (rng.standard_normal((n_pages, page_size, n_heads_kv, head_dim)) * 9).astype(npd)
    k_seq, v_seq = [], []
    for s, length in enumerate(seq_lens):
        k = rng.standard_normal((length, n_heads_kv, head_dim)).astype(npd)
        v = rng.standard_normal((length, n_heads_kv, head_dim)).astype(npd)
        for j in range(length):
            k_pages[page_table[s, j // page_size], j % page_size] = k[j]
            v_pages[page_table[s, j // page_size], j % page_size] = v[j]
        k_seq.append(k.astype(np.float64))
        v_seq.append(v.astype(np.float64))
    return k_pages, v_pages, page_table, k_seq, v_seq


# ---- the registry -----------------------------------------------------------------------------------------


@dataclass
class Case:
    op: str
    params: dict = field(default_factory=dict)

    @property
    def id(self):
        return self.op + "-" + "-".join(f"{k}{v}" for k, v in self.params.items())


CASES: list[Case] = []
for act in ("f32", "f16"):
    for wd in ("f32", "f16", "bf16"):
        CASES.append(
            Case("embedding", {"n": 19, "vocab": 50, "hidden": 111, "table": wd, "act": act})
        )
        CASES.append(
            Case("rms_norm", {"rows": 19, "hidden": 111, "w": wd, "act": act, "inplace": False})
        )
    CASES.append(
        Case("rms_norm", {"rows": 3, "hidden": 576, "w": "bf16", "act": act, "inplace": True})
    )
    CASES.append(
        Case("rms_norm", {"rows": 1, "hidden": 64, "w": "f32", "act": act, "inplace": False})
    )
    for wd in ("f32", "bf16"):
        for rows, hidden, inplace in ((19, 111, False), (3, 2304, True)):
            CASES.append(
                Case("layer_norm", {"rows": rows, "hidden": hidden, "w": wd, "act": act, "inplace": inplace})
            )
    for alias in ("", "gate", "up"):
        CASES.append(Case("gelu_tanh_mul", {"shape": (19, 111), "act": act, "alias": alias}))
    for s_, cap, inplace in ((1.0 / 12.0, 0.0, False), (2.5, 30.0, True), (-0.5, 0.0, True)):
        CASES.append(Case("scale", {"shape": (19, 111), "s": s_, "cap": cap, "act": act, "inplace": inplace}))
    for hd in (64, 128, 256):
        CASES.append(Case("rope", {"n": 19, "heads": 3, "head_dim": hd, "act": act}))
    CASES.append(Case("rope", {"n": 1, "heads": 9, "head_dim": 64, "act": act}))
    for n, k, o in [
        (1, 111, 45),
        (2, 576, 100),
        (4, 64, 33),
        (5, 111, 45),
        (6, 16, 16),
        (19, 111, 45),
        (19, 1536, 97),
        (77, 300, 130),
        (130, 576, 300),
        (7, 3, 5),
    ]:
        for wd in ("f32", "f16", "bf16"):
            CASES.append(
                Case("matmul_nt", {"n": n, "k": k, "o": o, "w": wd, "act": act, "bias": "none"})
            )
    for bias in ("f32", "f16"):
        CASES.append(
            Case("matmul_nt", {"n": 19, "k": 111, "o": 45, "w": "f16", "act": act, "bias": bias})
        )
        CASES.append(
            Case("matmul_nt", {"n": 1, "k": 111, "o": 45, "w": "bf16", "act": act, "bias": bias})
        )
    for alias in ("", "gate", "up"):
        CASES.append(Case("silu_mul", {"shape": (19, 111), "act": act, "alias": alias}))
    for alias in ("", "a", "b"):
        CASES.append(Case("add", {"shape": (19, 111), "act": act, "alias": alias}))
    CASES.append(Case("silu_mul", {"shape": (3, 5, 1537), "act": act, "alias": ""}))
    CASES.append(
        Case("silu_mul", {"shape": (7, 333), "act": act, "alias": "", "scale": 30.0})
    )  # exp's clamped range
    CASES.append(Case("add", {"shape": (40000,), "act": act, "alias": ""}))
    for cache in ("f32", "f16"):
        CASES.append(
            Case("kv_write", {"kv": 2, "head_dim": 64, "page": 16, "act": act, "cache": cache})
        )
        CASES.append(
            Case("kv_write", {"kv": 3, "head_dim": 128, "page": 16, "act": act, "cache": cache})
        )
        # attention: head_dim x GQA ratio x cache dtype, sequences spanning pages, chunks not starting at 0
        for hd, ratio in [(64, 1), (64, 3), (128, 4), (256, 8), (64, 8), (128, 1)]:
            CASES.append(
                Case(
                    "attention_paged",
                    {
                        "head_dim": hd,
                        "kv": 2 if ratio < 8 else 1,
                        "ratio": ratio,
                        "page": 16,
                        "act": act,
                        "cache": cache,
                    },
                )
            )
    CASES.append(
        Case(
            "attention_paged",
            {"head_dim": 64, "kv": 3, "ratio": 3, "page": 5, "act": act, "cache": "f16"},
        )
    )
    # sliding windows (1: the row's own key only; shorter and longer than a page) and soft-capped scores
    for hd, window, cap in [(64, 1, 0.0), (64, 5, 0.0), (128, 20, 0.0), (64, 100, 0.0), (128, 0, 1.5), (64, 9, 2.0)]:
        CASES.append(
            Case(
                "attention_paged",
                {"head_dim": hd, "kv": 2, "ratio": 3, "page": 16, "act": act, "cache": "f16", "window": window,
                 "cap": cap},
            )
        )
for act in ("f32", "f16"):
    # rows repeated, reordered, first/last row; odd widths exercise the 4- and 2-byte kernels on CUDA
    for rows, hidden, m in ((7, 64, 9), (5, 111, 3), (1, 33, 4), (70, 576, 64)):
        CASES.append(Case("gather_rows", {"rows": rows, "hidden": hidden, "m": m, "act": act}))
# the engine's device argmax: rows of one block each, vocab below / at / past the 1024-thread stride, with ties
for rows, vocab in ((1, 1), (3, 1023), (5, 1024), (2, 1025), (19, 49159)):
    CASES.append(Case("argmax_logprob", {"rows": rows, "vocab": vocab, "act": "f32"}))
# the engine's device sampling: the same row sizes under top-k / top-p / min-p, several draws per row
for rows, vocab in ((1, 1), (3, 1023), (2, 1025), (4, 49159)):
    CASES.append(Case("sample_logprob", {"rows": rows, "vocab": vocab, "act": "f32"}))
# the converter's KL sensitivity: no change, the small changes a quantized layer makes, a large one; vocab sizes
# around the 256-thread stride and a real one
for rows, vocab, dscale in ((1, 1, 0.5), (3, 255, 0.0), (5, 257, 1e-3), (4, 1023, 0.05), (2, 49159, 1e-2),
                            (3, 4096, 3.0)):
    CASES.append(Case("logit_kl", {"rows": rows, "vocab": vocab, "d": dscale, "act": "f32"}))
# attention at the tile and split boundaries of the CUDA tensor-core kernels (f16 act + f16 cache): prefill
# chunks spanning several 64-row tiles with a tile shared by two sequences; decode batches with contexts long
# enough to split, one row per sequence and two rows of one sequence, GQA groups of more than 16 heads.
for hd, kv, ratio, ps, layout in [
    (128, 2, 4, 64, "prefill"),
    (64, 2, 2, 16, "prefill"),
    (256, 1, 4, 32, "prefill"),
    (128, 2, 4, 16, "decode"),
    (128, 1, 20, 64, "decode"),
    (64, 4, 1, 16, "decode"),
    (256, 2, 2, 32, "decode"),
]:
    CASES.append(
        Case(
            "attention_tiles",
            {"head_dim": hd, "kv": kv, "ratio": ratio, "page": ps, "layout": layout, "act": "f16"},
        )
    )
# the same tiles with sliding windows: below one key tile, across tile boundaries, and longer than most contexts
# (tiles below every row's window are skipped, the tiles a window edge crosses masked; decode splits span the
# window only)
for hd, kv, ratio, ps, layout, window in [
    (128, 2, 4, 64, "prefill", 1),
    (128, 2, 4, 64, "prefill", 50),
    (64, 2, 2, 16, "prefill", 130),
    (256, 1, 4, 32, "prefill", 37),
    (128, 2, 4, 16, "decode", 33),
    (128, 1, 20, 64, "decode", 256),
    (64, 4, 1, 16, "decode", 1),
    (256, 2, 2, 32, "decode", 1000),
]:
    CASES.append(
        Case(
            "attention_tiles",
            {"head_dim": hd, "kv": kv, "ratio": ratio, "page": ps, "layout": layout, "act": "f16", "window": window},
        )
    )
# attention's decode/prefill row split (ops.h n_decode, ops::attention_spans): many single-row sequences (one
# launch block per row on CUDA; 40 rows still split long contexts, 130 fill the GPU without splits), decode rows
# followed by a prefill chunk (the engine's mixed step, every n_decode hint), and a layout of two spans (row
# slices on the device). GQA and MHA, head_dim 64 and 128, f16 (the CUDA tensor-core kernels).
for layout in ("decode40", "decode130", "mixed", "spans"):
    for hd, kv, ratio in [(128, 2, 4), (64, 4, 1), (128, 1, 20)]:
        CASES.append(
            Case(
                "attention_rows",
                {"head_dim": hd, "kv": kv, "ratio": ratio, "layout": layout, "act": "f16"},
            )
        )
for layout in ("decode40", "mixed", "spans"):
    CASES.append(
        Case(
            "attention_rows",
            {"head_dim": 128, "kv": 2, "ratio": 4, "layout": layout, "act": "f16", "window": 77},
        )
    )
for src in ("f32", "f16", "bf16"):
    for dst in ("f32", "f16", "bf16"):
        CASES.append(Case("convert", {"src": src, "dst": dst, "shape": (19, 111)}))


def run_case(case: Case, device: str):
    p = case.params
    rng = np.random.default_rng(zlib.crc32(case.id.encode()))
    act = p.get("act", "f32")
    tol = TOL[act]
    npa = NP_ACT[act]
    if case.op == "embedding":
        table, tdt, table64 = make_float(rng, (p["vocab"], p["hidden"]), p["table"])
        ids = rng.integers(0, p["vocab"], p["n"]).astype(np.int32)
        ids[0], ids[-1] = 0, p["vocab"] - 1
        out = _C.op_embedding(ids, table, act=act, device=device, table_dtype=tdt)
        assert out.dtype == npa
        # a copy with one rounding: exact for f32->f32 and f16/bf16->f32, rounded once to f16 otherwise
        np.testing.assert_array_equal(out, table64[ids].astype(npa))
        return
    if case.op == "rms_norm":
        x = rng.standard_normal((p["rows"], p["hidden"])).astype(npa) * 3
        w, wdt, w64 = make_float(rng, (p["hidden"],), p["w"])
        out = _C.op_rms_norm(x, w, 1e-5, device=device, w_dtype=wdt, inplace=p["inplace"])
        assert out.dtype == npa
        assert_close(out, ref_rms_norm(x.astype(np.float64), w64, 1e-5), tol, case.id)
        return
    if case.op == "rope":
        n, hd = p["n"], p["head_dim"]
        table = ref_rope_table(4096, hd)
        positions = rng.integers(0, 4096, n).astype(np.int32)
        positions[0] = 4095
        x = rng.standard_normal((n, p["heads"], hd)).astype(npa)
        out = _C.op_rope(x, positions, table, device=device)
        assert_close(out, ref_rope(x.astype(np.float64), positions, table), tol, case.id)
        return
    if case.op == "matmul_nt":
        n, k, o = p["n"], p["k"], p["o"]
        x = rng.standard_normal((n, k)).astype(npa)
        w, wdt, w64 = make_float(rng, (o, k), p["w"], scale=1.0 / math.sqrt(k))
        bias, b64 = None, 0.0
        if p["bias"] != "none":
            bias = rng.standard_normal(o).astype(NP_ACT[p["bias"]])
            b64 = bias.astype(np.float64)
        y = _C.op_matmul_nt(x, w, bias, device=device, w_dtype=wdt)
        assert y.dtype == npa
        assert_close(y, x.astype(np.float64) @ w64.T + b64, tol, case.id)
        return
    if case.op == "layer_norm":
        x = (rng.standard_normal((p["rows"], p["hidden"])) * 3 + 1.5).astype(npa)  # an offset to remove
        w, wdt, w64 = make_float(rng, (p["hidden"],), p["w"])
        out = _C.op_layer_norm(x, w, 1e-5, device=device, w_dtype=wdt, inplace=p["inplace"])
        assert out.dtype == npa
        assert_close(out, ref_layer_norm(x.astype(np.float64), w64, 1e-5), tol, case.id)
        return
    if case.op == "gelu_tanh_mul":
        g = (rng.standard_normal(p["shape"]) * 3).astype(npa)
        u = rng.standard_normal(p["shape"]).astype(npa)
        out = _C.op_gelu_tanh_mul(g, u, device=device, out_alias=p["alias"])
        assert out.dtype == npa
        assert_close(out, ref_gelu_tanh_mul(g.astype(np.float64), u.astype(np.float64)), tol, case.id)
        return
    if case.op == "scale":
        x = (rng.standard_normal(p["shape"]) * 40).astype(npa)
        out = _C.op_scale(x.copy(), p["s"], p["cap"], device=device, inplace=p["inplace"])
        assert out.dtype == npa
        ref = x.astype(np.float64) * p["s"]
        if p["cap"] > 0:
            ref = p["cap"] * np.tanh(ref / p["cap"])
        assert_close(out, ref, tol, case.id)
        return
    if case.op in ("silu_mul", "add"):
        a = (rng.standard_normal(p["shape"]) * p.get("scale", 3.0)).astype(npa)
        b = rng.standard_normal(p["shape"]).astype(npa)
        if case.op == "silu_mul":
            out = _C.op_silu_mul(a, b, device=device, out_alias=p["alias"])
            ref = ref_silu_mul(a.astype(np.float64), b.astype(np.float64))
        else:
            out = _C.op_add(a, b, device=device, out_alias=p["alias"])
            ref = a.astype(np.float64) + b.astype(np.float64)
        assert out.dtype == npa
        assert_close(out, ref, tol, case.id)
        return
    if case.op == "kv_write":
        kv, hd, ps = p["kv"], p["head_dim"], p["page"]
        seq_lens = [37, 16, 5]
        k_pages, v_pages, table, _, _ = make_paged(rng, seq_lens, ps, kv, hd, p["cache"])
        # the batch: a chunk of seq 0 starting at 30 (crosses a page), all of seq 2 starting at 0 (no, at 3),
        # and one decode token of seq 1 at position 16 (first slot of its second page)
        seq = np.array([0] * 7 + [2, 2] + [1], dtype=np.int32)
        pos = np.array(list(range(30, 37)) + [3, 4] + [16], dtype=np.int32)
        perm = rng.permutation(len(seq))
        seq, pos = seq[perm], pos[perm]
        k = rng.standard_normal((len(seq), kv, hd)).astype(npa)
        v = rng.standard_normal((len(seq), kv, hd)).astype(npa)
        k_out, v_out = _C.op_kv_write(k, v, k_pages, v_pages, pos, seq, table, device=device)
        k_ref, v_ref = k_pages.copy(), v_pages.copy()
        cache_np = NP_ACT[p["cache"]]
        for t in range(len(seq)):
            pg, slot = table[seq[t], pos[t] // ps], pos[t] % ps
            k_ref[pg, slot] = k[t].astype(cache_np)
            v_ref[pg, slot] = v[t].astype(cache_np)
        np.testing.assert_array_equal(k_out, k_ref)  # a copy with at most one rounding: exact
        np.testing.assert_array_equal(v_out, v_ref)
        return
    if case.op == "attention_paged":
        hd, kv, ratio, ps = p["head_dim"], p["kv"], p["ratio"], p["page"]
        n_heads = kv * ratio
        seq_lens = [45, 16, 3, 70]
        k_pages, v_pages, table, k_seq, v_seq = make_paged(rng, seq_lens, ps, kv, hd, p["cache"])
        # prefill-continuation chunk of seq 0 (positions 29..44, spanning pages), a decode token of seq 1 at
        # the last slot of a page, all of seq 2 from 0, a decode of seq 3 deep in its pages
        seq = np.array([0] * 16 + [1] + [2] * 3 + [3], dtype=np.int32)
        pos = np.array(list(range(29, 45)) + [15] + [0, 1, 2] + [69], dtype=np.int32)
        q = rng.standard_normal((len(seq), n_heads, hd)).astype(npa)
        scale = 1.0 / math.sqrt(hd) * 2.0  # sharper than usual so the softmax is not flat
        window, cap = p.get("window", 0), p.get("cap", 0.0)
        out = _C.op_attention_paged(q, k_pages, v_pages, pos, seq, table, scale, device=device, window=window,
                                    softcap=cap)  # fmt: skip
        assert out.dtype == npa
        ref = ref_attention(q.astype(np.float64), k_seq, v_seq, pos, seq, scale, window, cap)
        assert_close(out, ref, tol if p["cache"] == act else TOL["f16"], case.id)
        return
    if case.op == "gather_rows":
        x = rng.standard_normal((p["rows"], p["hidden"])).astype(npa)
        idx = rng.integers(0, p["rows"], p["m"]).astype(np.int32)
        idx[0] = p["rows"] - 1
        out = _C.op_gather_rows(x, idx, device=device)
        assert out.dtype == npa
        np.testing.assert_array_equal(out, x[idx])  # a copy: exact
        return
    if case.op == "argmax_logprob":
        x = (rng.standard_normal((p["rows"], p["vocab"])) * 4).astype(np.float32)
        x[0, p["vocab"] // 2 :] = x[0].max()  # a tie over the upper half: its first column wins
        idx, lp = _C.op_argmax_logprob(x, device=device)
        np.testing.assert_array_equal(idx, np.argmax(x, axis=1))  # the first (lowest id) maximum
        xd = x.astype(np.float64)
        m = xd.max(axis=1)
        ref = -np.log(np.exp(xd - m[:, None]).sum(axis=1))  # log_softmax at the max
        np.testing.assert_allclose(lp, ref, atol=2e-5, rtol=0)
        return
    if case.op == "logit_kl":
        z = (rng.standard_normal((p["rows"], p["vocab"])) * 4).astype(np.float32)
        d = (rng.standard_normal((p["rows"], p["vocab"])) * p["d"]).astype(np.float32)
        out = _C.op_logit_kl(z, d, device=device)
        assert out.dtype == np.float32 and out.shape == (p["rows"],)
        zd, dd = z.astype(np.float64), d.astype(np.float64)
        lp = zd - zd.max(axis=1, keepdims=True)
        lp -= np.log(np.exp(lp).sum(axis=1, keepdims=True))
        lq = zd + dd - (zd + dd).max(axis=1, keepdims=True)
        lq -= np.log(np.exp(lq).sum(axis=1, keepdims=True))
        ref = (np.exp(lp) * (lp - lq)).sum(axis=1)
        if p["d"] == 0.0:
            np.testing.assert_array_equal(out, 0.0)  # no change: exactly 0
        elif p["vocab"] == 1:
            np.testing.assert_allclose(out, 0.0, rtol=0, atol=1e-12)  # one token: log1p(expm1(d)) - d
        else:
            assert (ref > 1e-9).all(), case.id  # the case measures something
            # f32 weights (their error enters the KL at second order), fp64 expm1 and sums: ~1e-7 relative
            np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-14, err_msg=case.id)
        return
    if case.op == "sample_logprob":
        # reference: the host sampler with the same draw (engine/sampler.h); the CPU backend runs its code (the
        # same bits), CUDA may differ where a draw lands within rounding of a boundary (ops.h)
        x = (rng.standard_normal((p["rows"], p["vocab"])) * 3).astype(np.float32)
        x[0, p["vocab"] // 2 :] = x[0].max()  # a tie over the upper half
        settings = [
            (0.8, 0, 0.9, 0.0),
            (1.0, 20, 1.0, 0.0),
            (1.2, 0, 1.0, 0.1),
            (0.7, 50, 0.8, 0.05),
        ]
        rows, params, refs = [], [], []
        for r in range(p["rows"]):
            for j, (t, k, tp, mp) in enumerate(settings):
                sampler = _C.Sampler(
                    _C.SamplerSettings(temperature=t, top_k=k, top_p=tp, min_p=mp, seed=r + 1)
                )
                sampler.step = j
                u = _C.Sampler.uniform(sampler.seed, j)
                tok, slp, _ = sampler.sample(x[r], [], [])
                probs = _C.sampler_probs(
                    _C.SamplerSettings(temperature=t, top_k=k, top_p=tp, min_p=mp), x[r]
                )
                rows.append(x[r])
                params.append((t, k, tp, mp, u))
                refs.append((tok, slp, probs))
        t, k, tp, mp, u = (list(c) for c in zip(*params))
        idx, lp = _C.op_sample_logprob(np.stack(rows), t, k, tp, mp, u, device=device)
        same = np.array([int(i) == tok for i, (tok, _, _) in zip(idx, refs)])
        assert all(probs[i] > 0 for i, (_, _, probs) in zip(idx, refs)), (
            case.id
        )  # inside the support
        if device == "cpu":
            assert all(same)
            assert [np.float32(v).tobytes() for v in lp] == [
                np.float32(r[1]).tobytes() for r in refs
            ]
        else:
            assert np.mean(same) >= 0.9, (case.id, same)
            np.testing.assert_allclose(
                lp[same], np.array([r[1] for r in refs])[same], atol=1e-4, rtol=0
            )
        return
    if case.op == "attention_tiles":
        hd, kv, ratio, ps = p["head_dim"], p["kv"], p["ratio"], p["page"]
        n_heads = kv * ratio
        if p["layout"] == "prefill":  # seq 0 at 37..236 (continuation chunk), all of seq 1 from 0
            seq_lens = [237, 70]
            seq = np.array([0] * 200 + [1] * 70, dtype=np.int32)
            pos = np.array(list(range(37, 237)) + list(range(70)), dtype=np.int32)
        else:  # decode rows at the end of each sequence, plus a second row of seq 2 mid-way
            seq_lens = [1, 700, 1500, 65, 64, 2]
            seq = np.array([0, 1, 2, 3, 4, 5, 2], dtype=np.int32)
            pos = np.array([0, 699, 1499, 64, 63, 1, 1000], dtype=np.int32)
        k_pages, v_pages, table, k_seq, v_seq = make_paged(rng, seq_lens, ps, kv, hd, "f16")
        q = rng.standard_normal((len(seq), n_heads, hd)).astype(npa)
        scale = 1.0 / math.sqrt(hd) * 2.0
        window = p.get("window", 0)
        out = _C.op_attention_paged(q, k_pages, v_pages, pos, seq, table, scale, device=device, window=window)
        ref = ref_attention(q.astype(np.float64), k_seq, v_seq, pos, seq, scale, window)
        assert_close(out, ref, tol, case.id)
        return
    if case.op == "attention_rows":
        hd, kv, ratio, ps = p["head_dim"], p["kv"], p["ratio"], 16
        n_heads = kv * ratio
        hints: list = [None]  # None: planned from the layout as a model step plans it
        if p["layout"].startswith("decode"):
            # one row per sequence at its end; contexts of 1 to 1200 keys
            n_rows = int(p["layout"][len("decode") :])
            seq_lens = [int(x) for x in rng.integers(1, 600, n_rows)]
            seq_lens[0], seq_lens[1], seq_lens[2] = 1, 1200 if n_rows < 100 else 700, 17
            seq = np.arange(n_rows, dtype=np.int32)
            pos = np.array(seq_lens, dtype=np.int32) - 1
            hints += [-1, n_rows]
            spans = [(0, n_rows, n_rows)]
        elif p["layout"] == "mixed":
            # 20 decode rows, then a 100-row continuation chunk of seq 20 (positions 150..249)
            seq_lens = [int(x) for x in rng.integers(1, 900, 20)] + [250]
            seq = np.array(list(range(20)) + [20] * 100, dtype=np.int32)
            pos = np.array([n - 1 for n in seq_lens[:20]] + list(range(150, 250)), dtype=np.int32)
            hints += [-1, 0, 7, 20, 120]  # any hint: the same result
            spans = [(0, 120, 20)]
        else:
            # prefill 60 rows of seq 0, 20 decode rows, 100 rows of seq 1 from 0, 3 decode rows
            seq_lens = [60, 100] + [int(x) for x in rng.integers(1, 700, 23)]
            seq = np.array([0] * 60 + list(range(2, 22)) + [1] * 100 + [22, 23, 24], dtype=np.int32)
            pos = np.array(
                list(range(60))
                + [n - 1 for n in seq_lens[2:22]]
                + list(range(100))
                + [n - 1 for n in seq_lens[22:]],
                dtype=np.int32,
            )
            spans = [(0, 60, 0), (60, 180, 20), (180, 183, 3)]
        assert _C.op_attention_spans(seq) == spans
        k_pages, v_pages, table, k_seq, v_seq = make_paged(rng, seq_lens, ps, kv, hd, "f16")
        q = rng.standard_normal((len(seq), n_heads, hd)).astype(npa)
        scale = 1.0 / math.sqrt(hd) * 2.0
        window = p.get("window", 0)
        ref = ref_attention(q.astype(np.float64), k_seq, v_seq, pos, seq, scale, window)
        for n_decode in hints:
            out = _C.op_attention_paged(
                q, k_pages, v_pages, pos, seq, table, scale, device=device, n_decode=n_decode, window=window
            )
            assert_close(out, ref, tol, f"{case.id} n_decode {n_decode}")
        return
    if case.op == "convert":
        src, sdt, s64 = make_float(rng, p["shape"], p["src"], scale=100.0)
        out = _C.op_convert(src, p["dst"], device=device, src_dtype=sdt)
        if p["dst"] == "bf16":
            expect = f32_to_bf16_bits(s64.astype(np.float32))
        else:
            expect = s64.astype(NP_ACT[p["dst"]])
        np.testing.assert_array_equal(out, expect)  # one correctly rounded conversion: exact
        return
    raise AssertionError(f"no checker for {case.op}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_op(case, device):
    run_case(case, device)


# ---- hand-computed cases (the oracle above could be wrong the same way as the kernels) ---------------------


@pytest.mark.parametrize("device", DEVICES)
def test_hand_matmul(device):
    w = np.array([[3, 4], [5, 6]], dtype=np.float32)
    y = _C.op_matmul_nt(
        np.array([[1, 2]], np.float32), w, np.array([0.5, -1], np.float32), device=device
    )
    np.testing.assert_array_equal(y, [[11.5, 16.0]])
    # 6 rows: the blocked (GEMM) path on CPU
    x = np.array([[1, 2], [0, 1], [2, 0], [1, 1], [3, 1], [0, 0]], dtype=np.float32)
    y = _C.op_matmul_nt(x, w.astype(np.float16), None, device=device)
    np.testing.assert_array_equal(y, [[11, 17], [4, 6], [6, 10], [7, 11], [13, 21], [0, 0]])


@pytest.mark.parametrize("device", DEVICES)
def test_hand_rms_norm(device):
    # mean(x^2) = (9 + 16) / 2 = 12.5 -> x / sqrt(12.5) * w
    out = _C.op_rms_norm(
        np.array([[3, 4]], np.float32), np.array([1, 2], np.float32), 0.0, device=device
    )
    np.testing.assert_allclose(out, [[3 / 12.5**0.5, 8 / 12.5**0.5]], rtol=1e-6)
    assert abs(out[0, 0] - 0.8485281) < 1e-6


@pytest.mark.parametrize("device", DEVICES)
def test_hand_rope(device):
    # head_dim 2 at position 1 with cos = 0, sin = 1: (x1, x2) -> (x1*0 - x2*1, x2*0 + x1*1) = (-x2, x1)
    table = np.array([[1, 0], [0, 1]], np.float32)
    out = _C.op_rope(
        np.array([[[1, 2]]], np.float32), np.array([1], np.int32), table, device=device
    )
    np.testing.assert_allclose(out, [[[-2, 1]]], atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_hand_silu_add_embedding(device):
    out = _C.op_silu_mul(np.array([0, 1], np.float32), np.array([5, 1], np.float32), device=device)
    np.testing.assert_allclose(out, [0.0, 0.7310586], rtol=1e-6)
    out = _C.op_add(np.array([1, 2.5], np.float32), np.array([2, -0.5], np.float32), device=device)
    np.testing.assert_array_equal(out, [3, 2])
    table = np.array([[1, 2], [3, 4], [5, 6]], np.float16)
    out = _C.op_embedding(np.array([2, 0, 2], np.int32), table, device=device)
    np.testing.assert_array_equal(out, [[5, 6], [1, 2], [5, 6]])


@pytest.mark.parametrize("device", DEVICES)
def test_hand_attention(device):
    # one head, head_dim 2, page_size 1, keys in pages [2, 0] (page 1 unused garbage), scale 1:
    # q.k = (0, ln 3) -> softmax (1/4, 3/4); v = ((4, 0), (0, 8)) -> out (1, 6)
    kp = np.array(
        [[[[math.log(3), 0]]], [[[99, 99]]], [[[0, 0]]]], np.float32
    )  # [3 pages, 1, 1, 2]
    vp = np.array([[[[0, 8]]], [[[99, 99]]], [[[4, 0]]]], np.float32)
    q = np.array([[[1, 0]]], np.float32)
    out = _C.op_attention_paged(
        q,
        kp,
        vp,
        np.array([1], np.int32),
        np.array([0], np.int32),
        np.array([[2, 0]], np.int32),
        1.0,
        device=device,
    )
    np.testing.assert_allclose(out, [[[1, 6]]], rtol=1e-6)
    # position 0 sees only the first key: out = v0
    out = _C.op_attention_paged(
        q,
        kp,
        vp,
        np.array([0], np.int32),
        np.array([0], np.int32),
        np.array([[2, 0]], np.int32),
        1.0,
        device=device,
    )
    np.testing.assert_allclose(out, [[[4, 0]]], rtol=1e-6)
    args = (np.array([1], np.int32), np.array([0], np.int32), np.array([[2, 0]], np.int32), 1.0)
    # a window of 1: position 1 sees only key 1: out = v1
    out = _C.op_attention_paged(q, kp, vp, *args, device=device, window=1)
    np.testing.assert_allclose(out, [[[0, 8]]], rtol=1e-6)
    # soft-cap 1: scores (0, tanh(ln 3)) = (0, 0.8) -> softmax (1, e^0.8) / (1 + e^0.8)
    out = _C.op_attention_paged(q, kp, vp, *args, device=device, softcap=1.0)
    p1 = math.exp(0.8) / (1 + math.exp(0.8))
    np.testing.assert_allclose(out, [[[4 * (1 - p1), 8 * p1]]], rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_hand_layer_norm_gelu_scale(device):
    # x = (1, 3): mean 2, var 1 -> (-1, 1) / sqrt(1 + eps) * w
    out = _C.op_layer_norm(np.array([[1, 3]], np.float32), np.array([2, 5], np.float32), 0.0, device=device)
    np.testing.assert_allclose(out, [[-2, 5]], rtol=1e-6)
    # gelu_tanh(0) = 0, gelu_tanh(x) -> x for large x
    out = _C.op_gelu_tanh_mul(np.array([0, 10], np.float32), np.array([7, 3], np.float32), device=device)
    np.testing.assert_allclose(out, [0, 30], rtol=1e-6)
    # 2 * 3 = 6 capped at 6 tanh(1) ; 2 * -1 = -2 capped at 6 tanh(-1/3)
    out = _C.op_scale(np.array([3, -1], np.float32), 2.0, 6.0, device=device)
    np.testing.assert_allclose(out, [6 * math.tanh(1), 6 * math.tanh(-1 / 3)], rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_kv_write_then_attention(device):
    """The model's flow: write a batch's K/V, then attend over them (f16 cache, f32 act)."""
    rng = np.random.default_rng(7)
    n, kv, hd, ps = 21, 2, 64, 16
    pages = np.zeros((4, ps, kv, hd), np.float16)
    table = np.array([[3, 1], [0, 2]], np.int32)
    seq = np.array([0] * 20 + [1], np.int32)
    pos = np.array(list(range(20)) + [0], np.int32)
    k = rng.standard_normal((n, kv, hd)).astype(np.float32)
    v = rng.standard_normal((n, kv, hd)).astype(np.float32)
    kp, vp = _C.op_kv_write(k, v, pages, pages.copy(), pos, seq, table, device=device)
    q = rng.standard_normal((n, 2 * kv, hd)).astype(np.float32)
    out = _C.op_attention_paged(q, kp, vp, pos, seq, table, 0.125, device=device)
    k16, v16 = k.astype(np.float16).astype(np.float64), v.astype(np.float16).astype(np.float64)
    ref = ref_attention(
        q.astype(np.float64), [k16[:20], k16[20:]], [v16[:20], v16[20:]], pos, seq, 0.125
    )
    assert_close(out, ref, TOL["f32"], "kv_write+attention")


def test_attention_spans():
    """ops::attention_spans by hand: runs of <= 16 rows of one sequence are decode rows, longer runs prefill
    rows; a span is decode runs then prefill runs; a decode run after prefill runs opens the next span."""

    def spans(seq):
        return _C.op_attention_spans(np.array(seq, dtype=np.int32))

    assert spans([]) == []
    assert spans([4]) == [(0, 1, 1)]
    assert spans([0, 1, 2]) == [(0, 3, 3)]
    assert spans([0, 1, 0, 1]) == [(0, 4, 4)]  # a sequence's rows apart: runs of 1
    assert spans([5] * 16) == [(0, 16, 16)]
    assert spans([5] * 17) == [(0, 17, 0)]
    assert spans(list(range(20)) + [20] * 100) == [(0, 120, 20)]  # the engine's mixed step
    assert spans(list(range(20)) + [20] * 100 + [21] * 3 + [22] * 40) == [
        (0, 120, 20),
        (120, 163, 3),
    ]
    assert spans([7] * 100 + [1, 2, 3] + [9] * 50) == [(0, 100, 0), (100, 153, 3)]
    assert spans([3] * 30 + [4] * 40) == [(0, 70, 0)]
    with pytest.raises(Exception, match="int32"):
        _C.op_attention_spans(np.zeros(3, np.float32))


@pytest.mark.parametrize("device", DEVICES)
def test_attention_decode_many_rows(device):
    """More decode rows than one CUDA launch takes (65535 rows of grid z; 65536 / KV head groups counters): 65600
    rows over 5 short sequences as decode rows (n_decode = n) in three launches of <= 32768 rows (2 KV heads)."""
    rng = np.random.default_rng(11)
    kv, hd, ps, n = 2, 64, 16, 65600
    seq_lens = [1, 7, 16, 17, 40]
    k_pages, v_pages, table, k_seq, v_seq = make_paged(rng, seq_lens, ps, kv, hd, "f16")
    seq = rng.integers(0, len(seq_lens), n).astype(np.int32)
    pos = (rng.random(n) * np.array(seq_lens)[seq]).astype(np.int32)
    pos[-1], seq[-1] = 39, 4
    q = rng.standard_normal((n, kv, hd)).astype(np.float16)
    out = _C.op_attention_paged(
        q, k_pages, v_pages, pos, seq, table, 0.25, device=device, n_decode=n
    )
    # reference per sequence, vectorized over its rows: keys past a row's position masked
    ref = np.zeros((n, kv, hd))
    q64 = q.astype(np.float64)
    for s, length in enumerate(seq_lens):
        rows = np.nonzero(seq == s)[0]
        sc = np.einsum("rhd,khd->rhk", q64[rows], k_seq[s]) * 0.25
        sc = np.where(np.arange(length)[None, None, :] > pos[rows][:, None, None], -np.inf, sc)
        w = np.exp(sc - sc.max(axis=-1, keepdims=True))
        ref[rows] = np.einsum("rhk,khd->rhd", w / w.sum(axis=-1, keepdims=True), v_seq[s])
    assert_close(out, ref, TOL["f16"], "65600 decode rows")


@pytest.mark.parametrize("device", DEVICES)
def test_hand_gather_rows(device):
    x = np.array([[1, 2], [3, 4], [5, 6]], np.float16)
    out = _C.op_gather_rows(x, np.array([2, 0, 2, 1], np.int32), device=device)
    np.testing.assert_array_equal(out, [[5, 6], [1, 2], [5, 6], [3, 4]])
    assert _C.op_gather_rows(x, np.zeros(0, np.int32), device=device).shape == (0, 2)


def test_gather_rows_errors():
    x = np.zeros((3, 2), np.float32)
    with pytest.raises(
        InvalidArgumentError, match=r"gather_rows: idx\[1\] must be a row of x in \[0, 3\), got 3"
    ):
        _C.op_gather_rows(x, np.array([0, 3], np.int32))
    with pytest.raises(InvalidArgumentError, match="gather_rows: idx"):
        _C.op_gather_rows(x, np.array([0.0], np.float32))


def test_reference_helpers():
    """The test's own bf16 rounding: nearest-even on known bit patterns."""
    x = np.array(
        [1.0, 1.00390625, 1.01171875, -2.0, 3.0e38], np.float32
    )  # 1+2^-8 ties to even (1.0)
    assert list(f32_to_bf16_bits(x)) == [0x3F80, 0x3F80, 0x3F82, 0xC000, 0x7F62]


# ---- argument errors --------------------------------------------------------------------------------------

f32 = np.float32
ERRORS = {
    "logit_kl d shape": (
        lambda d: _C.op_logit_kl(np.ones((2, 5), f32), np.ones((2, 4), f32), device=d),
        "d must be [2, 5]",
    ),
    "logit_kl f16 z": (
        lambda d: _C.op_logit_kl(np.ones((2, 4), np.float16), np.ones((2, 4), f32), device=d),
        "z must be f32",
    ),
    "rms_norm w shape": (
        lambda d: _C.op_rms_norm(np.ones((2, 576), f32), np.ones(512, np.float16), 1e-5, device=d),
        "w must be [576], got f16[512]",
    ),
    "rms_norm int x": (
        lambda d: _C.op_rms_norm(np.ones((2, 4), np.int32), np.ones(4, f32), 1e-5, device=d),
        "x must be f32 or f16",
    ),
    "rms_norm eps": (
        lambda d: _C.op_rms_norm(np.ones((2, 4), f32), np.ones(4, f32), -1.0, device=d),
        "eps",
    ),
    "matmul in mismatch": (
        lambda d: _C.op_matmul_nt(np.ones((3, 5), f32), np.ones((4, 6), f32), device=d),
        "x's last dim must be 6",
    ),
    "matmul bias shape": (
        lambda d: _C.op_matmul_nt(
            np.ones((3, 5), f32), np.ones((4, 5), f32), np.ones(3, f32), device=d
        ),
        "bias must be [4]",
    ),
    "matmul w int": (
        lambda d: _C.op_matmul_nt(np.ones((3, 5), f32), np.ones((4, 5), np.int32), device=d),
        "w must be f32, f16 or bf16",
    ),
    "matmul w rank": (
        lambda d: _C.op_matmul_nt(np.ones((3, 5), f32), np.ones(5, f32), device=d),
        "w must have 2 dimensions",
    ),
    "embedding ids dtype": (
        lambda d: _C.op_embedding(np.zeros(3, np.int16), np.ones((4, 2), f32), device=d),
        "ids must be i32",
    ),
    "rope odd head_dim": (
        lambda d: _C.op_rope(
            np.ones((1, 1, 3), f32), np.zeros(1, np.int32), np.ones((4, 3), f32), device=d
        ),
        "must be even",
    ),
    "rope table width": (
        lambda d: _C.op_rope(
            np.ones((1, 1, 4), f32), np.zeros(1, np.int32), np.ones((4, 6), f32), device=d
        ),
        "cos_sin must be [4, 4]",
    ),
    "add shape": (
        lambda d: _C.op_add(np.ones((2, 3), f32), np.ones((3, 2), f32), device=d),
        "b must be [2, 3]",
    ),
    "add dtype": (
        lambda d: _C.op_add(np.ones(3, f32), np.ones(3, np.float16), device=d),
        "b must have the dtype",
    ),
    "attention window": (
        lambda d: _C.op_attention_paged(np.ones((1, 1, 2), f32), np.ones((1, 1, 1, 2), f32),
                                        np.ones((1, 1, 1, 2), f32), np.zeros(1, np.int32), np.zeros(1, np.int32),
                                        np.zeros((1, 1), np.int32), 1.0, device=d, window=-1),  # fmt: skip
        "window must be >= 0",
    ),
    "attention softcap": (
        lambda d: _C.op_attention_paged(np.ones((1, 1, 2), f32), np.ones((1, 1, 1, 2), f32),
                                        np.ones((1, 1, 1, 2), f32), np.zeros(1, np.int32), np.zeros(1, np.int32),
                                        np.zeros((1, 1), np.int32), 1.0, device=d, softcap=-2.0),  # fmt: skip
        "softcap must be",
    ),
    "layer_norm w shape": (
        lambda d: _C.op_layer_norm(np.ones((2, 8), f32), np.ones(4, f32), 1e-5, device=d),
        "layer_norm: w",
    ),
    "scale cap": (
        lambda d: _C.op_scale(np.ones(3, f32), 1.0, -1.0, device=d),
        "cap must be",
    ),
    "gelu shape": (
        lambda d: _C.op_gelu_tanh_mul(np.ones(3, f32), np.ones(4, f32), device=d),
        "gelu_tanh_mul: up",
    ),
    "silu shape": (
        lambda d: _C.op_silu_mul(np.ones(3, f32), np.ones(4, f32), device=d),
        "up must be [3]",
    ),
    "convert int": (
        lambda d: _C.op_convert(np.ones(3, np.int32), "f16", device=d),
        "src must be f32, f16 or bf16",
    ),
    "attention gqa": (
        lambda d: _C.op_attention_paged(
            np.ones((1, 3, 4), f32),
            np.ones((2, 4, 2, 4), f32),
            np.ones((2, 4, 2, 4), f32),
            np.zeros(1, np.int32),
            np.zeros(1, np.int32),
            np.zeros((1, 2), np.int32),
            1.0,
            device=d,
        ),
        "multiple of",
    ),
    "attention head_dim": (
        lambda d: _C.op_attention_paged(
            np.ones((1, 2, 8), f32),
            np.ones((2, 4, 2, 4), f32),
            np.ones((2, 4, 2, 4), f32),
            np.zeros(1, np.int32),
            np.zeros(1, np.int32),
            np.zeros((1, 2), np.int32),
            1.0,
            device=d,
        ),
        "k_pages must be [2, 4, 2, 8]",
    ),
    "kv_write cache dtype": (
        lambda d: _C.op_kv_write(
            np.ones((1, 2, 4), f32),
            np.ones((1, 2, 4), f32),
            np.ones((2, 4, 2, 4), f32),
            np.ones((2, 4, 2, 4), np.float16),
            np.zeros(1, np.int32),
            np.zeros(1, np.int32),
            np.zeros((1, 2), np.int32),
            device=d,
        ),
        "v_pages must have the dtype",
    ),
}

# Index ranges are checked on the host for CPU tensors only (CUDA clamps or flags them on the device).
HOST_ERRORS = {
    "embedding id range": (
        lambda: _C.op_embedding(np.array([0, 4], np.int32), np.ones((4, 2), f32)),
        "ids[1] must be a token id in [0, 4)",
    ),
    "embedding negative id": (
        lambda: _C.op_embedding(np.array([-1], np.int32), np.ones((4, 2), f32)),
        "ids[0]",
    ),
    "rope position": (
        lambda: _C.op_rope(
            np.ones((2, 1, 4), f32), np.array([0, 4], np.int32), np.ones((4, 4), f32)
        ),
        "positions[1] must be in [0, 4)",
    ),
    "kv_write position beyond pages": (
        lambda: _C.op_kv_write(
            np.ones((1, 2, 4), f32),
            np.ones((1, 2, 4), f32),
            np.ones((2, 4, 2, 4), f32),
            np.ones((2, 4, 2, 4), f32),
            np.array([8], np.int32),
            np.zeros(1, np.int32),
            np.zeros((1, 2), np.int32),
        ),
        "positions[0] must be in [0, 8)",
    ),
    "kv_write bad page": (
        lambda: _C.op_kv_write(
            np.ones((1, 2, 4), f32),
            np.ones((1, 2, 4), f32),
            np.ones((2, 4, 2, 4), f32),
            np.ones((2, 4, 2, 4), f32),
            np.array([5], np.int32),
            np.zeros(1, np.int32),
            np.array([[0, 2]], np.int32),
        ),
        "page_table[0, 1]",
    ),
    "attention bad seq": (
        lambda: _C.op_attention_paged(
            np.ones((1, 2, 4), f32),
            np.ones((2, 4, 2, 4), f32),
            np.ones((2, 4, 2, 4), f32),
            np.zeros(1, np.int32),
            np.array([1], np.int32),
            np.zeros((1, 2), np.int32),
            1.0,
        ),
        "seq_of_token[0] must be in [0, 1)",
    ),
    "attention bad earlier page": (
        lambda: _C.op_attention_paged(
            np.ones((1, 2, 4), f32),
            np.ones((2, 4, 2, 4), f32),
            np.ones((2, 4, 2, 4), f32),
            np.array([5], np.int32),
            np.zeros(1, np.int32),
            np.array([[-1, 1]], np.int32),
            1.0,
        ),
        "page_table[0, 0]",
    ),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(ERRORS))
def test_argument_errors(name, device):
    fn, match = ERRORS[name]
    with pytest.raises(InvalidArgumentError, match=re.escape(match)):
        fn(device)


@pytest.mark.parametrize("name", list(HOST_ERRORS))
def test_host_index_errors(name):
    fn, match = HOST_ERRORS[name]
    with pytest.raises(InvalidArgumentError, match=re.escape(match)):
        fn()


def test_threads_reported():
    assert _C.cpu_num_threads() >= 1


def test_concurrent_host_threads():
    """Several Python threads calling ops at once (the GIL is released): the pool serializes or runs inline,
    and every result is still right."""
    import threading

    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((37, 200)).astype(np.float32) for _ in range(4)]
    w = rng.standard_normal((150, 200)).astype(np.float16)
    refs = [x.astype(np.float64) @ w.astype(np.float64).T for x in xs]
    errors = []

    def work(i):
        try:
            for _ in range(5):
                assert_close(_C.op_matmul_nt(xs[i], w, None), refs[i], TOL["f32"], f"thread {i}")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_ops_after_fork():
    """A forked child (multiprocessing 'fork') inherits the pool without its worker threads: ops must still run
    (inline) instead of waiting forever."""
    import multiprocessing as mp

    x = np.arange(12 * 40, dtype=np.float32).reshape(12, 40) / 100
    w = np.ones((300, 40), np.float32)
    _C.op_matmul_nt(x, w, None)  # start the pool in the parent
    ctx = mp.get_context("fork")
    with ctx.Pool(1) as pool:
        y = pool.apply_async(_C.op_matmul_nt, (x, w, None)).get(timeout=60)
    np.testing.assert_allclose(y, np.repeat(x.sum(1, keepdims=True), 300, axis=1), rtol=1e-5)


# ---- fused ops of the decode step: the same bits as the ops they replace -----------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("rows,hidden", [(1, 4096), (3, 576), (5, 24), (2, 40)])
def test_add_rms_norm_equals_add_then_rms_norm(device, dtype, rows, hidden):
    """One kernel (f16, hidden % 8 == 0 on CUDA) or the two ops otherwise: h + r rounded as op_add, and the norm
    of that rounded sum, bit for bit; out may alias r."""
    rng = np.random.default_rng(rows * 1000 + hidden)
    h = (rng.standard_normal((rows, hidden)) * 4).astype(dtype)
    r = (rng.standard_normal((rows, hidden)) * 4).astype(dtype)
    w = rng.uniform(0.5, 1.5, hidden).astype(np.float32)
    want_h = _C.op_add(h, r, device=device)
    want = _C.op_rms_norm(want_h, w, 1e-5, device=device)
    for out_is_r in (False, True):
        got_h, got = _C.op_add_rms_norm(h, r, w, 1e-5, device=device, out_is_r=out_is_r)
        np.testing.assert_array_equal(got_h, want_h)
        np.testing.assert_array_equal(got, want)
    # and against float64 numpy (the sum rounded to dtype first, as the kernels do)
    s = (h.astype(np.float64) + r).astype(dtype).astype(np.float64)
    ref = s / np.sqrt((s * s).mean(axis=1, keepdims=True) + 1e-5) * w
    tol = 3e-3 if dtype == np.float16 else 3e-5
    assert np.max(np.abs(got.astype(np.float64) - ref)) <= tol * np.max(np.abs(ref))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("n,nq,nk,hd", [(1, 32, 8, 128), (5, 9, 3, 64), (3, 2, 2, 2)])
def test_rope_qk_equals_two_ropes(device, dtype, n, nq, nk, hd):
    rng = np.random.default_rng(n * 100 + nq)
    q = rng.standard_normal((n, nq, hd)).astype(dtype)
    k = rng.standard_normal((n, nk, hd)).astype(dtype)
    pos = rng.integers(0, 50, n).astype(np.int32)
    ang = np.outer(np.arange(50), rng.uniform(0.01, 1.0, hd // 2))
    table = np.concatenate([np.cos(ang), np.sin(ang)], axis=1).astype(np.float32)
    gq, gk = _C.op_rope_qk(q, k, pos, table, device=device)
    np.testing.assert_array_equal(gq, _C.op_rope(q, pos, table, device=device))
    np.testing.assert_array_equal(gk, _C.op_rope(k, pos, table, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype,cache", [(np.float16, np.float16), (np.float32, np.float32), (np.float32, np.float16)]
)
@pytest.mark.parametrize("nq,nk,hd", [(32, 8, 128), (9, 3, 64), (4, 4, 12), (2, 1, 6), (3, 3, 2)])
def test_rope_qk_kv_write_equals_the_two_ops(device, dtype, cache, nq, nk, hd):
    """The fused op (one kernel on CUDA, 4, 2 or 1 pairs per thread by head_dim) gives bit for bit what rope_qk
    then kv_write give: q and k rotated in place, the rotated k and v in their page slots, other slots untouched."""
    rng = np.random.default_rng(nq * 1000 + hd)
    ps = 16
    k_pages, v_pages, table, _, _ = make_paged(
        rng, [37, 16, 5], ps, nk, hd, "f16" if cache == np.float16 else "f32"
    )
    seq = np.array([0] * 7 + [2, 2] + [1], dtype=np.int32)
    pos = np.array(list(range(30, 37)) + [3, 4] + [16], dtype=np.int32)
    perm = rng.permutation(len(seq))
    seq, pos = seq[perm], pos[perm]
    n = len(seq)
    q = (rng.standard_normal((n, nq, hd)) * 3).astype(dtype)
    k = (rng.standard_normal((n, nk, hd)) * 3).astype(dtype)
    v = rng.standard_normal((n, nk, hd)).astype(dtype)
    ang = np.outer(np.arange(64), rng.uniform(0.01, 1.0, hd // 2))
    tab = np.concatenate([np.cos(ang), np.sin(ang)], axis=1).astype(np.float32)
    gq, gk, gkp, gvp = _C.op_rope_qk_kv_write(
        q, k, v, pos, tab, k_pages, v_pages, seq, table, device=device
    )
    wq, wk = _C.op_rope_qk(q, k, pos, tab, device=device)
    wkp, wvp = _C.op_kv_write(wk, v, k_pages, v_pages, pos, seq, table, device=device)
    np.testing.assert_array_equal(gq, wq)
    np.testing.assert_array_equal(gk, wk)
    np.testing.assert_array_equal(gkp, wkp)
    np.testing.assert_array_equal(gvp, wvp)
    if device == "cpu":  # and the two ops against numpy once
        c, s_ = tab[pos][:, None, : hd // 2], tab[pos][:, None, hd // 2 :]
        k64 = k.astype(np.float64)
        rot = np.concatenate(
            [
                k64[..., : hd // 2] * c - k64[..., hd // 2 :] * s_,
                k64[..., hd // 2 :] * c + k64[..., : hd // 2] * s_,
            ],
            axis=-1,
        )
        np.testing.assert_allclose(gk.astype(np.float64), rot, atol=4e-3 * 3 * 4, rtol=0)
        np.testing.assert_array_equal(gvp[table[seq, pos // ps], pos % ps], v.astype(cache))


def test_fused_op_errors():
    x = np.zeros((2, 8), np.float32)
    with pytest.raises(InvalidArgumentError, match="add_rms_norm: r"):
        _C.op_add_rms_norm(x, np.zeros((2, 4), np.float32), np.ones(8, np.float32), 1e-5)
    with pytest.raises(InvalidArgumentError, match="rope_qk: q and k must share"):
        _C.op_rope_qk(
            np.zeros((2, 2, 4), np.float32),
            np.zeros((3, 2, 4), np.float32),
            np.zeros(2, np.int32),
            np.zeros((4, 4), np.float32),
        )
