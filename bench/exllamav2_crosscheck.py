"""ExLlamaV2 0.3.2 loads an EXL2 folder written by `exl2cpp convert`, and its logits match exl2cpp's (GPU machine).

    EXLLAMA_NO_SDPA=1 python bench/exllamav2_crosscheck.py MODEL_DIR IDS.npz

Prints rel L2 and top-1 agreement of ExLlamaV2's logits against exl2cpp's on CUDA and on the CPU (fp32 reference on
the same dequantized weights). ExLlamaV2 runs without flash-attn (EXLLAMA_NO_SDPA=1 keeps its attention causal).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

os.environ.setdefault("EXLLAMA_NO_SDPA", "1")


def rel_l2(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def writer(model_dir: str) -> str:
    """Which converter wrote the folder, from config.json's quantization_config (ExLlamaV2 writes none)."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            qc = json.load(f).get("quantization_config") or {}
    except (OSError, ValueError):
        return "unknown writer"
    return "exl2cpp convert output" if "exl2cpp" in json.dumps(qc) else "ExLlamaV2 convert output"


def main() -> int:
    model_dir, ids_file = sys.argv[1], sys.argv[2]
    ids = np.load(ids_file)["ids"].astype(np.int64)
    import torch
    from exllamav2 import ExLlamaV2, ExLlamaV2Config

    config = ExLlamaV2Config(model_dir)
    config.max_seq_len = max(256, len(ids))
    model = ExLlamaV2(config)
    model.load()
    with torch.inference_mode():
        ex2 = model.forward(torch.from_numpy(ids)[None, :]).float()[0].cpu().numpy()
    ex2 = ex2[:, : config.vocab_size]

    import exl2cpp

    gpu = exl2cpp.load(model_dir, device="cuda").forward(ids.tolist())
    cpu = exl2cpp.load(model_dir, device="cpu").forward(ids.tolist())
    print(f"ExLlamaV2 0.3.2 loaded {model_dir} ({writer(model_dir)}), ran without flash-attn (EXLLAMA_NO_SDPA=1)")
    for name, ref in (("exl2cpp cuda", gpu), ("exl2cpp cpu fp32", cpu)):
        top1 = float(np.mean(ex2.argmax(1) == ref.argmax(1)))
        print(f"  ExLlamaV2 vs {name:16s}: rel L2 {rel_l2(ex2, ref):.2e}, top-1 agreement {top1:.3f}")
    print(f"  exl2cpp cuda vs cpu fp32: rel L2 {rel_l2(gpu, cpu):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
