"""Check `exl2cpp fit` on a GPU: fit a 7B-shaped fp16 source (a sparse safetensors file: the header of the real
shapes, no data) at a budget, synthesize that bpw's EXL2 folder (bench/synth_exl2.py), load it on CUDA, run a
full-context prefill, and report how close to the budget the load and the prefill came (cuda_mem_info: total - free,
the CUDA context included) and that +0.1 bpw does not fit by the same accounting.

    PYTHONPATH=python python3 bench/fit_check.py --vram 9GiB --ctx 8192 --work /tmp/fit --json out.json

With --bounds SRC QUANT [QUANT ...] it checks instead, for real quants of an fp16 folder, that fit's fp16 prediction
at each quant's bpw bounds what the CUDA loader lays out (above it, within 10 %; tests/test_compare_fit.py does the
same on the fixture quants).
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import synth_exl2  # noqa: E402

from exl2cpp import _C, budget  # noqa: E402

MIB, GIB = 1 << 20, 1 << 30


def sparse_fp16_source(folder: Path, preset: str) -> Path:
    """config.json + model.safetensors of the preset's shapes in f16; the data is a hole (sparse file)."""
    shape = synth_exl2.PRESETS[preset]
    folder.mkdir(parents=True, exist_ok=True)
    cfg = synth_exl2.config_json(shape, 16.0)
    cfg.pop("quantization_config")
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    h, v = shape["hidden"], shape["vocab"]
    specs = [("model.embed_tokens.weight", (v, h))]
    for i in range(shape["layers"]):
        p = f"model.layers.{i}"
        specs += [(f"{p}.input_layernorm.weight", (h,)), (f"{p}.post_attention_layernorm.weight", (h,))]
        for role, (fin, fout) in synth_exl2.linear_dims(shape).items():
            part = "self_attn" if role.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            specs.append((f"{p}.{part}.{role}.weight", (fout, fin)))
    specs += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    header, off = {}, 0
    for name, shp in specs:
        n = int(np.prod(shp)) * 2
        header[name] = {"dtype": "F16", "shape": list(shp), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + off)
    return folder


def used(index: int = 0) -> int:
    free, total = _C.cuda_mem_info(index)
    return int(total - free)


def bounds(src: str, quants: list[str]) -> int:
    import exl2cpp

    ok = True
    for q in quants:
        bpw = exl2cpp.load(q, max_seq_len=64, device="cuda").info()["bpw_layers"]
        real, pred = sum(budget.loader_sizes(q).layers), sum(budget.quantized_sizes(src, bpw).layers)
        good = real <= pred <= 1.10 * real
        ok &= good
        print(f"{q}: bpw {bpw:.3f}; CUDA loader {real} B, fp16 prediction {pred} B ({pred / real:.4f}x)"
              f"{'' if good else ' OUT OF BOUNDS'}", flush=True)  # fmt: skip
    return 0 if ok else 1


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--bounds"]:
        return bounds(argv[1], argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vram", default="9GiB")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--cache", default="fp16")
    ap.add_argument("--preset", default="llama2-7b")
    ap.add_argument("--work", default="/tmp/fit-check")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import exl2cpp

    work = Path(args.work)
    vram = budget.parse_size(args.vram)
    baseline = used()  # the CUDA context of this process (cuda_mem_info made it), before any weight
    src = sparse_fp16_source(work / "fp16", args.preset)
    t0 = time.perf_counter()
    r = exl2cpp.fit(src, vram, ctx=args.ctx, cache=args.cache)
    fit_s = time.perf_counter() - t0
    bpw = r["bpw"]
    report = {"vram": vram, "ctx": args.ctx, "cache": args.cache, "bpw": bpw, "plan": r["plan"], "next": r["next"],
              "fit_s": fit_s, "context_bytes_measured": baseline, "cuda_context_reserved": budget.CUDA_CONTEXT}
    print(budget.format_fit(r), flush=True)
    if bpw is None:
        print("nothing fits", flush=True)
        return 1
    quant = work / f"exl2-{bpw:.2f}"
    synth_exl2.synthesize(quant, args.preset, bpw, skip_existing=True)
    real = budget.loader_sizes(quant, args.ctx)
    pred = budget.quantized_sizes(src, bpw, ctx=args.ctx)
    report["weights_predicted"] = pred.total(args.ctx)
    report["weights_loader"] = real.total(args.ctx)  # the CUDA loader's exact sizes of the synthesized quant
    quant_fit = exl2cpp.fit(quant, vram, ctx=args.ctx, cache=args.cache)
    report["quant_fit"] = {"fits": quant_fit["plan"]["fits"], "need": quant_fit["plan"]["need"],
                           "max_ctx": quant_fit["max_ctx"]}
    t0 = time.perf_counter()
    m = exl2cpp.load(quant, device="cuda", max_seq_len=args.ctx)
    report["load_s"] = time.perf_counter() - t0
    report["info_bpw"] = m.info().get("bpw_layers")
    report["used_after_load"] = used()
    ids = [(7 * i + 3) % m.vocab_size for i in range(args.ctx)]
    cache = m._core.make_cache(args.ctx, 256, args.cache)
    pages = cache.pool.alloc(-(-args.ctx // 256))
    report["used_after_cache"] = used()
    t0 = time.perf_counter()
    peak = 0
    for a in range(0, args.ctx, 2048):
        step = ids[a : a + 2048]
        logits = m._step(cache, pages, step, a, [len(step) - 1])
        peak = max(peak, used())
    report["prefill_s"] = time.perf_counter() - t0
    report["prefill_finite"] = bool(np.isfinite(logits).all())
    report["used_after_prefill"] = peak
    report["headroom_after_prefill"] = vram - peak
    report["next_fits"] = bool(r["next"]["fits"]) if r["next"] else None
    for p in pages:
        cache.pool.release(p)
    del cache
    from exl2cpp.quality import speed

    try:
        report.update(speed(m, prompt_tokens=2048, new_tokens=128))  # compare's speed columns on this quant
    except Exception as exc:  # the speed columns are extra here: report, go on
        report["speed_error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps({k: v for k, v in report.items() if k not in ("plan", "next")}, indent=2), flush=True)
    print(f"budget {vram / GIB:.2f} GiB: load {report['used_after_load'] / GIB:.3f} GiB, + cache "
          f"{report['used_after_cache'] / GIB:.3f} GiB, prefill peak {peak / GIB:.3f} GiB "
          f"({(vram - peak) / MIB:.0f} MiB under); fit planned {r['plan']['need'] / GIB:.3f} GiB; weights predicted "
          f"{pred.total(args.ctx) / GIB:.3f} GiB vs the loader's {real.total(args.ctx) / GIB:.3f} GiB; "
          f"{bpw + 0.1:.2f} bpw fits by the accounting: {report['next_fits']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    ok = peak <= vram and report["next_fits"] is False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
