"""Whole-model speed of exl2cpp on one device, next to the hardware ceilings measured in the same process.

For each model folder: VRAM taken by the load, batch-1 decode tokens/s at context 0 and 2048 (prefill first, then N
timed decode steps) through the engine (exl2cpp._C.Engine, greedy, one job) and through raw Model forward steps,
and prefill tokens/s for a 2048-token prompt (both paths). Ceilings: device-to-device copy bandwidth / (bytes of
weights + KV read per token) for decode, and cuBLAS fp16 GEMMs of the same linear shapes for prefill
(exl2cpp._C.cuda_bench; absent on a CPU build, then no ceilings are printed).

    PYTHONPATH=python python3 bench/bench_model.py MODEL_DIR [MODEL_DIR ...] [--json out.jsonl]
    PYTHONPATH=python python3 bench/bench_model.py /tmp/tiny --device cpu --quick     # CPU smoke run
    ... --option gemv_group=false --option pdl=false     # runtime options for the run (docs/options.md)
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C

PAGE = 256


def mem_free(device):
    if not device.startswith("cuda"):
        return None
    from exl2cpp import _C

    index = int(device.split(":")[1]) if ":" in device else 0
    return _C.cuda_mem_info(index)[0]


def time_raw(model, args, shape, log):
    """Raw Model forward steps over one cache: prefill reps, then decode steps at each context."""
    core = model._core
    max_ctx = max(args.ctx + [args.prefill])
    n_tok = max_ctx + args.warmup + args.steps
    cache = core.make_cache(n_tok, PAGE)
    pages = cache.pool.alloc(-(-n_tok // PAGE))
    vocab = shape["vocab"]

    def fwd(tokens, start):
        n = len(tokens)
        return core.forward(
            cache, tokens, list(range(start, start + n)), [0] * n, pages, len(pages), [n - 1]
        )

    res = {}
    fwd(
        C.random_prompt(99, min(64, args.prefill), vocab), 0
    )  # warm-up (kernels, cuBLAS handles, graphs)
    times = []
    for r in range(args.reps):
        prompt = C.random_prompt(100 + r, args.prefill, vocab)
        t = time.perf_counter()
        fwd(prompt, 0)
        times.append(time.perf_counter() - t)
    res["prefill_tok_s"] = args.prefill / min(times)
    res["prefill_tok_s_median"] = args.prefill / statistics.median(times)
    for ctx in args.ctx:
        if ctx:
            logits = fwd(C.random_prompt(200 + ctx, ctx, vocab), 0)
        else:
            logits = fwd([1], 0)
        pos = max(ctx, 1)
        tok = int(np.argmax(logits[-1]))
        for _ in range(args.warmup):
            tok = int(np.argmax(fwd([tok], pos)[-1]))
            pos += 1
        t = time.perf_counter()
        for _ in range(args.steps):
            tok = int(np.argmax(fwd([tok], pos)[-1]))
            pos += 1
        res[f"decode{ctx}_tok_s"] = args.steps / (time.perf_counter() - t)
        log(f"    raw forward: ctx {ctx}: {res[f'decode{ctx}_tok_s']:.1f} tok/s")
    for p in pages:
        cache.pool.release(p)
    return res


def engine_job(eng, prompt, n_new, sampler):
    """Run one job to the end; returns (submit time, [time of each token event])."""
    t0 = time.perf_counter()
    jid = eng.submit(prompt, max_new_tokens=n_new, stop_tokens=[], sampler=sampler)
    times = []
    while not eng.idle:
        events = eng.step()
        now = time.perf_counter()
        for e in events:
            if e[0] == jid:
                if e[1] >= 0:
                    times.append(now)
                if e[4] and e[5] not in ("length", "stop_token"):
                    raise RuntimeError(f"engine job ended with {e[5]}: {e[6]}")
    return t0, times


def time_engine(model, args, shape, log):
    """Through exl2cpp._C.Engine: one greedy job at a time (batch 1), prefix cache off."""
    from exl2cpp import _C
    from exl2cpp.engine import _sampler_settings

    max_ctx = max(args.ctx + [args.prefill])
    n_tok = max_ctx + args.warmup + args.steps + 1
    eng = _C.Engine(
        model._core,
        cache_tokens=PAGE * -(-n_tok // PAGE),
        page_size=PAGE,
        max_batch_tokens=max(2048, args.prefill),
        max_jobs=1,
        prefix_cache=False,
    )
    greedy = _sampler_settings({"temperature": 0.0})
    vocab = shape["vocab"]
    res = {}
    engine_job(eng, C.random_prompt(98, min(64, args.prefill), vocab), 4, greedy)  # warm-up
    times = []
    for r in range(args.reps):
        t0, ev = engine_job(eng, C.random_prompt(300 + r, args.prefill, vocab), 1, greedy)
        times.append(ev[0] - t0)
    res["prefill_tok_s"] = args.prefill / min(times)
    res["prefill_tok_s_median"] = args.prefill / statistics.median(times)
    for ctx in args.ctx:
        prompt = C.random_prompt(400 + ctx, ctx, vocab) if ctx else [1]
        _, ev = engine_job(eng, prompt, 1 + args.warmup + args.steps, greedy)
        ev = ev[1 + args.warmup :]
        res[f"decode{ctx}_tok_s"] = (len(ev) - 1) / (ev[-1] - ev[0]) if len(ev) > 1 else None
        log(f"    engine:      ctx {ctx}: {C.fmt(res[f'decode{ctx}_tok_s'], '.1f')} tok/s")
    del eng
    return res


def bench_folder(folder, args, ceil, log):
    import exl2cpp

    shape = C.model_shape(folder)
    rec = {
        "bench": "exl2cpp",
        "model": C.model_label(folder),
        "path": str(folder),
        "device": args.device,
        "gpu": args.gpu,
        "shape": shape,
        "options": args.options,
    }
    max_ctx = max(args.ctx + [args.prefill])
    gc.collect()
    free0 = mem_free(args.device)
    t = time.perf_counter()
    model = exl2cpp.load(
        folder,
        device=args.device,
        max_seq_len=min(shape["max_pos"], max_ctx + args.warmup + args.steps + PAGE),
        options=args.options,
    )
    rec["load_s"] = time.perf_counter() - t
    free1 = mem_free(args.device)
    info = model.info()
    rec["bpw"] = info.get("bpw_layers")
    rec["bpw_with_head"] = info.get("bpw_with_head")
    rec["weight_bytes"] = info["weight_bytes"]
    rec["vram_model_bytes"] = free0 - free1 if free0 is not None else None
    lin_bytes = sum(x["bytes"] for x in info["linears"])
    # bytes one decode step must read: every linear, the norms, one embedding row
    step_bytes = lin_bytes + (2 * shape["layers"] + 1) * shape["hidden"] * 2 + shape["hidden"] * 2
    rec["decode_bytes_per_token_weights"] = step_bytes
    log(
        f"  {rec['model']}: {C.fmt(rec['bpw'], '.3f')} bpw, weights {info['weight_bytes'] / 2**30:.2f} GiB, "
        f"VRAM {C.fmt(rec['vram_model_bytes'] and rec['vram_model_bytes'] / 2**30, '.2f')} GiB, load {rec['load_s']:.1f} s"
    )

    raw = time_raw(model, args, shape, log)
    free2 = mem_free(args.device)
    eng = time_engine(model, args, shape, log)
    rec["raw"], rec["engine"] = raw, eng
    rec["vram_free_after_bytes"] = free2

    # ceilings
    bw = ceil.bandwidth()
    rec["copy_bw_bytes_s"] = bw
    rec["ceiling"] = {}
    for ctx in args.ctx:
        kv = C.kv_bytes_per_token(shape) * (ctx + (args.warmup + args.steps / 2))
        rec["ceiling"][f"decode{ctx}_tok_s"] = ceil.decode_tok_s(step_bytes + kv)
    gemm_s, attn_s = ceil.prefill_seconds(shape, args.prefill)
    rec["ceiling"]["prefill_tok_s"] = args.prefill / gemm_s if gemm_s else None
    rec["ceiling"]["prefill_attn_s"] = attn_s
    rec["ceiling"]["prefill_gemm_attn_tok_s"] = args.prefill / (gemm_s + attn_s) if gemm_s else None
    for key in [f"decode{c}_tok_s" for c in args.ctx] + ["prefill_tok_s"]:
        vals = [v for v in (raw.get(key), eng.get(key)) if v]
        rec[key] = max(vals) if vals else None
        rec[key + "_path"] = None if not vals else ("engine" if eng.get(key) == rec[key] else "raw")
        rec[key + "_pct"] = C.pct(rec[key], rec["ceiling"].get(key))
    del model
    gc.collect()
    return rec


def print_table(recs, args, out=print):
    rows = []
    for r in recs:
        row = [
            r["model"],
            C.fmt(r.get("bpw"), ".2f"),
            C.fmt(r.get("vram_model_bytes") and r["vram_model_bytes"] / 2**30, ".2f"),
        ]
        for ctx in args.ctx:
            k = f"decode{ctx}_tok_s"
            row += [
                f"{C.fmt(r['raw'].get(k), '.0f')}/{C.fmt(r['engine'].get(k), '.0f')}",
                C.fmt(r["ceiling"].get(k)),
                C.fmt(r.get(k + "_pct"), ".0f"),
            ]
        row += [
            f"{C.fmt(r['raw'].get('prefill_tok_s'))}/{C.fmt(r['engine'].get('prefill_tok_s'))}",
            C.fmt(r["ceiling"].get("prefill_tok_s")),
            C.fmt(r.get("prefill_tok_s_pct"), ".0f"),
        ]
        rows.append(row)
    headers = ["model", "bpw", "VRAM GiB"]
    for ctx in args.ctx:
        headers += [f"dec@{ctx} raw/eng", "ceiling", "%"]
    headers += [f"prefill{args.prefill} raw/eng", "cuBLAS", "%"]
    out(
        f"exl2cpp on {args.gpu} ({args.device}); tok/s, best path vs ceiling; decode {args.steps} steps, "
        f"prefill best of {args.reps}"
    )
    out(C.table(rows, headers))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="model folders")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ctx", default="0,2048", help="decode contexts, comma-separated")
    ap.add_argument(
        "--prefill", type=int, default=2048, help="prompt length of the prefill measurement"
    )
    ap.add_argument("--steps", type=int, default=128, help="timed decode steps per context")
    ap.add_argument(
        "--warmup", type=int, default=8, help="untimed decode steps before the timed ones"
    )
    ap.add_argument("--reps", type=int, default=3, help="prefill repetitions (best is reported)")
    ap.add_argument(
        "--quick", action="store_true", help="tiny settings for a smoke run (CPU tests)"
    )
    ap.add_argument("--json", help="append one JSON record per model to this file")
    C.add_option_flag(ap)
    args = ap.parse_args(argv)
    args.options = C.options_of(args)
    args.ctx = [int(c) for c in args.ctx.split(",") if c.strip()]
    if args.quick:
        args.ctx = [min(c, 64) for c in args.ctx]
        args.prefill, args.steps, args.warmup, args.reps = 64, 4, 1, 1
    args.gpu = C.gpu_name() if args.device.startswith("cuda") else "cpu"
    ceil = C.Ceilings(enabled=args.device.startswith("cuda"))
    if ceil.available:
        print(f"copy bandwidth: {ceil.bandwidth() / 1e9:.0f} GB/s (read + write)", flush=True)
    if args.options:
        print("options: " + " ".join(f"{k}={v}" for k, v in args.options.items()), flush=True)
    recs = []
    failed = 0
    for folder in args.models:
        try:
            rec = bench_folder(folder, args, ceil, lambda s: print(s, flush=True))
            recs.append(rec)
        except Exception as exc:  # noqa: BLE001 - one model failing must not lose the others
            rec = {
                "bench": "exl2cpp",
                "model": C.model_label(folder),
                "error": f"{type(exc).__name__}: {exc}",
            }
            print(f"  {rec['model']}: FAILED {rec['error']}", flush=True)
            failed += 1
            gc.collect()
        C.write_record(args.json, rec)
    if recs:
        print_table(recs, args)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
