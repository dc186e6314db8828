"""Offline model of the v4 GEMV's launch (cuda/exl2_gemm.cu launch_gemv_v4) on the Llama-2-7B linears: chunks, runs,
grid, slices, warps per SM, bytes per warp and per SM, bytes in flight per SM from the register double buffer, and
the time floor at the copy bandwidth. No GPU needed; the layer plans are bench/synth_exl2.py's (the end-to-end
model) and bench/bench_exl2.py's BIT_MIX (the per-linear bench).

    python3 dev/kernels/v4_grid.py [--sms 132] [--bpw 4.0] [--occ 3] [--chunks 8] [--bw 4.2e12] [--clock 1.98e9]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import synth_exl2  # noqa: E402


def v4_chunks(groups):
    """[(bits, rows)] -> [(bits, n_chunks, rpc)] per width run (cuda/exl2_gemm.cu exl2_v4_tables): rpc = the fewest
    scale rows per chunk (1, 2, 4) whose units [4j / rpc, 4(j + 1) / rpc) are of one group in every chunk."""
    units = []  # (bits, group)
    for g, (b, r) in enumerate(groups):
        units += [(b, g)] * math.ceil(r / 32)
    runs = []
    for b in dict.fromkeys(u[0] for u in units):
        us = [u[1] for u in units if u[0] == b]
        n = math.ceil(len(us) / 4)
        rpc = next(r for r in (1, 2, 4) if _rows_share(us, r))
        runs.append((b, n, rpc))
    return runs


def _rows_share(us, rpc):
    """Whether every chunk's scale row j (units [4j / rpc, 4(j + 1) / rpc)) is of one group (groups of the run's
    units in order; the padding past the end matches any)."""
    per = 4 // rpc
    return all(len(set(us[c + j * per : c + (j + 1) * per])) <= 1 for c in range(0, len(us), 4) for j in range(rpc))


def chunk_words(b, rpc, f16_rows=False):
    """Words of one chunk in a tile of 16 columns: 64 * bits of weights, then the scale codes (v4_code_words: 4 bits per
    column per scale row, 16-byte aligned); f16_rows: the session-5 layout's f16 scale rows (8 words each)."""
    return 64 * b + (8 * rpc if f16_rows else (8 if rpc == 4 else 4))


def alloc(nbytes):
    """Device memory one cudaMalloc of nbytes takes, as modelled here: the driver maps large allocations in 2 MiB
    pages (assumed from 1 MiB on) and packs small ones together (counted exactly)."""
    return nbytes if nbytes < 2**20 else math.ceil(nbytes / 2**21) * 2**21


def vram(n_in, n_out, groups, rounded=False):
    """Device bytes of one linear per EXL2CPP_GEMV mode (cuda/exl2_gemm.cu exl2_upload; no bias), the sum of its
    tensors (exl2_device_bytes), or with rounded=True of alloc() of each tensor (what cudaMemGetInfo sees)."""
    a = alloc if rounded else (lambda n: n)
    out_pad = math.ceil(n_out / 32) * 32
    G = len(groups)
    units = sum(math.ceil(r / 32) for _, r in groups)
    quads = sum(math.ceil(sum(math.ceil(r / 32) for b2, r in groups if b2 == b) / 4) for b in {b for b, _ in groups})
    qw = sum(math.ceil(r / 32) * 8 * b for b, r in groups) * (out_pad // 8) * 4  # tiled: 8 * bits words per unit
    # q_weight, q_scale, msc, q_perm, slots, xsrc, units
    main = sum(a(n) for n in (qw, G * (out_pad // 8) * 4, 2 * G, 4 * n_in, quads * 4 * 16, quads * 128 * 4, units * 16))
    runs = v4_chunks(groups)
    n_chunks = sum(n for _, n, _ in runs)
    # v4_chunk_woff, v4_xsrc, v4_msc (half2 per unit slot); v4k: v4_kcoef
    woff, xsrc, msc, kcoef = (n_chunks + 1) * 4, n_chunks * 128 * 4, n_chunks * 4 * 4, n_chunks * 128 * 4
    v4 = a(sum(n * chunk_words(b, r) for b, n, r in runs) * (out_pad // 16) * 4) + a(woff) + a(xsrc) + a(msc)
    # session 5: f16 scale rows in the stream (rpc 1 or 4, no v4_msc)
    old_runs = [(b, n, 1 if r == 1 else 4) for b, n, r in runs]
    v4_old = a(sum(n * chunk_words(b, r, True) for b, n, r in old_runs) * (out_pad // 16) * 4) + a(woff) + a(xsrc)
    return {"main": main, "v4": v4, "v4k": v4 + a(kcoef), "v4 f16 rows (session 5)": v4_old}


def launch(n_in, n_out, groups, sms, occ, chunks, m=1):
    runs = v4_chunks(groups)
    n_chunks = sum(n for _, n, _ in runs)
    out_pad = math.ceil(n_out / 32) * 32
    col_blocks = math.ceil(out_pad / 128)
    wave = sms * occ
    most = max(1, wave // col_blocks)
    fill = math.ceil(sms / col_blocks)
    slices = max(fill, math.ceil(n_chunks / chunks))
    slices = max(1, min(slices, most, n_chunks))
    cps = math.ceil(n_chunks / slices)
    slices = math.ceil(n_chunks / cps)
    blocks = col_blocks * slices
    # bytes of one tile (16 columns) per chunk of each run: 64 * bits + the scale codes
    tile_bytes = sum(n * chunk_words(b, r) * 4 for b, n, r in runs)
    total = tile_bytes * out_pad // 16
    chunk_bytes = max(chunk_words(b, r) for b, _, r in runs) * 4  # one chunk per warp (16 columns)
    return {
        "n_chunks": n_chunks,
        "runs": runs,
        "col_blocks": col_blocks,
        "slices": slices,
        "cps": cps,
        "blocks": blocks,
        "blocks_per_sm": blocks / sms,
        "warps_per_sm_max": 8 * math.ceil(blocks / sms),
        "bytes": total,
        "bytes_per_warp": tile_bytes * cps / n_chunks,
        "inflight_per_warp": chunk_bytes,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--occ", type=int, default=3, help="resident blocks per SM (v4 m=1: 3 at 80 registers)")
    ap.add_argument("--chunks", type=int, default=8, help="EXL2CPP_GEMV_CHUNKS")
    ap.add_argument("--bpw", type=float, default=4.0)
    ap.add_argument("--bw", type=float, default=4.2e12, help="copy bandwidth, bytes/s")
    ap.add_argument("--clock", type=float, default=1.98e9)
    args = ap.parse_args()
    shape = synth_exl2.PRESETS["llama2-7b"]
    plans, _ = synth_exl2.plan_model(shape, args.bpw, 1)
    dims = synth_exl2.linear_dims(shape)
    need = args.bw / args.sms / args.clock
    print(
        f"{args.sms} SMs, {args.occ} blocks/SM resident, {args.chunks} chunks/slice target; the copy bandwidth "
        f"needs {need:.1f} B per SM-cycle ({2 * need:.0f} 4-bit weights)"
    )
    hdr = (
        f"{'linear':<10} {'shape':>11} {'runs (bits x chunks, rpc)':<30} {'grid':>8} {'cps':>4} {'blk/SM':>6} "
        f"{'warps/SM':>8} {'KB/warp':>7} {'MB':>6} {'floor us':>8} {'inflight/SM KB (8 w)':>20}"
    )
    print(hdr)
    tot_bytes = 0
    for role in synth_exl2.ROLES:
        n_in, n_out = dims[role]
        r = launch(n_in, n_out, plans[0][role], args.sms, args.occ, args.chunks)
        tot_bytes += r["bytes"]
        runs = " ".join(f"{b}x{n}{'' if p == 1 else f'({p})'}" for b, n, p in r["runs"])
        grid = f"{r['col_blocks']}x{r['slices']}"
        shp = f"{n_in}x{n_out}"
        print(
            f"{role:<10} {shp:>11} {runs:<30} {grid:>8} {r['cps']:>4} "
            f"{r['blocks_per_sm']:>6.2f} {r['warps_per_sm_max']:>8} {r['bytes_per_warp'] / 1024:>7.1f} "
            f"{r['bytes'] / 1e6:>6.2f} {r['bytes'] / args.bw * 1e6:>8.2f} {8 * r['inflight_per_warp'] / 1024:>20.1f}"
        )
    print(
        f"one layer: {tot_bytes / 1e6:.1f} MB -> {tot_bytes / args.bw * 1e6:.1f} us at the copy bandwidth; "
        f"32 layers {32 * tot_bytes / args.bw * 1e3:.2f} ms/token"
    )
    modes = ["main", "v4", "v4k", "v4 f16 rows (session 5)"]
    print("VRAM per linear, MiB (" + " / ".join(modes) + ")")
    tot = dict.fromkeys(modes, 0)
    for role in synth_exl2.ROLES:
        n_in, n_out = dims[role]
        v = vram(n_in, n_out, plans[0][role])
        for k in modes:
            tot[k] += v[k]
        print(f"  {role:<10} " + " / ".join(f"{v[k] / 2**20:.2f}" for k in modes))
    print("  one layer  " + " / ".join(f"{tot[k] / 2**20:.2f}" for k in modes))
    print("  v4 / main  " + " / ".join(f"{tot[k] / tot['main']:.4f}" for k in modes))
    rnd = dict.fromkeys(modes, 0)
    for role in synth_exl2.ROLES:
        v = vram(*dims[role], plans[0][role], rounded=True)
        for k in modes:
            rnd[k] += v[k]
    print(
        "  allocated (2 MiB pages from 1 MiB on), 32 layers, GiB: "
        + " / ".join(f"{32 * rnd[k] / 2**30:.3f}" for k in modes)
        + f"; v4 - main {32 * (rnd['v4'] - rnd['main']) / 2**20:.0f} MiB"
    )
    lat = [400, 600, 800]
    print(
        "Little's law: bytes in flight per SM needed for the copy bandwidth at an L2->SM latency of "
        + ", ".join(f"{c} cycles: {need * c / 1024:.1f} KB" for c in lat)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
