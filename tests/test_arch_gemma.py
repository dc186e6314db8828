"""Gemma 2, Gemma 3 (text and the text model of Gemma3ForConditionalGeneration) and the text model of
Mistral3ForConditionalGeneration against HF transformers fp32 on tiny random-weight models: every norm weight
random (so (1 + w) and the pre / post norms are told apart), sliding windows shorter than the sequence, soft-caps
small enough to bend the scores and logits, a query_pre_attn_scalar other than head_dim, and for Gemma 3 a RoPE per
layer type. Through Model.forward and through the engine's paged cache; CUDA against the CPU (marker `cuda`)."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import exl2cpp  # noqa: E402
from exl2cpp import _C  # noqa: E402
from exl2cpp.errors import UnsupportedError  # noqa: E402

VOCAB = 250
TEXT = dict(
    hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-6,
)  # fmt: skip
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)  # fmt: skip

GEMMA2 = dict(TEXT, num_hidden_layers=4, sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
              final_logit_softcapping=3.0)  # fmt: skip
GEMMA3 = dict(  # Gemma 3 has no attention soft-cap (HF applies none), Gemma3ForConditionalGeneration no final one
    TEXT, num_hidden_layers=6, sliding_window=8, query_pre_attn_scalar=24, final_logit_softcapping=4.0,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                     "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0}},
)  # fmt: skip


def config(kind: str):
    if kind == "gemma2":
        return transformers.Gemma2Config(**GEMMA2)
    if kind == "gemma3":
        return transformers.Gemma3TextConfig(**GEMMA3)
    if kind == "gemma3_vlm":
        text = dict(GEMMA3, final_logit_softcapping=None)
        return transformers.Gemma3Config(text_config=text, vision_config=VISION, mm_tokens_per_image=4)
    if kind == "mistral3":
        text = dict(TEXT, num_hidden_layers=3, sliding_window=None, rope_parameters={"rope_type": "default",
                                                                                     "rope_theta": 1e6})
        return transformers.Mistral3Config(text_config=text, vision_config=dict(VISION, head_dim=16))
    raise KeyError(kind)


KINDS = ["gemma2", "gemma3", "gemma3_vlm", "mistral3"]


def rel_l2(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def make_model(kind: str, folder, seed=0):
    """The tiny HF model of `kind`, saved to folder; returns a callable ids -> fp32 logits [n, vocab]."""
    torch.manual_seed(seed)
    cfg = config(kind)
    multimodal = kind in ("gemma3_vlm", "mistral3")
    auto = transformers.AutoModelForImageTextToText if multimodal else transformers.AutoModelForCausalLM
    model = auto.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma stores w of (1 + w): both signs; the others w itself
                p.uniform_(-0.5, 0.5) if kind.startswith("gemma") else p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.08)
    model.eval().save_pretrained(folder, safe_serialization=True)

    def logits(ids):
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids])).logits[0].float().numpy()

    return logits


def ids_of(n, seed=1):
    return np.random.default_rng(seed).integers(0, VOCAB, size=n).tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_model_matches_hf(kind, tmp_path):
    hf = make_model(kind, tmp_path)
    ids = ids_of(70)  # several windows of 8
    ref = hf(ids)
    out = exl2cpp.load(tmp_path, device="cpu").forward(ids)
    assert out.shape == ref.shape
    assert rel_l2(out, ref) < 1e-4, kind


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_through_the_engine_matches_hf(kind, tmp_path):
    """The engine's paged path (pages of 16, prefill chunks of 24, decode steps): greedy tokens are HF's argmax at
    every step (teacher-forced on our sequence) and the whole sequence's logits match."""
    hf = make_model(kind, tmp_path)
    prompt = ids_of(37, seed=4)
    model = exl2cpp.load(tmp_path)
    eng = exl2cpp.Engine(model, cache_tokens=512, page_size=16, max_batch_tokens=24)
    job = eng.submit(prompt, max_new_tokens=12, temperature=0.0, ignore_eos=True)
    job.result()
    got = list(job.token_ids)
    assert len(got) == 12
    seq = prompt + got
    ref = hf(seq)
    assert np.argmax(ref[len(prompt) - 1 : -1], axis=1).tolist() == got
    assert rel_l2(model.forward(seq, chunk_size=24), ref) < 1e-4


def test_gemma3_old_style_rope_keys_match_hf(tmp_path):
    """rope_theta + rope_scaling (full layers) and rope_local_base_freq (sliding layers), with layer_types from
    sliding_window_pattern, as transformers < 5 and our GGUF import write them."""
    torch.manual_seed(2)
    cfg = transformers.Gemma3TextConfig(**{k: v for k, v in GEMMA3.items() if k not in ("rope_parameters",
                                                                                        "layer_types")})
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(-0.5, 0.5) if "norm" in name else p.normal_(0.0, 0.08)
    model.eval().save_pretrained(tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    for key in ("rope_parameters", "layer_types"):
        conf.pop(key)
    conf.update(rope_theta=1e6, rope_scaling={"rope_type": "yarn", "factor": 2.0,
                                              "original_max_position_embeddings": 128},
                rope_local_base_freq=300.0, sliding_window_pattern=4)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(conf))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                           attn_implementation="eager").eval()  # fmt: skip
    assert hf.config.layer_types == ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 2
    ids = ids_of(90, seed=5)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    assert rel_l2(exl2cpp.load(tmp_path).forward(ids), ref) < 1e-4


def _edit_config(folder, text: dict | None = None, **top):
    path = folder / "config.json"
    conf = json.loads(path.read_text())
    conf.update(top)
    if text:
        conf["text_config"].update(text)
    path.write_text(json.dumps(conf))


@pytest.mark.parametrize(
    "kind, text, top, needle",
    [
        ("gemma2", None, dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
        ("gemma2", None, dict(hidden_activation="gelu"), "hidden_activation"),
        ("gemma2", None, dict(sliding_window_size=16), "sliding_window_size"),
        ("gemma3", None, dict(rope_local_base_freq=100.0), "rope_local_base_freq"),
        ("gemma3", None, dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4}}),
         "sliding_attention"),
        ("gemma3", None, dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
        ("gemma3_vlm", dict(final_logit_softcapping=30.0), {}, "final_logit_softcapping"),
        ("gemma3_vlm", dict(some_new_field=3), {}, "some_new_field"),
        ("gemma3_vlm", None, dict(vision_new_field=1), "vision_new_field (top level)"),
        ("mistral3", dict(model_type="qwen2"), {}, "model_type"),
    ],
)  # fmt: skip
def test_unimplemented_fields_are_refused(kind, text, top, needle, tmp_path):
    make_model(kind, tmp_path)
    _edit_config(tmp_path, text, **top)
    with pytest.raises(UnsupportedError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        exl2cpp.load(tmp_path)


def test_nested_rope_parameters_refused_where_not_implemented(tmp_path):
    """rope_parameters keyed by layer type under an architecture that runs one RoPE (Llama) is refused, not read as
    one of its entries."""
    cfg = transformers.LlamaConfig(**{k: v for k, v in TEXT.items() if k != "head_dim"}, num_hidden_layers=1)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6}}  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "rope_parameters": rope}))
    with pytest.raises(UnsupportedError, match="rope_parameters"):
        exl2cpp.load(tmp_path)


def test_nested_text_config_refused_where_not_implemented(tmp_path):
    """A LlamaForCausalLM config holding its keys under text_config does not run as if flat."""
    cfg = transformers.LlamaConfig(**{k: v for k, v in TEXT.items() if k != "head_dim"}, num_hidden_layers=1)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    conf = json.loads(path.read_text())
    path.write_text(json.dumps({"architectures": conf["architectures"], "text_config": conf}))
    with pytest.raises(UnsupportedError, match="text_config"):
        exl2cpp.load(tmp_path)


_HAS_CUDA = getattr(_C, "cuda_device_count", lambda: 0)() > 0


@pytest.mark.cuda
@pytest.mark.skipif(not _HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("kind", KINDS)
def test_tiny_model_gpu_vs_cpu(kind, tmp_path):
    make_model(kind, tmp_path)
    ids = ids_of(150, seed=3)
    cpu = exl2cpp.load(tmp_path, device="cpu").forward(ids)
    gpu_model = exl2cpp.load(tmp_path, device="cuda")
    gpu = gpu_model.forward(ids, chunk_size=64)
    assert rel_l2(gpu, cpu) < 2e-3, kind
    decode = np.concatenate([gpu_model.forward(ids[: i + 1])[-1:] for i in range(len(ids) - 6, len(ids))])
    assert rel_l2(decode, cpu[-6:]) < 2e-3, kind


@pytest.mark.cuda
@pytest.mark.skipif(not _HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("kind", KINDS)
def test_engine_gpu_greedy_vs_cpu(kind, tmp_path):
    """The engine on the GPU (CUDA graphs for decode steps) gives the CPU engine's greedy tokens."""
    make_model(kind, tmp_path)
    prompt = ids_of(41, seed=6)
    out = []
    for device in ("cpu", "cuda"):
        eng = exl2cpp.Engine(exl2cpp.load(tmp_path, device=device), cache_tokens=512, page_size=16,
                             max_batch_tokens=24)  # fmt: skip
        job = eng.submit(prompt, max_new_tokens=16, temperature=0.0, ignore_eos=True)
        job.result()
        out.append(list(job.token_ids))
    assert out[0] == out[1], kind
