"""Phi-3 (fused qkv / gate_up, longrope), Cohere (LayerNorm, parallel block, interleaved RoPE, logit scale), Cohere2
(sliding-window pattern, unrotated global layers) and Granite (the four multipliers) against HF transformers fp32 on
tiny random-weight models: logits through the Model API, greedy tokens through the engine's paged cache, tensor
parallel on CPU ranks, config fields refused, and CUDA against the CPU (marker `cuda`). torch/transformers are
test-only references."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from exl2cpp import options as exl2_options

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import exl2cpp  # noqa: E402

BASE = dict(
    hidden_size=96,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    vocab_size=211,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
HALF = BASE["hidden_size"] // BASE["num_attention_heads"] // 2  # longrope factors per head


def _factors(seed, lo, hi, n=HALF):
    return np.random.default_rng(seed).uniform(lo, hi, n).round(4).tolist()


def _longrope(orig, partial=1.0, **extra):
    n = int(2 * HALF * partial) // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": _factors(5, 1.0, 1.6, n),
            "long_factor": _factors(6, 1.5, 9.0, n), "partial_rotary_factor": partial, **extra}  # fmt: skip
    return dict(original_max_position_embeddings=orig, rope_parameters=rope)


# kind: (config class, config changes, load kwargs)
CASES = {
    "phi3": ("Phi3Config", {}, {}),
    "phi3_tied": ("Phi3Config", dict(tie_word_embeddings=True, num_key_value_heads=6), {}),
    "phi3_window": ("Phi3Config", dict(sliding_window=24), {}),
    # original context 64 < the 150 tokens (and max_seq_len 256): the long factors, attention factor from 256 / 64
    "phi3_longrope_long": ("Phi3Config", _longrope(64), {}),
    # original context 200 >= max_seq_len 200 >= the 150 tokens: the short factors, attention factor from 256 / 200
    "phi3_longrope_short": ("Phi3Config", _longrope(200), dict(max_seq_len=200)),
    "phi3_longrope_given": ("Phi3Config", _longrope(64, factor=6.0, attention_factor=1.3), {}),
    # RoPE on the first half (8 of 16) of each head's channels, the rest passed through (Phi-4-mini: 0.75)
    "phi3_partial": ("Phi3Config", dict(partial_rotary_factor=0.5), {}),
    "phi3_partial_longrope": ("Phi3Config", _longrope(64, partial=0.75), {}),  # 12 channels, 6 factors
    "cohere": ("CohereConfig", dict(logit_scale=0.3, layer_norm_eps=1e-4), {}),
    "cohere_bias_untied": ("CohereConfig", dict(attention_bias=True, tie_word_embeddings=False, logit_scale=2.5), {}),
    # Command R+: LayerNorm over each head of q and k, a weight per head (randomised: every head's differs)
    "cohere_qk_norm": ("CohereConfig", dict(use_qk_norm=True, logit_scale=0.3, layer_norm_eps=1e-4), {}),
    # layers 0-2 slide over 24 keys with RoPE, layer 3 attends to everything without RoPE
    "cohere2": ("Cohere2Config", dict(num_hidden_layers=4, sliding_window=24, logit_scale=0.4), {}),
    "cohere2_types": (
        "Cohere2Config",
        dict(num_hidden_layers=3, sliding_window=20, layer_types=["full_attention", "sliding_attention",
                                                                  "full_attention"]),  # fmt: skip
        {},
    ),
    "granite": (
        "GraniteConfig",
        dict(embedding_multiplier=6.0, attention_multiplier=0.09, residual_multiplier=0.35, logits_scaling=4.0),
        {},
    ),
    "granite_bias_tied": (
        "GraniteConfig",
        dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True, embedding_multiplier=0.3,
             attention_multiplier=0.5, residual_multiplier=1.7, logits_scaling=0.5),  # fmt: skip
        {},
    ),
}


def rel_l2(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def make_model(kind, folder, seed=0):
    cls, changes, _ = CASES[kind]
    cfg = getattr(transformers, cls)(**{**BASE, **changes})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # larger than the default init so every term matters
            p.normal_(0.0, 0.08)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder, safe_serialization=True)
    return model.eval()


def make_model_cfg(cls, changes, folder, seed=0):
    """make_model for a configuration outside CASES."""
    CASES["_tmp"] = (cls, changes, {})
    try:
        return make_model("_tmp", folder, seed)
    finally:
        del CASES["_tmp"]


def hf_logits(hf, ids):
    with torch.no_grad():  # no cache: HF's sliding-layer cache needs a window (Cohere2 with sliding_window null)
        return hf(torch.tensor([ids]), use_cache=False).logits[0].numpy()


@pytest.mark.parametrize("kind", sorted(CASES))
def test_matches_hf(kind, tmp_path):
    hf = make_model(kind, tmp_path)
    ids = np.random.default_rng(1).integers(0, BASE["vocab_size"], size=150).tolist()
    ref = hf_logits(hf, ids)
    model = exl2cpp.load(tmp_path, device="cpu", **CASES[kind][2])
    out = model.forward(ids)
    assert out.shape == ref.shape
    assert rel_l2(out, ref) < 1e-4, kind
    assert rel_l2(model.forward(ids, chunk_size=40), ref) < 1e-4, kind  # prefill in chunks over the paged cache


def test_longrope_factors_matter(tmp_path):
    """The tests above can tell the two factor sets apart: the long-factor model loaded for a context within its
    original one (short factors) is far from HF's long-factor logits."""
    hf = make_model("phi3_longrope_long", tmp_path)
    ids = np.random.default_rng(1).integers(0, BASE["vocab_size"], size=150).tolist()
    ref = hf_logits(hf, ids)
    out = exl2cpp.load(tmp_path, device="cpu", max_seq_len=64).forward(ids[:64])
    assert rel_l2(out, ref[:64]) > 1e-2


ENGINE_KINDS = ["phi3_longrope_long", "phi3_partial_longrope", "phi3_window", "cohere", "cohere_qk_norm", "cohere2",
                "granite"]  # fmt: skip


@pytest.mark.parametrize("kind", ENGINE_KINDS)
def test_engine_greedy_matches_hf(kind, tmp_path):
    """The engine's paged path (pages of 16, prefill chunks of 24, then decode steps): the greedy tokens are HF's
    argmax at every step (teacher-forced on our sequence, which passes the longrope original context of 64)."""
    hf = make_model(kind, tmp_path)
    prompt = np.random.default_rng(4).integers(0, BASE["vocab_size"], size=45).tolist()
    model = exl2cpp.load(tmp_path, **CASES[kind][2])
    eng = exl2cpp.Engine(model, cache_tokens=512, page_size=16, max_batch_tokens=24)
    job = eng.submit(prompt, max_new_tokens=30, temperature=0.0, ignore_eos=True)
    job.result()
    got = list(job.token_ids)
    eng.close()
    assert len(got) == 30
    seq = prompt + got
    ref = hf_logits(hf, seq)
    assert np.argmax(ref[len(prompt) - 1 : -1], axis=1).tolist() == got
    assert rel_l2(model.forward(seq, chunk_size=24), ref) < 1e-4


@pytest.mark.parametrize("kind", ["phi3_longrope_long", "phi3_partial_longrope", "phi3_tied", "cohere_bias_untied",
                                  "cohere_qk_norm", "cohere2", "granite_bias_tied"])  # fmt: skip
def test_tensor_parallel_cpu_ranks_match_one_device(kind, tmp_path, monkeypatch):
    """Two virtual CPU ranks: the fused qkv_proj / gate_up_proj (Phi-3) split per module (each rank its q, k, v heads
    and gate, up columns), the parallel block (Cohere) and the multipliers (Granite) give one device's logits and
    greedy tokens."""
    from test_multigpu import run_core

    make_model(kind, tmp_path, seed=3)
    one = exl2cpp.load(tmp_path, device="cpu")
    ids = np.random.default_rng(2).integers(0, BASE["vocab_size"], 90).tolist()
    for threads in ("0", "1"):
        exl2_options.set(tp_threads=threads)
        tp = exl2cpp.load(tmp_path, device="cpu", tensor_parallel=2)
        assert tp.tensor_parallel == ["cpu", "cpu"]
        assert rel_l2(tp.forward(ids, chunk_size=32), one.forward(ids, chunk_size=32)) < 1e-6
        a, _ = run_core(one._core, ids[:70])
        b, _ = run_core(tp._core, ids[:70])
        assert rel_l2(b, a) < 1e-6
        want = one.generate_ids(ids[:20], max_new_tokens=12, temperature=0.0)
        assert tp.generate_ids(ids[:20], max_new_tokens=12, temperature=0.0) == want


def _edit_config(folder, **changes):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))


def test_phi3_refusals(tmp_path):
    make_model("phi3_longrope_long", tmp_path)
    good = json.loads((tmp_path / "config.json").read_text())
    _edit_config(tmp_path, rope_parameters={**good["rope_parameters"], "partial_rotary_factor": 0.1875})  # 3 channels
    with pytest.raises(exl2cpp.ModelFormatError, match="partial_rotary_factor' must be a number in .0, 1. giving an"):
        exl2cpp.load(tmp_path)
    _edit_config(tmp_path, rope_parameters={**good["rope_parameters"], "partial_rotary_factor": 0.5})
    with pytest.raises(exl2cpp.ModelFormatError, match="short_factor' must be a list of rotary dims / 2 = 4"):
        exl2cpp.load(tmp_path)  # the factors cover the rotated channels only
    rope = {**good["rope_parameters"], "short_factor": [1.0] * (HALF - 1)}
    _edit_config(tmp_path, rope_parameters=rope)
    with pytest.raises(exl2cpp.ModelFormatError, match=f"short_factor' must be a list of rotary dims / 2 = {HALF}"):
        exl2cpp.load(tmp_path)
    rope = {k: v for k, v in good["rope_parameters"].items() if k != "long_factor"}
    _edit_config(tmp_path, rope_parameters=rope)
    with pytest.raises(exl2cpp.ModelFormatError, match="long_factor"):
        exl2cpp.load(tmp_path)
    _edit_config(tmp_path, rope_parameters=good["rope_parameters"], residual_multiplier=2.0)
    with pytest.raises(exl2cpp.UnsupportedError, match="'residual_multiplier' is not implemented for Phi3"):
        exl2cpp.load(tmp_path)


def test_phi3_older_rope_scaling_names_are_longrope(tmp_path):
    """Phi-3's older configs: rope_scaling {"type": "su" or "yarn", short/long factors} with a top-level
    original_max_position_embeddings are read as longrope, as transformers' Phi3Config does."""
    hf = make_model("phi3_longrope_long", tmp_path)
    ids = np.random.default_rng(1).integers(0, BASE["vocab_size"], size=100).tolist()
    ref = hf_logits(hf, ids)
    rope = json.loads((tmp_path / "config.json").read_text())["rope_parameters"]
    for name in ("su", "yarn"):
        old = {"type": name, "short_factor": rope["short_factor"], "long_factor": rope["long_factor"]}
        _edit_config(tmp_path, rope_parameters=None, rope_scaling=old, rope_theta=rope["rope_theta"])
        assert rel_l2(exl2cpp.load(tmp_path).forward(ids), ref) < 1e-4, name


def test_partial_rotary_is_refused_where_not_implemented(tmp_path):
    """Llama's HF RoPE ignores partial_rotary_factor, Cohere's has none: a value below 1 is refused for them."""
    make_model_cfg("LlamaConfig", {}, tmp_path)
    _edit_config(tmp_path, partial_rotary_factor=0.5)
    with pytest.raises(exl2cpp.UnsupportedError, match="partial_rotary_factor 0.5 is not supported for LlamaForCausalLM"):
        exl2cpp.load(tmp_path)
    _edit_config(tmp_path, partial_rotary_factor=1.0)
    exl2cpp.load(tmp_path)


def test_cohere_refusals(tmp_path):
    make_model("cohere", tmp_path)
    _edit_config(tmp_path, use_qk_norm=True)  # the per-head q / k norm weights are missing from this checkpoint
    with pytest.raises(exl2cpp.ModelFormatError, match="q_norm"):
        exl2cpp.load(tmp_path)
    _edit_config(tmp_path, use_qk_norm=False, sliding_window=16)
    with pytest.raises(exl2cpp.UnsupportedError, match="'sliding_window' is not implemented for CohereForCausalLM"):
        exl2cpp.load(tmp_path)


def test_cohere2_config_forms(tmp_path):
    """Cohere2 without layer_types (sliding_window_pattern, the original checkpoints' form, with their ignored keys)
    gives the same model; odd values of the ignored keys and sliding layers without a window are refused."""
    hf = make_model("cohere2", tmp_path)
    ids = np.random.default_rng(1).integers(0, BASE["vocab_size"], size=100).tolist()
    ref = hf_logits(hf, ids)
    _edit_config(tmp_path, layer_types=None, sliding_window_pattern=4, rotary_pct=1.0, use_gated_activation=True,
                 position_embedding_type="rope_gptj", order_of_interleaved_layers="local_attn_first",
                 use_embedding_sharing=True, cache_implementation="hybrid")  # fmt: skip
    assert rel_l2(exl2cpp.load(tmp_path).forward(ids), ref) < 1e-4
    _edit_config(tmp_path, rotary_pct=0.5)
    with pytest.raises(exl2cpp.UnsupportedError, match="rotary_pct"):
        exl2cpp.load(tmp_path)
    _edit_config(tmp_path, rotary_pct=None, order_of_interleaved_layers="global_attn_first")
    with pytest.raises(exl2cpp.UnsupportedError, match="order_of_interleaved_layers"):
        exl2cpp.load(tmp_path)
    _edit_config(tmp_path, order_of_interleaved_layers=None)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["sliding_window"] = None  # sliding layers without a window: transformers refuses it too
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(exl2cpp.UnsupportedError, match="sliding_window = null .*need a positive window"):
        exl2cpp.load(tmp_path)
    _edit_config(tmp_path, sliding_window_pattern=None, layer_types=["sliding_attention"] * 3 + ["full_attention"])
    with pytest.raises(exl2cpp.UnsupportedError, match="sliding_window = null"):
        exl2cpp.load(tmp_path)


def test_granite_refusals(tmp_path):
    make_model("granite", tmp_path)
    _edit_config(tmp_path, attention_multiplier=0.0)
    with pytest.raises(exl2cpp.UnsupportedError, match="attention_multiplier"):
        exl2cpp.load(tmp_path)
    _edit_config(tmp_path, attention_multiplier=0.1, logits_scaling=0)
    with pytest.raises(exl2cpp.UnsupportedError, match="logits_scaling"):
        exl2cpp.load(tmp_path)


# ---- CUDA against the CPU ------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(getattr(exl2cpp._C, "cuda_device_count", lambda: 0)() == 0, reason="no CUDA device")
@pytest.mark.parametrize("kind", ["phi3_longrope_long", "phi3_longrope_short", "phi3_partial_longrope",
                                  "phi3_window", "cohere", "cohere_bias_untied", "cohere_qk_norm", "cohere2",
                                  "granite", "granite_bias_tied"])  # fmt: skip
def test_cuda_matches_cpu(kind, tmp_path):
    """fp16 weights on the GPU (its fused GEMV paths where the options allow them, composed ops otherwise) against
    the CPU on the same fp16 weights: logits of prefill and of decode steps, and greedy tokens through the engine."""
    from test_multigpu import assert_same_greedy

    hf = make_model(kind, tmp_path)
    hf.to(torch.float16).save_pretrained(tmp_path, safe_serialization=True)
    kw = CASES[kind][2]
    cpu = exl2cpp.load(tmp_path, device="cpu", **kw)
    gpu = exl2cpp.load(tmp_path, device="cuda", **kw)
    ids = np.random.default_rng(1).integers(0, BASE["vocab_size"], size=150).tolist()
    ref = cpu.forward(ids)
    assert rel_l2(gpu.forward(ids), ref) < 5e-3
    assert rel_l2(gpu.forward(ids, chunk_size=1)[-20:], ref[-20:]) < 5e-3  # decode steps (batch-1 GEMV paths)
    prompt = ids[:40]
    ta = cpu.generate_ids(prompt, max_new_tokens=24, temperature=0.0)
    gpu.engine(cache_tokens=1024)
    tb = gpu.generate_ids(prompt, max_new_tokens=24, temperature=0.0)
    assert_same_greedy(cpu, prompt, ta, tb)


# ---- EXL2 q / k under interleaved RoPE ------------------------------------------------------------------------


def _exl2_linear(rng, fin, fout, bias=None):
    """A random 4-bit EXL2 linear (groups of 32 input rows, act-order permutation): its tensors and the dense
    weight [out, in] f32 it dequantizes to (bit-exact)."""
    from exl2cpp import _C

    codes = rng.integers(0, 16, (fin, fout)).astype(np.uint8)
    groups = fin // 32
    scales = rng.integers(4, 16, (groups, fout)).astype(np.uint8)
    qsm = np.full(groups, 0.02, np.float16)
    t = _C.exl2_pack(codes, [4] * groups, [32] * groups, scales, qsm, rng.permutation(fin).astype(np.int32), fout)
    if bias is not None:
        t["bias"] = bias.astype(np.float16)
    w = _C.exl2_dequantize(t).astype(np.float32).T.copy()
    return t, w


@pytest.fixture(scope="module")
def cohere_exl2(tmp_path_factory):
    """A Cohere model (head_dim 32, q/k/v/o biases) whose q_proj and k_proj are EXL2 (their rows reordered at load
    for the rotate-half RoPE layout, q_scale nibbles moved one by one), and the same model with those linears
    dequantized to dense fp32."""
    from safetensors.numpy import load_file, save_file

    base = tmp_path_factory.mktemp("cohere_dense")
    make_model_cfg("CohereConfig", dict(hidden_size=128, intermediate_size=192, num_attention_heads=4, attention_bias=True,
                                        logit_scale=0.5),
                   base)  # fmt: skip
    tensors = load_file(base / "model.safetensors")
    rng = np.random.default_rng(11)
    quant = {}
    for name in [n for n in tensors if n.endswith(("q_proj.weight", "k_proj.weight"))]:
        prefix = name[: -len(".weight")]
        fout, fin = tensors[name].shape
        t, w = _exl2_linear(rng, fin, fout, tensors[prefix + ".bias"])
        tensors[name] = w
        tensors[prefix + ".bias"] = t["bias"].astype(np.float32)
        quant.update({f"{prefix}.{k}": v for k, v in t.items()})
    save_file(tensors, base / "model.safetensors")
    exl2 = tmp_path_factory.mktemp("cohere_exl2")
    (exl2 / "config.json").write_text((base / "config.json").read_text())
    dense = {k: v for k, v in tensors.items() if not k.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias",
                                                                 "k_proj.bias"))}  # fmt: skip
    save_file({**dense, **quant}, exl2 / "model.safetensors")
    return base, exl2


def test_cohere_exl2_qk_match_dense(cohere_exl2):
    """EXL2 q/k with interleaved RoPE on the CPU: the logits of the same weights dense (and HF's on them), and two
    CPU ranks (each its reordered columns) the same as one."""
    base, exl2 = cohere_exl2
    ids = np.random.default_rng(1).integers(0, BASE["vocab_size"], size=120).tolist()
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    ref = hf_logits(hf, ids)
    dense = exl2cpp.load(base, device="cpu").forward(ids)
    q = exl2cpp.load(exl2, device="cpu")
    assert rel_l2(dense, ref) < 1e-4
    assert rel_l2(q.forward(ids), dense) < 1e-5
    tp = exl2cpp.load(exl2, device="cpu", tensor_parallel=2)
    assert rel_l2(tp.forward(ids), q.forward(ids)) < 1e-6


@pytest.mark.cuda
@pytest.mark.skipif(getattr(exl2cpp._C, "cuda_device_count", lambda: 0)() == 0, reason="no CUDA device")
def test_cuda_cohere_exl2_qk_matches_cpu(cohere_exl2):
    """The same EXL2 q/k (reordered columns in the CUDA kernels' layout) on the GPU against the CPU."""
    _, exl2 = cohere_exl2
    ids = np.random.default_rng(1).integers(0, BASE["vocab_size"], size=120).tolist()
    cpu = exl2cpp.load(exl2, device="cpu").forward(ids)
    gpu = exl2cpp.load(exl2, device="cuda")
    assert rel_l2(gpu.forward(ids), cpu) < 5e-3
    assert rel_l2(gpu.forward(ids, chunk_size=1)[-20:], cpu[-20:]) < 5e-3


@pytest.mark.parametrize("kind", ["gemma3_vlm", "mistral3"])
def test_nested_config_cache_sizes_read_the_text_model(kind, tmp_path, monkeypatch):
    """The default KV-cache size (one GPU, a layer split), the server's fit check and info() read the text model's
    sizes, which a multimodal config.json nests under text_config (its top level has no layer count or heads)."""
    from types import SimpleNamespace

    import test_arch_gemma

    from exl2cpp import _C, engine, multigpu
    from exl2cpp.server import app

    test_arch_gemma.make_model(kind, tmp_path)
    model = exl2cpp.load(tmp_path)
    top = json.loads((tmp_path / "config.json").read_text())
    text = top["text_config"]
    assert "num_hidden_layers" not in top
    tc = model.text_config
    assert (tc["num_hidden_layers"], tc["num_key_value_heads"], tc["head_dim"]) == (
        text["num_hidden_layers"], text["num_key_value_heads"], text["head_dim"])  # fmt: skip
    info = model.info()
    assert (info["hidden_size"], info["num_hidden_layers"]) == (text["hidden_size"], text["num_hidden_layers"])
    per_token = 2 * text["num_hidden_layers"] * text["num_key_value_heads"] * text["head_dim"] * 2  # fp16 K, V
    free = {0: 3 * 2**30, 1: 2**30}
    monkeypatch.setattr(_C, "cuda_mem_info", lambda i: (free[i], 2 * free[i]), raising=False)
    one = SimpleNamespace(device="cuda:0", split=False, config=model.config, text_config=tc)
    assert engine._default_cache_tokens(one, 0.5) == int(free[0] * 0.5) // per_token
    n = text["num_hidden_layers"]
    devices = ["cuda:0"] * (n - 1) + ["cuda:1"]
    split = SimpleNamespace(device="cuda:0", split=True, config=model.config, text_config=tc, tensor_parallel=[],
                            layer_devices=devices)  # fmt: skip
    per_layer = per_token // n
    want = min(int(free[0] * 0.5 / (per_layer * (n - 1))), int(free[1] * 0.5 / per_layer))
    assert engine._default_cache_tokens(split, 0.5) == max(256, want)
    tokens = (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // per_token + 1  # one token over RAM
    with pytest.raises(exl2cpp.InvalidArgumentError, match="KV-cache memory"):
        app._check_cache_could_fit(model, tokens)
    app._check_cache_could_fit(model, tokens - 2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    getattr(exl2cpp._C, "cuda_device_count", lambda: 0)() == 0, reason="no CUDA device")])])  # fmt: skip
def test_layer_norm_weight_per_head(device):
    """ops::layer_norm with w [heads, head_dim] (Cohere's q / k norm): row r of x [n * heads, head_dim] takes w's
    row r % heads; a row count that heads does not divide is refused."""
    from exl2cpp import _C

    rng = np.random.default_rng(0)
    heads, hd, n = 3, 20, 7
    x = rng.standard_normal((n * heads, hd)).astype(np.float32) * 3 + 1
    w = rng.uniform(0.5, 1.5, (heads, hd)).astype(np.float32)
    act = np.float32 if device == "cpu" else np.float16
    out = _C.op_layer_norm(x.astype(act), w, 1e-5, device=device).astype(np.float64)
    xc = x.astype(act).astype(np.float64)
    xc = xc - xc.mean(1, keepdims=True)
    ref = xc / np.sqrt((xc * xc).mean(1, keepdims=True) + 1e-5) * np.tile(w, (n, 1))
    assert rel_l2(out, ref) < (1e-6 if device == "cpu" else 2e-3)
    with pytest.raises(exl2cpp.InvalidArgumentError, match="divisible"):
        _C.op_layer_norm(x[:-1].astype(act), w, 1e-5, device=device)
