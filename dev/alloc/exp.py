"""Experiment driver (docs/convert.md "Allocation"; inputs in /tmp/convq, outputs in /tmp/alloc): convert SmolLM2 with given calibration ids / settings, eval KL vs fp16 on GPL-3 prefix."""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import exl2cpp.convert as CV
from convert_quality import evaluate, windows
from exl2cpp.tokenizer import Tokenizer

SRC = Path("/tmp/convq/smol-fp16")

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tag"); ap.add_argument("--bits", type=float, nargs="+", default=[5.0, 6.0])
    ap.add_argument("--cal", default=None); ap.add_argument("--qrows", type=int, default=None)
    ap.add_argument("--rowsel", default=None, help="python slice/index expr over rows, e.g. '::2'")
    ap.add_argument("--mrows", type=int, default=None); ap.add_argument("--measurement", default=None)
    ap.add_argument("--damp", type=float, default=None); ap.add_argument("--norm", type=float, default=2.0)
    ap.add_argument("--head-bits", type=int, default=6); ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--outlier", type=float, default=None,
                    help="convert(alloc_outlier_k=) for this run (0 = the old allocation)")
    a = ap.parse_args()
    kw = {"gptq_damp": a.damp, "alloc_outlier_k": a.outlier}
    if a.cal:
        ids = np.load(a.cal)
        if a.rowsel:
            ids = eval(f"ids[{a.rowsel}]")
        if a.qrows:
            ids = ids[: a.qrows]
        info = {"rows": int(ids.shape[0]), "length": int(ids.shape[1]), "dataset": "exp:" + a.cal}
        CV.build_calibration = lambda *args, **k: (np.ascontiguousarray(ids, dtype=np.int32), dict(info))
        kw.update(rows=int(ids.shape[0]), length=int(ids.shape[1]))
    refp = Path("/tmp/convq/ref_%d.npz" % a.tokens)
    tok = Tokenizer(SRC)
    wins = windows(tok.encode(Path("/usr/share/common-licenses/GPL-3").read_text())[: a.tokens], 2048)
    if refp.is_file():
        z = np.load(refp); ref_logp = [z[f"a{i}"] for i in range(len(wins))]
    else:
        r = evaluate(SRC, wins, None, "cpu"); ref_logp = r["logp"]
        np.savez(refp, **{f"a{i}": x for i, x in enumerate(ref_logp)}); print("ref ppl", r["ppl"])
    meas = a.measurement
    res = []
    for b in a.bits:
        out = Path(f"/tmp/alloc/runs/{a.tag}-{b}")
        t0 = time.perf_counter()
        if not (out / "config.json").is_file():
            import shutil; shutil.rmtree(out, ignore_errors=True)
            CV.convert(SRC, out, bits=b, head_bits=a.head_bits, measurement=meas, measure_rows=a.mrows, device="cpu",
                       workers=a.workers, progress=False, error_norm=a.norm, **kw)
        dt = time.perf_counter() - t0
        meas = meas or str(out / "measurement.json")
        r = evaluate(out, wins, ref_logp, "cpu")
        line = {"tag": a.tag, "bits": b, "kl": r["kl"], "ppl": r["ppl"], "bpw": r["bpw_layers"], "time_s": round(dt, 1),
                "args": vars(a)}
        print(json.dumps(line), flush=True)
        with open("/tmp/alloc/results.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")

if __name__ == "__main__":
    main()
