"""Quality and time of exl2cpp's EXL2 converter: for a model folder and a list of bpw, convert (the first run
measures, the others reuse its measurement.json, as ExLlamaV2's -m does), then evaluate every quant with our
runtime: perplexity on a text (default GPL-3) and mean KL divergence of its next-token distributions to the
unquantized model's on the same windows. Other quants (e.g. ExLlamaV2's converter's) join the table with
--compare LABEL@BITS=DIR and are evaluated identically; ExLlamaV3 quants join with --compare-exl3 LABEL@BITS=DIR and
are run by ExLlamaV3's own runtime (torch, CUDA) on the same token windows, their logits scored against the same
reference logits in this process.

    PYTHONPATH=python python3 bench/convert_quality.py MODEL_DIR --bits 2.5 3.0 4.0 5.0 6.0 --work /tmp/cq \\
        [--compare exllamav2@4.0=/path/q40 ...] [--compare-time exllamav2@4.0=SECONDS ...] [--json out.json]
        [--convert-device cuda] [--convert-only | --skip-convert] [--compare-exl3 exl3@4.0=/path/exl3-40 ...]
        [--text FILE --text FILE2] [--speed]

Finished quants in --work are not converted again (their times come from WORK/times.json), and an interrupted
one resumes, so the script can be run again after a timeout. Each conversion writes its per-phase timing to
WORK/timing-LABEL-BITS.json (exl2cpp.convert's timing_file); the table splits our time into measurement and
quantization from it. --merge FILE adds rows of an earlier run's --json (e.g. bench/results/*.json) to the table
without evaluating them again (same text and windows assumed; their reference ppl is printed next to ours).

Prints a markdown table: label, target bpw, measured bpw (decoder, overhead included), ppl, mean KL, top-1 agreement
with the reference, file size, time; with --speed also batch-1 decode tok/s (greedy, 128 new tokens, each runtime's
own generator). Several --text files are windowed separately (no window crosses two texts) and scored together;
the per-text ppl is in the JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

GPL3 = "/usr/share/common-licenses/GPL-3"
SPEED_PROMPT = "The GNU General Public License is a free, copyleft license for"
SPEED_TOKENS = 128


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def windows(ids: list[int], ctx: int) -> list[list[int]]:
    return [ids[s : s + ctx] for s in range(0, len(ids) - 1, ctx) if len(ids[s : s + ctx]) >= 2]


def _score(results: dict, w_i: int, win: list[int], lp: np.ndarray, ref_logp, text_of: list[int]) -> None:
    tgt = np.asarray(win[1:])
    nll = -float(lp[np.arange(len(tgt)), tgt].sum())
    results["nll"] += nll
    results["n"] += len(tgt)
    per = results["per_text"].setdefault(text_of[w_i], [0.0, 0])
    per[0] += nll
    per[1] += len(tgt)
    if ref_logp is None:
        results["logps"].append(lp.astype(np.float32))
    else:
        r = ref_logp[w_i].astype(np.float64)
        results["kl_sum"] += float(np.sum(np.exp(r) * (r - lp)))
        results["kl_n"] += lp.shape[0]
        results["top1"] += int(np.count_nonzero(lp.argmax(axis=1) == r.argmax(axis=1)))


def _finish(acc: dict, ref_logp) -> dict:
    res = {"ppl": math.exp(acc["nll"] / acc["n"]), "tokens": acc["n"],
           "ppl_per_text": [math.exp(a / b) for _, (a, b) in sorted(acc["per_text"].items())]}  # fmt: skip
    if ref_logp is None:
        res["logp"] = acc["logps"]
    else:
        res["kl"] = acc["kl_sum"] / acc["kl_n"]
        res["top1"] = acc["top1"] / acc["kl_n"]
    return res


def _acc() -> dict:
    return {"nll": 0.0, "n": 0, "kl_sum": 0.0, "kl_n": 0, "top1": 0, "per_text": {}, "logps": []}


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file() and f.suffix == ".safetensors")


def evaluate(model_dir: Path, wins: list[list[int]], ref_logp: list[np.ndarray] | None, device: str,
             text_of: list[int], speed: bool = False) -> dict:
    """ppl, mean KL(ref || model) and top-1 agreement over all positions of the windows; returns logp when ref_logp
    is None."""
    import exl2cpp

    model = exl2cpp.load(model_dir, device=device)
    acc = _acc()
    for w_i, win in enumerate(wins):
        _score(acc, w_i, win, log_softmax(model.forward(win)), ref_logp, text_of)
    info = model.info()
    res = _finish(acc, ref_logp)
    res.update({"bpw_layers": info.get("bpw_layers"), "bpw_with_head": info.get("bpw_with_head"),
                "file_bytes": dir_bytes(model_dir)})  # fmt: skip
    if speed:
        from exl2cpp.quality import speed as measure_speed

        res.update(measure_speed(model, new_tokens=SPEED_TOKENS))  # compare's prefill and decode tok/s
    return res


def evaluate_exl3(model_dir: Path, wins: list[list[int]], ref_logp: list[np.ndarray], text_of: list[int],
                  speed: bool = False) -> dict:
    """The same scores for an EXL3 quant run by ExLlamaV3's runtime (its `flash_attn_nc` forward, logits cropped to
    the config's vocabulary, as its own eval scripts do); bpw as ExLlamaV3 counts it (get_storage_info)."""
    import torch
    from exllamav3 import ArgmaxSampler, Cache, Config, Generator, Model, Tokenizer

    config = Config.from_directory(str(model_dir))
    model = Model.from_config(config)
    model.load("cuda:0", max_output_size=max(len(w) for w in wins), max_output_factor=5)
    bpw_layers, bpw_head, vram_bits = model.get_storage_info()
    acc = _acc()
    with torch.inference_mode():
        for w_i, win in enumerate(wins):
            logits = model.forward(torch.tensor([win], dtype=torch.long), {"attn_mode": "flash_attn_nc"})
            lg = logits[0, :, : config.vocab_size].float().cpu().numpy()
            _score(acc, w_i, win, log_softmax(lg), ref_logp, text_of)
    model.unload()
    res = _finish(acc, ref_logp)
    res.update({"bpw_layers": bpw_layers, "bpw_head": bpw_head, "vram_bytes": vram_bits / 8,
                "file_bytes": dir_bytes(model_dir)})  # fmt: skip
    if speed:
        model = Model.from_config(config)
        cache = Cache(model, max_num_tokens=4096)
        model.load("cuda:0")
        gen = Generator(model=model, cache=cache, tokenizer=Tokenizer.from_config(config))
        kw = {"sampler": ArgmaxSampler(), "add_bos": True}
        gen.generate(prompt=SPEED_PROMPT, max_new_tokens=8, min_new_tokens=8, **kw)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gen.generate(prompt=SPEED_PROMPT, max_new_tokens=SPEED_TOKENS, min_new_tokens=SPEED_TOKENS, **kw)
        torch.cuda.synchronize()
        res["decode_tok_s"] = SPEED_TOKENS / (time.perf_counter() - t0)
        model.unload()
    return res


def parse_compare(items: list[str]) -> list[tuple[str, float, str]]:
    out = []
    for it in items:
        try:
            label, rest = it.split("@", 1)
            bits, path = rest.split("=", 1)
            out.append((label, float(bits), path))
        except ValueError:
            sys.exit(f"--compare wants LABEL@BITS=DIR, got {it!r}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--bits", type=float, nargs="+", default=[2.5, 3.0, 4.0, 5.0, 6.0])
    ap.add_argument("--work", required=True, help="folder for the quants (one subfolder per bpw)")
    ap.add_argument("--head-bits", type=int, default=6)
    ap.add_argument("--rows", type=int, default=None, help="calibration rows (default: convert's, per device)")
    ap.add_argument("--length", type=int, default=None)
    ap.add_argument("--measure-rows", type=int, default=None)
    ap.add_argument("--calibration", action="append", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--error-norm", type=float, default=2.0, help="allocation objective sum(err^norm)")
    ap.add_argument("--measurement", default=None, help="reuse this measurement.json for every bpw")
    ap.add_argument("--label", default="exl2cpp", help="name of our quants in the table")
    ap.add_argument("--text", action="append", default=None,
                    help="evaluation text (repeatable; default GPL-3); each is windowed on its own")
    ap.add_argument("--ctx", type=int, default=2048, help="evaluation window, tokens")
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="device for evaluation")
    ap.add_argument("--convert-device", default=None, help="device for conversion (default: cuda if present)")
    ap.add_argument("--workers", type=int, default=None, help="GPTQ processes on the CPU (convert's default)")
    ap.add_argument("--convert-only", action="store_true", help="convert, do not evaluate")
    ap.add_argument("--compare", action="append", default=[], metavar="LABEL@BITS=DIR")
    ap.add_argument("--compare-time", action="append", default=[], metavar="LABEL@BITS=SECONDS")
    ap.add_argument("--compare-exl3", action="append", default=[], metavar="LABEL@BITS=DIR",
                    help="an EXL3 quant, run by ExLlamaV3's runtime (needs exllamav3, torch and a GPU)")
    ap.add_argument("--speed", action="store_true", help="also batch-1 decode tok/s of every model")
    ap.add_argument("--skip-convert", action="store_true", help="evaluate existing quants in --work only")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--merge", action="append", default=[], metavar="JSON",
                    help="add the rows of an earlier --json file to the table (not re-evaluated)")
    args = ap.parse_args(argv)

    from exl2cpp.convert import convert
    from exl2cpp.errors import InvalidArgumentError
    from exl2cpp.tokenizer import Tokenizer

    src = Path(args.model_dir)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    results = []
    meas = args.measurement
    times_file = work / "times.json"
    times_saved = json.loads(times_file.read_text()) if times_file.is_file() else {}
    for bits in args.bits:
        out = work / f"{args.label}-{bits:.2f}bpw"
        key = f"{args.label}@{bits}"
        done = (out / "config.json").is_file() and not (out / ".convert_state").is_dir()
        measured = meas is None
        if not args.skip_convert and not done:
            resumed = out.exists()
            t0 = time.perf_counter()
            tfile = work / f"timing-{args.label}-{bits:.2f}.json"
            try:
                convert(src, out, bits=bits, head_bits=args.head_bits, calibration=args.calibration, rows=args.rows,
                        length=args.length, measure_rows=args.measure_rows, measurement=meas, seed=args.seed,
                        error_norm=args.error_norm, resume=resumed, device=args.convert_device,
                        workers=args.workers, verbose=True, timing_file=tfile)  # fmt: skip
            except InvalidArgumentError as e:  # e.g. a bpw this model's candidates cannot reach: the other rows go on
                print(f"skipped {key}: {e}", file=sys.stderr, flush=True)
                continue
            times_saved[key] = {"time_s": time.perf_counter() - t0, "measured": measured, "resumed": resumed}
            tim = json.loads(tfile.read_text())["timing"]
            times_saved[key]["measure_s"] = sum(tim[k]["s"] for k in ("measure", "measure_io") if k in tim)
            times_saved[key]["calibration_s"] = tim.get("calibration", {}).get("s")
            times_file.write_text(json.dumps(times_saved, indent=1))
            print(f"converted {key} in {times_saved[key]['time_s']:.1f} s", file=sys.stderr, flush=True)
        t = times_saved.get(key, {})
        results.append({"label": args.label, "bits": bits, "dir": str(out), "time_s": t.get("time_s"),
                        "measured": t.get("measured", measured), "resumed": t.get("resumed", False),
                        "measure_time_s": t.get("measure_s") if t.get("measured", measured) else None})  # fmt: skip
        meas = meas or out / "measurement.json"
    if args.convert_only:
        return 0
    times = {}
    for it in args.compare_time:
        k, v = it.split("=", 1)
        times[k] = float(v)
    for fmt, items in (("exl2", args.compare), ("exl3", args.compare_exl3)):
        for label, bits, path in parse_compare(items):
            results.append({"label": label, "bits": bits, "dir": path, "time_s": times.get(f"{label}@{bits}"),
                            "measure_time_s": times.get(f"{label}@measure"), "format": fmt})  # fmt: skip

    tok = Tokenizer(src)
    texts = args.text or [GPL3]
    max_pos = json.loads((src / "config.json").read_text()).get("max_position_embeddings") or args.ctx
    ctx = min(args.ctx, max_pos)
    wins, text_of, counts = [], [], []
    for t_i, path in enumerate(texts):
        ids = tok.encode(Path(path).read_text(encoding="utf-8"))
        if args.max_tokens:
            ids = ids[: args.max_tokens]
        counts.append(len(ids))
        w = windows(ids, ctx)
        wins += w
        text_of += [t_i] * len(w)
    ref = evaluate(src, wins, None, args.device, text_of, speed=args.speed)
    ref_logp = ref.pop("logp")
    print(f"reference {src}: ppl {ref['ppl']:.4f} over {ref['tokens']} tokens of {texts} ({counts} tokens)",
          file=sys.stderr)  # fmt: skip
    for r in results:
        try:
            if r.get("format") == "exl3":
                r.update(evaluate_exl3(Path(r["dir"]), wins, ref_logp, text_of, speed=args.speed))
            else:
                r.update(evaluate(Path(r["dir"]), wins, ref_logp, args.device, text_of, speed=args.speed))
        except Exception as e:  # one model that fails (a peer's runtime, a missing quant) keeps the others' rows
            r["error"] = f"{type(e).__name__}: {e}"
            print(f"FAILED {r['label']}@{r['bits']}: {r['error']}", file=sys.stderr, flush=True)
            continue
        print(f"evaluated {r['label']}@{r['bits']}: ppl {r['ppl']:.4f} kl {r['kl']:.5f}", file=sys.stderr, flush=True)
    for m in args.merge:
        old = json.loads(Path(m).read_text())
        oref = old.get("reference", {}).get("ppl")
        print(f"merged {m}: reference ppl {oref} (this run: {ref['ppl']:.4f})", file=sys.stderr)
        for r in old["results"]:
            if any(x["label"] == r["label"] and x["bits"] == r["bits"] for x in results):
                continue  # evaluated in this run
            results.append({**r, "merged_from": m})

    names = ", ".join(Path(t).name for t in texts)
    print(f"\nmodel {src.name}, eval {names} ({ref['tokens']} tokens, ctx {ctx}); unquantized ppl {ref['ppl']:.4f}"
          + (f", decode {ref['decode_tok_s']:.0f} tok/s" if args.speed else "") + "\n")  # fmt: skip
    sp = " decode tok/s |" if args.speed else ""
    print(f"| quant | target bpw | bpw (layers) | bpw (with head) | ppl | mean KL | top-1 | MB |{sp} time (s) |")
    print("|---|---|---|---|---|---|---|---|" + ("---|" if args.speed else "") + "---|")
    for r in sorted(results, key=lambda r: (r["bits"], r["label"])):
        if r.get("error"):
            print(f"| {r['label']} | {r['bits']:.2f} | failed: {r['error'][:160]} |")
            continue
        t = "" if r.get("time_s") is None else f"{r['time_s']:.1f}"
        if r.get("measure_time_s") is not None:
            t += f" (incl. {r['measure_time_s']:.1f} measurement)" if r.get("measured") else \
                f" (+ {r['measure_time_s']:.1f} measurement)"
        elif r.get("measured"):
            t += " (measure+quant)"
        t += " (resumed)" if r.get("resumed") else ""
        t += " (earlier session)" if r.get("merged_from") else ""
        head = r.get("bpw_with_head")
        head = f"{head:.4f}" if head is not None else f"head {r['bpw_head']:.2f}" if r.get("bpw_head") else ""
        top1 = f"{100 * r['top1']:.1f} %" if r.get("top1") is not None else ""
        mb = f"{r['file_bytes'] / 1e6:.1f}" if r.get("file_bytes") else ""
        dec = f" {r['decode_tok_s']:.0f} |" if args.speed and r.get("decode_tok_s") else " |" if args.speed else ""
        print(f"| {r['label']} | {r['bits']:.2f} | {r['bpw_layers']:.4f} | {head} | {r['ppl']:.4f} | {r['kl']:.5f} | "
              f"{top1} | {mb} |{dec} {t} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"reference": ref, "results": results}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
