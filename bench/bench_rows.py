"""EXL2 linear time per row count on the GPU (issue 17): 1..128 rows of x through the planner's choice (the v4
GEMV in 16-row launches, or with option gemv_m32 in 32-row launches; dequantize + cuBLAS above gemv_max_rows) and
through dequantize + cuBLAS alone, next to cuBLAS fp16 on the same shape (f16 weights) and the copy-bandwidth time
of the layer's bytes (the floor a weight-streaming kernel cannot beat at any row count).

Weights as bench_exl2.py packs them (random codes, the BIT_MIX of each bpw, groups of 128 rows), for the linears of
Llama-2-7B and Llama-3-8B. CUDA events, mean over --iters calls after warm-up.

    PYTHONPATH=python python3 bench/bench_rows.py [--bpw 4.0] [--rows 1,2,4,...] [--json OUT.json]
        [--variant NAME:OPTION=VALUE,...]   (repeatable; default: "default" and "m32:gemv_m32=true")
Each variant's options hold for its measurements only (exl2cpp.options.scope)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_exl2 import BIT_MIX, MODELS, gpu_name, make_layer  # noqa: E402

SHAPES = [("llama2-7b", "q"), ("llama2-7b", "gate"), ("llama2-7b", "down"), ("llama3-8b", "k"), ("llama3-8b", "gate")]
DEFAULT_VARIANTS = ["default:", "m32:gemv_m32=true,gemv_max_rows=128"]


def parse_variant(text: str) -> tuple[str, dict]:
    name, _, opts = text.partition(":")
    assigns = [a for a in opts.split(",") if a.strip()]
    from exl2cpp.options import parse_assignments

    return name or "default", parse_assignments(assigns)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bpw", default="4.0", help="comma-separated, of " + ", ".join(map(str, BIT_MIX)))
    ap.add_argument("--rows", default="1,2,4,8,16,17,24,32,48,64,96,128")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--variant", action="append", default=[], help="NAME:OPTION=VALUE,... (repeatable)")
    ap.add_argument("--json", help="write all numbers here")
    args = ap.parse_args(argv)

    import exl2cpp.options
    from exl2cpp import _C

    if not _C.cuda_compiled() or _C.cuda_device_count() == 0:
        print("bench_rows: no CUDA GPU (or a CPU-only build)", file=sys.stderr)
        return 1
    bpws = [float(b) for b in args.bpw.split(",")]
    for b in bpws:
        if b not in BIT_MIX:
            ap.error(f"--bpw {b}: one of {sorted(BIT_MIX)}")
    rows = [int(r) for r in args.rows.split(",")]
    variants = [parse_variant(v) for v in (args.variant or DEFAULT_VARIANTS)]
    gpu = gpu_name()
    cb = _C.cuda_bench
    copy_bytes = 512 << 20
    copy_bw = 2 * copy_bytes / cb.copy(copy_bytes, 50, True)
    print(f"GPU: {gpu}; copy bandwidth {copy_bw / 1e9:.0f} GB/s (copy kernel)")
    for name, opts in variants:
        print(f"variant {name}: " + (" ".join(f"{k}={v}" for k, v in opts.items()) or "the shipped defaults"))
    rng = np.random.default_rng(0)
    out = {"gpu": gpu, "copy_GBps": copy_bw / 1e9, "variants": dict(variants), "rows": []}
    with tempfile.TemporaryDirectory() as td:
        for bpw in bpws:
            for model, lin in SHAPES:
                n_in, n_out = next((i, o) for n, i, o in MODELS[model] if n == lin)
                path = Path(td) / f"l_{n_in}_{n_out}_{bpw}.safetensors"
                if not path.exists():
                    make_layer(_C, rng, n_in, n_out, bpw, path)
                print(f"\n{model} {lin} {n_in}x{n_out} @ {bpw} bpw, us per call")
                head = f"{'rows':>5} " + " ".join(f"{n:>10}" for n, _ in variants)
                print(head + f" {'dq+cuBLAS':>10} {'cuBLAS f16':>10} {'copy floor':>10}  best / 1-row")
                base = None
                for m in rows:
                    rec = {"model": model, "linear": lin, "in": n_in, "out": n_out, "bpw": bpw, "m": m}
                    times = {}
                    for name, opts in variants:
                        with exl2cpp.options.scope(opts):
                            times[name] = _C.exl2_linear_bench(str(path), "layer", m, args.iters)["seconds"]
                    r = _C.exl2_linear_bench(str(path), "layer", m, args.iters, threshold=0)
                    deq, nbytes = r["seconds"], r["nbytes"]
                    f16 = cb.matmul_f16(m, n_in, n_out, args.iters)
                    floor = nbytes / copy_bw
                    best = min(times.values())
                    base = base or best
                    rec.update({f"{n}_us": t * 1e6 for n, t in times.items()})
                    rec.update({"dequant_cublas_us": deq * 1e6, "cublas_f16_us": f16 * 1e6,
                                "copy_floor_us": floor * 1e6, "nbytes": nbytes})
                    out["rows"].append(rec)
                    print(f"{m:>5} " + " ".join(f"{times[n] * 1e6:>10.1f}" for n, _ in variants)
                          + f" {deq * 1e6:>10.1f} {f16 * 1e6:>10.1f} {floor * 1e6:>10.1f}  {best / base:5.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
