"""Every architecture and RoPE type against HF transformers in fp32 on tiny random-weight models, and the real
SmolLM2-135M on perplexity and greedy tokens. torch/transformers are test-only references."""

from __future__ import annotations

import numpy as np
import pytest
from exl2cpp import options as exl2_options

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import exl2cpp  # noqa: E402

GPL3 = "/usr/share/common-licenses/GPL-3"


def rel_l2(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


BASE = dict(
    hidden_size=96,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    vocab_size=211,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)

CASES = {
    "llama": ("LlamaConfig", {}),
    "llama_tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "llama_bias": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True)),
    "llama_headdim": ("LlamaConfig", dict(head_dim=32)),
    "llama_mha": ("LlamaConfig", dict(num_key_value_heads=6)),
    "llama_rope_linear": ("LlamaConfig", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama_rope_dynamic": ("LlamaConfig", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "llama_rope_llama3": (
        "LlamaConfig",
        dict(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    ),
    "llama_rope_yarn": (
        "LlamaConfig",
        dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    ),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "mistral_window": ("MistralConfig", dict(sliding_window=24)),  # Mistral 7B v0.1's per-layer window
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen2_window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=20, max_window_layers=1)),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
}


def make_hf_model(kind: str, extra: dict, folder, dtype=torch.float32, seed=0):
    cfg_cls = getattr(transformers, CASES[kind][0])
    cfg = cfg_cls(**{**BASE, **CASES[kind][1], **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # larger than the default init so every term matters
            p.normal_(0.0, 0.08)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    if dtype == torch.float32:
        model.save_pretrained(folder, safe_serialization=True)
        return model.eval()
    model.to(dtype).save_pretrained(folder, safe_serialization=True)
    # Reload in fp32 rather than upcasting: .to(fp16) would also round HF's RoPE inv_freq buffer.
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", sorted(CASES))
def test_tiny_model_matches_hf(kind, tmp_path):
    hf = make_hf_model(kind, {}, tmp_path)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, BASE["vocab_size"], size=150).tolist()  # spans several 64-token rope regimes
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    model = exl2cpp.load(tmp_path, device="cpu")
    out = model.forward(ids)
    assert out.shape == ref.shape and out.dtype == np.float32
    assert rel_l2(out, ref) < 1e-4, kind


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_weights_match_hf_fp32_on_same_weights(dtype, tmp_path):
    hf = make_hf_model("llama", {}, tmp_path, dtype=getattr(torch, dtype))
    ids = list(range(3, 90))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    out = exl2cpp.load(tmp_path).forward(ids)
    assert rel_l2(out, ref) < 1e-4


def test_sliding_window_64_tokens_matches_hf(tmp_path):
    """A tiny MistralForCausalLM with sliding_window 24 over 64 tokens: every key older than the window is masked
    (it gave rel L2 0.50 while the window was ignored)."""
    hf = make_hf_model("mistral_window", {}, tmp_path)
    ids = np.random.default_rng(3).integers(0, BASE["vocab_size"], size=64).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    assert rel_l2(exl2cpp.load(tmp_path).forward(ids), ref) < 1e-4


def test_sliding_window_through_the_engine(tmp_path):
    """The engine's paged path (pages of 16, prefill chunks of 24, then decode steps) with sliding_window 24: the
    greedy tokens are HF's argmax at every step (teacher-forced on our sequence), and the last step's logits match."""
    hf = make_hf_model("mistral_window", {}, tmp_path)
    prompt = np.random.default_rng(4).integers(0, BASE["vocab_size"], size=45).tolist()
    model = exl2cpp.load(tmp_path)
    eng = exl2cpp.Engine(model, cache_tokens=512, page_size=16, max_batch_tokens=24)
    job = eng.submit(prompt, max_new_tokens=30, temperature=0.0, ignore_eos=True)
    job.result()
    got = list(job.token_ids)
    assert len(got) == 30
    seq = prompt + got
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0].numpy()
    assert np.argmax(ref[len(prompt) - 1 : -1], axis=1).tolist() == got
    assert rel_l2(model.forward(seq, chunk_size=24), ref) < 1e-4


def _save_config(folder, **changes):
    import json

    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def test_unimplemented_config_field_is_refused(tmp_path):
    """A config field the architecture does not implement is an UnsupportedError naming it, never ignored; harmless
    metadata and null values load."""
    make_hf_model("llama", {}, tmp_path)
    _save_config(tmp_path, initializer_range=0.5, use_cache=False, sliding_window=None)  # metadata, null: fine
    exl2cpp.load(tmp_path)
    _save_config(tmp_path, sliding_window=16)  # Llama has no sliding window
    with pytest.raises(exl2cpp.UnsupportedError, match="'sliding_window' is not implemented for LlamaForCausalLM"):
        exl2cpp.load(tmp_path)
    _save_config(tmp_path, sliding_window=None, attn_logit_softcapping=50.0, query_pre_attn_scalar=64)
    with pytest.raises(exl2cpp.UnsupportedError, match="'attn_logit_softcapping', 'query_pre_attn_scalar' are not"):
        exl2cpp.load(tmp_path)
    _save_config(tmp_path, attn_logit_softcapping=None, query_pre_attn_scalar=None, hidden_act="gelu")
    with pytest.raises(exl2cpp.UnsupportedError, match="hidden_act"):
        exl2cpp.load(tmp_path)
    per_type = {"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}}
    _save_config(tmp_path, hidden_act="silu", rope_parameters=per_type)  # per layer type: Gemma 3's, not Llama's
    with pytest.raises(exl2cpp.UnsupportedError, match="rope_parameters"):
        exl2cpp.load(tmp_path)
    _save_config(tmp_path, rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5})  # Phi-3's
    with pytest.raises(exl2cpp.UnsupportedError, match="partial_rotary_factor 0.5 is not supported for Llama"):
        exl2cpp.load(tmp_path)
    _save_config(tmp_path, rope_parameters=None, architectures=["FancyForCausalLM"])
    with pytest.raises(exl2cpp.UnsupportedError, match="FancyForCausalLM.*supported: .*LlamaForCausalLM"):
        exl2cpp.load(tmp_path)


def test_unread_checkpoint_tensors_are_refused(tmp_path):
    """Tensors no module reads are an UnsupportedError naming them: an extra norm, a bias the architecture does not
    use (Mistral has none), and Gemma 3 weights under a config claiming LlamaForCausalLM."""
    from safetensors.numpy import load_file, save_file

    make_hf_model("mistral", {}, tmp_path)
    f = tmp_path / "model.safetensors"
    tensors = load_file(f)
    save_file({**tensors, "model.layers.1.post_feedforward_layernorm.weight": np.ones(96, np.float32)}, f)
    with pytest.raises(exl2cpp.UnsupportedError, match="1 checkpoint tensor.*layers.1.post_feedforward_layernorm"):
        exl2cpp.load(tmp_path)
    save_file({**tensors, "model.layers.0.self_attn.q_proj.bias": np.ones(96, np.float32)}, f)
    with pytest.raises(exl2cpp.UnsupportedError, match="model.layers.0.self_attn.q_proj.bias"):
        exl2cpp.load(tmp_path)
    save_file(tensors, f)
    exl2cpp.load(tmp_path)


def test_gemma3_weights_under_a_llama_config_are_refused(tmp_path):
    """Gemma 3's checkpoint with a Llama config of the same sizes (the case found: Gemma 3 270M loaded with its 72
    pre/post-feedforward and q/k norms ignored): the unread tensors are named."""
    import json

    cfg = transformers.Gemma3TextConfig(**{**BASE, "head_dim": 16}, layer_types=["full_attention"] * 2)
    transformers.Gemma3ForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    llama = transformers.LlamaConfig(**{**BASE, "head_dim": 16}).to_dict()
    llama["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(llama))
    with pytest.raises(exl2cpp.UnsupportedError, match=r"8 checkpoint tensor\(s\) are read by no module.*"
                                                       r"feedforward_layernorm"):  # fmt: skip
        exl2cpp.load(tmp_path)


def test_chunked_forward_equals_whole(tmp_path):
    """Prefill in chunks through the paged cache gives the same logits as one pass."""
    make_hf_model("llama", {}, tmp_path)
    model = exl2cpp.load(tmp_path)
    ids = list(np.random.default_rng(2).integers(0, BASE["vocab_size"], size=250))
    whole = model.forward(ids)
    chunked = model.forward(ids, chunk_size=37)
    assert rel_l2(chunked, whole) < 1e-6


def test_bad_inputs(tmp_path):
    make_hf_model("llama", {}, tmp_path)
    model = exl2cpp.load(tmp_path, max_seq_len=64)
    with pytest.raises(exl2cpp.InvalidArgumentError, match="vocabulary"):
        model.forward([1, 2, BASE["vocab_size"]])
    with pytest.raises(exl2cpp.InvalidArgumentError, match="max_seq_len"):
        model.forward(list(range(65)))
    with pytest.raises(exl2cpp.InvalidArgumentError):
        model.forward([])
    with pytest.raises(exl2cpp.InvalidArgumentError, match="device"):
        exl2cpp.load(tmp_path, device="tpu")


# ---- the real model ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_pair(smollm2_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ours = exl2cpp.load(smollm2_dir, device="cpu")
    return hf, ours


@pytest.mark.slow
def test_smollm2_perplexity_matches_hf(smollm2_pair):
    hf, ours = smollm2_pair
    text = open(GPL3, encoding="utf-8").read()
    ids = ours.tokenizer.encode(text)[:1024]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    ref = float(torch.exp(-logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].mean()))
    ppl = ours.perplexity(text, ctx=2048, max_tokens=1024)
    assert abs(ppl / ref - 1) < 1e-3, (ppl, ref)


@pytest.mark.slow
def test_smollm2_greedy_matches_hf(smollm2_pair):
    hf, ours = smollm2_pair
    # A plain-text prompt the model continues for well over 32 tokens (no end-of-sequence token in between).
    ids = ours.tokenizer.encode("The GNU General Public License is a free, copyleft license for")
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
    assert len(ref) == 32
    got = ours.generate_ids(ids, max_new_tokens=32, temperature=0.0)
    assert got == ref


def test_cpu_f16_activations_diagnostic(tmp_path, monkeypatch):
    """Option cpu_activations="f16" runs the CPU backend with f16 activations (the GPU's numerics, for diagnostics): the
    logits stay within f16 rounding of the f32 run (but not equal to it)."""
    make_hf_model("llama", {}, tmp_path)
    ids = list(range(1, 40))
    ref = exl2cpp.load(tmp_path, device="cpu").forward(ids)
    exl2_options.set(cpu_activations="f16")
    m16 = exl2cpp.load(tmp_path, device="cpu")
    got = m16.forward(ids)
    assert got.dtype == np.float32 and got.shape == ref.shape
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert 0 < err < 5e-3, err
