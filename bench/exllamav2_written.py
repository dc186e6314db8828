"""EXL2 files written by ExLlamaV2 0.3.2's own converter for architectures past Llama, loaded by exl2cpp.

For each architecture (tiny random-weight models made by HF transformers, norm weights randomised too; Mixtral with
more experts than top-k, Gemma 2 with its soft-caps and pre/post norms), ExLlamaV2's converter writes a 4.0 bpw
EXL2 folder; then
  - every quantized linear is dequantized by ExLlamaV2 (its `reconstruct` kernel) and by exl2cpp
    (`_C.exl2_dequantize`): the fp16 bits must be identical (ExLlamaV2's MLP row/column reordering at load is
    undone as tests/conftest_exl2.exllama_orientation does for the Llama fixture);
  - exl2cpp loads the folder (CUDA) and its logits on a token sequence are compared with ExLlamaV2's own on the same
    folder (rel L2) and with HF transformers fp32 on the unquantized model (for scale).
Prints one block per architecture and a summary line; exits 1 when any weight differs.

    python3 bench/exllamav2_written.py --tokenizer TOKENIZER_DIR --work /tmp/ew [--arch mixtral gemma2]

Needs torch, transformers, exllamav2 0.3.2 (its extension built) and a GPU: a device script (scripts/device_*.sh).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

BASE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, rms_norm_eps=1e-5)  # fmt: skip
ARCHS = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
                                      tie_word_embeddings=False)),  # fmt: skip
    "gemma2": ("Gemma2Config", dict(query_pre_attn_scalar=64, attn_logit_softcapping=50.0,
                                    final_logit_softcapping=30.0, sliding_window=1024,
                                    hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)),  # fmt: skip
}


def rel_l2(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def make_source(arch: str, folder: Path, tokenizer: Path, vocab: int, seed: int = 0):
    import torch
    import transformers

    cls, extra = ARCHS[arch]
    cfg = getattr(transformers, cls)(**{**BASE, **extra, "vocab_size": vocab})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.3, 0.3) if arch == "gemma2" else p.uniform_(0.6, 1.4)  # Gemma: (1 + w)
            elif name.endswith("block_sparse_moe.gate.weight"):
                p.normal_(0.0, 0.3)
            else:
                p.normal_(0.0, 0.05)
    model.eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(folder, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (tokenizer / f).is_file():
            shutil.copy(tokenizer / f, folder / f)
    return model.to(torch.float32)


def exllamav2_linears(model) -> dict:
    """{key: ExLlamaV2Linear} of every quantized linear of a loaded ExLlamaV2 model."""
    from exllamav2.linear import ExLlamaV2Linear

    out = {}

    def walk(m):
        if isinstance(m, ExLlamaV2Linear):
            if m.is_quant():
                out[m.key] = m
            return
        for s in getattr(m, "submodules", []) or []:
            walk(s)

    for m in model.modules:
        walk(m)
    return out


def orientations(tensors: dict, prefix: str, w: np.ndarray):
    """W [in, out] as stored (attention, and experts: ExLlamaV2 keeps their rows), then with the dense MLP's
    reordering ExLlamaV2 applies at load (tests/conftest_exl2.exllama_orientation)."""
    from conftest_exl2 import exllama_orientation

    yield "as stored", w
    if prefix.endswith(("gate_proj", "up_proj", "down_proj")):
        yield "MLP-reordered", exllama_orientation(tensors, prefix, w)


def check(arch: str, work: Path, tokenizer: Path, bits: float, n_tokens: int) -> bool:
    import torch
    from conftest_exl2 import layer, linear_prefixes
    from safetensors.numpy import load_file

    import exl2cpp
    from exl2cpp import _C

    vocab = len(json.loads((tokenizer / "tokenizer.json").read_text())["model"]["vocab"])
    src, wdir, q = work / arch / "src", work / arch / "work", work / arch / "q"
    for d in (src, wdir, q):
        shutil.rmtree(d, ignore_errors=True)
    hf = make_source(arch, src, tokenizer, vocab)
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "exllamav2.conversion.convert_exl2", "-i", str(src), "-o", str(wdir), "-cf", str(q),
           "-b", str(bits), "-hb", "6", "-nr", "-r", "16", "-mr", "8", "-l", "512", "-ml", "512"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 or not (q / "config.json").is_file():
        print(f"== {arch}: ExLlamaV2's converter failed (rc {r.returncode})\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        return False
    print(f"== {arch}: ExLlamaV2 0.3.2 converted {src.name} to {bits} bpw in {time.perf_counter() - t0:.1f} s")

    tensors = {}
    for f in sorted(q.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    prefixes = linear_prefixes(tensors)
    names = sorted({k.rsplit(".", 1)[0] for k in tensors})
    print(f"   {len(prefixes)} quantized linears, e.g. {[p for p in prefixes if 'experts' in p][:3] or prefixes[:3]}")

    from exllamav2 import ExLlamaV2, ExLlamaV2Config

    config = ExLlamaV2Config(str(q))
    ex = ExLlamaV2(config)
    ex.load()
    ex_lin = exllamav2_linears(ex)
    same, differ, missing, how = 0, [], [], {}
    for prefix in prefixes:
        lin = ex_lin.get(prefix)
        if lin is None:
            missing.append(prefix)
            continue
        want = lin.get_weight_tensor_dq().cpu().numpy()
        ours = _C.exl2_dequantize(layer(tensors, prefix))
        hit = None
        for label, w in orientations(tensors, prefix, ours):
            if w.shape == want.shape and np.array_equal(w.view(np.uint16), want.view(np.uint16)):
                hit = label
                break
        if hit:
            same += 1
            how[hit] = how.get(hit, 0) + 1
        else:
            w = ours if ours.shape == want.shape else None
            n = "shape" if w is None else int(np.count_nonzero(w.view(np.uint16) != want.view(np.uint16)))
            differ.append((prefix, n))
    print(f"   dequantized weights: {same} of {len(prefixes)} bit-identical to ExLlamaV2's ({how})"
          + (f"; differ: {differ[:6]}" if differ else "") + (f"; not found in ExLlamaV2: {missing[:6]}" if missing else ""))

    ids = [(37 * i + 11) % vocab for i in range(n_tokens)]
    with torch.inference_mode():
        ex_logits = ex.forward(torch.tensor([ids], dtype=torch.long)).float().cpu().numpy()[0, :, :vocab]
        hf_logits = hf(torch.tensor([ids])).logits[0].double().numpy()
    ex.unload()
    del ex
    torch.cuda.empty_cache()
    ours_m = exl2cpp.load(q, device="cuda")
    ours = ours_m.forward(ids)
    info = ours_m.info()
    del ours_m
    ours_cpu = exl2cpp.load(q, device="cpu").forward(ids)
    print(f"   exl2cpp loads it: {info.get('architecture')}, bpw {info.get('bpw_layers')}; tensors {len(names)}")
    print(f"   logits rel L2, {n_tokens} tokens: exl2cpp CUDA vs ExLlamaV2 {rel_l2(ours, ex_logits):.2e}; "
          f"exl2cpp CPU vs ExLlamaV2 {rel_l2(ours_cpu, ex_logits):.2e}; exl2cpp CUDA vs CPU {rel_l2(ours, ours_cpu):.2e}; "
          f"quant vs HF fp32 unquantized: exl2cpp {rel_l2(ours, hf_logits):.3f}, ExLlamaV2 {rel_l2(ex_logits, hf_logits):.3f}; "
          f"greedy top-1 agreement exl2cpp/ExLlamaV2 {np.mean(ours.argmax(1) == ex_logits.argmax(1)) * 100:.1f} %")  # fmt: skip
    return not differ and not missing


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, type=Path, help="folder with a tokenizer.json (vocab sets the size)")
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--arch", nargs="+", default=list(ARCHS), choices=list(ARCHS))
    ap.add_argument("--bits", type=float, default=4.0)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args(argv)
    ok = {}
    for arch in args.arch:
        try:
            ok[arch] = check(arch, args.work, args.tokenizer, args.bits, args.tokens)
        except Exception as e:  # report the rest of the architectures too
            import traceback

            traceback.print_exc()
            print(f"== {arch}: failed: {type(e).__name__}: {e}")
            ok[arch] = False
    print("summary: " + ", ".join(f"{a} {'bit-exact' if v else 'FAILED'}" for a, v in ok.items()))
    return 0 if all(ok.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
