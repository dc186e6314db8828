"""Diagnostic (dev/kv_q4_diag/README.md): ppl change, its se and mean KL(fp16 cache || quantized cache) per token.

[OFF=<first token>] [EXL2CPP_CPU_ACT=f16] PYTHONPATH=python python3 dev/kv_q4_diag/kl_diag.py <tokens> q4[,q6,...]
"""

import math
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
os.environ.setdefault("EXL2CPP_CACHE", str(Path(__file__).resolve().parents[2] / ".models"))
import exl2cpp
from exl2cpp.models import resolve_model


def run(model, ids, t, chunk=128, page_size=256):
    core = model._core
    cache = core.make_cache(len(ids), page_size, t)
    pages = cache.pool.alloc(-(-len(ids) // page_size))
    out = []
    for s in range(0, len(ids) - 1, chunk):
        part = ids[s : s + chunk]
        lg = np.asarray(
            core.forward(
                cache, part, list(range(s, s + len(part))), [0] * len(part), pages, len(pages), None
            ),
            dtype=np.float64,
        )
        n = min(len(part), len(ids) - 1 - s)
        lg = lg[:n]
        lg -= lg.max(axis=1, keepdims=True)
        out.append(lg - np.log(np.exp(lg).sum(axis=1, keepdims=True)))
    for p in pages:
        cache.pool.release(p)
    return np.concatenate(out)


def main():
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    types = sys.argv[2].split(",") if len(sys.argv) > 2 else ["q4"]
    model = exl2cpp.load(resolve_model("smollm2"), device="cpu")
    off = int(os.environ.get("OFF", "0"))
    ids = model.tokenizer.encode(Path("/usr/share/common-licenses/GPL-3").read_text())[
        off : off + tokens
    ]
    tg = np.asarray(ids[1:])
    base = run(model, ids, "fp16")
    pb = math.exp(-base[np.arange(len(tg)), tg].mean())
    msg = [f"off={off} act={os.environ.get('EXL2CPP_CPU_ACT', 'f32')} {tokens}tok fp16 {pb:.4f}"]
    for t in types:
        lp = run(model, ids, t)
        p = math.exp(-lp[np.arange(len(tg)), tg].mean())
        kl = (np.exp(base) * (base - lp)).sum(1)
        dn = base[np.arange(len(tg)), tg] - lp[np.arange(len(tg)), tg]
        se = 100 * dn.std() / math.sqrt(len(dn))
        msg.append(
            f"{t} {100 * (p / pb - 1):+.3f}% (se {se:.2f}%) KL {1e3 * kl.mean():.2f}e-3 (first512 {1e3 * kl[:512].mean():.2f}, rest {1e3 * kl[512:].mean():.2f})"
        )
    print(" | ".join(msg), flush=True)


main()
