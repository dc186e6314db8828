"""Multi-GPU speed: one GPU against a layer split over two and tensor parallel over two, on a Llama-3-8B-shaped
4.0 bpw synthetic EXL2 model, in one run.

For each configuration: decode tokens/s at batch 1 and 32 (one token per sequence per step, each sequence holding a
short prompt) and prefill tokens/s of a 2048-token prompt, through raw Model forward steps (exl2cpp._C.Model.forward,
as bench_model.py's raw path). Prints the GPU names, peer access, the NCCL version, the model shape, where the
layers went, the table and the ratio to one GPU per column.

The one-GPU path decodes through CUDA graphs; the split and tensor-parallel paths run every step eagerly (see
cpp/model/graph.h, cpp/model/tensor_parallel.h), so at batch 1 they also pay the kernel launch overhead the graphs
hide. A layer split does not make one step faster (the GPUs take turns); it makes a model fit that one GPU cannot
hold. Tensor parallel halves each GPU's weight reads and matmul work per step but adds four all-gathers per layer
(NCCL over NVLink) and a host thread driving both GPUs' launches.

    PYTHONPATH=python python3 bench/bench_multigpu.py                      # synthesizes the model if needed
    PYTHONPATH=python python3 bench/bench_multigpu.py --model DIR --json out.jsonl
    PYTHONPATH=python python3 bench/bench_multigpu.py --preset tiny --device cpu --quick   # CPU smoke run
On the CPU (smoke run) the tensor-parallel row runs two virtual CPU ranks (the same sharded graph): it checks the
code path, its speed means nothing.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C

PAGE = 256


def gpu_names(n):
    from exl2cpp import _C

    return [_C.cuda_device_name(i) for i in range(n)]


def make_model(args):
    if args.model:
        return Path(args.model)
    from synth_exl2 import synthesize

    out = Path(args.models_dir) / f"{args.preset}-{args.bpw:.1f}"
    synthesize(
        out,
        args.preset,
        args.bpw,
        distinct=args.distinct_layers,
        skip_existing=True,
        log=lambda *a: None,
    )
    return out


def time_prefill(core, args, vocab):
    n = args.prefill
    cache = core.make_cache(n, PAGE)
    pages = cache.pool.alloc(-(-n // PAGE))
    prompt = C.random_prompt(7, n, vocab)
    core.forward(cache, prompt[:64], list(range(64)), [0] * 64, pages, len(pages), [63])  # warm-up
    times = []
    for _ in range(args.reps):
        t = time.perf_counter()
        core.forward(cache, prompt, list(range(n)), [0] * n, pages, len(pages), [n - 1])
        times.append(time.perf_counter() - t)
    for p in pages:
        cache.pool.release(p)
    return n / min(times), n / statistics.median(times)


def time_decode(core, args, vocab, batch):
    """`batch` sequences, each prefilled with args.context tokens, then args.steps steps of one token each."""
    ctx = args.context
    per_seq = ctx + args.warmup + args.steps + 1
    pps = -(-per_seq // PAGE)
    cache = core.make_cache(batch * pps * PAGE, PAGE)
    table = cache.pool.alloc(batch * pps)
    rng = np.random.default_rng(batch)
    # prefill in chunks of whole sequences (<= 2048 rows per step)
    per_chunk = max(1, 2048 // ctx)
    for s0 in range(0, batch, per_chunk):
        seqs = list(range(s0, min(batch, s0 + per_chunk)))
        toks = rng.integers(3, vocab, ctx * len(seqs)).tolist()
        pos = [p for _ in seqs for p in range(ctx)]
        sot = [s for s in seqs for _ in range(ctx)]
        core.forward(cache, toks, pos, sot, table, pps, [len(toks) - 1])
    seq_ids = list(range(batch))
    pos = ctx
    tokens = rng.integers(3, vocab, batch).tolist()
    for _ in range(args.warmup):
        core.forward(cache, tokens, [pos] * batch, seq_ids, table, pps)
        pos += 1
    t = time.perf_counter()
    for _ in range(args.steps):
        logits = core.forward(cache, tokens, [pos] * batch, seq_ids, table, pps)
        tokens = np.argmax(logits, axis=1).tolist()
        pos += 1
    dt = time.perf_counter() - t
    for p in table:
        cache.pool.release(p)
    return batch * args.steps / dt


def bench_config(name, folder, args, shape, log, **load_kw):
    import exl2cpp

    gc.collect()
    t = time.perf_counter()
    model = exl2cpp.load(
        folder,
        max_seq_len=max(args.prefill, args.context + args.warmup + args.steps + 1) + PAGE,
        **load_kw,
    )
    rec = {
        "config": name,
        "load_s": time.perf_counter() - t,
        "layer_devices": model.layer_devices,
        "head_device": model.head_device,
        "tp_devices": model.tensor_parallel,
    }
    if model.tensor_parallel:
        log(
            f"  {name}: loaded in {rec['load_s']:.1f} s; every layer split over {', '.join(model.tensor_parallel)}; "
            f"lm_head on {model.head_device}"
        )
    else:
        where = {}
        for i, d in enumerate(model.layer_devices):
            where.setdefault(d, []).append(i)
        log(
            f"  {name}: loaded in {rec['load_s']:.1f} s; "
            + "; ".join(f"{d}: layers {v[0]}-{v[-1]}" for d, v in where.items())
            + f"; lm_head on {model.head_device}"
        )
    core = model._core
    for b in args.batches:
        rec[f"decode_b{b}_tok_s"] = time_decode(core, args, shape["vocab"], b)
        log(f"    decode batch {b}: {rec[f'decode_b{b}_tok_s']:.1f} tok/s")
    rec["prefill_tok_s"], rec["prefill_tok_s_median"] = time_prefill(core, args, shape["vocab"])
    log(f"    prefill {args.prefill}: {rec['prefill_tok_s']:.0f} tok/s")
    del core, model
    gc.collect()
    return rec


def main(argv=None):
    import exl2cpp

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", help="model folder (default: synthesize --preset at --bpw into --models-dir)"
    )
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--bpw", type=float, default=4.0)
    ap.add_argument("--models-dir", default="/tmp/exl2-bench-models")
    ap.add_argument(
        "--distinct-layers",
        type=int,
        default=4,
        help="synthesis: distinct layer variants (speed "
        "does not depend on it; fewer is faster to write)",
    )
    ap.add_argument(
        "--device", default="cuda", help='"cuda" (default) or "cpu" (smoke run: one device only)'
    )
    ap.add_argument("--batches", default="1,32")
    ap.add_argument(
        "--context", type=int, default=128, help="prompt tokens per sequence before decoding"
    )
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="few steps, short prompts (smoke runs)")
    ap.add_argument(
        "--tp-variants",
        default="eager,graphs",
        help="tensor-parallel rows on GPUs: eager (one host thread), threads (option tp_threads), graphs "
        "(tp_threads and tp_graphs on, experimental), comma-separated",
    )
    ap.add_argument("--json", help="append one JSON line with every number to this file")
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",") if b.strip()]
    if args.quick:
        args.steps, args.warmup, args.reps = 4, 2, 1
        args.prefill, args.context = min(args.prefill, 128), min(args.context, 16)

    from exl2cpp import _C

    def log(msg):
        print(msg, flush=True)

    n_gpus = _C.cuda_device_count() if args.device.startswith("cuda") else 0
    folder = make_model(args)
    shape = C.model_shape(folder)
    log(
        f"model: {folder} ({args.preset}-shaped, {shape['layers']} layers, hidden {shape['hidden']}, inter "
        f"{shape['inter']}, heads {shape['heads']}/{shape['kv_heads']}, vocab {shape['vocab']}, bits "
        f"{shape['bits']})"
    )
    if n_gpus:
        names = gpu_names(n_gpus)
        log("GPUs: " + ", ".join(f"cuda:{i} {n}" for i, n in enumerate(names)))
        if n_gpus >= 2:
            log(
                f"peer access cuda:0 -> cuda:1: {_C.cuda_can_access_peer(0, 1)}, cuda:1 -> cuda:0: "
                f"{_C.cuda_can_access_peer(1, 0)}"
            )
    else:
        names = ["cpu"]
        log("GPUs: none (CPU run)")
    log(
        f"decode: batch {args.batches}, context {args.context}, {args.steps} steps; prefill {args.prefill} tokens"
    )

    def write_json(partial):
        if not args.json:
            return
        C.write_record(
            args.json,
            {
                "bench": "multigpu",
                "partial": partial,
                "model": str(folder),
                "gpus": names,
                "shape": shape,
                "args": {k: v for k, v in vars(args).items() if k != "json"},
                "results": recs,
                "tensor_parallel": tp_status,
            },
        )

    recs = []
    tp_status = "not run"
    one = "cuda:0" if n_gpus else "cpu"
    recs.append(bench_config("one GPU" if n_gpus else "CPU", folder, args, shape, log, device=one))
    if n_gpus >= 2:
        half = shape["layers"] // 2
        split = [0] * half + [1] * (shape["layers"] - half)
        recs.append(
            bench_config(
                "layer split x2", folder, args, shape, log, device="cuda", layer_devices=split
            )
        )
    else:
        log("  layer split x2: skipped (needs 2 CUDA GPUs)")
    tp_status = "measured"
    if n_gpus >= 2:
        from exl2cpp import tensor_parallel as tp

        tp.prepare_nccl()
        try:
            log(
                f"  NCCL {_C.nccl_describe()}, NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}"
            )
        except Exception as e:  # noqa: BLE001 (a missing NCCL: say so, keep the other rows)
            tp_status = f"failed: {type(e).__name__}: {e}"
            log(f"  tensor parallel x2: {tp_status}")
        variants = {
            "eager": ("tensor parallel x2", "0", "0"),
            "threads": ("tensor parallel x2 (threads)", "1", "0"),
            "graphs": ("tensor parallel x2 (threads + graphs)", "1", "1"),
        }
        for v in (
            [x.strip() for x in args.tp_variants.split(",") if x.strip()]
            if tp_status == "measured"
            else []
        ):
            name, threads, graphs = variants[v]
            if (
                v == "graphs"
            ):  # experimental: keep what is measured so far if this one hangs or fails
                write_json(partial=True)
            exl2cpp.options.set(tp_threads=threads == "1", tp_graphs="on" if graphs == "1" else "off")
            try:
                recs.append(bench_config(name, folder, args, shape, log, device="cuda", tensor_parallel=True,
                                         devices=[0, 1]))  # fmt: skip
            except Exception as e:  # noqa: BLE001 (say so, keep the other rows)
                log(f"  {name}: failed: {type(e).__name__}: {e}")
            finally:
                exl2cpp.options.set(tp_threads=False, tp_graphs="off")
    elif args.device == "cpu":
        recs.append(bench_config("tensor parallel x2 (CPU ranks)", folder, args, shape, log, device="cpu",
                                 tensor_parallel=2))  # fmt: skip
        tp_status = "virtual CPU ranks (code path only)"
    else:
        tp_status = "skipped (needs 2 CUDA GPUs)"
        log(f"  tensor parallel x2: {tp_status}")

    cols = [f"decode_b{b}_tok_s" for b in args.batches] + ["prefill_tok_s"]
    headers = (
        ["config"]
        + [f"decode b{b} tok/s" for b in args.batches]
        + [f"prefill {args.prefill} tok/s"]
    )
    rows = [[r["config"]] + [C.fmt(r[c], ".1f") for c in cols] for r in recs]
    base = recs[0]
    for r in recs[1:]:
        rows.append(
            [f"{r['config']} / {base['config']}"] + [f"{r[c] / base[c]:.2f}x" for c in cols]
        )
    log("")
    log(C.table(rows, headers))
    for r in recs[1:]:
        ratios = ", ".join(f"{h} {r[c] / base[c]:.2f}x" for h, c in zip(headers[1:], cols))
        if r["config"] == "layer split x2":
            log(
                f"scaling (layer split over 2 GPUs / one GPU): {ratios}. A layer split runs the GPUs one after the "
                "other, so ~1.0x is the expected best; it is for models that do not fit on one GPU."
            )
        elif r["config"].startswith("tensor parallel x2") and "CPU" not in r["config"]:
            log(
                f"scaling ({r['config']} / one GPU): {ratios}. Each GPU reads half the weights per step; the four "
                "all-gathers per layer and, without graphs, the kernel launches of both GPUs from the host are the "
                "cost."
            )
    write_json(partial=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
