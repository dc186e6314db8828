"""Imports a llama, qwen2 or gemma3 GGUF file into an HF-style model folder (safetensors, config.json, tokenizer).

    >>> from exl2cpp.gguf_import import import_gguf
    >>> import_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2")   # writes smollm2/{model.safetensors,...}

What is written:

- ``model.safetensors``: every tensor under its HF name, dequantized (``gguf.quants.dequantize``)
  and stored as ``dtype`` (float16, bfloat16 or float32). Norm weights and biases too.
- ``config.json``: ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or ``Gemma3ForCausalLM`` with every
  field the GGUF metadata holds, and for Gemma 3 the fields llama.cpp hard-codes (sliding-window
  pattern 6, local RoPE base 10000, attention scale).
- ``tokenizer.json``: byte-level BPE rebuilt from ``tokenizer.ggml.tokens``/``merges`` with the
  pre-tokenizer named by ``tokenizer.ggml.pre`` (``tokenizer.ggml.model`` "gpt2"), or, for a
  SentencePiece-style vocabulary (model "llama": Gemma, Llama 2), a BPE whose merges are rebuilt
  from the token scores so that it merges as llama.cpp's SPM tokenizer does (highest-scoring
  pair first, byte fallback for characters outside the vocabulary). CONTROL tokens become
  special added tokens, USER_DEFINED tokens plain added tokens. A GGUF that embeds
  ``tokenizer.huggingface.json`` uses it as is.
- ``tokenizer_config.json`` (chat template, bos/eos/pad tokens, ``add_bos_token``) and
  ``generation_config.json`` (bos/eos ids).

llama.cpp's converter permutes the Q and K rows of ``llama`` models so that each head's rotary
pairs (i, i + head_dim/2) become adjacent (i, i+1) for its interleaved RoPE; the import undoes it.
``qwen2`` and ``gemma3`` GGUFs keep the HF (rotate-half) layout and are copied as they are.
For ``gemma3`` the converter stores every ``*norm.weight`` (input, post-attention, pre/post
feed-forward, q/k and final norms) as ``1 + w``, the factor Gemma's RMSNorm applies; the import
subtracts the 1 again.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from .errors import InvalidArgumentError, ModelFileError, ModelFormatError, UnsupportedError

__all__ = ["SUPPORTED_ARCHS", "import_gguf", "permute_rope_rows", "unpermute_rope_rows"]

SUPPORTED_ARCHS = ("llama", "qwen2", "gemma3")

# GGUF architecture -> HF class / model_type.
_HF_ARCH = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}

# llama.cpp token types (gguf.TokenType).
_TT_NORMAL, _TT_UNKNOWN, _TT_CONTROL, _TT_USER_DEFINED, _TT_UNUSED, _TT_BYTE = 1, 2, 3, 4, 5, 6

# Split regexes of the byte-level pre-tokenizers, keyed by tokenizer.ggml.pre (from llama.cpp's
# llama-vocab.cpp, which copies them from each model's tokenizer.json).
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZERS = {
    # GPT-2 regex applied by ByteLevel itself.
    "default": "gpt2",
    "gpt2": "gpt2",
    "gpt-2": "gpt2",
    # Digits split one by one first, then the GPT-2 regex (SmolLM, StarCoder...).
    "smollm": "digits+gpt2",
    "starcoder": "digits+gpt2",
    "refact": "digits+gpt2",
    # Llama 3 family.
    "llama3": "llama3",
    "llama-bpe": "llama3",
    "llama-v3": "llama3",
    "smaug-bpe": "llama3",
    # Qwen 2 family (NFC normalizer too).
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
}

# GGUF tensor name stem -> HF name (``{}`` = layer index).
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LLAMA_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 (gguf's tensor_mapping): norms around both sublayers, q/k norms. Note that its
# ``ffn_norm`` is the pre-feed-forward norm, not Llama's post-attention norm.
_GEMMA3_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSORS = {"llama": _LLAMA_LAYER_TENSORS, "qwen2": _LLAMA_LAYER_TENSORS,
                  "gemma3": _GEMMA3_LAYER_TENSORS}  # fmt: skip
# What convert_hf_to_gguf.py added to every tensor whose HF name ends in "norm.weight"
# (Gemma3Model.norm_shift: Gemma's RMSNorm scales by 1 + w).
_NORM_SHIFT = {"gemma3": 1.0}
# Tensors that hold information already carried by config.json.
_SKIPPED_TENSORS = {"rope_freqs.weight"}

# Storage types: name -> (safetensors dtype, config.json torch_dtype).
_DTYPES = {
    "float16": ("F16", "float16"), "fp16": ("F16", "float16"),
    "bfloat16": ("BF16", "bfloat16"), "bf16": ("BF16", "bfloat16"),
    "float32": ("F32", "float32"), "fp32": ("F32", "float32"),
}  # fmt: skip
_ST_ITEMSIZE = {"F16": 2, "BF16": 2, "F32": 4}


# ----------------------------------------------------------------------------------------------
# RoPE row permutation
# ----------------------------------------------------------------------------------------------


def permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF (rotate-half) row order -> llama.cpp (interleaved) order, as convert_hf_to_gguf.py does.

    ``w`` is ``[n_heads * head_dim, ...]`` (a weight ``[out, in]`` or a bias ``[out]``).
    """
    _check_rope_rows(w, n_heads)
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp (interleaved) row order -> HF (rotate-half) order: the inverse of permute_rope_rows."""
    _check_rope_rows(w, n_heads)
    return (
        w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _check_rope_rows(w: np.ndarray, n_heads: int) -> None:
    if n_heads <= 0 or w.shape[0] % (2 * n_heads) != 0:
        raise ModelFormatError(
            f"cannot (un)permute RoPE rows: {w.shape[0]} rows is not a multiple of 2 * n_heads "
            f"(n_heads={n_heads}); the GGUF head counts do not match the Q/K tensor shapes"
        )


# ----------------------------------------------------------------------------------------------
# GGUF metadata access
# ----------------------------------------------------------------------------------------------


class _Meta:
    """Typed access to the key/value metadata of a GGUFReader, with errors naming the file."""

    def __init__(self, reader: Any, path: Path):
        self._reader = reader
        self.path = path
        self._memo: dict[str, Any] = {}

    def has(self, key: str) -> bool:
        return key in self._reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self._reader.fields.get(key)
        if field is None:
            return default
        if key in self._memo:  # token lists are large: decode them once
            return self._memo[key]
        try:
            value = field.contents()
            self._memo[key] = value
            return value
        except Exception as exc:  # a corrupt field
            raise ModelFormatError(
                f"{self.path}: cannot read GGUF metadata key {key!r}: {exc}"
            ) from exc

    def require(self, key: str) -> Any:
        if not self.has(key):
            raise ModelFormatError(
                f"{self.path}: GGUF metadata key {key!r} is missing; the file was not written by a "
                "complete llama.cpp converter"
            )
        return self.get(key)

    def int(self, key: str, default: Any = None, required: bool = False) -> Any:
        value = self.require(key) if required else self.get(key, default)
        if value is None:
            return None
        if isinstance(value, (list, tuple)):  # per-layer arrays (some converters): must be uniform
            if len(set(value)) != 1:
                raise UnsupportedError(
                    f"{self.path}: {key!r} varies per layer ({value[:8]}...); exl2cpp needs one value"
                )
            value = value[0]
        return int(value)

    def float(self, key: str, default: Any = None) -> Any:
        value = self.get(key, default)
        return None if value is None else float(value)


def _open_gguf(path: Path) -> Any:
    import gguf

    if not path.is_file():
        raise ModelFileError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelFormatError(
            f"{path}: not a GGUF file (first bytes {magic!r}, expected b'GGUF'); pass a .gguf file "
            "written by llama.cpp"
        )
    try:
        return gguf.GGUFReader(str(path), "r")
    except (
        Exception
    ) as exc:  # truncated or corrupt: gguf raises ValueError/IndexError/struct errors
        raise ModelFormatError(
            f"{path}: cannot parse GGUF file ({type(exc).__name__}: {exc})"
        ) from exc


# ----------------------------------------------------------------------------------------------
# config.json
# ----------------------------------------------------------------------------------------------


def _build_config(
    meta: _Meta, arch: str, tensors: dict[str, Any], dtype_name: str
) -> dict[str, Any]:
    k = lambda s: f"{arch}.{s}"
    hidden = meta.int(k("embedding_length"), required=True)
    n_heads = meta.int(k("attention.head_count"), required=True)
    n_kv = meta.int(k("attention.head_count_kv"), default=n_heads)
    n_layers = meta.int(k("block_count"), required=True)
    ffn = meta.int(k("feed_forward_length"), required=True)
    head_dim = meta.int(k("attention.key_length"), default=None)
    if head_dim is None:
        if hidden % n_heads:
            raise ModelFormatError(
                f"{meta.path}: embedding_length {hidden} is not divisible by head_count {n_heads}"
            )
        head_dim = hidden // n_heads
    v_dim = meta.int(k("attention.value_length"), default=head_dim)
    if v_dim != head_dim:
        raise UnsupportedError(
            f"{meta.path}: key_length {head_dim} != value_length {v_dim} is not supported"
        )
    rope_dim = meta.int(k("rope.dimension_count"), default=head_dim)
    if rope_dim != head_dim:
        raise UnsupportedError(
            f"{meta.path}: partial RoPE (rope.dimension_count {rope_dim} < head_dim {head_dim}) is not supported"
        )
    if "token_embd.weight" not in tensors:
        raise ModelFormatError(f"{meta.path}: tensor 'token_embd.weight' is missing")
    vocab = int(tensors["token_embd.weight"].shape[1])  # ggml shape is [hidden, vocab]
    tied = "output.weight" not in tensors

    hf_arch, model_type = _HF_ARCH[arch]
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": meta.float(k("attention.layer_norm_rms_epsilon"), default=1e-6),
        "rope_theta": meta.float(k("rope.freq_base"), default=10000.0),
        "max_position_embeddings": meta.int(k("context_length"), default=4096),
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "torch_dtype": dtype_name,
    }
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
        config["mlp_bias"] = False
    if arch == "qwen2":
        config["use_sliding_window"] = False
    rope_scaling = _rope_scaling(meta, arch, tensors, config)
    if arch == "gemma3":
        _gemma3_config(meta, config, rope_scaling)
    elif rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    bos = meta.int("tokenizer.ggml.bos_token_id")
    if bos is not None:
        config["bos_token_id"] = bos
    eos = meta.int("tokenizer.ggml.eos_token_id") if arch == "gemma3" else None
    eos = [eos] if eos is not None else _eos_ids(meta)
    if eos:
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    pad = meta.int("tokenizer.ggml.padding_token_id") if arch == "gemma3" else None
    if pad is not None:
        config["pad_token_id"] = pad
    return config


# llama.cpp's Gemma 3 constants (llama-model.cpp, LLM_ARCH_GEMMA3), used where the GGUF has no key.
_GEMMA3_SWA_PATTERN = 6  # every 6th layer attends globally, the others within the sliding window
_GEMMA3_LOCAL_ROPE_BASE = 10000.0  # RoPE base of the sliding-window layers (no scaling there)
# The one size (27B, 62 layers) whose attention scale is 1/sqrt(hidden / heads), not 1/sqrt(head_dim).
_GEMMA3_27B_LAYERS = 62


def _gemma3_config(meta: _Meta, config: dict[str, Any], rope_scaling: dict | None) -> None:
    """The Gemma 3 fields of ``config`` (as google's Gemma3ForCausalLM config.json spells them)."""
    k = lambda s: f"gemma3.{s}"
    n_layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    del config["hidden_act"]
    window = meta.int(k("attention.sliding_window"), required=True)
    pattern = meta.get(k("attention.sliding_window_pattern"))
    if isinstance(pattern, (list, tuple)):  # per layer: True = sliding window
        if len(pattern) != n_layers:
            raise ModelFormatError(
                f"{meta.path}: attention.sliding_window_pattern has {len(pattern)} entries for {n_layers} layers"
            )
        sliding = [bool(x) for x in pattern]
    else:
        every = int(pattern) if pattern is not None else _GEMMA3_SWA_PATTERN
        sliding = [bool((i + 1) % every) for i in range(n_layers)]
    scale = meta.float(k("attention.scale"))
    if scale is not None:
        scalar: float | int = 1.0 / (scale * scale)
    elif n_layers == _GEMMA3_27B_LAYERS:
        scalar = hidden // config["num_attention_heads"]
    else:
        scalar = config["head_dim"]
    config.update(
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=scalar,
        sliding_window=window,
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        rope_local_base_freq=meta.float(k("rope.freq_base_swa"), default=_GEMMA3_LOCAL_ROPE_BASE),
        rope_scaling=rope_scaling,  # applies to the full-attention layers only (as in HF and llama.cpp)
        final_logit_softcapping=meta.float(k("final_logit_softcapping")),
        attn_logit_softcapping=meta.float(k("attn_logit_softcapping")),
        attention_bias=False,
        attention_dropout=0.0,
        use_bidirectional_attention=False,
    )
    if not isinstance(pattern, (list, tuple)):
        config["sliding_window_pattern"] = every


# End-of-generation tokens llama.cpp recognises by their text (llama-vocab.cpp) that the GGUF's
# eos/eot keys do not name, per architecture: generation stops at them too.
_EOG_TOKENS = {"gemma3": ("<end_of_turn>",)}


def _generation_eos(meta: _Meta, arch: str, config: dict[str, Any]) -> list[int]:
    eos = config.get("eos_token_id")
    ids = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
    names = _EOG_TOKENS.get(arch, ())
    if names:
        tokens = meta.get("tokenizer.ggml.tokens") or []
        types = meta.get("tokenizer.ggml.token_type") or []
        for i, (tok, tt) in enumerate(zip(tokens, types)):
            if tok in names and tt == _TT_CONTROL and i not in ids:
                ids.append(i)
    return ids


def _eos_ids(meta: _Meta) -> list[int]:
    ids: list[int] = []
    for key in (
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ):
        value = meta.int(key)
        if value is not None and value not in ids:
            ids.append(value)
    return ids


def _rope_scaling(meta: _Meta, arch: str, tensors: dict[str, Any], config: dict) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.float(f"{arch}.rope.scaling.factor")
    if kind is None and meta.has(f"{arch}.rope.scale_linear"):  # older key
        kind, factor = "linear", meta.float(f"{arch}.rope.scale_linear")
    if "rope_freqs.weight" in tensors:
        if kind not in (None, "none"):
            raise UnsupportedError(
                f"{meta.path}: rope_freqs tensor together with rope.scaling.type {kind!r}"
            )
        return _llama3_rope_scaling(meta, tensors["rope_freqs.weight"], config)
    if kind in (None, "none") or factor in (None, 0.0, 1.0) and kind != "yarn":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        out: dict[str, Any] = {"rope_type": "yarn", "factor": factor}
        orig = meta.int(f"{arch}.rope.scaling.original_context_length")
        if orig is not None:
            out["original_max_position_embeddings"] = orig
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = meta.float(f"{arch}.rope.scaling.{key}")
            if value is not None:
                out[name] = value
        return out
    raise UnsupportedError(
        f"{meta.path}: rope.scaling.type {kind!r} is not supported (supported: none, linear, yarn, "
        "llama3 via rope_freqs)"
    )


def _llama3_rope_scaling(meta: _Meta, rope_freqs: Any, config: dict) -> dict:
    """Recovers Llama 3.1 ``rope_scaling`` from the per-frequency factors llama.cpp stores.

    The converter bakes (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    into ``rope_freqs``; every released Llama 3.1/3.2 uses low 1, high 4, original 8192, so those are
    assumed, ``factor`` is read off, and the whole table is recomputed and compared.
    """
    freqs = np.asarray(rope_freqs.data, dtype=np.float32).reshape(-1)
    head_dim, theta = config["head_dim"], config["rope_theta"]
    factor = float(np.round(freqs.max(), 4))
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    base = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / base
    low_wl, high_wl = 8192 / 1.0, 8192 / 4.0
    expected = np.ones_like(base)
    expected[wavelen > low_wl] = factor
    mid = (wavelen >= high_wl) & (wavelen <= low_wl)
    smooth = (8192 / wavelen[mid] - 1.0) / (4.0 - 1.0)
    expected[mid] = 1.0 / ((1 - smooth) / factor + smooth)
    if freqs.shape != expected.shape or not np.allclose(freqs, expected, rtol=1e-3):
        raise UnsupportedError(
            f"{meta.path}: the rope_freqs tensor does not match Llama 3 RoPE scaling with low/high "
            "frequency factors 1/4 and original context 8192; this RoPE variant is not supported"
        )
    return scaling


# ----------------------------------------------------------------------------------------------
# tokenizer.json / tokenizer_config.json
# ----------------------------------------------------------------------------------------------


def _build_tokenizer_json(meta: _Meta) -> str:
    embedded = meta.get("tokenizer.huggingface.json")
    if embedded:
        return embedded
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        raise ModelFormatError(
            f"{meta.path}: no tokenizer in the GGUF (tokenizer.ggml.model missing)"
        )
    if model not in ("gpt2", "llama"):
        raise UnsupportedError(
            f"{meta.path}: tokenizer model {model!r} is not supported; import-gguf rebuilds byte-level "
            "BPE tokenizers (tokenizer.ggml.model 'gpt2', as in Llama 3, Qwen 2, SmolLM) and "
            "SentencePiece-style ones ('llama', as in Gemma and Llama 2)"
        )
    tokens: list[str] = list(meta.require("tokenizer.ggml.tokens"))
    types = meta.get("tokenizer.ggml.token_type")
    types = list(types) if types is not None else [_TT_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ModelFormatError(
            f"{meta.path}: tokenizer.ggml.token_type has {len(types)} entries, tokenizer.ggml.tokens {len(tokens)}"
        )
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)  # a duplicate string keeps its first id
    if model == "gpt2":
        tk = _byte_level_bpe(meta, vocab)
    else:
        tk = _sentencepiece_bpe(meta, tokens, vocab)
    _add_gguf_tokens(tk, tokens, types, vocab)
    _add_post_processor(tk, meta, tokens, add_bos=_add_bos(meta))
    return tk.to_str()


def _add_bos(meta: _Meta) -> bool:
    """Whether llama.cpp prepends BOS: the GGUF's flag, else its default (on for SentencePiece vocabularies)."""
    default = meta.get("tokenizer.ggml.model") == "llama"
    return bool(meta.get("tokenizer.ggml.add_bos_token", default))


def _byte_level_bpe(meta: _Meta, vocab: dict[str, int]) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    merges_raw = meta.get("tokenizer.ggml.merges") or []
    merges: list[tuple[str, str]] = []
    for m in merges_raw:
        parts = m.split(" ")
        if len(parts) != 2:
            raise ModelFormatError(
                f"{meta.path}: malformed BPE merge {m!r} (expected 'left right')"
            )
        merges.append((parts[0], parts[1]))
    tk = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))

    pre = meta.get("tokenizer.ggml.pre", "default")
    style = _PRE_TOKENIZERS.get(pre)
    if style is None:
        import warnings

        warnings.warn(
            f"{meta.path}: unknown tokenizer.ggml.pre {pre!r}; using the GPT-2 pre-tokenizer, so "
            "tokenization may differ slightly from the original model",
            stacklevel=4,
        )
        style = "gpt2"
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if style == "gpt2":
        tk.pre_tokenizer = byte_level
    elif style == "digits+gpt2":
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        regex = _LLAMA3_REGEX if style == "llama3" else _QWEN2_REGEX
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        if style == "qwen2":
            tk.normalizer = normalizers.NFC()
    tk.decoder = decoders.ByteLevel()
    return tk


# SentencePiece's visible space, which llama.cpp writes for " " before merging.
_SPM_SPACE = "\u2581"


def _sentencepiece_bpe(meta: _Meta, tokens: list[str], vocab: dict[str, int]) -> Any:
    """llama.cpp's SPM tokenizer (llm_tokenizer_spm) as an HF BPE.

    llama.cpp starts from the UTF-8 characters of each text piece (spaces written as U+2581) and
    keeps merging the adjacent pair whose concatenation is a token with the highest score (the
    leftmost among equals); characters left outside the vocabulary become ``<0xXX>`` byte tokens.
    An HF BPE does the same when its merges are every split (left, right) of every token into two
    tokens, ranked by the token's score: ``_spm_merges``. Without a pre-tokenizer each text piece
    between added tokens is one word, as in llama.cpp.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ModelFormatError(
            f"{meta.path}: a SentencePiece vocabulary needs tokenizer.ggml.scores, one per token "
            f"({len(tokens)} tokens, {'no' if scores is None else len(scores)} scores)"
        )
    has_bytes = all(f"<0x{b:02X}>" in vocab for b in range(256))
    unk = meta.int("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[unk] if unk is not None and 0 <= unk < len(tokens) else None
    tk = Tokenizer(
        models.BPE(vocab, _spm_merges(tokens, scores, vocab), unk_token=unk_token,
                   fuse_unk=True, byte_fallback=has_bytes)
    )  # fmt: skip
    space = normalizers.Replace(" ", _SPM_SPACE)
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        # llama.cpp prefixes a space to every text piece that follows a token it matched whole
        # (and to the first): the normalizer runs on each such piece.
        tk.normalizer = normalizers.Sequence([normalizers.Prepend(_SPM_SPACE), space])
        tk.decoder = decoders.Sequence(
            [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
             decoders.Strip(" ", 1, 0)]
        )  # fmt: skip
    else:
        tk.normalizer = space
        tk.decoder = decoders.Sequence(
            [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        )
    return tk


def _spm_merges(tokens: list[str], scores: Any, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of every token into two tokens, best-scoring token first (ties: lower id)."""
    ranked: list[tuple[float, int, int]] = []
    for i, tok in enumerate(tokens):
        if vocab.get(tok) != i:
            continue
        for cut in range(1, len(tok)):
            if tok[:cut] in vocab and tok[cut:] in vocab:
                ranked.append((-float(scores[i]), i, cut))
    ranked.sort()
    return [(tokens[i][:cut], tokens[i][cut:]) for _, i, cut in ranked]


def _add_gguf_tokens(tk: Any, tokens: list[str], types: list[int], vocab: dict[str, int]) -> None:
    """CONTROL tokens as special added tokens, USER_DEFINED ones as plain added tokens, both
    matched in the raw text before anything else (as llama.cpp does)."""
    from tokenizers import AddedToken

    added = []
    for i, (tok, tt) in enumerate(zip(tokens, types)):
        if tt in (_TT_CONTROL, _TT_USER_DEFINED) and vocab.get(tok) == i:
            added.append(AddedToken(tok, special=(tt == _TT_CONTROL), normalized=False))
    # add_tokens keeps the ids the vocab already gives these strings.
    tk.add_special_tokens([a for a in added if a.special])
    tk.add_tokens([a for a in added if not a.special])


def _add_post_processor(tk: Any, meta: _Meta, tokens: list[str], add_bos: bool) -> None:
    from tokenizers import processors

    bos = meta.int("tokenizer.ggml.bos_token_id")
    if add_bos and bos is not None and 0 <= bos < len(tokens):
        bos_tok = tokens[bos]
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos_tok} $A",
            pair=f"{bos_tok} $A {bos_tok} $B",
            special_tokens=[(bos_tok, bos)],
        )


def _build_tokenizer_config(meta: _Meta) -> dict[str, Any]:
    tokens = meta.get("tokenizer.ggml.tokens") or []

    def tok(key: str) -> str | None:
        i = meta.int(key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for name, key in (
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("unk_token", "tokenizer.ggml.unknown_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
    ):
        value = tok(key)
        if value is not None:
            cfg[name] = value
    if meta.has("tokenizer.ggml.add_bos_token") or meta.get("tokenizer.ggml.model") == "llama":
        cfg["add_bos_token"] = _add_bos(meta)
    if meta.has("tokenizer.ggml.add_eos_token"):
        cfg["add_eos_token"] = bool(meta.get("tokenizer.ggml.add_eos_token"))
    arch = meta.get("general.architecture")
    ctx = meta.int(f"{arch}.context_length")
    if ctx is not None:
        cfg["model_max_length"] = ctx
    template = meta.get("tokenizer.chat_template")
    names = meta.get("tokenizer.chat_templates")
    if names:
        named = [{"name": "default", "template": template}] if template else []
        for name in names:
            body = meta.get(f"tokenizer.chat_template.{name}")
            if body:
                named.append({"name": name, "template": body})
        cfg["chat_template"] = named
    elif template:
        cfg["chat_template"] = template
    return cfg


# ----------------------------------------------------------------------------------------------
# tensors
# ----------------------------------------------------------------------------------------------


def _hf_name(name: str, n_layers: int, path: Path, layer_tensors: dict[str, str]) -> str | None:
    """GGUF tensor name -> HF name; None for tensors to skip."""
    if name in _SKIPPED_TENSORS:
        return None
    stem, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        raise UnsupportedError(f"{path}: unexpected tensor {name!r} (expected a .weight or .bias)")
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_tensors:
        layer = int(parts[1])
        if layer >= n_layers:
            raise ModelFormatError(
                f"{path}: tensor {name!r} names layer {layer} but block_count is {n_layers}"
            )
        return f"model.layers.{layer}.{layer_tensors[parts[2]]}.{suffix}"
    raise UnsupportedError(
        f"{path}: tensor {name!r} has no HF equivalent for this architecture (known: token_embd, "
        f"output_norm, output, blk.N.{{{', '.join(layer_tensors)}}})"
    )


def _dequantize(t: Any, path: Path) -> np.ndarray:
    import gguf

    qtype = gguf.GGMLQuantizationType(t.tensor_type)
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # ggml lists the fastest dim first
    if qtype == gguf.GGMLQuantizationType.F32:
        out = np.asarray(t.data, dtype=np.float32)
    elif qtype == gguf.GGMLQuantizationType.F16:
        out = np.asarray(t.data, dtype=np.float16)
    else:
        try:
            out = gguf.quants.dequantize(np.asarray(t.data), qtype)
        except NotImplementedError as exc:
            raise UnsupportedError(
                f"{path}: tensor {t.name!r} has type {qtype.name}, which the gguf package cannot "
                "dequantize; re-quantize the model to another type (e.g. Q8_0, Q4_K)"
            ) from exc
    if out.size != math.prod(shape):
        raise ModelFormatError(f"{path}: tensor {t.name!r}: {out.size} values for shape {shape}")
    return out.reshape(shape)


def _to_storage(w: np.ndarray, st_dtype: str) -> np.ndarray:
    """float32/float16 values -> the array whose bytes safetensors stores as ``st_dtype``."""
    if st_dtype == "F16":
        return w.astype(np.float16, copy=False)
    if st_dtype == "F32":
        return w.astype(np.float32, copy=False)
    # BF16: the upper half of each float32, rounded to nearest even (NaN kept a NaN).
    bits = np.ascontiguousarray(w, dtype=np.float32).view(np.uint32)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    return np.where(np.isnan(w), (bits >> 16) | 0x40, rounded).astype(np.uint16)


class _SafetensorsWriter:
    """Streams tensors into one safetensors file: the header is planned first, data written one at a time."""

    def __init__(
        self,
        path: Path,
        specs: list[tuple[str, str, tuple[int, ...]]],
        metadata: dict[str, str],
    ):
        header: dict[str, Any] = {"__metadata__": metadata}
        offset = 0
        self._order = []
        for name, st_dtype, shape in specs:
            nbytes = math.prod(shape) * _ST_ITEMSIZE[st_dtype]
            header[name] = {
                "dtype": st_dtype,
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self._order.append((name, st_dtype, shape))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
        self._file = open(path, "wb")  # noqa: SIM115 (closed by close())
        self._file.write(struct.pack("<Q", len(raw)))
        self._file.write(raw)
        self._next = 0

    def write(self, name: str, array: np.ndarray) -> None:
        exp_name, st_dtype, shape = self._order[self._next]
        array = _to_storage(array, st_dtype)
        assert name == exp_name and array.shape == shape, (name, exp_name)
        self._file.write(np.ascontiguousarray(array).tobytes())
        self._next += 1

    def close(self) -> None:
        self._file.close()


# ----------------------------------------------------------------------------------------------
# entry point
# ----------------------------------------------------------------------------------------------


def import_gguf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: str = "float16",
    progress: bool | None = None,
) -> Path:
    """Convert a llama/qwen2/gemma3 GGUF file into an HF-style folder that ``exl2cpp.load`` (and HF) read.

    Parameters
    ----------
    gguf_path : path of the ``.gguf`` file (one file; split GGUFs are not supported).
    out_dir : folder to write (created; existing files of the same names are overwritten).
    dtype : ``"float16"`` (default), ``"bfloat16"`` or ``"float32"``: storage type of every tensor
        (values are dequantized in float32, then rounded once to this type).
    progress : show a tqdm bar over tensors; default: when stderr is a terminal.

    Returns
    -------
    Path of ``out_dir``.

    Raises
    ------
    ModelFileError : the file is missing.  ModelFormatError : not a GGUF, or inconsistent.
    UnsupportedError : architecture, tensor type, tokenizer model or RoPE variant not handled.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if dtype not in _DTYPES:
        raise InvalidArgumentError(
            f"import_gguf: dtype {dtype!r} is not supported (use 'float16', 'bfloat16' or 'float32')"
        )
    st_dtype, dtype_name = _DTYPES[dtype]

    reader = _open_gguf(gguf_path)
    meta = _Meta(reader, gguf_path)
    if meta.int("split.count", default=1) not in (None, 1):
        raise UnsupportedError(
            f"{gguf_path}: split GGUF files are not supported; merge them with llama-gguf-split --merge"
        )
    arch = meta.require("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedError(
            f"{gguf_path}: GGUF architecture {arch!r} is not supported by import-gguf "
            f"(supported: {', '.join(SUPPORTED_ARCHS)})"
        )
    tensors = {t.name: t for t in reader.tensors}
    config = _build_config(meta, arch, tensors, dtype_name)
    tokenizer_json = _build_tokenizer_json(meta)
    tokenizer_config = _build_tokenizer_config(meta)

    n_layers = config["num_hidden_layers"]
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    layer_tensors = _LAYER_TENSORS[arch]
    plan: list[tuple[str, Any]] = []
    for t in reader.tensors:
        hf = _hf_name(t.name, n_layers, gguf_path, layer_tensors)
        if hf is not None:
            plan.append((hf, t))
    names = {hf for hf, _ in plan}
    required = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{n}.weight" for i in range(n_layers) for n in layer_tensors.values()
    ]
    missing = [n for n in required if n not in names]
    if missing:
        raise ModelFormatError(
            f"{gguf_path}: {len(missing)} required tensors are missing, e.g. {missing[:3]}"
        )
    plan.sort(key=lambda p: _sort_key(p[0]))

    specs = [(hf, st_dtype, tuple(int(d) for d in reversed(t.shape.tolist()))) for hf, t in plan]
    norm_shift = _NORM_SHIFT.get(arch, 0.0)
    out_dir.mkdir(parents=True, exist_ok=True)
    writer = _SafetensorsWriter(out_dir / "model.safetensors", specs, {"format": "pt"})
    try:
        for hf, t in _progress(plan, progress, f"import {gguf_path.name}"):
            w = _dequantize(t, gguf_path)
            if arch == "llama" and (".self_attn.q_proj." in hf or ".self_attn.k_proj." in hf):
                w = unpermute_rope_rows(w, n_heads if ".q_proj." in hf else n_kv)
            if norm_shift and hf.endswith("norm.weight"):
                w = w.astype(np.float32) - np.float32(norm_shift)
            writer.write(hf, w)
    finally:
        writer.close()

    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "tokenizer.json").write_text(tokenizer_json)
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n"
    )
    gen: dict[str, Any] = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    stops = _generation_eos(meta, arch, config)
    if stops:
        gen["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out_dir


def _sort_key(name: str) -> tuple:
    parts = name.split(".")
    if len(parts) > 2 and parts[1] == "layers":
        return (1, int(parts[2]), name)
    return (0 if "embed" in name else 2, 0, name)


def _progress(items: list, enabled: bool | None, desc: str) -> Iterable:
    import sys

    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit="tensor", leave=False)
