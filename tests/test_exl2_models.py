"""The three ExLlamaV2 fixture quants run end to end on the CPU backend: logits on the fixture's token ids match
an fp32 computation (HF transformers) on the same dequantized weights. Also reports how far ExLlamaV2's own
logits are from that computation (run with -s to see the table)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest_exl2 import TAGS, assemble_fixture_models, load_quant, np_dequantize, require_fixtures

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import exl2cpp  # noqa: E402


def rel_l2(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def hf_reference(tag: str):
    """HF LlamaForCausalLM in fp32 whose linears are the dequantized EXL2 weights of quant `tag`."""
    from safetensors.numpy import load_file

    fx = require_fixtures()
    tensors, config = load_quant(tag)
    # EXL2 stores a quantized lm_head even for tied models: untie so it does not overwrite the embedding.
    cfg = {k: v for k, v in config.items() if k != "quantization_config"}
    cfg = transformers.LlamaConfig(**{**cfg, "tie_word_embeddings": False})
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    state = {"model.embed_tokens.weight": load_file(str(fx / "fx_embed.safetensors"))["model.embed_tokens.weight"]}
    for name, t in tensors.items():
        if name.endswith(".weight"):  # norms
            state[name] = t
        elif name.endswith(".q_weight"):
            prefix = name[: -len(".q_weight")]
            sub = {s: tensors[f"{prefix}.{s}"] for s in ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm")}
            out = model.get_submodule(prefix).weight.shape[0]
            state[f"{prefix}.weight"] = np_dequantize(sub, out_features=out).T  # [out, in]
    sd = {k: torch.from_numpy(np.ascontiguousarray(v).astype(np.float32)) for k, v in state.items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return model


@pytest.fixture(scope="module")
def fixture_logits():
    fx = require_fixtures()
    return dict(np.load(fx / "fx_logits.npz"))


@pytest.mark.parametrize("tag", TAGS)
def test_fixture_quant_matches_fp32_on_dequantized_weights(tag, fixture_logits, capsys):
    models = assemble_fixture_models()
    ids = fixture_logits["ids"].astype(np.int64).tolist()
    hf = hf_reference(tag)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].double().numpy()
    model = exl2cpp.load(models / tag, device="cpu")
    ours = model.forward(ids)
    err = rel_l2(ours, ref)
    ex2 = fixture_logits[f"ex2_{tag}"].astype(np.float64)
    with capsys.disabled():
        print(f"\n{tag}: exl2cpp CPU vs HF fp32 (dequantized) rel L2 {err:.2e}; "
              f"ExLlamaV2 vs same {rel_l2(ex2, ref):.2e}; top-1 agreement ExLlamaV2 "
              f"{np.mean(ex2.argmax(1) == ref.argmax(1)):.3f}, exl2cpp {np.mean(ours.argmax(1) == ref.argmax(1)):.3f}")
    assert err < 1e-4


@pytest.mark.parametrize("tag", TAGS)
def test_info_reports_bits(tag):
    models = assemble_fixture_models()
    info = exl2cpp.load(models / tag).info()
    assert info["quantization"] == "exl2"
    qc = json.loads((models / tag / "config.json").read_text())["quantization_config"]
    # the quant's nominal bits (decoder layers) and what info() counts with overhead agree within 0.1
    assert abs(info["bpw_layers"] - qc["bits"]) < 0.1, (info["bpw_layers"], qc)
    for lin in info["linears"]:
        assert lin["kind"] == "exl2" and "b:" in lin["bits"]
