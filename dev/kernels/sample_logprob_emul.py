"""A NumPy model of cuda/sampling.cu's sample_logprob_kernel, step for step (order keys, the 8-bit radix selects
by count and by mass, the top-p tie pass and the draw over 32 warp segments), checked against the CPU op (the host
sampler's code) on random rows. It validates the kernel's algorithm where no GPU is at hand, not its CUDA code:
    PYTHONPATH=python:tests python3 dev/kernels/sample_logprob_emul.py
"""

from __future__ import annotations

import sys

import numpy as np
from exl2cpp import _C

F = np.float32


def fast_exp(x):  # cpu::fast_exp in f32 without FMA
    x = x.astype(F)
    xc = np.minimum(np.maximum(x, F(-87.3)), F(88.3))
    n = (xc * F(1.44269504088896341) + F(12582912.0)) - F(12582912.0)
    f = xc - n * F(0.693359375)
    f = f + n * F(2.12194440e-4)
    y = np.full_like(f, F(1.9875691500e-4))
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        y = y * f + F(c)
    y = y * (f * f) + f + F(1.0)
    scale = ((n.astype(np.int32) + 127) << 23).astype(np.int32).view(F)
    return np.where(x < F(-87.3), F(0), y * scale).astype(F)


def order_key(x):
    x = np.where(x == 0, F(0), x).astype(F)
    b = x.view(np.uint32)
    return np.where(b & np.uint32(0x80000000), ~b, b | np.uint32(0x80000000)).astype(np.uint32)


def key_float(k):
    k = np.uint32(k)
    b = k & np.uint32(0x7FFFFFFF) if k & np.uint32(0x80000000) else ~k
    return np.array([b], np.uint32).view(F)[0]


def radix_select(keys, w, admit, target):
    prefix, mask, above, found = 0, 0, 0.0, True
    for shift in (24, 16, 8, 0):
        sel = admit & ((keys & np.uint32(mask)) == np.uint32(prefix))
        d = ((keys[sel] >> np.uint32(shift)) & np.uint32(0xFF)).astype(np.int64)
        mass = np.bincount(d, w[sel], 256)
        count = np.bincount(d, minlength=256)
        acc, pick, last = above, None, -1
        for dd in range(255, -1, -1):
            if count[dd] == 0:
                continue
            last = dd
            if acc + mass[dd] >= target:
                pick = dd
                break
            acc += mass[dd]
        if pick is None:
            found = False
            pick = max(last, 0)
            acc -= mass[pick] if last >= 0 else 0.0
        prefix |= pick << shift
        mask |= 0xFF << shift
        above = acc
    return prefix, above, found


def first_crossing(w, admit, base, target, reach):
    vocab = w.shape[0]
    seg = -(-vocab // 32)
    cross = (lambda a: a >= target) if reach else (lambda a: a > target)
    wa = np.where(admit, w, 0.0)
    carry = base
    for s in range(32):
        lo, hi = s * seg, min(vocab, (s + 1) * seg)
        tot = wa[lo:hi].sum() if lo < hi else 0.0
        if not cross(carry) and cross(carry + tot):
            acc = carry + np.cumsum(wa[lo:hi])
            hit = np.flatnonzero((wa[lo:hi] > 0) & cross(acc))
            if hit.size:
                return lo + int(hit[0])
            pos = np.flatnonzero(wa[lo:hi] > 0)
            return lo + int(pos[-1]) if pos.size else -1
        carry += tot
    pos = np.flatnonzero(wa > 0)
    return int(pos[-1]) if pos.size else -1


def kernel_row(row, t, k, p, mp, u):
    bad = np.flatnonzero(~(row < np.inf))
    if bad.size:
        return -2 - int(bad[0])
    if np.all(row == -np.inf):
        return -1
    i = int(np.argmax(row))
    lmax = row[i]
    if not t > 0:
        return i
    vocab = row.shape[0]
    zthr = F(-np.inf)
    if 0 < k < vocab:
        key, _, _ = radix_select(order_key(row), np.ones(vocab), np.ones(vocab, bool), float(k))
        lthr = key_float(key)
        if lthr > -np.inf:
            zthr = (lthr - lmax) / F(t)
    with np.errstate(over="ignore", invalid="ignore"):
        z = ((row - lmax) / F(t)).astype(F)
    cand = (row != -np.inf) & (z >= zthr)
    w = fast_exp(np.where(cand, z, F(0))).astype(np.float64)
    kept = cand.copy()
    if p < 1:
        total = w[cand].sum()
        target = float(F(p)) * total
        zk = order_key(z)
        pkey, above, found = radix_select(zk, w, cand, target)
        if found:
            ties = cand & (zk == np.uint32(pkey))
            pid = first_crossing(w, ties, above, target, True)
            pid = pid if pid >= 0 else 2**31 - 2
            ids = np.arange(vocab)
            kept &= (zk > np.uint32(pkey)) | ((zk == np.uint32(pkey)) & (ids <= pid))
    if mp > 0:
        kept &= w >= float(F(mp))
    total = w[kept].sum()
    tok = first_crossing(w, kept, 0.0, u * total, False)
    return tok if tok >= 0 else i


def main():
    sys.path.insert(0, "tests")
    from test_engine_device_sample import SETTINGS, case_params, rows_for

    agree = n = 0
    for vocab in (1, 7, 64, 1031, 49152, 49159, 128256):
        rng = np.random.default_rng(vocab)
        x = rows_for(rng, vocab, 6)
        cases = case_params(rng, x.shape[0], 2 if vocab < 100000 else 1)
        rows = np.stack([x[r] for r, _, _, _ in cases])
        params = [(*s, _C.Sampler.uniform(seed, step)) for _, s, seed, step in cases]
        t, k, p, mp, u = (list(c) for c in zip(*params))
        ci, _ = _C.op_sample_logprob(rows, t, k, p, mp, u)
        for j, (r, s, _, _) in enumerate(cases):
            g = kernel_row(x[r], *s, params[j][4])
            n += 1
            agree += g == ci[j]
            if g != ci[j]:
                probs = _C.sampler_probs(
                    _C.SamplerSettings(temperature=s[0], top_k=s[1], top_p=s[2], min_p=s[3]), x[r]
                )
                print(
                    f"vocab {vocab} row {r} {s} u {params[j][4]:.6f}: model {g} cpu {ci[j]} "
                    f"(p model {probs[g] if g >= 0 else None}, p cpu {probs[ci[j]]})"
                )
    print(f"{agree}/{n} draws agree ({100 * agree / n:.2f}%); {len(SETTINGS)} settings")


if __name__ == "__main__":
    main()
