"""Offline look at allocations of one measurement: per norm, the picks' summed/max error and bits split."""
import json
import sys

import numpy as np

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "python"))
import os

from exl2cpp.convert import allocate as alloc
from exl2cpp.convert.qparams import QParams

meas = json.load(open(sys.argv[1]))["measurement"]
W = {}
if os.environ.get("W"):
    n = json.load(open(os.environ["W"]))
    W = {k: v["y"] / v["yr"][0] for k, v in n.items()}
H, I, Q, KV = 576, 1536, 576, 192
sh = {"self_attn": {"q_proj": (H, Q, False), "k_proj": (H, KV, False), "v_proj": (H, KV, False), "o_proj": (Q, H, False)},
      "mlp": {"gate_proj": (H, I, False), "up_proj": (H, I, False), "down_proj": (I, H, False)}}
blocks, numel = [], 0
for i in range(30):
    for mode in ("self_attn", "mlp"):
        s = sh[mode]; numel += sum(a * b for a, b, _ in s.values())
        opts = []
        for e in meas[f"model.layers.{i}.{mode}"]:
            g = {p: QParams.from_json(e[p]).groups(s[p][0]) for p in s}
            opts.append({"cost": sum(alloc.linear_cost(g[p], s[p]) for p in s), "err": (1 - e["accuracy"]) * W.get(f"model.layers.{i}.{mode}", 1.0)})
        blocks.append({"key": f"{i}.{mode}", "options": opts})
for bits in [float(b) for b in sys.argv[2:]]:
    for norm in [float(x) for x in os.environ.get('NORMS','1 2 4').split()]:
        picks, s = alloc.allocate(blocks, bits, numel, norm)
        errs = np.array([b["options"][j]["err"] for b, j in zip(blocks, picks)])
        print(f"{bits} n={norm:4}: sum={errs.sum():.4f} sum2={np.square(errs).sum():.5f} max={errs.max():.4f} "
              f"logsum={np.log(errs).sum():.2f} picks={''.join(np.base_repr(j,36) for j in picks)}")
