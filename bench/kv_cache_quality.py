"""Quantized KV cache quality: perplexity of a model on a text with each cache type, and cache bytes per 1k tokens.

The text runs through the paged cache in chunks (default 128 tokens), so every chunk attends to the earlier
chunks' K/V as stored (quantized) in the cache, and to its own K/V after they went through the cache too.

    PYTHONPATH=python python3 bench/kv_cache_quality.py                       # SmolLM2 on GPL-3, CPU
    PYTHONPATH=python python3 bench/kv_cache_quality.py --device cuda:0 --tokens 4096

Measured (SmolLM2-135M-Instruct: 30 layers, 3 KV heads, head_dim 64; first 1024 GPL-3 tokens; CPU):
    fp16 19.2828 | q8 19.2870 (+0.02%) | q6 19.3539 (+0.37%) | q4 20.0034 (+3.74%)
    KiB per 1k tokens: fp32 45000, fp16 22500, q8 11953, q6 9141, q4 7031 (5 bits per value).
    First 4096 tokens: fp16 17.9220 | q8 17.9318 (+0.055%) | q4 18.7109 (+4.40%).
Q4 is an asymmetric grid (f16 scale and offset per 32) with the clip (1.0 .. 0.7 of min/max) picked per block by
least squared error; the earlier symmetric absmax Q4 (4.5 bits per value) gave +10.5% (4096 tokens: +7.3%).
Issue 6's 3% target for Q4 is still NOT met on this small model. Variants simulated in fp32 HF (K/V quantized
after RoPE, full 1024-token forward; mean KL(fp32 || quantized) per token in 1e-3, lower is better, ppl in
parentheses; a 1024-token ppl moves by a few % from code flips alone, KL is the steadier measure):
    symmetric absmax (old) 72.9 (+5.5%); + clip search 73.2; asymmetric 69.2 (+3.9%); asym + clip 66.8 (+2.3%);
    K fp16 + V Q4 6.9; K Q4 + V fp16 71.8 (K is the problem); Q5 symmetric 23.1 (+1.7%); Q6 4.9.
    K mean removal (mu per layer/KV head after RoPE, calibrated on 512 Apache-2.0 tokens): sym 47.3, asym + clip
    38.7 (+2.4%; 2048 tokens: 39.3, +3.5% vs asym + clip 56.7, +3.5%); + per-channel K/q smoothing 34.4;
    K blocks of 16 sym + clip 54.9 (5 bits per K value); mu + asym16 K + clip 30.4 (6 bits per K value).
So the quick candidates reach at best about half the old KL at <= 5 bits per value; mu removal needs a
calibration pass at load time and was not built. Per-layer KL is spread over all 30 layers (layer 10 worst).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

TYPES = ["fp32", "fp16", "q8", "q6", "q4"]


def cache_perplexity(
    model, ids: list[int], cache_type: str, chunk: int = 128, page_size: int = 256
) -> float:
    """Perplexity of ids[1:] given the prefix, run in chunks through one cache of type ``cache_type``."""
    core = model._core
    cache = core.make_cache(len(ids), page_size, cache_type)
    pages = cache.pool.alloc(-(-len(ids) // page_size))
    nll, count = 0.0, 0
    try:
        for s in range(0, len(ids) - 1, chunk):
            part = ids[s : s + chunk]
            logits = core.forward(
                cache, part, list(range(s, s + len(part))), [0] * len(part), pages, len(pages), None
            )
            logits = np.asarray(logits, dtype=np.float64)
            targets = np.asarray(ids[s + 1 : s + 1 + len(part)])
            logits = logits[: len(targets)]
            logits -= logits.max(axis=1, keepdims=True)
            logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
            nll -= float(logp[np.arange(len(targets)), targets].sum())
            count += len(targets)
    finally:
        for p in pages:
            cache.pool.release(p)
    return math.exp(nll / count)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="model folder or name (default: smollm2)")
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--types", default=",".join(TYPES))
    args = ap.parse_args()

    import exl2cpp
    from exl2cpp.models import resolve_model

    if args.model == "smollm2" and "EXL2CPP_CACHE" not in os.environ:
        os.environ["EXL2CPP_CACHE"] = str(Path(__file__).resolve().parent.parent / ".models")
    path = resolve_model(args.model) if not Path(args.model).is_dir() else args.model
    model = exl2cpp.load(path, device=args.device)
    ids = model.tokenizer.encode(Path(args.text).read_text(encoding="utf-8"))[: args.tokens]
    c = model.config
    print(
        f"model {Path(path).name} on {args.device}: {c['num_hidden_layers']} layers, "
        f"{c.get('num_key_value_heads')} KV heads, head_dim "
        f"{c.get('head_dim') or c['hidden_size'] // c['num_attention_heads']}; "
        f"{len(ids)} tokens of {Path(args.text).name} in chunks of {args.chunk}"
    )
    types = [t for t in args.types.split(",") if t]
    rows, base = [], None
    for t in types:
        t0 = time.perf_counter()
        ppl = cache_perplexity(model, ids, t, args.chunk)
        dt = time.perf_counter() - t0
        bpt = model._core.make_cache(256, 256, t).bytes_per_token
        if t == "fp16":
            base = ppl
        rows.append((t, ppl, bpt, dt))
    print(
        f"{'cache':>6} {'ppl':>10} {'vs fp16':>9} {'KiB/1k tok':>11} {'vs fp16':>8} {'time s':>7}"
    )
    fp16_b = next((r[2] for r in rows if r[0] == "fp16"), None)
    for t, ppl, bpt, dt in rows:
        rel = f"{100 * (ppl / base - 1):+8.3f}%" if base else "        -"
        mem = f"{bpt / fp16_b:7.3f}x" if fp16_b else "       -"
        print(f"{t:>6} {ppl:10.4f} {rel} {bpt * 1000 / 1024:11.1f} {mem} {dt:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
