"""Serving throughput of exl2cpp's engine: total generated tokens/s for 1, 8, 32 and 128 concurrent jobs (512-token
random prompts, 256 new tokens each, greedy unless --sampler says otherwise, all submitted at once, prefix cache off
so nothing is shared), and the KV-cache memory per 1k tokens of each cache type the engine offers. With --exllamav2,
the same load through ExLlamaV2 0.3.2's dynamic generator in this process (see bench_exllamav2.py for its mode).

    PYTHONPATH=python python3 bench/bench_engine.py MODEL_DIR [--json out.jsonl] [--exllamav2]
    PYTHONPATH=python python3 bench/bench_engine.py /tmp/tiny --device cpu --quick      # CPU smoke run
    ... --sampler temperature=0.8,top_p=0.9,seed=1   # sampled jobs (A/B: --option device_sample=true)
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C

PAGE = 256
CACHE_TYPES = ("fp16", "q8", "q6", "q4")


def make_engine(model, cache_tokens, max_jobs, max_batch_tokens, cache_type=None):
    """The core engine (no Python streaming layer: the fastest path); cache_type passed only when asked for."""
    from exl2cpp import _C

    kw = {
        "cache_tokens": cache_tokens,
        "page_size": PAGE,
        "max_batch_tokens": max_batch_tokens,
        "max_jobs": max_jobs,
        "prefix_cache": False,
    }
    if cache_type is not None:
        kw["cache_type"] = cache_type
    return _C.Engine(model._core, **kw)


def cache_types_supported(model):
    """Cache types the engine accepts: probe _C.Engine(cache_type=...) with a one-page cache; fp16 only when the
    build has no such option."""
    ok = []
    for t in CACHE_TYPES:
        try:
            make_engine(model, PAGE, 1, 64, cache_type=t)
            ok.append(t)
        except TypeError:  # no cache_type keyword in this build
            return ["fp16"], False
        except Exception as exc:  # noqa: BLE001 - this type is not available
            print(f"    cache type {t}: not available ({exc})")
    return ok, True


def run_load(eng, prompts, new_tokens, sampler, max_seconds):
    """Submit every prompt at once and step until all finish (or max_seconds: the rest are cancelled).
    Returns (tokens generated, seconds, jobs finished, capped)."""
    t0 = time.perf_counter()
    ids = [
        eng.submit(p, max_new_tokens=new_tokens, stop_tokens=[], sampler=sampler) for p in prompts
    ]
    tokens, done, capped = 0, 0, False
    while not eng.idle:
        for e in eng.step():
            if e[1] >= 0:
                tokens += 1
            if e[4]:
                if e[5] not in ("length", "stop_token", "cancelled"):
                    raise RuntimeError(f"engine job {e[0]} ended with {e[5]}: {e[6]}")
                done += e[5] != "cancelled"
        if max_seconds and time.perf_counter() - t0 > max_seconds and not capped:
            capped = True
            elapsed = time.perf_counter() - t0
            for i in ids:
                eng.cancel(i)
            while not eng.idle:
                eng.step()
            return tokens, elapsed, done, capped
    return tokens, time.perf_counter() - t0, done, capped


def bench(folder, args, log):
    import exl2cpp
    from exl2cpp import _C
    from exl2cpp.engine import _sampler_settings

    shape = C.model_shape(folder)
    per_job = args.prompt_len + args.new_tokens
    rec = {
        "bench": "exl2cpp_engine",
        "model": C.model_label(folder),
        "gpu": args.gpu,
        "device": args.device,
        "prompt": args.prompt_len,
        "new": args.new_tokens,
        "levels": [],
    }
    model = exl2cpp.load(
        folder,
        device=args.device,
        max_seq_len=min(shape["max_pos"], 256 * -(-per_job // 256) + 256),
        options=args.options,
    )
    rec["options"] = args.options
    sampler = _sampler_settings(args.sampler)
    rec["sampler"] = args.sampler
    n_max = max(args.concurrency)
    pages_per_job = -(-(per_job + 1) // PAGE)
    eng = make_engine(model, PAGE * pages_per_job * n_max, n_max, args.max_batch_tokens)
    run_load(eng, [C.random_prompt(7, 32, shape["vocab"])], 8, sampler, None)  # warm-up
    for n in args.concurrency:
        prompts = [
            C.random_prompt(10_000 * n + i, args.prompt_len, shape["vocab"]) for i in range(n)
        ]
        tokens, secs, done, capped = run_load(
            eng, prompts, args.new_tokens, sampler, args.max_seconds
        )
        st = eng.stats()
        lvl = {
            "jobs": n,
            "tokens": tokens,
            "seconds": secs,
            "tok_s": tokens / secs,
            "jobs_done": done,
            "capped": capped,
            "steps": st["steps"],
        }
        rec["levels"].append(lvl)
        log(
            f"    {n:4d} jobs: {lvl['tok_s']:.0f} tok/s ({tokens} tokens in {secs:.1f} s"
            f"{f', capped with {done} of {n} jobs done' if capped else ''})"
        )
    rec["bytes_per_token_fp16"] = eng.bytes_per_token
    del eng
    gc.collect()

    types, has_option = cache_types_supported(model)
    rec["cache_type_option"] = has_option
    rec["cache_bytes_per_1k"] = {}
    for t in types:
        free0 = _C.cuda_mem_info(0)[0] if args.device.startswith("cuda") else None
        e = make_engine(model, 16 * 1024, 1, 64, cache_type=t if has_option else None)
        free1 = _C.cuda_mem_info(0)[0] if free0 is not None else None
        rec["cache_bytes_per_1k"][t] = e.bytes_per_token * 1000
        if free0 is not None:
            rec.setdefault("cache_vram_per_1k", {})[t] = (
                (free0 - free1) * 1000 // (e.n_pages * PAGE)
            )
        del e
        gc.collect()
    log(
        "    cache per 1k tokens: "
        + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in rec["cache_bytes_per_1k"].items())
        + ("" if has_option else " (this build has no cache_type option: fp16 only)")
    )
    del model
    gc.collect()
    return rec


def parse_sampler(text):
    """'temperature=0.8,top_k=40' -> {'temperature': 0.8, 'top_k': 40} (ints for top_k, seed, top_logprobs)."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        out[key.strip()] = (
            int(value) if key.strip() in ("top_k", "seed", "top_logprobs") else float(value)
        )
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "model", help="model folder (Llama-2-7B shape at 4.0 bpw for the issue-6 numbers)"
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--concurrency", default="1,8,32,128")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--max-batch-tokens", type=int, default=2048)
    ap.add_argument(
        "--max-seconds", type=float, default=60.0, help="cap per concurrency level (rest cancelled)"
    )
    ap.add_argument(
        "--exllamav2",
        action="store_true",
        help="also run ExLlamaV2's dynamic generator on the load",
    )
    ap.add_argument(
        "--ex-max-seconds", type=float, default=20.0, help="cap per level for ExLlamaV2"
    )
    ap.add_argument(
        "--quick", action="store_true", help="tiny settings for a smoke run (CPU tests)"
    )
    ap.add_argument(
        "--sampler",
        default="temperature=0",
        help="every job's SamplerSettings as key=value,... (default greedy), "
        "e.g. temperature=0.8,top_p=0.9,seed=1",
    )
    ap.add_argument("--json", help="append JSON records to this file")
    C.add_option_flag(ap)
    args = ap.parse_args(argv)
    args.options = C.options_of(args)
    args.sampler = parse_sampler(args.sampler)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if args.quick:
        args.concurrency, args.prompt_len, args.new_tokens = [1, 3], 40, 6
    args.gpu = C.gpu_name() if args.device.startswith("cuda") else "cpu"
    log = lambda s: print(s, flush=True)
    log(
        f"exl2cpp engine on {args.gpu}: {C.model_label(args.model)}, jobs {args.concurrency} x "
        f"({args.prompt_len} prompt + {args.new_tokens} new), "
        f"{'greedy' if args.sampler == {'temperature': 0.0} else args.sampler}, prefix cache off"
    )
    try:
        recs = [bench(args.model, args, log)]
    except Exception as exc:  # noqa: BLE001 - still run ExLlamaV2 and write the error
        recs = [
            {
                "bench": "exl2cpp_engine",
                "model": C.model_label(args.model),
                "error": f"{type(exc).__name__}: {exc}",
            }
        ]
        log(f"  exl2cpp engine load FAILED: {recs[0]['error']}")
    if args.exllamav2:
        import bench_exllamav2 as X

        env = X.Env(log)
        xargs = argparse.Namespace(
            concurrency=args.concurrency,
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            max_seconds=args.ex_max_seconds,
            autosplit=False,
            gpu=args.gpu,
        )
        recs.append(X.bench_engine_load(env, args.model, xargs, log))
    for r in recs:
        C.write_record(args.json, r)
    print(engine_table(recs))
    return 0 if all("error" not in r for r in recs) else 1


def engine_table(recs):
    """Concurrency x backend table of total tok/s, then cache bytes per 1k tokens."""
    levels = sorted({lv["jobs"] for r in recs for lv in r.get("levels", [])})
    names = {"exl2cpp_engine": "exl2cpp Engine", "exllamav2_engine": "ExLlamaV2 dyn. gen."}
    rows = []
    for r in recs:
        by = {lv["jobs"]: lv for lv in r.get("levels", [])}
        rows.append(
            [names.get(r["bench"], r["bench"])]
            + [
                (C.fmt(by[n]["tok_s"]) + ("*" if by[n].get("capped") else "")) if n in by else "-"
                for n in levels
            ]
        )
    out = C.table(rows, ["total tok/s"] + [f"{n} jobs" for n in levels])
    if any(lv.get("capped") for r in recs for lv in r.get("levels", [])):
        out += "\n  * capped: stopped after the time limit (tok/s over the tokens made until then)"
    types = sorted(
        {t for r in recs for t in r.get("cache_bytes_per_1k", {})}, key=CACHE_TYPES.index
    )
    if types:
        rows = [
            [names.get(r["bench"], r["bench"])]
            + [
                C.fmt(
                    r.get("cache_bytes_per_1k", {}).get(t) and r["cache_bytes_per_1k"][t] / 2**20,
                    ".1f",
                )
                for t in types
            ]
            for r in recs
        ]
        out += "\n" + C.table(rows, ["cache MiB / 1k tok"] + types)
    modes = [r["mode"] for r in recs if r.get("mode")]
    if modes:
        out += "\n" + modes[0]
    return out


if __name__ == "__main__":
    sys.exit(main())
