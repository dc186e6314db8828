"""Imports a llama or qwen2 GGUF file into an HF-style model folder (fp16 safetensors, config.json, tokenizer).

    >>> from exl2cpp.gguf_import import import_gguf
    >>> import_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2")   # writes smollm2/{model.safetensors,...}

What is written:

- ``model.safetensors``: every tensor under its HF name, dequantized (``gguf.quants.dequantize``)
  and stored as ``dtype`` (float16 or float32). Norm weights and biases too.
- ``config.json``: ``LlamaForCausalLM`` or ``Qwen2ForCausalLM`` with every field the GGUF metadata holds.
- ``tokenizer.json``: byte-level BPE rebuilt from ``tokenizer.ggml.tokens``/``merges`` with the
  pre-tokenizer named by ``tokenizer.ggml.pre``; CONTROL tokens become special added tokens,
  USER_DEFINED tokens plain added tokens. A GGUF that embeds ``tokenizer.huggingface.json`` uses it as is.
- ``tokenizer_config.json`` (chat template, bos/eos/pad tokens, ``add_bos_token``) and
  ``generation_config.json`` (bos/eos ids).

llama.cpp's converter permutes the Q and K rows of ``llama`` models so that each head's rotary
pairs (i, i + head_dim/2) become adjacent (i, i+1) for its interleaved RoPE; the import undoes it.
``qwen2`` GGUFs keep the HF (rotate-half) layout and are copied as they are.
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

SUPPORTED_ARCHS = ("llama", "qwen2")

# GGUF architecture -> HF class / model_type.
_HF_ARCH = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
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
_LAYER_TENSORS = {
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
# Tensors that hold information already carried by config.json.
_SKIPPED_TENSORS = {"rope_freqs.weight"}

_DTYPES = {"float16": np.float16, "fp16": np.float16, "float32": np.float32, "fp32": np.float32}
_ST_DTYPE = {np.dtype(np.float16): "F16", np.dtype(np.float32): "F32"}


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
    except Exception as exc:  # truncated or corrupt: gguf raises ValueError/IndexError/struct errors
        short = _truncation(path)
        if short:
            raise ModelFormatError(f"{path}: the file is truncated: {short}; download it again") from exc
        raise ModelFormatError(
            f"{path}: cannot parse GGUF file ({type(exc).__name__}: {exc})"
        ) from exc


_GGUF_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _truncation(path: Path) -> str | None:
    """Why a GGUF file is too short, or None when its layout fits in the file (then it is corrupt otherwise):
    walks the header, the metadata and the tensor table (GGUF v2/v3) and compares where the last tensor's data
    ends with the file size."""
    import mmap

    import gguf

    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return "it is empty"
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # only the metadata is read
    pos = 0

    def take(n: int) -> bytes:
        nonlocal pos
        if pos + n > size:
            raise EOFError
        pos += n
        return data[pos - n : pos]

    def u64() -> int:
        return struct.unpack("<Q", take(8))[0]

    def u32() -> int:
        return struct.unpack("<I", take(4))[0]

    def string() -> bytes:
        return take(u64())

    def value(vtype: int) -> Any:
        if vtype == _GGUF_STRING:
            return string()
        if vtype == _GGUF_ARRAY:
            item, count = u32(), u64()
            if item in _GGUF_SCALAR:
                take(_GGUF_SCALAR[item] * count)
            else:
                for _ in range(count):
                    value(item)
            return None
        if vtype not in _GGUF_SCALAR:
            raise ValueError(f"unknown value type {vtype}")
        raw = take(_GGUF_SCALAR[vtype])
        return int.from_bytes(raw, "little") if vtype in (4, 10) else None

    try:
        take(4)  # magic
        version, n_tensors, n_kv = u32(), u64(), u64()
        if version < 2:
            return None
        alignment = 32
        for _ in range(n_kv):
            key = string()
            v = value(u32())
            if key == b"general.alignment" and v:
                alignment = v
        end, last = 0, None
        for _ in range(n_tensors):
            name = string().decode("utf-8", "replace")
            dims = [u64() for _ in range(u32())]
            ttype, offset = u32(), u64()
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)]
            nbytes = math.prod(dims) // block * type_size
            if offset + nbytes > end:
                end, last = offset + nbytes, name
    except EOFError:
        return f"it is {size} bytes and ends inside its metadata"
    except (ValueError, KeyError):
        return None
    finally:
        data.close()
    start = pos + (-pos % alignment)
    if start + end > size:
        return f"it is {size} bytes but tensor {last!r} needs bytes up to {start + end}"
    return None


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
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    bos = meta.int("tokenizer.ggml.bos_token_id")
    if bos is not None:
        config["bos_token_id"] = bos
    eos = _eos_ids(meta)
    if eos:
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return config


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
    if model != "gpt2":
        raise UnsupportedError(
            f"{meta.path}: tokenizer model {model!r} is not supported; import-gguf rebuilds only "
            "byte-level BPE tokenizers (tokenizer.ggml.model 'gpt2', as in Llama 3, Qwen 2, SmolLM)"
        )
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    tokens: list[str] = list(meta.require("tokenizer.ggml.tokens"))
    types = meta.get("tokenizer.ggml.token_type")
    types = list(types) if types is not None else [_TT_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ModelFormatError(
            f"{meta.path}: tokenizer.ggml.token_type has {len(types)} entries, tokenizer.ggml.tokens {len(tokens)}"
        )
    merges_raw = meta.get("tokenizer.ggml.merges") or []
    merges: list[tuple[str, str]] = []
    for m in merges_raw:
        parts = m.split(" ")
        if len(parts) != 2:
            raise ModelFormatError(
                f"{meta.path}: malformed BPE merge {m!r} (expected 'left right')"
            )
        merges.append((parts[0], parts[1]))

    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)  # a duplicate string keeps its first id
    tk = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))

    pre = meta.get("tokenizer.ggml.pre", "default")
    style = _PRE_TOKENIZERS.get(pre)
    if style is None:
        import warnings

        warnings.warn(
            f"{meta.path}: unknown tokenizer.ggml.pre {pre!r}; using the GPT-2 pre-tokenizer, so "
            "tokenization may differ slightly from the original model",
            stacklevel=3,
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

    added = []
    for i, (tok, tt) in enumerate(zip(tokens, types)):
        if tt in (_TT_CONTROL, _TT_USER_DEFINED) and vocab.get(tok) == i:
            added.append(AddedToken(tok, special=(tt == _TT_CONTROL), normalized=False))
    # add_tokens keeps the ids the vocab already gives these strings.
    tk.add_special_tokens([a for a in added if a.special])
    tk.add_tokens([a for a in added if not a.special])

    bos = meta.int("tokenizer.ggml.bos_token_id")
    if (
        meta.get("tokenizer.ggml.add_bos_token", False)
        and bos is not None
        and 0 <= bos < len(tokens)
    ):
        bos_tok = tokens[bos]
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos_tok} $A",
            pair=f"{bos_tok} $A {bos_tok} $B",
            special_tokens=[(bos_tok, bos)],
        )
    return tk.to_str()


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
    if meta.has("tokenizer.ggml.add_bos_token"):
        cfg["add_bos_token"] = bool(meta.get("tokenizer.ggml.add_bos_token"))
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


def _hf_name(name: str, n_layers: int, path: Path) -> str | None:
    """GGUF tensor name -> HF name; None for tensors to skip."""
    if name in _SKIPPED_TENSORS:
        return None
    stem, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        raise UnsupportedError(f"{path}: unexpected tensor {name!r} (expected a .weight or .bias)")
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        layer = int(parts[1])
        if layer >= n_layers:
            raise ModelFormatError(
                f"{path}: tensor {name!r} names layer {layer} but block_count is {n_layers}"
            )
        return f"model.layers.{layer}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    raise UnsupportedError(
        f"{path}: tensor {name!r} has no HF equivalent for this architecture (known: token_embd, "
        f"output_norm, output, blk.N.{{{', '.join(_LAYER_TENSORS)}}})"
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


class _SafetensorsWriter:
    """Streams tensors into one safetensors file: the header is planned first, data written one at a time."""

    def __init__(
        self,
        path: Path,
        specs: list[tuple[str, np.dtype, tuple[int, ...]]],
        metadata: dict[str, str],
    ):
        header: dict[str, Any] = {"__metadata__": metadata}
        offset = 0
        self._order = []
        for name, dtype, shape in specs:
            nbytes = math.prod(shape) * np.dtype(dtype).itemsize
            header[name] = {
                "dtype": _ST_DTYPE[np.dtype(dtype)],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self._order.append((name, np.dtype(dtype), shape))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
        self._file = open(path, "wb")  # noqa: SIM115 (closed by close())
        self._file.write(struct.pack("<Q", len(raw)))
        self._file.write(raw)
        self._next = 0

    def write(self, name: str, array: np.ndarray) -> None:
        exp_name, dtype, shape = self._order[self._next]
        assert name == exp_name and array.dtype == dtype and array.shape == shape, (name, exp_name)
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
    """Convert a llama/qwen2 GGUF file into an HF-style folder that ``exl2cpp.load`` (and HF) read.

    Parameters
    ----------
    gguf_path : path of the ``.gguf`` file (one file; split GGUFs are not supported).
    out_dir : folder to write: new or empty (InvalidArgumentError otherwise, as ``convert``).
    dtype : ``"float16"`` (default) or ``"float32"``: storage type of every tensor.
    progress : show a tqdm bar over tensors; default: when stderr is a terminal.

    Returns
    -------
    Path of ``out_dir``.

    Raises
    ------
    ModelFileError : the file is missing.  ModelFormatError : not a GGUF, truncated, or inconsistent.
    InvalidArgumentError : ``out_dir`` is not empty, or a bad ``dtype``.
    UnsupportedError : architecture, tensor type, tokenizer model or RoPE variant not handled.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):  # as convert refuses
        raise InvalidArgumentError(
            f"import-gguf: output folder {out_dir} is not empty (choose an empty or new folder)"
            if out_dir.is_dir() else f"import-gguf: output {out_dir} exists and is not a folder"
        )
    if dtype not in _DTYPES:
        raise InvalidArgumentError(
            f"import_gguf: dtype {dtype!r} is not supported (use 'float16' or 'float32')"
        )
    np_dtype = np.dtype(_DTYPES[dtype])
    dtype_name = "float16" if np_dtype == np.float16 else "float32"

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
    plan: list[tuple[str, Any]] = []
    for t in reader.tensors:
        hf = _hf_name(t.name, n_layers, gguf_path)
        if hf is not None:
            plan.append((hf, t))
    names = {hf for hf, _ in plan}
    required = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{n}.weight" for i in range(n_layers) for n in _LAYER_TENSORS.values()
    ]
    missing = [n for n in required if n not in names]
    if missing:
        raise ModelFormatError(
            f"{gguf_path}: {len(missing)} required tensors are missing, e.g. {missing[:3]}"
        )
    plan.sort(key=lambda p: _sort_key(p[0]))

    specs = [(hf, np_dtype, tuple(int(d) for d in reversed(t.shape.tolist()))) for hf, t in plan]
    out_dir.mkdir(parents=True, exist_ok=True)
    writer = _SafetensorsWriter(out_dir / "model.safetensors", specs, {"format": "pt"})
    try:
        for hf, t in _progress(plan, progress, f"import {gguf_path.name}"):
            w = _dequantize(t, gguf_path)
            if arch == "llama" and (".self_attn.q_proj." in hf or ".self_attn.k_proj." in hf):
                w = unpermute_rope_rows(w, n_heads if ".q_proj." in hf else n_kv)
            writer.write(hf, w.astype(np_dtype, copy=False))
    finally:
        writer.close()

    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "tokenizer.json").write_text(tokenizer_json)
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n"
    )
    gen: dict[str, Any] = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
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
