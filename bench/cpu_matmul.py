"""GFLOP/s of matmul_nt (y = x @ w^T) on the CPU backend for SmolLM2-135M shapes (hidden 576, MLP 1536,
vocab 49152): prefill (n = 512 tokens) and decode (n = 1; memory bound, so GB/s of weights is printed too).

    PYTHONPATH=python python3 bench/cpu_matmul.py [--threads N] [--reps R]
"""

from __future__ import annotations

import argparse
import os
import platform


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=0, help="EXL2CPP_NUM_THREADS (default: all cores)")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if args.threads:
        os.environ["EXL2CPP_NUM_THREADS"] = str(args.threads)  # read at the pool's first use
    from exl2cpp import _C

    shapes = [  # (name, n, in, out)
        ("q/o proj", 512, 576, 576),
        ("k/v proj", 512, 576, 192),
        ("gate/up", 512, 576, 1536),
        ("down", 512, 1536, 576),
        ("lm_head", 512, 576, 49152),
        ("gate/up decode", 1, 576, 1536),
        ("down decode", 1, 1536, 576),
        ("lm_head decode", 1, 576, 49152),
    ]
    print(f"CPU: {platform.processor() or platform.machine()}, threads: {_C.cpu_num_threads()}")
    print(f"{'shape':<16}{'n':>5}{'in':>6}{'out':>7}  {'w':>4}  {'ms':>9}  {'GFLOP/s':>8}  {'w GB/s':>7}")
    for name, n, k, o in shapes:
        for wd in ("f16", "bf16", "f32"):
            if wd != "f16" and not name.startswith(("gate/up", "lm_head")):
                continue
            reps = args.reps if n > 1 else args.reps * 20
            sec = _C.op_bench_matmul_nt(n, k, o, w_dtype=wd, act="f32", reps=reps)
            gflops = 2.0 * n * k * o / sec / 1e9
            wbytes = k * o * (4 if wd == "f32" else 2)
            print(f"{name:<16}{n:>5}{k:>6}{o:>7}  {wd:>4}  {sec * 1e3:9.3f}  {gflops:8.1f}  {wbytes / sec / 1e9:7.1f}")


if __name__ == "__main__":
    main()
