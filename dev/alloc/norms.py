"""Per-block residual-stream norms of the clean model on the measurement rows: mean over rows of |y|_F (block
output, residual included) and of |y - x|_F, written as JSON {block_key: {"y": .., "d": ..}}."""
import json
import sys
from pathlib import Path

import numpy as np
from exl2cpp.convert.layers import SourceModel

src = SourceModel(Path("/tmp/convq/smol-fp16"), "cpu")
ids = np.asarray(json.load(open(sys.argv[1]))["calibration"]["ids"], np.int32)[: int(sys.argv[3])]
x = src.embed(ids)
out = {}
def fro(a):
    return float(np.mean(np.sqrt(np.sum(np.square(a, dtype=np.float64), axis=(1, 2)))))
def robust(a, k=8.0):
    """mean over rows of |a|_F with tokens whose norm exceeds k x the row's median token norm left out (the rest
    scaled up to the full token count), and the number of such tokens"""
    tn = np.sum(np.square(a, dtype=np.float64), axis=2)  # [rows, T]
    med = np.median(tn, axis=1, keepdims=True)
    keep = tn <= (k * k) * med
    r = np.sqrt(np.sum(np.where(keep, tn, 0), axis=1) * tn.shape[1] / keep.sum(axis=1))
    return float(np.mean(r)), int((~keep).sum())
for i in range(src.n_layers):
    w = src.layer(i)
    y = src.attn_block(x, w)
    out[f"model.layers.{i}.self_attn"] = {"y": fro(y), "d": fro(y - x), "x": fro(x), "yr": robust(y)}
    x = y
    y = src.mlp_block(x, w)
    out[f"model.layers.{i}.mlp"] = {"y": fro(y), "d": fro(y - x), "x": fro(x), "yr": robust(y)}
    x = y
    print(i, out[f"model.layers.{i}.self_attn"], out[f"model.layers.{i}.mlp"], flush=True)
Path(sys.argv[2]).write_text(json.dumps(out, indent=1))
