"""Whole-model batch-1 decode of a Mixtral-8x7B-shaped synthetic EXL2 model (bench/synth_exl2.py preset
mixtral-8x7b: 32 layers, 8 experts of 4096 x 14336, top-2, random codes at the target bpw), exl2cpp next to
ExLlamaV2 0.3.2 on the same folder in the same call when it imports.

The ceiling is the copy bandwidth over the bytes a decode step must read: every non-expert linear, the router, top_k
of each layer's experts (a token's chosen experts; the synthetic experts of a layer have one bit plan, so any top_k
of them are the same bytes), the norms, one embedding row and the KV cache read at that context. exl2cpp's rows come
from raw Model forward steps (one CUDA graph per step) and from its engine; ExLlamaV2's from model.forward(ids,
cache) (bench_exllamav2.py's measurement, without flash-attn where it is missing: printed).

    PYTHONPATH=python python3 bench/bench_moe_model.py --dir /tmp/models [--bpw 4.0] [--ctx 0,2048] [--json f]
    PYTHONPATH=python python3 bench/bench_moe_model.py --dir /tmp/m --preset tiny-moe --device cpu --quick
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_model as BM
import common as C
import synth_exl2 as S


def moe_shape(folder):
    import json

    c = json.loads((Path(folder) / "config.json").read_text())
    shape = C.model_shape(folder)
    shape["experts"] = c["num_local_experts"]
    shape["top_k"] = c["num_experts_per_tok"]
    return shape


def step_bytes(info, shape):
    """Weight bytes one batch-1 decode step reads: linears outside the experts whole, per layer top_k / experts of
    the experts' bytes (equal bit plans per layer: the mean expert), norms and one embedding row."""
    other = experts = 0
    for lin in info["linears"]:
        if ".experts." in lin["name"]:
            experts += lin["bytes"]
        else:
            other += lin["bytes"]
    h = shape["hidden"]
    norms = (2 * shape["layers"] + 1) * h * 4  # f32 norm weights (the router is one of the linears)
    return other + experts * shape["top_k"] // shape["experts"] + norms + h * 2, experts


def ceiling_row(name, res, shape, bw, wbytes, args):
    row = {"system": name}
    for ctx in args.ctx:
        kv = C.kv_bytes_per_token(shape) * (ctx + args.warmup + args.steps / 2)
        ceil = bw / (wbytes + kv) if bw else None
        row[f"decode{ctx}"] = res.get(f"decode{ctx}_tok_s")
        row[f"ceiling{ctx}"] = ceil
        row[f"pct{ctx}"] = C.pct(row[f"decode{ctx}"], ceil)
    return row


def bench_exl2cpp(folder, shape, args, ceil, log):
    import exl2cpp

    max_seq_len = max(args.ctx + [args.prefill]) + args.warmup + args.steps + 2 * BM.PAGE
    model = exl2cpp.load(folder, device=args.device, max_seq_len=max_seq_len)
    info = model.info()
    wbytes, expert_bytes = step_bytes(info, shape)
    log(
        f"  exl2cpp: {C.fmt(info.get('bpw_layers'), '.3f')} bpw, weights {info['weight_bytes'] / 2**30:.2f} GiB, "
        f"experts {expert_bytes / 2**30:.2f} GiB, a decode step reads {wbytes / 2**30:.2f} GiB of weights"
    )
    raw = BM.time_raw(model, args, shape, log)
    eng = BM.time_engine(model, args, shape, log)
    best = {k: max(v for v in (raw.get(k), eng.get(k)) if v) for k in raw if k.startswith("decode")}
    del model
    gc.collect()
    return best, wbytes, info


def bench_exllamav2(folder, shape, args, log):
    try:
        import bench_exllamav2 as BX

        env = BX.Env(log)
    except Exception as exc:  # noqa: BLE001 - not installed here: the exl2cpp rows still print
        log(f"  ExLlamaV2: not run ({type(exc).__name__}: {exc})")
        return None, None
    need = max(args.ctx) + args.warmup + args.steps + 8
    cache_len = 256 * -(-need // 256)
    config, model, cache, tokenizer = BX.load(env, folder, cache_len, cache_len)
    res = BX.time_forward(env, model, cache, args, shape, log)
    model.unload()
    del model, cache, tokenizer, config
    env.cleanup()
    return res, env.mode


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="folder for the synthetic model (kept: reruns reuse it)")
    ap.add_argument("--preset", default="mixtral-8x7b", help="a MoE preset of synth_exl2.py")
    ap.add_argument("--bpw", type=float, default=4.0)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--ctx", default="0,2048", help="decode contexts, comma-separated")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--prefill", type=int, default=256, help="prompt length of the (untabled) prefill timing")
    ap.add_argument("--distinct-layers", type=int, default=2, help="synth_exl2 --distinct-layers (speed is the same)")
    ap.add_argument("--no-exllamav2", action="store_true")
    ap.add_argument("--quick", action="store_true", help="tiny settings for a smoke run")
    ap.add_argument("--json", help="append one JSON record to this file")
    args = ap.parse_args(argv)
    args.ctx = [int(c) for c in args.ctx.split(",") if c.strip()]
    if args.quick:
        args.ctx = [min(c, 64) for c in args.ctx]
        args.steps, args.warmup, args.prefill = 4, 1, 32
    args.reps = 1
    if not S.PRESETS.get(args.preset, {}).get("experts"):
        ap.error(f"--preset {args.preset} is not a MoE preset of synth_exl2.py")
    folder = Path(args.dir) / f"{args.preset}-{args.bpw:.1f}"
    S.synthesize(folder, args.preset, args.bpw, distinct=args.distinct_layers, skip_existing=True)
    shape = moe_shape(folder)
    args.gpu = C.gpu_name() if args.device.startswith("cuda") else "cpu"
    ceil = C.Ceilings(enabled=args.device.startswith("cuda"))
    bw = ceil.bandwidth()
    log = lambda s: print(s, flush=True)  # noqa: E731
    log(f"{folder.name} on {args.gpu}: copy bandwidth {C.fmt(bw and bw / 1e9)} GB/s")
    ours, wbytes, info = bench_exl2cpp(folder, shape, args, ceil, log)
    rows = [ceiling_row("exl2cpp", ours, shape, bw, wbytes, args)]
    theirs, mode = (None, None) if args.no_exllamav2 or not args.device.startswith("cuda") else bench_exllamav2(
        folder, shape, args, log
    )
    if theirs:
        rows.append(ceiling_row("ExLlamaV2", theirs, shape, bw, wbytes, args))
        log(f"  ({mode})")
    headers = ["system"]
    table = []
    for r in rows:
        line = [r["system"]]
        for ctx in args.ctx:
            ratio = (
                C.fmt(r[f"decode{ctx}"] / rows[1][f"decode{ctx}"], ".2f")
                if theirs and rows[1][f"decode{ctx}"]
                else "-"
            )
            line += [C.fmt(r[f"decode{ctx}"], ".1f"), C.fmt(r[f"ceiling{ctx}"]), C.fmt(r[f"pct{ctx}"], ".0f"), ratio]
        table.append(line)
    for ctx in args.ctx:
        headers += [f"dec@{ctx} tok/s", "ceiling", "%", "x ExLlamaV2"]
    log(
        f"batch-1 decode, {shape['experts']} experts top-{shape['top_k']}, {args.bpw} bpw; ceiling = copy bandwidth / "
        f"({wbytes / 2**30:.2f} GiB weights read + KV)"
    )
    log(C.table(table, headers))
    C.write_record(args.json, {"bench": "moe_model", "model": folder.name, "gpu": args.gpu, "rows": rows,
                               "step_weight_bytes": wbytes, "bpw": info.get("bpw_layers")})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
