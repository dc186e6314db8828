"""GPTQ for one linear, producing exactly what the EXL2 format stores: act-order permutation, groups of descending
bit widths, per-(group, column) 4-bit quadratic scale codes relative to an fp16 group maximum, and the dequantized
weights the runtime will compute from them (bit-exact fp16, spec §1.6).

Algorithm (spec §2.5, §2.6, ExLlamaV2's AdaptiveGPTQ): perm = argsort(diag H) descending; damping
0.12*mean(diag H) (raised until Cholesky succeeds); U = upper Cholesky factor of H^-1 (prepare(), NumPy float64);
groups in order, each: scale search on the current (error-fed) rows, then row by row quantize, error
e = (w - q)/U[c,c] fed to the group's later rows, then one lazy block update of all later rows. quantize() runs
that loop in C++ (``_C.gptq_quantize``, cpp/quant/gptq.h: CPU and CUDA give bit-identical results);
quantize_numpy() is the original NumPy version, kept as the tests' independent reference (its scale search sums
the error in fp32 BLAS order, so it may pick a neighbouring scale on near-ties).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from .. import _C
from ..errors import InternalError, InvalidArgumentError
from .timing import timer

# Relative damping (ExLlamaV2), convert's ``gptq_damp``. On SmolLM2-135M at 6.0 bpw (CPU, docs/convert.md) 0.01 gave
# 3 % lower KL than 0.12; not yet the default (other bitrates unmeasured).
DAMP = 0.12
P_MIN, P_MAX, P_GRID = 0.70, 1.20, 96  # scale search grid (ExLlamaV2 find_params)
F16_256 = np.float32(1.0 / 256.0)


@dataclass
class QuantizedLinear:
    """Result of quantize(): the packer's inputs plus the runtime's dequantized weight."""

    codes: np.ndarray  # uint8 [in, out], packed (act-order) row order
    group_bits: list[int]
    group_rows: list[int]
    scale_nibbles: np.ndarray  # uint8 [G, out]
    q_scale_max: np.ndarray  # float16 [G]
    perm: np.ndarray  # int32 [in]: packed row k holds input feature perm[k]
    weight: np.ndarray  # float32 [out, in] HF layout, = fp16 dequantization (what the runtime computes)

    def pack(self, bias: np.ndarray | None = None) -> dict[str, np.ndarray]:
        d = _C.exl2_pack(self.codes, self.group_bits, self.group_rows, self.scale_nibbles, self.q_scale_max,
                         self.perm, self.codes.shape[1])  # fmt: skip
        if bias is not None:
            d["bias"] = bias.astype(np.float16)
        return d


def runtime_scale(qs: np.ndarray, qsm16: np.ndarray) -> np.ndarray:
    """The runtime's scale: fp16(qs^2 * fp16(fp32(q_scale_max) / 256)), as float32. qs = nibble + 1 (1..16)."""
    msc = (np.float32(qsm16) * F16_256).astype(np.float16).astype(np.float32)
    return (np.square(qs.astype(np.float32)) * msc).astype(np.float16).astype(np.float32)


def find_params(w: np.ndarray, bits: int, h: np.ndarray | None = None) -> tuple[np.ndarray, np.float16]:
    """Scale codes qs [out] (1..16) and fp16 q_scale_max of one group w [rows, out] (spec §2.5). The p grid is
    searched coarse (every 4th point) then fine around the best. With row weights h [rows] (the "hmse" search,
    cpp/quant/gptq.h) the grid minimizes sum h_r d^2 and every column's code is then searched (refine_codes)."""
    maxq = 2**bits - 1
    z = 2 ** (bits - 1)
    xmax = np.abs(w).max(axis=0) + np.float32(1e-12)
    base = xmax / np.float32(maxq / 2)
    smax = np.float32(base.max())
    qs = np.clip(np.rint(16.0 * np.sqrt(base / smax)), 1, 16).astype(np.float32)
    s = np.square(qs / 16.0).astype(np.float32) * smax

    buf = np.empty_like(w)
    tmp = np.empty_like(w)

    def err(i: int) -> float:  # sum |clamp(rint(w/sp)) * sp - w|^3.5 (ExLlamaV2's norm), in place
        sp = s * np.float32(P_MIN + (P_MAX - P_MIN) * i / P_GRID)
        np.divide(w, sp, out=buf)
        np.rint(buf, out=buf)
        np.clip(buf, -z, maxq - z, out=buf)
        np.multiply(buf, sp, out=buf)
        np.subtract(buf, w, out=buf)
        if h is not None:  # sum h_r d^2
            return float(np.dot(h.astype(np.float64), np.sum(np.square(buf.astype(np.float64)), axis=1)))
        np.abs(buf, out=buf)
        np.sqrt(buf, out=tmp)
        np.multiply(tmp, buf, out=tmp)  # |d|^1.5
        np.multiply(buf, buf, out=buf)  # |d|^2
        return float(np.dot(buf.ravel(), tmp.ravel()))

    cache: dict[int, float] = {}

    def e(i: int) -> float:
        if i not in cache:
            cache[i] = err(i)
        return cache[i]

    best = min(range(0, P_GRID + 1, 4), key=lambda i: (e(i), i))
    best = min(range(max(0, best - 3), min(P_GRID, best + 3) + 1), key=lambda i: (e(i), i))
    qsm = smax * np.float32(P_MIN + (P_MAX - P_MIN) * best / P_GRID)
    if not np.isfinite(qsm) or qsm > 65504:
        raise InvalidArgumentError(f"weights too large for EXL2 fp16 scales (group max scale {qsm})")
    if h is not None:
        qs = refine_codes(w, bits, np.float16(qsm), h)
    return qs, np.float16(qsm)


def check_damp(damp: float) -> float:
    """``damp`` as a float when it is a finite positive number (convert's ``gptq_damp``), else InvalidArgumentError
    naming the parameter."""
    if isinstance(damp, bool) or not isinstance(damp, numbers.Real) or not math.isfinite(damp) or not damp > 0:
        raise InvalidArgumentError(f"--gptq-damp must be a positive number (default {DAMP}), got {damp!r}")
    return float(damp)


def refine_codes(w: np.ndarray, bits: int, qsm16: np.float16, h: np.ndarray) -> np.ndarray:
    """Per column of w [rows, out] the code n in 1..16 (float32) with the least sum_r h_r (w - dq)^2, dq the
    runtime's dequantization at scale runtime_scale(n, qsm16); ties keep the smaller n."""
    maxq, z = 2**bits - 1, np.float32(2 ** (bits - 1))
    errs = []
    for n in range(1, 17):
        scale = runtime_scale(np.array([n], np.float32), qsm16)[0]
        if scale > 0:
            q = np.clip(np.rint(w / scale) + z, 0, maxq)
            dq = ((q - z) * scale).astype(np.float16).astype(np.float32)
        else:
            dq = np.zeros_like(w)
        d = (w - dq).astype(np.float64)
        errs.append(h.astype(np.float64) @ np.square(d))
    return (np.argmin(np.stack(errs), axis=0) + 1).astype(np.float32)


def row_weights(u: np.ndarray, a: int, b: int) -> np.ndarray:
    """The hmse search's row weights of group rows [a, b): 1 / U[r, r]^2 in float32."""
    d = np.diag(u)[a:b].astype(np.float32)
    return (np.float32(1.0) / (d * d)).astype(np.float32)


# The group scale searches: "absmax" is ExLlamaV2's (one group-max scale from a 0.70-1.20 grid minimizing
# |error|^3.5, per-column codes from the column maxima); "hmse" minimizes the squared error weighted per row by
# GPTQ's 1 / U[r, r]^2 and then searches every column's 4-bit code (cpp/quant/gptq.h). Same tensors either way.
SCALE_SEARCHES = ("absmax", "hmse")
SCALE_SEARCH = "hmse"  # the default (convert(scale_search=), --scale-search)


def check_search(search: str) -> str:
    """``search`` when it is one of SCALE_SEARCHES (convert's ``scale_search``), else InvalidArgumentError naming
    the parameter."""
    if search not in SCALE_SEARCHES:
        raise InvalidArgumentError(f"--scale-search must be one of {', '.join(SCALE_SEARCHES)}, got {search!r}")
    return search


def _upper_inverse_cholesky(h: np.ndarray, damp: float = DAMP) -> np.ndarray:
    """U (upper) with U^T U = (H + d I)^-1, d = damp * mean(diag H), in float64; d grows until Cholesky succeeds.

    One Cholesky and one triangular inverse (the reversal trick): with J the reversal permutation and
    J H J = L L^T, H^-1 = (L^-1 J)^T (L^-1 J), so U = J L^-1 J is upper triangular with a positive diagonal and
    U^T U = H^-1; U is unique, so this is the same factor as chol(H^-1)^T (ExLlamaV2's route: Cholesky, inverse,
    Cholesky), computed in about half the flops without forming H^-1 (tests: test_convert_gptq.py)."""
    n = h.shape[0]
    damp_ = max(check_damp(damp) * float(np.mean(np.diag(h))), 1e-5)
    eye = np.eye(n)
    for attempt in range(10):
        try:
            hd = h[::-1, ::-1] + eye * (damp_ * (attempt + 1))
            lo = np.linalg.cholesky(hd)
            li = _lower_inverse(lo)
            u = np.ascontiguousarray(li[::-1, ::-1])
            if np.all(np.isfinite(u)):
                return u
        except np.linalg.LinAlgError:
            pass
    raise InternalError("GPTQ: Hessian is not positive definite even with 10x damping")


def _lower_inverse(lo: np.ndarray, block: int = 128) -> np.ndarray:
    """Inverse of a lower-triangular float64 matrix by blocked forward substitution (BLAS-3 products; NumPy has no
    triangular solver): inv [[A, 0], [B, C]] = [[A^-1, 0], [-C^-1 B A^-1, C^-1]]."""
    n = lo.shape[0]
    if n <= block:
        return np.linalg.inv(lo)
    k = n // 2
    ai = _lower_inverse(lo[:k, :k], block)
    ci = _lower_inverse(lo[k:, k:], block)
    out = np.zeros_like(lo)
    out[:k, :k] = ai
    out[k:, k:] = ci
    out[k:, :k] = -(ci @ (lo[k:, :k] @ ai))
    return out


@dataclass
class Prepared:
    """What GPTQ derives from one Hessian, shared by every linear and config that reads the same input."""

    perm: np.ndarray  # int32 [in], act order
    u: np.ndarray  # float32 [in, in], upper Cholesky factor of the damped, permuted H^-1
    dead: np.ndarray  # bool [in], inputs that were always zero
    search: str = SCALE_SEARCH  # the group scale search of every quantize() with this preparation


def prepare(hessian: np.ndarray, damp: float = DAMP, search: str = SCALE_SEARCH) -> Prepared:
    """Act-order permutation and U for a Hessian [in, in] (sum of x^T x over calibration tokens), with relative
    damping ``damp`` (DAMP: ExLlamaV2's); quantize() with it uses the group scale search ``search``."""
    check_search(search)
    with timer("prepare"):
        return _prepare(hessian, damp, search)


def _prepare(hessian: np.ndarray, damp: float, search: str) -> Prepared:
    h = hessian.astype(np.float64)
    if h.ndim != 2 or h.shape[0] != h.shape[1] or not np.all(np.isfinite(h)):
        raise InvalidArgumentError(f"GPTQ: Hessian must be a finite square matrix, got shape {h.shape}")
    diag = np.diag(h).copy()
    dead = diag <= 0
    if dead.any():
        h[dead, dead] = 1.0
        diag = np.diag(h).copy()
    perm = np.argsort(-diag, kind="stable").astype(np.int32)
    h = h[np.ix_(perm, perm)]
    return Prepared(perm, _upper_inverse_cholesky(h, damp).astype(np.float32), dead, search)


def _permuted(weight: np.ndarray, prep: Prepared | np.ndarray, groups: list[tuple[int, int]]):
    """(prep, w) with w = weight^T [in, out] in act order, dead inputs zeroed, after checking the shapes."""
    if isinstance(prep, np.ndarray):
        prep = prepare(prep)
    in_f = weight.shape[1]
    if prep.perm.shape != (in_f,):
        raise InvalidArgumentError(f"GPTQ: Hessian is for {prep.perm.shape[0]} inputs, weight has {in_f}")
    if sum(r for _, r in groups) != in_f:
        raise InvalidArgumentError(f"GPTQ: group rows sum to {sum(r for _, r in groups)}, expected {in_f}")
    w = np.ascontiguousarray(weight.T, dtype=np.float32)  # [in, out]
    w[prep.dead] = 0.0
    return prep, np.ascontiguousarray(w[prep.perm])


def permuted(weight: np.ndarray, prep: Prepared) -> np.ndarray:
    """weight^T [in, out] in prep's act order with dead inputs zeroed: what quantize() feeds the op; pass it as
    quantize(..., permuted=) to share it between the candidate configs of one linear."""
    return _permuted(weight, prep, [(0, weight.shape[1])])[1]


def quantize(weight: np.ndarray | None, prep: Prepared | np.ndarray, groups: list[tuple[int, int]],
             device: str = "cpu", permuted: np.ndarray | None = None, search: str | None = None) -> QuantizedLinear:  # fmt: skip
    """GPTQ-quantize weight [out, in] (fp32, HF layout) given prepare(H) (or H itself) into `groups`
    ((bits, rows) in storage order, bits non-increasing, rows summing to in), on `device` ("cpu" or "cuda[:n]").
    With ``permuted`` (= permuted(weight, prep), computed once for several configs) weight may be None. search: the
    group scale search (SCALE_SEARCHES; None: the preparation's, prep.search)."""
    with timer("gptq.host"):
        if permuted is None:
            prep, w = _permuted(weight, prep, groups)
        else:
            w = permuted
            if sum(r for _, r in groups) != w.shape[0] or prep.perm.shape != (w.shape[0],):
                raise InvalidArgumentError(f"GPTQ: groups / Hessian do not match the permuted weight {w.shape}")
    with timer("gptq.op"):
        r = _C.gptq_quantize(w, prep.u, [(int(b), int(n)) for b, n in groups], device,
                             prep.search if search is None else search)
    with timer("gptq.host"):
        deq = r["weight"]
        w_orig = np.empty_like(deq)
        w_orig[prep.perm] = deq
        w_orig = np.ascontiguousarray(w_orig.T)
    return QuantizedLinear(r["codes"], [b for b, _ in groups], [n for _, n in groups], r["scale_nibbles"],
                           r["q_scale_max"], prep.perm, w_orig)  # fmt: skip


def quantize_numpy(weight: np.ndarray, prep: Prepared | np.ndarray, groups: list[tuple[int, int]],
                   search: str = "absmax") -> QuantizedLinear:  # fmt: skip
    """quantize() in NumPy (slow; the tests' reference)."""
    if search not in SCALE_SEARCHES:
        raise InvalidArgumentError(f"GPTQ: search must be one of {', '.join(SCALE_SEARCHES)}, got {search!r}")
    prep, w = _permuted(weight, prep, groups)
    out_f, in_f = weight.shape
    perm = prep.perm
    u = prep.u

    codes = np.empty((in_f, out_f), np.uint8)
    deq = np.empty((in_f, out_f), np.float32)
    nibbles = np.empty((len(groups), out_f), np.uint8)
    qsms = np.empty(len(groups), np.float16)
    a = 0
    for g, (bits, rows) in enumerate(groups):
        b = a + rows
        maxq = 2**bits - 1
        z = np.float32(2 ** (bits - 1))
        qs, qsm = find_params(w[a:b], bits, row_weights(u, a, b) if search == "hmse" else None)
        scale = runtime_scale(qs, qsm)
        nz = scale > 0
        all_nz = bool(nz.all())
        safe = np.where(nz, scale, np.float32(1.0))
        err = np.empty((rows, out_f), np.float32)
        for c in range(a, b):
            wc = w[c]
            q = np.clip(np.rint(wc / safe) + z, 0, maxq)
            if not all_nz:
                q = np.where(nz, q, z)
            dq = ((q - z) * scale).astype(np.float16).astype(np.float32)
            e = (wc - dq) / u[c, c]
            if c + 1 < b:
                w[c + 1 : b] -= np.outer(u[c, c + 1 : b], e)
            codes[c] = q
            deq[c] = dq
            err[c - a] = e
        if b < in_f:
            w[b:] -= u[a:b, b:].T @ err
        nibbles[g] = (qs - 1).astype(np.uint8)
        qsms[g] = qsm
        a = b
    w_orig = np.empty_like(deq)
    w_orig[perm] = deq
    return QuantizedLinear(codes, [b for b, _ in groups], [r for _, r in groups], nibbles, qsms, perm,
                           np.ascontiguousarray(w_orig.T))  # fmt: skip


def check_packed(packed: dict, q: QuantizedLinear, name: str) -> None:
    """The runtime's bit-exact dequantization of the packed tensors must equal GPTQ's own (sanity check)."""
    tensors = {f"{name}.{k}": v for k, v in packed.items()}
    w = _C.exl2_dequantize(tensors, out_features=q.weight.shape[0]).astype(np.float32)
    if not np.array_equal(w.T, q.weight):
        bad = int(np.sum(w.T != q.weight))
        raise InternalError(f"convert: {name}: packed tensors dequantize differently from GPTQ's result "
                            f"({bad} of {w.size} weights differ)")  # fmt: skip
