"""The source model for the converter: its fp32 weights read layer by layer, and a NumPy float32 forward of one
Llama-family decoder layer (RMSNorm, GQA attention with NEOX RoPE, SiLU MLP; Mistral, Qwen2 biases, Qwen3 q/k norms)
that exposes the input of every linear. tests/test_convert.py checks it against the runtime's logits.

Shapes: hidden states are float32 ``[rows, tokens, hidden]``; every calibration row starts at position 0.
HF weights are ``[out, in]``; ``y = x @ W.T``. With ``device="cuda[:n]"`` the projections (the bulk of the work) run
as fp32 GEMMs on our CUDA backend (``_C.op_matmul_nt``: cuBLAS, fp32 compute, one linear's input/output on the
device at a time), and so does the attention core (``_C.op_attention_paged``, fp32); norms and activations
stay in NumPy.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from .. import _C
from ..errors import ModelFileError, ModelFormatError, UnsupportedError

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def _f32(a: np.ndarray) -> np.ndarray:
    if a.dtype == np.uint16:  # bf16 bits
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


class SourceModel:
    """An unquantized HF model folder (config.json + *.safetensors in fp16/bf16/fp32)."""

    def __init__(self, path: str | Path, device: str = "cpu"):
        self.path = Path(path)
        self.device = device
        self.attn_op = device != "cpu"  # attention core through _C.op_attention_paged (else NumPy)
        if not (self.path / "config.json").is_file():
            raise ModelFileError(f"convert: {self.path} has no config.json; pass an HF model folder")
        self.raw_config = json.loads((self.path / "config.json").read_text(encoding="utf-8"))
        if self.raw_config.get("quantization_config"):
            q = self.raw_config["quantization_config"]
            raise UnsupportedError(
                f"convert: {self.path} is already quantized ({q.get('quant_method', q)}); "
                "convert needs the unquantized fp16/bf16/fp32 model"
            )
        self.config = _C.load_config(str(self.path))
        c = self.config
        if c["architecture"] not in SUPPORTED:
            raise UnsupportedError(f"convert: architecture {c['architecture']} is not supported; "
                                   f"supported: {', '.join(SUPPORTED)}")  # fmt: skip
        self.names = set(_C.safetensors_names(str(self.path)))
        self.n_layers = c["num_hidden_layers"]
        self.hidden = c["hidden_size"]
        self.n_heads = c["num_attention_heads"]
        self.n_kv = c["num_key_value_heads"]
        self.head_dim = c["head_dim"]
        self.eps = float(c["rms_norm_eps"])
        self.vocab = c["vocab_size"]
        self.qk_norm = c["architecture"] == "Qwen3ForCausalLM"
        self.tied = "lm_head.weight" not in self.names
        self.inv_freq = rope_inv_freq(c)
        self._rope: tuple[np.ndarray, np.ndarray] | None = None

    # -- weights --------------------------------------------------------------------------------
    def tensor(self, name: str) -> np.ndarray:
        if name not in self.names:
            raise ModelFormatError(f"convert: tensor {name} not found in {self.path}/*.safetensors")
        return _f32(_C.read_tensor(str(self.path), name, None, []))

    def maybe(self, name: str) -> np.ndarray | None:
        return self.tensor(name) if name in self.names else None

    def raw(self, name: str) -> np.ndarray:
        """A tensor as float16 (the EXL2 file stores embeddings and norms in fp16)."""
        return self.tensor(name).astype(np.float16)

    def layer(self, i: int) -> dict[str, np.ndarray]:
        """fp32 weights of decoder layer i: attn_norm, mlp_norm, q/k/v/o_proj, gate/up/down_proj, biases."""
        p = f"model.layers.{i}."
        w = {
            "attn_norm": self.tensor(p + "input_layernorm.weight"),
            "mlp_norm": self.tensor(p + "post_attention_layernorm.weight"),
        }
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            w[n] = self.tensor(f"{p}self_attn.{n}.weight")
            b = self.maybe(f"{p}self_attn.{n}.bias")
            if b is not None:
                w[n + ".bias"] = b
        for n in ("gate_proj", "up_proj", "down_proj"):
            w[n] = self.tensor(f"{p}mlp.{n}.weight")
            b = self.maybe(f"{p}mlp.{n}.bias")
            if b is not None:
                w[n + ".bias"] = b
        if self.qk_norm:
            w["q_norm"] = self.tensor(p + "self_attn.q_norm.weight")
            w["k_norm"] = self.tensor(p + "self_attn.k_norm.weight")
        return w

    def head_weight(self) -> np.ndarray:
        return self.tensor("model.embed_tokens.weight" if self.tied else "lm_head.weight")

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """[rows, tokens] ids -> fp32 [rows, tokens, hidden]."""
        emb = self.tensor("model.embed_tokens.weight")
        return emb[np.asarray(ids)]

    # -- forward pieces ---------------------------------------------------------------------------
    def linear(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
        """x [..., in] @ w[out, in].T (+ b) in fp32 on self.device."""
        return linear(x, w, b, self.device)

    def rope(self, n_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        if self._rope is None or self._rope[0].shape[0] < n_tokens:
            pos = np.arange(n_tokens, dtype=np.float64)
            ang = np.outer(pos, self.inv_freq)
            self._rope = (np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32))
        return self._rope[0][:n_tokens], self._rope[1][:n_tokens]

    def norm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return rms_norm(x, w, self.eps)

    def attention(self, xn: np.ndarray, w: dict, wq: np.ndarray, wk: np.ndarray, wv: np.ndarray) -> np.ndarray:
        """Attention output before o_proj, [rows, T, n_heads*head_dim], for normed input xn [rows, T, hidden]
        with projection weights wq/wk/wv (possibly quantized)."""
        R, T, _ = xn.shape
        H, Hk, d = self.n_heads, self.n_kv, self.head_dim
        qa = self.linear(xn, wq, w.get("q_proj.bias"))
        ka = self.linear(xn, wk, w.get("k_proj.bias"))
        va = self.linear(xn, wv, w.get("v_proj.bias"))
        cos, sin = self.rope(T)
        scale = np.float32(1.0 / math.sqrt(d))
        if self.attn_op:
            q = qa.reshape(R, T, H, d)
            k = ka.reshape(R, T, Hk, d)
            if self.qk_norm:
                q = rms_norm(q, w["q_norm"], self.eps)
                k = rms_norm(k, w["k_norm"], self.eps)
            return attention_op(_apply_rope(q, cos, sin), _apply_rope(k, cos, sin), va.reshape(R, T, Hk, d),
                                float(scale), self.device)  # fmt: skip
        out = np.empty((R, T, H * d), np.float32)
        mask = np.triu(np.full((T, T), -np.inf, np.float32), 1)
        for r in range(R):
            q = qa[r].reshape(T, H, d)
            k = ka[r].reshape(T, Hk, d)
            v = va[r].reshape(T, Hk, d)
            if self.qk_norm:
                q = rms_norm(q, w["q_norm"], self.eps)
                k = rms_norm(k, w["k_norm"], self.eps)
            q = _apply_rope(q, cos, sin).transpose(1, 0, 2)  # [H, T, d]
            k = _apply_rope(k, cos, sin).transpose(1, 0, 2)
            v = v.transpose(1, 0, 2)
            rep = H // Hk
            qg = q.reshape(Hk, rep * T, d)
            s = (qg @ k.transpose(0, 2, 1)).reshape(Hk, rep, T, T) * scale + mask
            s -= s.max(axis=-1, keepdims=True)
            np.exp(s, out=s)
            s /= s.sum(axis=-1, keepdims=True)
            o = s.reshape(Hk, rep * T, T) @ v  # [Hk, rep*T, d]
            out[r] = o.reshape(H, T, d).transpose(1, 0, 2).reshape(T, H * d)
        return out

    def mlp_act(self, xn: np.ndarray, w: dict, wg: np.ndarray, wu: np.ndarray) -> np.ndarray:
        """silu(gate) * up, the input of down_proj, [rows, T, intermediate]."""
        g = self.linear(xn, wg, w.get("gate_proj.bias"))
        u = self.linear(xn, wu, w.get("up_proj.bias"))
        return (g / (1.0 + np.exp(-g))) * u

    def attn_block(self, x: np.ndarray, w: dict, ws: dict | None = None) -> np.ndarray:
        """x + o_proj(attention(norm(x))) with the weights in ws (default: w's)."""
        ws = ws or w
        xn = self.norm(x, w["attn_norm"])
        a = self.attention(xn, w, ws["q_proj"], ws["k_proj"], ws["v_proj"])
        return x + self.linear(a, ws["o_proj"], w.get("o_proj.bias"))

    def mlp_block(self, x: np.ndarray, w: dict, ws: dict | None = None) -> np.ndarray:
        ws = ws or w
        xn = self.norm(x, w["mlp_norm"])
        a = self.mlp_act(xn, w, ws["gate_proj"], ws["up_proj"])
        return x + self.linear(a, ws["down_proj"], w.get("down_proj.bias"))

    def logits(self, x: np.ndarray, head: np.ndarray | None = None) -> np.ndarray:
        xn = self.norm(x, self.tensor("model.norm.weight"))
        return xn @ (self.head_weight() if head is None else head).T

    def forward(self, ids) -> np.ndarray:
        """Full fp32 forward: logits [rows, T, vocab] (reference for tests)."""
        x = self.embed(np.atleast_2d(np.asarray(ids)))
        for i in range(self.n_layers):
            w = self.layer(i)
            x = self.mlp_block(self.attn_block(x, w), w)
        return self.logits(x)


def linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None, device: str = "cpu") -> np.ndarray:
    """x [..., in] @ w[out, in].T (+ b), fp32; on a CUDA device through cuBLAS (fp32 compute)."""
    if device == "cpu":
        return _linear(x, w, b)
    x2 = np.ascontiguousarray(x.reshape(-1, x.shape[-1]), dtype=np.float32)
    y = _C.op_matmul_nt(x2, np.ascontiguousarray(w, dtype=np.float32),
                        None if b is None else np.ascontiguousarray(b, dtype=np.float32), device)  # fmt: skip
    return y.reshape(*x.shape[:-1], w.shape[0])


def attention_op(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, device: str) -> np.ndarray:
    """Causal GQA attention of rows that each start at position 0 through our runtime's op (fp32 activations and
    cache, so the CUDA backend takes its fp32 reference kernel): q [R, T, H, d], k/v [R, T, Hk, d] (rotated) ->
    [R, T, H*d]. Each row is one sequence whose cache is one page of T slots."""
    R, T, H, d = q.shape
    pos = np.tile(np.arange(T, dtype=np.int32), R)
    seq = np.repeat(np.arange(R, dtype=np.int32), T)
    table = np.arange(R, dtype=np.int32)[:, None]
    o = _C.op_attention_paged(np.ascontiguousarray(q.reshape(R * T, H, d), dtype=np.float32),
                              np.ascontiguousarray(k, dtype=np.float32), np.ascontiguousarray(v, dtype=np.float32),
                              pos, seq, table, scale, device)  # fmt: skip
    return o.reshape(R, T, H * d)


def _linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    y = x @ w.T
    if b is not None:
        y += b
    return y


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    var = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True)
    return (x / np.sqrt(var + np.float32(eps))) * w


def _apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """NEOX rotation of x [T, heads, d] with cos/sin [T, d/2]."""
    h = x.shape[-1] // 2
    c = cos[:, None, :]
    s = sin[:, None, :]
    x1, x2 = x[..., :h], x[..., h:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def rope_inv_freq(c: dict) -> np.ndarray:
    """inv_freq [head_dim/2] (float64) for default, linear and llama3 RoPE, as HF modeling_rope_utils."""
    d = c["head_dim"]
    base = float(c["rope_theta"])
    inv = 1.0 / (base ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rs = c.get("rope_scaling") or {}
    kind = rs.get("type", "default")
    if kind in ("default", "", None):
        return inv
    if kind == "linear":
        return inv / float(rs["factor"])
    if kind == "llama3":
        factor, lo, hi = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        old = float(rs["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        lo_wl, hi_wl = old / lo, old / hi
        out = np.where(wavelen > lo_wl, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * out / factor + smooth * out
        is_mid = (wavelen >= hi_wl) & (wavelen <= lo_wl)
        return np.where(is_mid, mid, out)
    raise UnsupportedError(f"convert: rope_scaling type {kind!r} is not supported by the converter "
                           "(default, linear and llama3 are)")  # fmt: skip
