"""Whole models on the GPU against the CPU backend (marker `cuda`; skipped without a GPU): tiny random models of
each architecture, the three ExLlamaV2 fixture quants, and a real-weight SmolLM2 (its first 4 layers, from the
fixture) on perplexity and greedy tokens."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import exl2cpp
from exl2cpp import _C

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(getattr(_C, "cuda_device_count", lambda: 0)() == 0, reason="no CUDA device"),
]

GPL3 = "/usr/share/common-licenses/GPL-3"


def rel_l2(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("kind", ["llama", "llama_bias", "qwen2", "qwen3", "llama_rope_yarn", "llama_rope_llama3"])
def test_tiny_models_gpu_vs_cpu(kind, tmp_path):
    pytest.importorskip("transformers")
    from test_models_hf import make_hf_model

    make_hf_model(kind, {}, tmp_path)
    ids = np.random.default_rng(3).integers(0, 211, size=200).tolist()
    cpu = exl2cpp.load(tmp_path, device="cpu").forward(ids)
    gpu = exl2cpp.load(tmp_path, device="cuda").forward(ids, chunk_size=64)
    assert rel_l2(gpu, cpu) < 2e-3, kind


@pytest.fixture(scope="module")
def quant_models():
    from conftest_exl2 import assemble_fixture_models

    return assemble_fixture_models()


@pytest.mark.parametrize("tag", ["q25", "q40", "q60"])
def test_fixture_quants_gpu_vs_cpu(tag, quant_models, capsys):
    from conftest_exl2 import require_fixtures

    ids = np.load(require_fixtures() / "fx_logits.npz")["ids"].astype(np.int64).tolist()
    cpu = exl2cpp.load(quant_models / tag, device="cpu").forward(ids)
    gpu_model = exl2cpp.load(quant_models / tag, device="cuda")
    gpu = gpu_model.forward(ids)
    decode = np.concatenate([gpu_model.forward(ids[: i + 1])[-1:] for i in range(len(ids) - 8, len(ids))])
    with capsys.disabled():
        print(f"\n{tag}: GPU vs CPU (fp32 reference on dequantized weights) rel L2 {rel_l2(gpu, cpu):.2e}")
    assert rel_l2(gpu, cpu) < 2e-3
    assert rel_l2(decode, cpu[-8:]) < 2e-3


@pytest.fixture(scope="module")
def smol_fp16(tmp_path_factory):
    """SmolLM2's first 4 layers in fp16: the fixture's source model, or (where only the quants travel) the q60
    quant dequantized to fp16."""
    from conftest_exl2 import load_quant, np_dequantize, require_fixtures
    from safetensors.numpy import load_file, save_file

    fx = require_fixtures()
    out = tmp_path_factory.mktemp("smol4")
    if (fx / "source" / "model.safetensors").is_file():
        for f in (fx / "source").iterdir():
            shutil.copy(f, out)
        return out
    tensors, config = load_quant("q60")
    state = dict(load_file(str(fx / "fx_embed.safetensors")))
    for name, t in tensors.items():
        if name.endswith(".weight"):
            state[name] = t.astype(np.float16)
        elif name.endswith(".q_weight"):
            p = name[: -len(".q_weight")]
            sub = {s: tensors[f"{p}.{s}"] for s in ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm")}
            w = np_dequantize(sub)  # [in, out_pad] -> [in, out]
            if p == "lm_head":
                w = w[:, : config["vocab_size"]]
            state[f"{p}.weight"] = np.ascontiguousarray(w.T).astype(np.float16)
    cfg = {k: v for k, v in config.items() if k != "quantization_config"}
    cfg["tie_word_embeddings"] = False
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(fx / "source" / f, out)
    return out


def test_smol_perplexity_gpu_within_half_percent_of_cpu(smol_fp16, capsys):
    text = open(GPL3, encoding="utf-8").read()
    cpu = exl2cpp.load(smol_fp16, device="cpu").perplexity(text, ctx=1024, max_tokens=4096)
    gpu = exl2cpp.load(smol_fp16, device="cuda").perplexity(text, ctx=1024, max_tokens=4096)
    with capsys.disabled():
        print(f"\nSmolLM2 (4 layers) ppl over 4096 GPL-3 tokens: CPU {cpu:.4f}, GPU {gpu:.4f}")
    assert abs(gpu / cpu - 1) < 5e-3


def test_smol_greedy_gpu_equals_cpu(smol_fp16):
    ids = exl2cpp.load(smol_fp16, device="cpu").tokenizer.encode("The GNU General Public License is a free")
    cpu = exl2cpp.load(smol_fp16, device="cpu").generate_ids(ids, max_new_tokens=32, temperature=0.0)
    gpu = exl2cpp.load(smol_fp16, device="cuda").generate_ids(ids, max_new_tokens=32, temperature=0.0)
    assert gpu == cpu
