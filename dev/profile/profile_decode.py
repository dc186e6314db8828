"""Issue 4 profile driver: batch-1 decode steps of a model folder through raw Model.forward, with the CUDA profiler
range (cuProfilerStart/Stop through libcuda) around --steps timed steps, so `ncu --profile-from-start off` sees
exactly those steps' kernels. Prints the wall time per step measured outside the range.
    PYTHONPATH=python python3 dev/profile/profile_decode.py MODEL_DIR [--steps 2] [--ctx 0]
--prefill N profiles one N-token prefill (after a warm-up prefill of the same length) instead of decode steps;
--batch B decodes B sequences of --ctx tokens each in one forward (one row each, own pages), as a batched step;
--option NAME=VALUE (repeatable) sets a runtime option for the run (docs/options.md), e.g.
--option cuda_graphs=false."""
import argparse
import ctypes
import time

import numpy as np

import exl2cpp
import exl2cpp.options

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--steps", type=int, default=2)
ap.add_argument("--ctx", type=int, default=0)
ap.add_argument("--timed", type=int, default=64)
ap.add_argument("--prefill", type=int, default=0)
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--device", default="cuda")
ap.add_argument("--option", action="append", default=[], metavar="NAME=VALUE", help="runtime option (docs/options.md)")
args = ap.parse_args()
model = exl2cpp.load(args.model, device=args.device, options=exl2cpp.options.parse_assignments(args.option))
core = model._core
PAGE = 256
n_tok = max(args.ctx + args.timed + args.steps + 64, args.prefill + 1)
per_seq = -(-n_tok // PAGE)
B = max(args.batch, 1)
cache = core.make_cache(PAGE * per_seq * B, PAGE)
pages = cache.pool.alloc(per_seq * B)


def fwd(tokens, start):
    n = len(tokens)
    return core.forward(cache, tokens, list(range(start, start + n)), [0] * n, pages, len(pages), [n - 1])


if args.prefill:
    prompt = [1 + (i * 7919) % 1000 for i in range(args.prefill)]
    fwd(prompt, 0)
    t = time.perf_counter()
    for _ in range(3):
        fwd(prompt, 0)
    dt = (time.perf_counter() - t) / 3
    print(f"prefill {args.prefill}: {dt * 1e3:.2f} ms wall = {args.prefill / dt:.0f} tok/s", flush=True)
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuProfilerStart()
    fwd(prompt, 0)
    cuda.cuProfilerStop()
    raise SystemExit(0)

prompt = [1 + (i * 7919) % 1000 for i in range(max(args.ctx, 1))]
if B > 1:
    # B sequences: sequence b owns pages[b * per_seq:(b + 1) * per_seq]; each is prefilled alone, then decoded
    # together, one row per sequence.
    def fwd_seq(b, tokens, start):
        n = len(tokens)
        return core.forward(cache, tokens, list(range(start, start + n)), [0] * n,
                            pages[b * per_seq:(b + 1) * per_seq], per_seq, [n - 1])

    toks = [int(np.argmax(fwd_seq(b, prompt[b % 7:] + prompt[:b % 7], 0)[-1])) for b in range(B)]
    pos = len(prompt)

    def step(toks, pos):
        out = core.forward(cache, toks, [pos] * B, list(range(B)), pages, per_seq, list(range(B)))
        return [int(t) for t in np.argmax(out, axis=-1)]

    for _ in range(8):
        toks = step(toks, pos)
        pos += 1
    t = time.perf_counter()
    for _ in range(args.timed):
        toks = step(toks, pos)
        pos += 1
    dt = (time.perf_counter() - t) / args.timed
    print(f"decode step, batch {B} (ctx {args.ctx}): {dt * 1e6:.0f} us wall = {B / dt:.1f} tok/s", flush=True)
    if args.device == "cpu":
        raise SystemExit(0)
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuProfilerStart()
    for _ in range(args.steps):
        toks = step(toks, pos)
        pos += 1
    cuda.cuProfilerStop()
    raise SystemExit(0)
prompt = [1 + (i * 7919) % 1000 for i in range(max(args.ctx, 1))]
tok = int(np.argmax(fwd(prompt, 0)[-1]))
pos = len(prompt)
for _ in range(8):
    tok = int(np.argmax(fwd([tok], pos)[-1]))
    pos += 1
t = time.perf_counter()
for _ in range(args.timed):
    tok = int(np.argmax(fwd([tok], pos)[-1]))
    pos += 1
dt = (time.perf_counter() - t) / args.timed
print(f"decode step (ctx {args.ctx}): {dt * 1e6:.0f} us wall = {1 / dt:.1f} tok/s", flush=True)
cuda = ctypes.CDLL("libcuda.so.1")
cuda.cuProfilerStart()
for _ in range(args.steps):
    tok = int(np.argmax(fwd([tok], pos)[-1]))
    pos += 1
cuda.cuProfilerStop()
