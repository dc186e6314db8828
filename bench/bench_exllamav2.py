"""ExLlamaV2 0.3.2 on the same model folders and measurements as bench_model.py / bench_engine.py, in one process
(its CUDA extension JIT-compiles on the first import, ~2.5 min; later imports load the cached build).

Runs with EXLLAMA_NO_SDPA=1 (set here when unset): without flash-attn, ExLlamaV2's SDPA path is not causal on this
torch, so it falls back to its matmul attention; and its dynamic generator cannot page without flash-attn, so it
runs unpaged (one job at a time). Both facts are printed with the results.

Per model (public API only): ExLlamaV2Config(dir), ExLlamaV2(config), model.load() then ExLlamaV2Cache(model,
max_seq_len) (or --autosplit: lazy cache + load_autosplit), VRAM taken, batch-1 decode tok/s at context 0 and 2048
through model.forward(ids, cache) and through ExLlamaV2DynamicGenerator (one job), prefill tok/s of a 2048-token
prompt both ways. Ceilings via torch (copy bandwidth, fp16 matmul on the same linear shapes).
With --engine-model: the concurrent-jobs load of bench_engine.py through the dynamic generator, and cache bytes per
1k tokens of each of its cache types.

    EXLLAMA_NO_SDPA=1 PYTHONPATH=/tmp/site python3 bench/bench_exllamav2.py M1 M2 ... [--engine-model M] [--json f]
    python3 bench/bench_exllamav2.py M1 --dry-run          # check arguments and folders without torch/exllamav2
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C

os.environ.setdefault("EXLLAMA_NO_SDPA", "1")


class Env:
    """torch + exllamav2 imported once (the import is what triggers the JIT build)."""

    def __init__(self, log):
        t = time.perf_counter()
        import exllamav2
        import torch
        from exllamav2 import attn as xattn

        self.torch, self.x = torch, exllamav2
        self.import_s = time.perf_counter() - t
        self.version = exllamav2.__version__
        self.flash = bool(xattn.has_flash_attn)
        self.paged = bool(getattr(xattn, "has_flash_attn_with_paged", False))
        self.sdpa = bool(getattr(xattn, "has_lower_right_sdpa", False))
        self.mode = (
            f"ExLlamaV2 {self.version}: flash-attn {'yes' if self.flash else 'NO (ran without flash-attn)'}, "
            f"SDPA {'on' if self.sdpa else 'off (EXLLAMA_NO_SDPA=1: matmul attention)'}, dynamic generator "
            f"{'paged' if self.paged else 'unpaged (no flash-attn: one job at a time)'}"
        )
        log(f"{self.mode}; import {self.import_s:.1f} s")

    def sync(self):
        self.torch.cuda.synchronize()

    def free(self):
        return self.torch.cuda.mem_get_info()[0]

    def cleanup(self):
        gc.collect()
        self.torch.cuda.empty_cache()


def load(env, folder, max_seq_len, cache_len, autosplit=False, cache_cls=None):
    x = env.x
    config = x.ExLlamaV2Config(str(folder))
    config.max_seq_len = max_seq_len
    model = x.ExLlamaV2(config)
    cache_cls = cache_cls or x.ExLlamaV2Cache
    if autosplit:
        cache = cache_cls(model, max_seq_len=cache_len, lazy=True)
        model.load_autosplit(cache)
    else:
        model.load()
        cache = cache_cls(model, max_seq_len=cache_len)
    tokenizer = x.ExLlamaV2Tokenizer(config)
    return config, model, cache, tokenizer


def cache_bytes(cache):
    return sum(t.numel() * t.element_size() for t in cache.all_tensors() if t is not None)


def torch_ceilings(env, shape, n, iters=10, _memo={}):  # noqa: B006 - per-process memo
    """(copy bandwidth B/s, cuBLAS fp16 seconds for n tokens through the linears) via torch."""
    torch = env.torch
    key = (tuple(sorted(shape.items())), n)
    if "bw" not in _memo:
        a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        b = torch.empty_like(a)
        _memo["bw"] = 2 * a.numel() / _time_cuda(env, lambda: b.copy_(a), iters)
        del a, b
    if key not in _memo:
        total = 0.0
        for _, fin, fout in C.linear_shapes(shape):
            xin = torch.randn(n, fin, dtype=torch.float16, device="cuda")
            w = torch.randn(fout, fin, dtype=torch.float16, device="cuda")
            total += _time_cuda(env, lambda: xin @ w.t(), iters)  # noqa: B023
            del xin, w
        xin = torch.randn(1, shape["hidden"], dtype=torch.float16, device="cuda")
        w = torch.randn(shape["vocab"], shape["hidden"], dtype=torch.float16, device="cuda")
        head = _time_cuda(env, lambda: xin @ w.t(), iters)
        del xin, w
        _memo[key] = shape["layers"] * total + head
        env.cleanup()
    return _memo["bw"], _memo[key]


def _time_cuda(env, fn, iters):
    torch = env.torch
    for _ in range(3):
        fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) * 1e-3 / iters


def weight_read_bytes(folder):
    """Bytes one decode step reads: every tensor in the folder except the embedding table (one row of it)."""
    from safetensors import safe_open  # header only

    total = 0
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), "np") as s:
            for k in s.keys():  # noqa: SIM118 - safe_open has no __iter__
                sl = s.get_slice(k)
                shape = sl.get_shape()
                n = 1
                for d in shape:
                    n *= d
                size = {"F16": 2, "BF16": 2, "F32": 4, "I32": 4, "I16": 2}.get(
                    sl.get_dtype(), 4
                ) * n
                total += size // shape[0] if k.endswith("embed_tokens.weight") else size
    return total


def time_forward(env, model, cache, args, shape, log):
    """model.forward(ids, cache): prefill reps, then greedy decode steps (argmax fed back) at each context."""
    torch = env.torch
    vocab = shape["vocab"]
    res = {}

    def ids_of(tokens):
        return torch.tensor([tokens], dtype=torch.long)

    with torch.inference_mode():
        cache.current_seq_len = 0
        model.forward(
            ids_of(C.random_prompt(99, min(64, args.prefill), vocab)), cache, last_id_only=True
        )
        env.sync()
        times = []
        for r in range(args.reps):
            cache.current_seq_len = 0
            prompt = ids_of(C.random_prompt(100 + r, args.prefill, vocab))
            t = time.perf_counter()
            model.forward(prompt, cache, last_id_only=True)
            env.sync()
            times.append(time.perf_counter() - t)
        res["prefill_tok_s"] = args.prefill / min(times)
        res["prefill_tok_s_median"] = args.prefill / statistics.median(times)
        for ctx in args.ctx:
            cache.current_seq_len = 0
            prompt = C.random_prompt(200 + ctx, ctx, vocab) if ctx else [1]
            logits = model.forward(ids_of(prompt), cache, last_id_only=True)
            for _ in range(args.warmup):
                tok = logits[:, -1:].argmax(-1).cpu()
                logits = model.forward(tok, cache)
            env.sync()
            t = time.perf_counter()
            for _ in range(args.steps):
                tok = logits[:, -1:].argmax(-1).cpu()
                logits = model.forward(tok, cache)
            env.sync()
            res[f"decode{ctx}_tok_s"] = args.steps / (time.perf_counter() - t)
            log(f"    model.forward: ctx {ctx}: {res[f'decode{ctx}_tok_s']:.1f} tok/s")
        cache.current_seq_len = 0
    return res


def make_generator(env, model, cache, tokenizer):
    from exllamav2.generator import ExLlamaV2DynamicGenerator

    return ExLlamaV2DynamicGenerator(model=model, cache=cache, tokenizer=tokenizer, paged=env.paged)


def gen_job(env, gen, prompt, n_new):
    from exllamav2.generator import ExLlamaV2DynamicJob, ExLlamaV2Sampler

    return ExLlamaV2DynamicJob(
        input_ids=env.torch.tensor([prompt], dtype=env.torch.long),
        max_new_tokens=n_new,
        stop_conditions=[],
        gen_settings=ExLlamaV2Sampler.Settings.greedy(),
    )


def run_jobs(env, gen, jobs, max_seconds=None):
    """Enqueue jobs, iterate until all finish (or max_seconds pass: the rest are cancelled). Returns (t0, {job:
    [token event times]}, capped)."""
    times = {id(j): [] for j in jobs}
    t0 = time.perf_counter()
    gen.enqueue(jobs)
    capped = False
    while gen.num_remaining_jobs():
        results = gen.iterate()
        now = time.perf_counter()
        for r in results:
            if r.get("stage") == "streaming" and "token_ids" in r:
                times[id(r["job"])] += [now] * int(r["token_ids"].shape[-1])
        if max_seconds and now - t0 > max_seconds and gen.num_remaining_jobs():
            for j in list(gen.pending_jobs) + list(gen.active_jobs):
                gen.cancel(j)
            capped = True
            break
    return t0, times, capped


def time_generator(env, model, cache, tokenizer, args, shape, log):
    """ExLlamaV2DynamicGenerator, one greedy job at a time."""
    vocab = shape["vocab"]
    gen = make_generator(env, model, cache, tokenizer)
    res = {}
    run_jobs(env, gen, [gen_job(env, gen, C.random_prompt(98, min(64, args.prefill), vocab), 4)])
    times = []
    for r in range(args.reps):
        job = gen_job(env, gen, C.random_prompt(300 + r, args.prefill, vocab), 1)
        t0, ev, _ = run_jobs(env, gen, [job])
        times.append(ev[id(job)][0] - t0)
    res["prefill_tok_s"] = args.prefill / min(times)
    res["prefill_tok_s_median"] = args.prefill / statistics.median(times)
    for ctx in args.ctx:
        prompt = C.random_prompt(400 + ctx, ctx, vocab) if ctx else [1]
        job = gen_job(env, gen, prompt, 1 + args.warmup + args.steps)
        _, ev, _ = run_jobs(env, gen, [job])
        ev = ev[id(job)][1 + args.warmup :]
        res[f"decode{ctx}_tok_s"] = (len(ev) - 1) / (ev[-1] - ev[0]) if len(ev) > 1 else None
        log(f"    generator:     ctx {ctx}: {C.fmt(res[f'decode{ctx}_tok_s'], '.1f')} tok/s")
    del gen
    return res


def bench_folder(env, folder, args, log):
    shape = C.model_shape(folder)
    rec = {
        "bench": "exllamav2",
        "version": env.version,
        "mode": env.mode,
        "flash_attn": env.flash,
        "model": C.model_label(folder),
        "path": str(folder),
        "gpu": args.gpu,
        "shape": shape,
    }
    max_ctx = max(args.ctx + [args.prefill])
    need = max_ctx + args.warmup + args.steps + 8
    cache_len = 256 * -(-need // 256)
    env.cleanup()
    free0 = env.free()
    t = time.perf_counter()
    config, model, cache, tokenizer = load(env, folder, cache_len, cache_len, args.autosplit)
    env.sync()
    rec["load_s"] = time.perf_counter() - t
    rec["cache_bytes"] = cache_bytes(cache)
    rec["vram_model_bytes"] = free0 - env.free() - rec["cache_bytes"]
    rec["bpw"] = shape["bits"]
    log(
        f"  {rec['model']}: VRAM {rec['vram_model_bytes'] / 2**30:.2f} GiB (+ cache "
        f"{rec['cache_bytes'] / 2**30:.2f} GiB), load {rec['load_s']:.1f} s"
    )
    rec["raw"] = time_forward(env, model, cache, args, shape, log)
    rec["engine"] = time_generator(env, model, cache, tokenizer, args, shape, log)
    bw, gemm_s = torch_ceilings(env, shape, args.prefill)
    step_bytes = weight_read_bytes(folder)
    rec["copy_bw_bytes_s"] = bw
    rec["decode_bytes_per_token_weights"] = step_bytes
    rec["ceiling"] = {"prefill_tok_s": args.prefill / gemm_s, "source": "torch"}
    for ctx in args.ctx:
        kv = C.kv_bytes_per_token(shape) * (ctx + args.warmup + args.steps / 2)
        rec["ceiling"][f"decode{ctx}_tok_s"] = bw / (step_bytes + kv)
    for key in [f"decode{c}_tok_s" for c in args.ctx] + ["prefill_tok_s"]:
        vals = [v for v in (rec["raw"].get(key), rec["engine"].get(key)) if v]
        rec[key] = max(vals) if vals else None
        rec[key + "_path"] = (
            None if not vals else ("engine" if rec["engine"].get(key) == rec[key] else "raw")
        )
        rec[key + "_pct"] = C.pct(rec[key], rec["ceiling"].get(key))
    model.unload()
    del model, cache, tokenizer, config
    env.cleanup()
    return rec


def bench_engine_load(env, folder, args, log):
    """Total generated tok/s for N concurrent jobs (bench_engine.py's load) through the dynamic generator, and cache
    bytes per 1k tokens for each cache type."""
    shape = C.model_shape(folder)
    vocab = shape["vocab"]
    rec = {
        "bench": "exllamav2_engine",
        "version": env.version,
        "mode": env.mode,
        "model": C.model_label(folder),
        "gpu": args.gpu,
        "prompt": args.prompt_len,
        "new": args.new_tokens,
        "levels": [],
    }
    per_job = args.prompt_len + args.new_tokens
    if env.paged:
        cache_len = 256 * -(-(max(args.concurrency) * (per_job + 256)) // 256)
    else:
        cache_len = 256 * -(
            -(per_job + 8) // 256
        )  # unpaged: one page = the whole cache, one job at a time
    config, model, cache, tokenizer = load(env, folder, cache_len, cache_len, args.autosplit)
    gen = make_generator(env, model, cache, tokenizer)
    run_jobs(env, gen, [gen_job(env, gen, C.random_prompt(7, 32, vocab), 8)])
    for n in args.concurrency:
        jobs = [
            gen_job(
                env, gen, C.random_prompt(10_000 * n + i, args.prompt_len, vocab), args.new_tokens
            )
            for i in range(n)
        ]
        t0, ev, capped = run_jobs(env, gen, jobs, args.max_seconds)
        end = max((t[-1] for t in ev.values() if t), default=t0)
        if capped:
            end = time.perf_counter()
        tokens = sum(len(t) for t in ev.values())
        done = sum(1 for t in ev.values() if len(t) >= args.new_tokens)
        lvl = {
            "jobs": n,
            "tokens": tokens,
            "seconds": end - t0,
            "tok_s": tokens / (end - t0) if end > t0 else None,
            "jobs_done": done,
            "capped": capped,
        }
        rec["levels"].append(lvl)
        log(
            f"    {n:4d} jobs: {C.fmt(lvl['tok_s'], '.0f')} tok/s ({tokens} tokens in {lvl['seconds']:.1f} s"
            f"{f', capped at {args.max_seconds} s with {done} of {n} jobs done' if capped else ''})"
        )
    del gen, cache
    env.cleanup()
    # cache bytes per 1k tokens: allocate each type for 1024 tokens on the same load
    rec["cache_bytes_per_1k"] = {}
    for name, cls in (
        ("fp16", env.x.ExLlamaV2Cache),
        ("q8", env.x.ExLlamaV2Cache_Q8),
        ("q6", env.x.ExLlamaV2Cache_Q6),
        ("q4", env.x.ExLlamaV2Cache_Q4),
    ):
        c = cls(model, max_seq_len=1024)
        rec["cache_bytes_per_1k"][name] = cache_bytes(c) * 1000 // 1024
        del c
        env.cleanup()
    model.unload()
    del model, tokenizer, config
    env.cleanup()
    log(
        "    cache per 1k tokens: "
        + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in rec["cache_bytes_per_1k"].items())
    )
    return rec


def add_common_args(ap):
    ap.add_argument("--ctx", default="0,2048", help="decode contexts, comma-separated")
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", help="append one JSON record per measurement to this file")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", help="model folders for the per-model measurements")
    add_common_args(ap)
    ap.add_argument(
        "--engine-model", help="folder for the concurrent-jobs load (bench_engine.py's workload)"
    )
    ap.add_argument("--concurrency", default="1,8,32,128")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument(
        "--max-seconds",
        type=float,
        default=20.0,
        help="per concurrency level: stop (cancel the rest) after this long; unpaged runs one job at a "
        "time, so its tok/s is steady and a capped run measures it",
    )
    ap.add_argument(
        "--autosplit", action="store_true", help="lazy cache + load_autosplit instead of load()"
    )
    ap.add_argument(
        "--dry-run", action="store_true", help="check the folders and print the plan; no torch"
    )
    args = ap.parse_args(argv)
    args.ctx = [int(c) for c in args.ctx.split(",") if c.strip()]
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    args.gpu = C.gpu_name()
    folders = list(args.models) + ([args.engine_model] if args.engine_model else [])
    for f in folders:
        C.model_shape(f)  # raises on a missing/bad folder
    if args.dry_run:
        print(
            f"dry run: EXLLAMA_NO_SDPA={os.environ.get('EXLLAMA_NO_SDPA')}; models: "
            f"{', '.join(C.model_label(m) for m in args.models) or '-'}; ctx {args.ctx}, prefill {args.prefill}, "
            f"{args.steps} steps; engine load: {C.model_label(args.engine_model) if args.engine_model else '-'} "
            f"jobs {args.concurrency} x ({args.prompt_len} + {args.new_tokens})"
        )
        return 0
    log = lambda s: print(s, flush=True)
    env = Env(log)
    recs = []
    for folder in args.models:
        try:
            rec = bench_folder(env, folder, args, log)
        except Exception as exc:  # noqa: BLE001 - one model failing must not lose the others
            rec = {
                "bench": "exllamav2",
                "model": C.model_label(folder),
                "error": f"{type(exc).__name__}: {exc}",
            }
            log(f"  {rec['model']}: FAILED {rec['error']}")
            env.cleanup()
        C.write_record(args.json, rec)
        recs.append(rec)
    if args.engine_model:
        try:
            rec = bench_engine_load(env, args.engine_model, args, log)
        except Exception as exc:  # noqa: BLE001
            rec = {
                "bench": "exllamav2_engine",
                "model": C.model_label(args.engine_model),
                "error": f"{type(exc).__name__}: {exc}",
            }
            log(f"  engine load FAILED: {rec['error']}")
        C.write_record(args.json, rec)
    ok = [r for r in recs if "error" not in r]
    if ok:
        rows, headers = [], ["model", "bpw", "VRAM GiB"]
        keys = [f"decode{c}_tok_s" for c in args.ctx] + ["prefill_tok_s"]
        for c in args.ctx:
            headers += [f"dec@{c} fwd/gen", "%"]
        headers += [f"prefill{args.prefill} fwd/gen", "%"]
        for r in ok:
            row = [
                r["model"],
                C.fmt(r.get("bpw"), ".2f"),
                C.fmt(r["vram_model_bytes"] / 2**30, ".2f"),
            ]
            for k in keys:
                row += [
                    f"{C.fmt(r['raw'].get(k))}/{C.fmt(r['engine'].get(k))}",
                    C.fmt(r.get(k + "_pct"), ".0f"),
                ]
            rows.append(row)
        print(f"{env.mode}\non {args.gpu}; tok/s, % of the torch-measured ceiling")
        print(C.table(rows, headers))
    return 0 if all("error" not in r for r in recs) else 1


if __name__ == "__main__":
    sys.exit(main())
