"""Comparison table of exl2cpp vs ExLlamaV2 from the JSON lines the benches wrote (bench_model, bench_exllamav2,
bench_engine): per model, batch-1 decode at each context and prefill, each as tok/s and % of its ceiling (copy
bandwidth / bytes read per token for decode, cuBLAS fp16 GEMMs of the same shapes for prefill), then the engine
load table.

    python3 bench/report.py results.jsonl [more.jsonl ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C
from bench_engine import engine_table


def contexts(recs):
    ks = set()
    for r in recs:
        for k in r:
            if k.startswith("decode") and k.endswith("_tok_s"):
                ks.add(int(k[len("decode") : -len("_tok_s")]))
    return sorted(ks)


def cell(v, ceiling):
    """'905 (72%)': tok/s and % of the ceiling."""
    if v is None:
        return "-"
    p = C.pct(v, ceiling)
    return f"{v:.0f}" + (f" ({p:.0f}%)" if p is not None else "")


def model_table(recs):
    ours = {r["model"]: r for r in recs if r.get("bench") == "exl2cpp" and "error" not in r}
    theirs = {r["model"]: r for r in recs if r.get("bench") == "exllamav2"}
    if not ours and not theirs:
        return "no per-model results"
    ctxs = contexts(list(ours.values()) + [t for t in theirs.values() if "error" not in t])
    gpu = next(
        (r.get("gpu") for r in list(ours.values()) + list(theirs.values()) if r.get("gpu")), "?"
    )
    rows = []
    wins = []
    for name in sorted(set(ours) | set(theirs)):
        o, t = ours.get(name, {}), theirs.get(name, {})
        bpw = o.get("bpw") or t.get("bpw")
        row = [
            name,
            C.fmt(bpw, ".2f"),
            C.fmt(o.get("vram_model_bytes") and o["vram_model_bytes"] / 2**30, ".1f"),
            C.fmt(t.get("vram_model_bytes") and t["vram_model_bytes"] / 2**30, ".1f"),
        ]
        for key in [f"decode{c}_tok_s" for c in ctxs] + ["prefill_tok_s"]:
            ceiling = (o.get("ceiling") or {}).get(key)
            ov, tv = o.get(key), t.get(key)
            row += [
                cell(ov, ceiling),
                cell(tv, ceiling) if "error" not in t else "ERR",
                C.fmt(ov / tv if ov and tv else None, ".2f"),
            ]
            if ov and tv:
                wins.append(ov > tv)
        rows.append(row)
    headers = ["model", "bpw", "VRAM", "xV2 VRAM"]
    for c in ctxs:
        headers += [f"decode@{c}", "xV2", "x"]
    headers += ["prefill", "xV2", "x"]
    mode = next((t.get("mode") for t in theirs.values() if t.get("mode")), "ExLlamaV2 did not run")
    bw = next((o.get("copy_bw_bytes_s") for o in ours.values() if o.get("copy_bw_bytes_s")), None)
    head = (
        f"GPU: {gpu}; copy bandwidth {C.fmt(bw and bw / 1e9)} GB/s; tok/s at batch 1 (best of engine and raw "
        f"forward for exl2cpp, of generator and model.forward for xV2 = ExLlamaV2) and % of the ceiling measured "
        f"in the same run (decode: copy bandwidth / bytes per token; prefill: cuBLAS fp16); x = exl2cpp / xV2; "
        f"VRAM: GiB for the weights"
    )
    lines = [head, C.table(rows, headers), mode]
    errs = [f"  {n}: {t['error']}" for n, t in theirs.items() if "error" in t]
    errs += [
        f"  exl2cpp {r['model']}: {r['error']}"
        for r in recs
        if r.get("bench") == "exl2cpp" and "error" in r
    ]
    if errs:
        lines.append("errors:\n" + "\n".join(errs))
    if wins:
        lines.append(f"exl2cpp ahead in {sum(wins)} of {len(wins)} comparisons")
    return "\n".join(lines)


def main(argv=None):
    paths = argv if argv is not None else sys.argv[1:]
    recs = C.read_records(*paths)
    print(model_table(recs))
    eng = [
        r
        for r in recs
        if r.get("bench") in ("exl2cpp_engine", "exllamav2_engine") and "error" not in r
    ]
    if eng:
        print()
        print(engine_table(eng))
    for r in recs:
        if r.get("bench") in ("exl2cpp_engine", "exllamav2_engine") and "error" in r:
            print(f"engine bench error ({r['bench']}): {r['error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
