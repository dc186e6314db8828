"""MoE expert matmuls on the GPU (linear/moe_linear.h MoeExperts, the grouped EXL2 v4 kernel): a Mixtral-8x7B-shaped
projection (8 experts, top-2; w1 4096 -> 14336 and w2 14336 -> 4096) at 4.0 bpw, rows 1..16 tokens, against the
copy-bandwidth ceiling for the bytes the kernel actually streamed (its own counter: the chosen experts' weights
only) and against k single-expert GEMV launches (the dense-layer v4 kernel, exl2_linear_bench) reading the same bytes.

Weights are random codes packed by our packer in bench_exl2.py's 4.0 bpw bit mix (values don't change the speed).

    PYTHONPATH=python python3 bench/bench_moe.py [--experts 8] [--iters 100]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_exl2 import gpu_name, pack_random_layer, write_safetensors

SHAPES = [("w1", 4096, 14336), ("w2", 14336, 4096)]


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--bpw", type=float, default=4.0)
    ap.add_argument("--iters", type=int, default=100)
    args = ap.parse_args()
    from exl2cpp import _C

    if not _C.cuda_compiled() or _C.cuda_device_count() == 0:
        print("bench_moe: no CUDA GPU (or a CPU-only build)", file=sys.stderr)
        return 1
    gpu = gpu_name()
    copy_bytes = 512 << 20
    ceiling = 2 * copy_bytes / _C.cuda_bench.copy(copy_bytes, 50, True)
    print(
        f"GPU: {gpu}; copy bandwidth {ceiling / 1e9:.0f} GB/s; {args.experts} experts, top-{args.k}, {args.bpw} bpw"
    )
    print(
        f"{'proj':<4} {'shape':>12} {'rows':>4} {'active':>6} {'MB read':>8} {'us':>8} {'GB/s':>7} {'% copy':>7}"
        f" {'k x GEMV us':>11}"
    )
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as td:
        for name, n_in, n_out in SHAPES:
            path = Path(td) / f"{name}.safetensors"
            tensors = {}
            for e in range(args.experts):
                t = pack_random_layer(_C, rng, n_in, n_out, args.bpw)
                tensors.update({f"experts.{e}.{k}": v for k, v in t.items()})
            write_safetensors(path, tensors)
            del tensors
            prefixes = [f"experts.{e}" for e in range(args.experts)]
            single = _C.exl2_linear_bench(str(path), "experts.0", rows=1, iters=args.iters)[
                "seconds"
            ]
            for rows in (1, 2, 4, 8, 16):
                ids = np.stack(
                    [rng.choice(args.experts, args.k, replace=False) for _ in range(rows)]
                ).astype(np.int32)
                s, nbytes, p = _C.moe_experts_bench(
                    str(path), prefixes, ids, n_in, n_out, iters=args.iters
                )
                active = len(np.unique(ids))
                gemv = f"{args.k * single * 1e6:11.1f}" if rows == 1 else f"{'':>11}"
                print(
                    f"{name:<4} {f'{n_in}x{n_out}':>12} {rows:>4} {active:>6} {nbytes / 1e6:8.1f} {s * 1e6:8.1f}"
                    f" {nbytes / s / 1e9:7.0f} {100 * nbytes / s / ceiling:6.1f}% {gemv}  [{p}]"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
