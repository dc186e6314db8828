"""Diagnostic: evaluate an EXL2 SmolLM2 quant with its lm_head dropped (tied fp16 head) to see the head's KL share."""
import json
import shutil
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from convert_quality import evaluate, windows
from exl2cpp.tokenizer import Tokenizer

src, dst = Path(sys.argv[1]), Path(sys.argv[2])
if not dst.is_dir():
    shutil.copytree(src, dst)
    t = load_file(str(src / "output.safetensors"))
    save_file({k: v for k, v in t.items() if not k.startswith("lm_head.")}, str(dst / "output.safetensors"))
    cfg = json.loads((dst / "config.json").read_text()); assert cfg.get("tie_word_embeddings"), cfg.get("tie_word_embeddings")
tok = Tokenizer(Path("/tmp/convq/smol-fp16"))
wins = windows(tok.encode(Path("/usr/share/common-licenses/GPL-3").read_text())[:4096], 2048)
z = np.load("/tmp/convq/ref_4096.npz"); ref = [z[f"a{i}"] for i in range(len(wins))]
r = evaluate(dst, wins, ref, "cpu")
print(json.dumps({"model": str(dst), "kl": r["kl"], "ppl": r["ppl"]}))
