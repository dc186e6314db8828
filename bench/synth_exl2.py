"""Synthetic EXL2 model folders for benchmarks: Llama-shaped models at a target bpw with random codes and scales.

The values mean nothing (speed does not depend on them), but everything else is what ExLlamaV2's converter writes:
per-linear bit mixes in its style (descending widths, 32/64/128-row groups, a few 8-bit rows in down_proj, a 6-bit
lm_head: 0.15:8b/0.85:6b 128g), a random act-order permutation per linear, fp16 embeddings and norms, config.json
with quantization_config, and a byte-level BPE tokenizer.json whose vocabulary matches the config (ExLlamaV2 0.3.2
needs tokenizer.json). Tensors are packed with ``exl2cpp._C.exl2_pack`` on all cores and streamed into one
``output.safetensors``. Same seed, same bytes.

    PYTHONPATH=python python3 bench/synth_exl2.py --preset llama2-7b --bpw 4.0 --out /tmp/m/l2-4.0
    PYTHONPATH=python python3 bench/synth_exl2.py --preset tiny --bpw 2.5 --out /tmp/tiny25 --distinct-layers 0

The bpw target is ExLlamaV2's accounting of the decoder layers (q_weight bits plus group, scale and permutation
overhead, lm_head excluded), the number ``exl2cpp.load(folder).info()["bpw_layers"]`` reports.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

PRESETS = {
    # name: shape and config values of the model family
    "llama2-7b": {
        "hidden": 4096,
        "inter": 11008,
        "layers": 32,
        "heads": 32,
        "kv_heads": 32,
        "vocab": 32000,
        "rope_theta": 10000.0,
        "max_pos": 4096,
        "norm_eps": 1e-5,
    },
    "llama3-8b": {
        "hidden": 4096,
        "inter": 14336,
        "layers": 32,
        "heads": 32,
        "kv_heads": 8,
        "vocab": 128256,
        "rope_theta": 500000.0,
        "max_pos": 8192,
        "norm_eps": 1e-5,
    },
    # Mixtral-8x7B: every MLP 8 experts of the Mistral-7B MLP shape, 2 chosen per token (MixtralForCausalLM)
    "mixtral-8x7b": {
        "hidden": 4096,
        "inter": 14336,
        "layers": 32,
        "heads": 32,
        "kv_heads": 8,
        "vocab": 32000,
        "rope_theta": 1000000.0,
        "max_pos": 32768,
        "norm_eps": 1e-5,
        "experts": 8,
        "top_k": 2,
    },
    # for tests: the tiny shape with 4 experts, top-2
    "tiny-moe": {
        "hidden": 256,
        "inter": 512,
        "layers": 2,
        "heads": 4,
        "kv_heads": 2,
        "vocab": 1024,
        "rope_theta": 10000.0,
        "max_pos": 4096,
        "norm_eps": 1e-5,
        "experts": 4,
        "top_k": 2,
    },
    # for tests: runs on the CPU in well under a second; head_dim 64, GQA 2:1, in_features all multiples of 32
    "tiny": {
        "hidden": 256,
        "inter": 704,
        "layers": 2,
        "heads": 4,
        "kv_heads": 2,
        "vocab": 1024,
        "rope_theta": 10000.0,
        "max_pos": 4096,
        "norm_eps": 1e-5,
    },
}

WIDTHS = (2, 3, 4, 5, 6, 8)
ROLES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# ExLlamaV2's optimizer spends more on v_proj and down_proj and less on gate/up (qparams.py option tables); the error
# carried from linear to linear keeps the total on target whatever these are.
ROLE_BIAS = {
    "q_proj": 0.0,
    "k_proj": 0.0,
    "v_proj": 0.25,
    "o_proj": 0.0,
    "gate_proj": -0.08,
    "up_proj": -0.04,
    "down_proj": 0.12,
}
MLP_ROLES = ("gate_proj", "up_proj", "down_proj")
EXPERT_NAME = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}  # Mixtral's (HF and ExLlamaV2's converter)
HEAD_MIX = ((8, 0.15), (6, 0.85))  # qparams_headoptions[6]: 0.15:8b/0.85:6b, 128-row groups
HEAD_GROUP = 128
F16_CHUNK = 1 << 24  # fp16 elements per slice of the random pool


# ---- bit allocation (pure arithmetic; ExLlamaV2's total_bits accounting, as exl2cpp's quant::total_bits) ----------


def split_groups(sections, gs_default=128):
    """[(bits, rows, group_size)] -> per-group (bits, rows): each section cut into group_size rows, last one clipped."""
    groups = []
    for bits, rows, gs in sections:
        gs = gs or gs_default
        r = 0
        while r < rows:
            n = min(gs, rows - r)
            groups.append((bits, n))
            r += n
    return groups


def total_bits(groups, in_features, out_features):
    """ExLlamaV2's stored-bits count of one linear (q_weight + q_scale_max + q_groups + q_scale + q_invperm)."""
    G = len(groups)
    return (
        sum(rows * bits for bits, rows in groups) * out_features
        + G * 16
        + G * 32
        + G * out_features * 4
        + in_features * 32
    )


def plan_linear(in_features, out_features, target_bpw, role, base_bpw):
    """Groups [(bits, rows)] of one linear whose bpw is closest to target_bpw, in ExLlamaV2's style: down_proj opens
    with 5% of rows at 8 bits (6 bits below 3.5 bpw) in 32-row groups, then two adjacent widths in 128-row groups
    (64 below 3.5 bpw); the split between them is chosen by exact bit count."""
    if in_features % 32:
        raise ValueError(
            f"in_features {in_features} of a {role} must be a multiple of 32 (EXL2 groups)"
        )
    gs = 128 if base_bpw >= 3.5 else 64
    fixed = []
    if role == "down_proj":
        fixed = [(8 if base_bpw >= 3.5 else 6, 32 * math.ceil(0.05 * in_features / 32), 32)]
    fixed_rows = sum(r for _, r, _ in fixed)
    R = in_features - fixed_rows
    want = target_bpw * in_features * out_features
    # average q bits the free rows can take (overhead estimated with the free part in gs-row groups)
    est_groups = len(split_groups(fixed)) + math.ceil(R / gs) + 1
    overhead = est_groups * (48 + 4 * out_features) + 32 * in_features
    fixed_bits = sum(b * r for b, r, _ in fixed) * out_features
    avg = (want - overhead - fixed_bits) / max(1, R * out_features)
    cap = fixed[0][0] if fixed else 8
    avg = min(max(avg, 2.0), cap)
    lo = max(w for w in WIDTHS if w <= avg)
    hi = min([w for w in WIDTHS if w > lo and w <= cap] or [lo])
    best = None
    for n_hi in range(0, R + 1, 32):
        if n_hi % gs and n_hi != R:
            continue
        groups = split_groups(fixed + [(hi, n_hi, gs), (lo, R - n_hi, gs)])
        err = abs(total_bits(groups, in_features, out_features) - want)
        if best is None or err < best[0]:
            best = (err, groups)
    return best[1]


def plan_model(shape, bpw, distinct):
    """Per layer variant (distinct ones; layer i uses variant i % distinct), per role: groups. The error of each
    linear against the target carries into the next, weighted by how many layers use the variant."""
    L = shape["layers"]
    n_var = L if distinct <= 0 else min(distinct, L)
    count = [len(range(v, L, n_var)) for v in range(n_var)]
    dims = linear_dims(shape)
    # role biases made zero-sum over a layer's parameters, so the last linear's own bias leaves no error behind
    params = {r: fin * fout * copies(shape, r) for r, (fin, fout) in dims.items()}
    mean_bias = sum(ROLE_BIAS[r] * params[r] for r in ROLES) / sum(params.values())
    plans, carry = [], 0.0
    for v in range(n_var):
        plan = {}
        for role in ROLES:
            fin, fout = dims[role]
            n = count[v] * copies(shape, role)  # experts of a layer variant share its plan
            w = n * fin * fout
            base = bpw + ROLE_BIAS[role] - mean_bias
            t = min(max(base + carry / w, 2.05), 8.3)
            groups = plan_linear(fin, fout, t, role, bpw)
            carry += (base * fin * fout - total_bits(groups, fin, fout)) * n
            plan[role] = groups
        plans.append(plan)
    h = shape["hidden"]
    rows8 = min(h, HEAD_GROUP * math.ceil(HEAD_MIX[0][1] * h / HEAD_GROUP))
    head = split_groups(
        [(HEAD_MIX[0][0], rows8, HEAD_GROUP), (HEAD_MIX[1][0], h - rows8, HEAD_GROUP)]
    )
    return plans, head


def copies(shape, role):
    """How many linears of `role` a layer has: one per expert for the MLP of a MoE shape."""
    return shape.get("experts", 1) if role in MLP_ROLES else 1


def linear_name(shape, layer, role, expert=0):
    p = f"model.layers.{layer}"
    if role not in MLP_ROLES:
        return f"{p}.self_attn.{role}"
    if shape.get("experts"):
        return f"{p}.block_sparse_moe.experts.{expert}.{EXPERT_NAME[role]}"
    return f"{p}.mlp.{role}"


def linear_dims(shape):
    h, i = shape["hidden"], shape["inter"]
    hd = h // shape["heads"]
    return {
        "q_proj": (h, shape["heads"] * hd),
        "k_proj": (h, shape["kv_heads"] * hd),
        "v_proj": (h, shape["kv_heads"] * hd),
        "o_proj": (shape["heads"] * hd, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def plan_bpw(shape, plans):
    """bpw of the decoder layers the plan gives (ExLlamaV2 accounting)."""
    dims = linear_dims(shape)
    L = shape["layers"]
    bits = params = 0
    for layer in range(L):
        plan = plans[layer % len(plans)]
        for role in ROLES:
            fin, fout = dims[role]
            bits += total_bits(plan[role], fin, fout) * copies(shape, role)
            params += fin * fout * copies(shape, role)
    return bits / params


# ---- safetensors streaming writer -------------------------------------------------------------------------------

_ST_DTYPE = {np.dtype(np.int32): "I32", np.dtype(np.int16): "I16", np.dtype(np.float16): "F16"}


class StreamingSafetensors:
    """Write a .safetensors file whose tensor list (name, dtype, shape) is known up front; data comes in that order."""

    def __init__(self, path, specs, metadata=None):
        header, off = {}, 0
        self._order = []
        for name, dtype, shape in specs:
            nbytes = int(np.dtype(dtype).itemsize * math.prod(shape))
            header[name] = {
                "dtype": _ST_DTYPE[np.dtype(dtype)],
                "shape": list(shape),
                "data_offsets": [off, off + nbytes],
            }
            self._order.append((name, np.dtype(dtype), tuple(shape), nbytes))
            off += nbytes
        if metadata:
            header["__metadata__"] = metadata
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.total = off
        self._f = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._f.write(len(raw).to_bytes(8, "little"))
        self._f.write(raw)
        self._next = 0

    def write(self, name, array):
        want_name, dtype, shape, _ = self._order[self._next]
        if name != want_name or array.dtype != dtype or tuple(array.shape) != shape:
            raise RuntimeError(
                f"safetensors writer: expected {want_name} {dtype} {shape}, got {name} "
                f"{array.dtype} {tuple(array.shape)}"
            )
        self._f.write(memoryview(np.ascontiguousarray(array)).cast("B"))
        self._next += 1

    def close(self):
        if self._next != len(self._order):
            raise RuntimeError(
                f"safetensors writer: {len(self._order) - self._next} tensors were never written"
            )
        self._f.close()


def exl2_specs(prefix, fin, fout, groups):
    out_pad = 32 * math.ceil(fout / 32)
    qrows = sum(rows * bits // 32 for bits, rows in groups)
    G = len(groups)
    return [
        (f"{prefix}.q_weight", np.int32, (qrows, out_pad)),
        (f"{prefix}.q_scale", np.int32, (G, out_pad // 8)),
        (f"{prefix}.q_scale_max", np.float16, (G,)),
        (f"{prefix}.q_groups", np.int16, (2 * G,)),
        (f"{prefix}.q_invperm", np.int32, (fin,)),
    ]


# ---- random tensors ---------------------------------------------------------------------------------------------


class Source:
    """Deterministic random material: one pool of random bytes per model, sliced at seeded offsets (codes need only
    look random; drawing 7 billion fresh bytes would dominate the run), plus a seeded generator per linear."""

    def __init__(self, seed, pool_bytes):
        self.seed = seed
        self.pool = np.frombuffer(
            np.random.default_rng([seed, 0xB175]).bytes(2 * pool_bytes), dtype=np.uint8
        )
        self.half = pool_bytes

    def rng(self, *key):
        return np.random.default_rng([self.seed, *key])

    def bytes(self, rng, n):
        if n > self.half:
            raise ValueError(f"pool too small for {n} bytes")
        off = int(rng.integers(0, self.half))
        return self.pool[off : off + n]


def make_linear(src, key, fin, fout, groups, std):
    """Pack one random EXL2 linear; returns the five tensors in exl2_specs order."""
    from exl2cpp import _C

    rng = src.rng(*key)
    raw = src.bytes(rng, fin * fout).reshape(fin, fout)
    codes = np.empty((fin, fout), dtype=np.uint8)
    r = 0
    for bits, rows in groups:
        block = codes[r : r + rows]
        np.bitwise_and(raw[r : r + rows], (1 << bits) - 1, out=block)
        # Code 0 (the most negative value, -2^(b-1)) becomes the zero point, so q - z is symmetric with mean 0 like
        # real GPTQ codes. Uniform codes have mean -1/2: at 2 bits that is -0.45 standard deviations, a bias that
        # sums coherently over thousands of inputs and overflowed fp16 activations of the 2.5 bpw 7B/8B models.
        block[block == 0] = 1 << (bits - 1)
        r += rows
    G = len(groups)
    scales = (src.bytes(rng, G * fout).reshape(G, fout) & 15).astype(np.uint8)
    # weight std ~ std: (q - z) has std ~ 2^b / sqrt(12); scale = qsm * ((nib+1)/16)^2 averages ~0.35 qsm
    bits = np.array([b for b, _ in groups], dtype=np.float64)
    jitter = 0.75 + 0.5 * rng.random(G)
    qsm = (std * math.sqrt(12) / (0.35 * 2.0**bits) * jitter).astype(np.float16)
    perm = rng.permutation(fin).astype(np.int32)
    d = _C.exl2_pack(codes, [b for b, _ in groups], [n for _, n in groups], scales, qsm, perm, fout)
    return [d["q_weight"], d["q_scale"], d["q_scale_max"], d["q_groups"], d["q_invperm"]]


def random_f16(src, key, shape, exponent=8):
    """fp16 values of magnitude 2^(exponent-15) * [1, 2) with random sign and mantissa, straight from random bits."""
    rng = src.rng(*key)
    n = math.prod(shape)
    out = np.empty(n, dtype=np.uint16)
    for s in range(0, n, F16_CHUNK):
        e = min(n, s + F16_CHUNK)
        u = src.bytes(rng, 2 * (e - s)).view(np.uint16)
        np.bitwise_and(u, 0x83FF, out=out[s:e])
        np.bitwise_or(out[s:e], exponent << 10, out=out[s:e])
    return out.view(np.float16).reshape(shape)


# ---- tokenizer ----------------------------------------------------------------------------------------------------


def _bytes_to_unicode():
    """GPT-2's byte -> printable character map (the ByteLevel pre-tokenizer's alphabet)."""
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


SPECIALS = ("<unk>", "<s>", "</s>")


def tokenizer_files(vocab_size, max_pos):
    """(tokenizer.json text, tokenizer_config dict): byte-level BPE with exactly vocab_size ids: 0-2 <unk> <s> </s>,
    3-258 the 256 byte symbols, then merges of byte pairs (printable ASCII first) and pair+byte triples."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if vocab_size < len(SPECIALS) + 256:
        raise ValueError(
            f"vocab_size {vocab_size} is below the {len(SPECIALS) + 256} ids a byte-level BPE needs"
        )
    b2u = _bytes_to_unicode()
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for b in range(256):
        vocab[b2u[b]] = len(vocab)
    order = [b for b in range(256) if 32 <= b < 127] + [b for b in range(256) if not 32 <= b < 127]
    syms = [b2u[b] for b in order]
    merges = []
    need = vocab_size - len(vocab)
    pairs = ((a, b) for a in syms for b in syms)
    for a, b in pairs:
        if len(merges) == need:
            break
        merges.append((a, b))
        vocab[a + b] = len(vocab)
    level1 = [a + b for a, b in merges]
    for p in level1:
        if len(merges) >= need:
            break
        for c in syms:
            if len(merges) >= need:
                break
            merges.append((p, c))
            vocab[p + c] = len(vocab)
    if len(vocab) != vocab_size:
        raise ValueError(f"could not build {vocab_size} tokens (got {len(vocab)})")
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken

    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": max_pos,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, t in enumerate(SPECIALS)
        },
    }
    return tk.to_str(), cfg


# ---- the folder ---------------------------------------------------------------------------------------------------


def config_json(shape, bpw):
    h = shape["hidden"]
    moe = (
        {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
         "num_local_experts": shape["experts"], "num_experts_per_tok": shape["top_k"]}
        if shape.get("experts")
        else {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    )  # fmt: skip
    return {
        **moe,
        "hidden_size": h,
        "intermediate_size": shape["inter"],
        "num_hidden_layers": shape["layers"],
        "num_attention_heads": shape["heads"],
        "num_key_value_heads": shape["kv_heads"],
        "head_dim": h // shape["heads"],
        "rms_norm_eps": shape["norm_eps"],
        "rope_theta": shape["rope_theta"],
        "max_position_embeddings": shape["max_pos"],
        "vocab_size": shape["vocab"],
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "float16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "quantization_config": {
            "quant_method": "exl2",
            "version": "0.3.2",
            "bits": bpw,
            "head_bits": 6,
            "calibration": {"rows": 0, "length": 0, "dataset": "(synthetic: random codes)"},
        },
    }


def synthesize(
    out,
    preset="tiny",
    bpw=4.0,
    seed=0,
    threads=0,
    distinct=0,
    shape_overrides=None,
    log=print,
    skip_existing=False,
):
    """Write the model folder `out`; returns a summary dict (bpw planned, bytes, seconds). With skip_existing, a
    folder whose synth.json records the same request is left as it is (warm reruns on one machine)."""
    t0 = time.perf_counter()
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    shape = dict(PRESETS[preset], **(shape_overrides or {}))
    out = Path(out)
    request = {"preset": preset, "bpw": bpw, "seed": seed, "distinct": distinct, "shape": shape}
    done_file = out / "synth.json"
    if skip_existing and done_file.is_file():
        try:
            old = json.loads(done_file.read_text())
        except ValueError:
            old = {}
        if old.get("request") == request and (out / "output.safetensors").is_file():
            log(f"synth {preset} {bpw} bpw -> {out}: already there (synth.json matches), kept")
            return dict(old["summary"], seconds=0.0, kept=True)
    done_file.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    L, h, vocab = shape["layers"], shape["hidden"], shape["vocab"]
    plans, head = plan_model(shape, bpw, distinct)
    dims = linear_dims(shape)

    specs = [("model.embed_tokens.weight", np.float16, (vocab, h))]
    for layer in range(L):
        plan = plans[layer % len(plans)]
        p = f"model.layers.{layer}"
        specs += [
            (f"{p}.input_layernorm.weight", np.float16, (h,)),
            (f"{p}.post_attention_layernorm.weight", np.float16, (h,)),
        ]
        if shape.get("experts"):  # the router stays fp16, as ExLlamaV2's converter leaves it
            specs += [(f"{p}.block_sparse_moe.gate.weight", np.float16, (shape["experts"], h))]
        for role in ROLES:
            for e in range(copies(shape, role)):
                specs += exl2_specs(linear_name(shape, layer, role, e), *dims[role], plan[role])
    specs += [("model.norm.weight", np.float16, (h,))]
    specs += exl2_specs("lm_head", h, vocab, head)

    biggest = max(
        [fin * fout for fin, fout in dims.values()] + [h * vocab, 2 * min(F16_CHUNK, h * vocab)]
    )
    src = Source(seed, biggest)
    ones = np.ones(h, dtype=np.float16)
    writer = StreamingSafetensors(out / "output.safetensors", specs, metadata={"format": "pt"})
    threads = threads or os.cpu_count() or 1

    def layer_job(variant):
        plan = plans[variant]
        out = [
            [
                make_linear(
                    src,
                    (1, variant, ri, e) if shape.get("experts") else (1, variant, ri),
                    *dims[role],
                    plan[role],
                    1.0 / math.sqrt(dims[role][0]),
                )
                for e in range(copies(shape, role))
            ]
            for ri, role in enumerate(ROLES)
        ]
        if shape.get("experts"):
            out.append(random_f16(src, (4, variant), (shape["experts"], h)))
        return out

    with ThreadPoolExecutor(max_workers=threads) as pool:
        # embedding and head in the background while layers are made
        emb_f = pool.submit(random_f16, src, (2,), (vocab, h))
        head_f = pool.submit(make_linear, src, (3,), h, vocab, head, 1.0 / math.sqrt(h))
        variants = {}
        n_var = len(plans)
        # linears of one layer variant per task; keep at most threads + 2 variants in flight (memory)
        futs = {v: pool.submit(layer_job, v) for v in range(min(n_var, threads + 2))}
        next_v = len(futs)
        writer.write("model.embed_tokens.weight", emb_f.result())
        del emb_f
        for layer in range(L):
            v = layer % n_var
            if v not in variants:
                variants[v] = futs.pop(v).result()
                if next_v < n_var:
                    futs[next_v] = pool.submit(layer_job, next_v)
                    next_v += 1
            p = f"model.layers.{layer}"
            writer.write(f"{p}.input_layernorm.weight", ones)
            writer.write(f"{p}.post_attention_layernorm.weight", ones)
            if shape.get("experts"):
                writer.write(f"{p}.block_sparse_moe.gate.weight", variants[v][len(ROLES)])
            for role, per_copy in zip(ROLES, variants[v]):
                for e, tensors in enumerate(per_copy):
                    specs_e = exl2_specs(linear_name(shape, layer, role, e), *dims[role], plans[v][role])
                    for (name, _, _), t in zip(specs_e, tensors):
                        writer.write(name, t)
            if n_var == L:
                variants.pop(v)  # every layer distinct: free as we go
        writer.write("model.norm.weight", ones)
        for (name, _, _), t in zip(exl2_specs("lm_head", h, vocab, head), head_f.result()):
            writer.write(name, t)
    writer.close()

    (out / "config.json").write_text(json.dumps(config_json(shape, bpw), indent=2) + "\n")
    tok_json, tok_cfg = tokenizer_files(vocab, shape["max_pos"])
    (out / "tokenizer.json").write_text(tok_json)
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2}) + "\n"
    )

    planned = plan_bpw(shape, plans)
    dt = time.perf_counter() - t0
    summary = {
        "preset": preset,
        "target_bpw": bpw,
        "planned_bpw": round(planned, 4),
        "bytes": writer.total,
        "seconds": round(dt, 2),
        "distinct_layers": len(plans),
        "path": str(out),
    }
    done_file.write_text(json.dumps({"request": request, "summary": summary}) + "\n")
    log(
        f"synth {preset} {bpw} bpw -> {out}: layers {planned:.3f} bpw, {writer.total / 2**30:.2f} GiB, "
        f"{len(plans)} distinct layer(s), {dt:.1f} s"
    )
    return summary


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--preset", default="tiny", help=f"one of {', '.join(PRESETS)}, or a comma-separated list"
    )
    ap.add_argument(
        "--bpw",
        default="4.0",
        help="target bits per weight of the decoder layers (comma list allowed)",
    )
    ap.add_argument("--out", help="model folder to write (one preset and bpw)")
    ap.add_argument("--out-dir", help="write every preset x bpw into OUT_DIR/<preset>-<bpw>")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="packing threads (default: all cores)")
    ap.add_argument(
        "--distinct-layers",
        type=int,
        default=0,
        help="write N distinct layer variants and repeat them (0: every layer distinct); speed is the "
        "same, synthesis N/layers as long",
    )
    ap.add_argument("--layers", type=int, default=0, help="override the preset's layer count")
    ap.add_argument("--plan", action="store_true", help="print the bit plan and exit (no files)")
    ap.add_argument("--json", help="append one JSON summary line per folder to this file")
    ap.add_argument(
        "--skip-existing",
        action="store_true",
        help="keep folders whose synth.json shows the same request",
    )
    args = ap.parse_args(argv)
    presets = [p.strip() for p in args.preset.split(",") if p.strip()]
    bpws = [float(b) for b in args.bpw.split(",") if b.strip()]
    for p in presets:
        if p not in PRESETS:
            ap.error(f"unknown preset {p!r}; choose from {', '.join(PRESETS)}")
    for b in bpws:
        if not 2.0 <= b <= 8.0:
            ap.error(f"--bpw must be within 2.0..8.0, got {b}")
    over = {"layers": args.layers} if args.layers else None
    if args.plan:
        for preset in presets:
            for bpw in bpws:
                print_plan(preset, bpw, args.distinct_layers, over)
        return 0
    if args.out_dir:
        jobs = [(p, b, Path(args.out_dir) / f"{p}-{b:.1f}") for p in presets for b in bpws]
    elif args.out and len(presets) == 1 and len(bpws) == 1:
        jobs = [(presets[0], bpws[0], Path(args.out))]
    else:
        ap.error("give --out for one preset and bpw, or --out-dir")
    for preset, bpw, out in jobs:
        summary = synthesize(
            out,
            preset,
            bpw,
            args.seed,
            args.threads,
            args.distinct_layers,
            over,
            skip_existing=args.skip_existing,
        )
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(summary) + "\n")
    return 0


def print_plan(preset, bpw, distinct, over):
    shape = dict(PRESETS[preset], **(over or {}))
    plans, head = plan_model(shape, bpw, distinct)
    dims = linear_dims(shape)
    print(f"{preset} at {bpw} bpw, layer 0:")
    for role in ROLES:
        g = plans[0][role]
        mix = {}
        for b, r in g:
            mix[b] = mix.get(b, 0) + r
        fin, fout = dims[role]
        print(
            f"  {role:10s} {fin:6d}x{fout:<6d} {total_bits(g, fin, fout) / (fin * fout):5.2f} bpw  "
            + " ".join(f"{r / fin:.2f}:{b}b" for b, r in mix.items())
        )
    print(
        f"  layers: {plan_bpw(shape, plans):.4f} bpw;  lm_head: "
        f"{total_bits(head, shape['hidden'], shape['vocab']) / (shape['hidden'] * shape['vocab']):.2f} bpw"
    )


if __name__ == "__main__":
    sys.exit(main())
