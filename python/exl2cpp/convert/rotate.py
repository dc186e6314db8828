"""Residual-stream rotation folded into the weights, before quantization: the model computes the same function in
full precision, is still a plain checkpoint of its architecture, and its linears' inputs lose the few massive
coordinates (outlier channels) that cost GPTQ most.

For a pre-norm decoder whose every norm is an RMSNorm read only by the linears after it (Llama, Mistral, Qwen2,
Qwen3; ROTATABLE), with the hidden states as row vectors x:

1. each norm's weight g is folded into the linears that read it (W <- W diag(g)) and becomes ones; the final
   norm's into the head, which is untied from the embedding when the file ties them;
2. with Q an orthogonal [hidden, hidden] matrix (rotation_matrix: random signs times a Hadamard matrix / sqrt(n)),
   the residual stream becomes x Q: embedding E <- E Q, every linear reading it (q/k/v, gate/up, head)
   W <- W Q, every linear writing it (o_proj, down_proj) W <- Q^T W and its bias b <- b Q. RMSNorm(x Q) with ones
   = RMSNorm(x) Q, since Q keeps the norm of each row;
3. optionally (vo=True) per attention layer an orthogonal [head_dim, head_dim] R on the value heads: v_proj's rows
   of each KV head W_v <- R^T W_v (bias b <- b R), o_proj's columns of each query head W_o <- W_o R. Attention
   mixes value rows linearly per head, so o_proj's input becomes a R and its output is unchanged.

Architectures with other norms (Gemma's post-norms and 1 + w weights, Cohere's LayerNorm with mean and bias, a
parallel block) or MoE routers are not rotated: rotation_reason says why, and the converter records it.
The rotation runs in float64 and the rotated checkpoint is written in float32 (rotate_checkpoint).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from ..errors import InvalidArgumentError
from .source import SourceModel

# HF architectures whose decoder is llama_like (cpp/model/decoder.cpp) with RMSNorm before attention and MLP and
# nothing else on the residual stream (no embedding or residual scales, no post-norms)
ROTATABLE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
NORMS = ("input_layernorm", "post_attention_layernorm")  # the pre-attention and pre-MLP RMSNorms of these files
READS = {"input_layernorm": ("q_proj", "k_proj", "v_proj"), "post_attention_layernorm": ("gate_proj", "up_proj")}
WRITES = ("o_proj", "down_proj")
HEAD_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")  # Qwen3: over head_dim, after q/k_proj


# -- orthogonal matrices ---------------------------------------------------------------------------


def _is_prime(p: int) -> bool:
    return p >= 2 and all(p % d for d in range(2, int(p**0.5) + 1))


def _paley_core(q: int) -> np.ndarray:
    """Jacobsthal matrix of the prime q: Q[i, j] = chi(j - i), chi the quadratic character mod q."""
    chi = np.full(q, -1, np.int64)
    chi[0] = 0
    chi[[(x * x) % q for x in range(1, q)]] = 1
    i = np.arange(q)
    return chi[(i[None, :] - i[:, None]) % q]


def _paley(n: int) -> np.ndarray | None:
    """A Hadamard matrix of order n from Paley's constructions over a prime field: I (n = q + 1, q = 3 mod 4) or
    II (n = 2 (q + 1), q = 1 mod 4); None when neither applies."""
    q = n - 1
    if n % 4 == 0 and _is_prime(q) and q % 4 == 3:
        s = np.zeros((n, n), np.int64)
        s[0, 1:] = 1
        s[1:, 0] = -1
        s[1:, 1:] = _paley_core(q)
        return s + np.eye(n, dtype=np.int64)
    q = n // 2 - 1
    if n % 4 == 0 and _is_prime(q) and q % 4 == 1:
        c = np.zeros((q + 1, q + 1), np.int64)
        c[0, 1:] = c[1:, 0] = 1
        c[1:, 1:] = _paley_core(q)
        eye = np.eye(q + 1, dtype=np.int64)
        return np.kron(c, np.array([[1, 1], [1, -1]])) + np.kron(eye, np.array([[1, -1], [-1, -1]]))
    return None


def _sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1), np.int64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def hadamard(n: int) -> np.ndarray | None:
    """A Hadamard matrix of order n (entries +-1, H H^T = n I): Sylvester's 2^k times a Paley matrix of the rest;
    None when n has no such factorization (e.g. an odd factor above 1 that no Paley order covers)."""
    if n < 1:
        raise InvalidArgumentError(f"hadamard: order must be positive, got {n}")
    k = 1
    while n % (2 * k) == 0:
        k *= 2
    while k >= 1:
        rest = n // k
        base = np.ones((1, 1), np.int64) if rest == 1 else _sylvester(2) if rest == 2 else _paley(rest)
        if base is not None:
            return np.kron(_sylvester(k), base)
        k //= 2
    return None


def rotation_matrix(n: int, seed: int) -> np.ndarray:
    """Orthogonal float64 [n, n]: diag(random signs) H / sqrt(n) with H = hadamard(n); when n has no Hadamard
    matrix, a Hadamard matrix of its largest power-of-two factor Kronecker a random orthogonal matrix (QR of a
    Gaussian) of the odd part. Deterministic in (n, seed)."""
    rng = np.random.default_rng([int(seed), int(n), 0x524F54])
    h = hadamard(n)
    if h is None:
        k = n & -n
        g = rng.standard_normal((n // k, n // k))
        qm, r = np.linalg.qr(g)
        qm = qm * np.sign(np.diag(r))[None, :]
        m = np.kron(_sylvester(k) / np.sqrt(k), qm)
    else:
        m = h / np.sqrt(n)
    signs = rng.choice(np.array([-1.0, 1.0]), size=n)
    return signs[:, None] * m


# -- which models ----------------------------------------------------------------------------------


def rotation_reason(src: SourceModel) -> str | None:
    """None when the rotation is exact for src, else why it is not rotated (a sentence for the log and
    quantization_config)."""
    arch = src.config.get("architecture")
    if arch not in ROTATABLE:
        return (f"{arch} is not rotated: the rotation is exact only for pre-norm RMSNorm decoders with nothing else "
                f"on the residual stream ({', '.join(ROTATABLE)})")  # fmt: skip
    pre = src.tensor_names["layers"]
    known = {f"{n}.weight" for n in NORMS} | set(HEAD_NORMS)
    for i in range(src.n_layers):
        info = src.layer_linears[i]
        roles = sorted(d["role"] for d in info)
        if roles != sorted(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")):
            return f"{arch} is not rotated: layer {i} has linears {roles}, not the q/k/v/o and gate/up/down it expects"
        lin = {d["name"] for d in info}
        for name in src.names:
            if not name.startswith(f"{pre}{i}."):
                continue
            base = name.rsplit(".", 1)[0]
            if base in lin or name[len(f"{pre}{i}.") :] in known or name.endswith(".rotary_emb.inv_freq"):
                continue
            return f"{arch} is not rotated: {name} is not a tensor the rotation knows how to carry"
        for n in NORMS:
            if f"{pre}{i}.{n}.weight" not in src.names:
                return f"{arch} is not rotated: {pre}{i}.{n}.weight is missing"
    return None


# -- the rotated checkpoint ------------------------------------------------------------------------


def rotate_checkpoint(src: SourceModel, out_dir: str | Path, seed: int = 0, vo: bool = False,
                      residual: bool = True) -> dict:  # fmt: skip
    """Write src rotated (module docstring) as an HF folder out_dir: float32 safetensors (one file per layer, the
    embedding, norm and head in the first), src's other files, and config.json with tie_word_embeddings false.
    With residual=False only the value heads are rotated (vo; steps 1 and 2 skipped: norms, embedding, head and
    tying as in src). Returns the rotation's description for quantization_config. Raises InvalidArgumentError when src is not
    rotatable (rotation_reason)."""
    from .writer import save_safetensors

    reason = rotation_reason(src)
    if reason is not None:
        raise InvalidArgumentError(f"rotate: {reason}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    q = rotation_matrix(src.hidden, seed) if residual else np.eye(src.hidden)
    cfg = src.config
    heads, kv = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    head_dim = int(cfg.get("head_dim") or src.hidden // heads)
    r_vo = rotation_matrix(head_dim, seed + 1) if vo else None
    pre = src.tensor_names["layers"]
    f64 = lambda n: src.tensor(n).astype(np.float64)  # noqa: E731
    f32 = lambda a: np.ascontiguousarray(a, dtype=np.float32)  # noqa: E731

    head_w = f64(src.tensor_names["embed"] if src.tied else src.head_name + ".weight")
    g_final = f64(src.tensor_names["final_norm"])
    first = {
        src.tensor_names["embed"]: f32(f64(src.tensor_names["embed"]) @ q),
        src.tensor_names["final_norm"]: np.ones_like(g_final, dtype=np.float32),
        src.head_name + ".weight": f32((head_w * g_final[None, :]) @ q),
    } if residual else {n: src.tensor(n) for n in (src.tensor_names["embed"], src.tensor_names["final_norm"],
                                                   src.head_name + ".weight") if n in src.names}  # fmt: skip
    del head_w
    n_files = src.n_layers + 1
    weight_map: dict[str, str] = {}
    sizes: list[int] = []

    def save(t: dict, k: int) -> None:
        name = f"model-{k:05d}-of-{n_files:05d}.safetensors"
        save_safetensors(t, out / name, {"format": "pt"})
        weight_map.update(dict.fromkeys(t, name))
        sizes.append(sum(v.nbytes for v in t.values()))

    save(first, 1)
    for i in range(src.n_layers):
        lp = f"{pre}{i}."
        by_role = {d["role"]: d["name"] for d in src.layer_linears[i]}
        t: dict[str, np.ndarray] = {}
        for n in NORMS:
            g = f64(f"{lp}{n}.weight") if residual else np.ones(src.hidden)
            t[f"{lp}{n}.weight"] = np.ones_like(g, dtype=np.float32) if residual else src.tensor(f"{lp}{n}.weight")
            for role in READS[n]:
                name = by_role[role]
                w = (f64(name + ".weight") * g[None, :]) @ q
                b = src.maybe(name + ".bias")
                if role == "v_proj" and r_vo is not None:
                    w = np.einsum("ji,hjk->hik", r_vo, w.reshape(kv, head_dim, -1)).reshape(w.shape)
                    b = None if b is None else (b.astype(np.float64).reshape(kv, head_dim) @ r_vo).ravel()
                t[name + ".weight"] = f32(w)
                if b is not None:
                    t[name + ".bias"] = f32(b)
        for role in WRITES:
            name = by_role[role]
            w = f64(name + ".weight")
            if role == "o_proj" and r_vo is not None:
                w = (w.reshape(-1, heads, head_dim) @ r_vo).reshape(w.shape)
            t[name + ".weight"] = f32(q.T @ w)
            b = src.maybe(name + ".bias")
            if b is not None:
                t[name + ".bias"] = f32(b.astype(np.float64) @ q)
        for n in HEAD_NORMS:
            if lp + n in src.names:
                t[lp + n] = src.tensor(lp + n)
        save(t, i + 2)
    total = sum(sizes)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")
    for f in sorted(src.path.iterdir()):
        if not f.is_file() or f.suffix in (".safetensors", ".bin", ".pt", ".pth", ".gguf") or f.name.endswith(
            ".index.json"
        ):
            continue
        if f.name == "config.json":
            c = json.loads(f.read_text(encoding="utf-8"))
            if residual:
                c["tie_word_embeddings"] = False
                if isinstance(c.get("text_config"), dict):
                    c["text_config"]["tie_word_embeddings"] = False
            (out / "config.json").write_text(json.dumps(c, indent=2) + "\n", encoding="utf-8")
        else:
            shutil.copyfile(f, out / f.name)
    return describe(seed, vo, residual)


def describe(seed: int, vo: bool, residual: bool = True) -> dict:
    """quantization_config["rotation"] of a rotated conversion."""
    return {"method": "hadamard", "residual": bool(residual), "norms_folded": bool(residual), "vo": bool(vo),
            "seed": int(seed)}  # fmt: skip
