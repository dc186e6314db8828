"""What fits a GPU budget: the highest bpw to convert an fp16 model to, or whether an EXL2 quant fits and its largest
context per cache type, from the same numbers the loader and the layer-split planner use.

    >>> import exl2cpp
    >>> exl2cpp.fit("fp16-model/", vram="24GiB", ctx=32768, cache="q4")["bpw"]

A GPU holds (all per GPU in use; ``--gpus N`` fills N GPUs of ``vram`` each in order, as ``gpu_split`` does):

- weights: ``_C.weight_load_bytes`` (the CUDA loader's sizes, model/graph.h: each tensor 256-byte aligned, norms and
  biases f32, other float tensors f16, an EXL2 linear at its upload size, RoPE tables f32 ``[ctx, head_dim]`` on
  every GPU). For an fp16 source, each decoder linear becomes ``bpw * numel / 8`` bytes (the converter's budget:
  its allocation averages at most ``bpw`` bits per weight, format overhead included, as ``info()["bpw_layers"]``
  counts it) plus ``LAYOUT_RESERVE`` for the GPU layout's tables and padding, and the lm_head its ``head_bits``
  config's bits (convert/qparams.py);
- the KV cache of ``batch`` sequences of ``ctx`` tokens in pages of 256 (model.cpp make_cache: bytes per token of
  the cache type, the quantized types' f16 sink rows per page and the scratch page);
- working buffers: ``multigpu.workspace_estimate`` (activations of 2048 rows, kept logits, the largest dequantized
  tile, cuBLAS workspace and allocator slack);
- ``CUDA_CONTEXT`` for the CUDA context and the runtime's kernels, which no allocation sees but the card's size
  includes.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from .errors import InvalidArgumentError, ModelFileError, OutOfMemoryError

MIB = 1 << 20
GIB = 1 << 30
ALIGN = 256  # the weight arena's alignment (core/weight_arena.h)
PAGE = 256  # tokens per KV page (model.py PAGE_SIZE)
KV_BLOCK = 32  # values per quantization block of a Q8/Q6/Q4 cache (cache/kv_quant.h kKvQuantBlock)
CACHE_BITS = {"fp16": 16, "q8": 8, "q6": 6, "q4": 4}
CUDA_CONTEXT = 512 * MIB  # CUDA context + module images per GPU (the runtime's kernels, cuBLAS); an allowance
LAYOUT_RESERVE = 0.03  # share of a quantized linear added for the GPU layout's tables and chunk padding
BPW_STEP = 0.05
BPW_MIN, BPW_MAX = 2.0, 8.0  # the converter's range of targets (convert._check_args; 8.0: every option at 8 bits)
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _aligned(n: int) -> int:
    return max(1, -(-int(n) // ALIGN)) * ALIGN


def parse_size(text) -> int:
    """``"24GiB"``, ``"24GB"`` (both 2**30, as gpu_split counts), ``"24000MiB"``, ``"24"`` (a bare number in a
    string: GiB) or a number of bytes -> bytes."""
    if isinstance(text, bool):
        raise InvalidArgumentError(f"a memory size must be like 24GiB, got {text!r}")
    if isinstance(text, (int, float)):
        if not math.isfinite(text) or text <= 0:
            raise InvalidArgumentError(f"a memory size must be a positive number of bytes, got {text!r}")
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]i?[bB]?)?\s*", str(text))
    if not m:
        raise InvalidArgumentError(f"a memory size must be like 24GiB, 80GB or 16000MiB, got {text!r}")
    unit = (m.group(2) or "g")[0].lower()
    value = float(m.group(1)) * {"k": 1 << 10, "m": MIB, "g": GIB, "t": 1 << 40}[unit]
    if value <= 0:
        raise InvalidArgumentError(f"a memory size must be positive, got {text!r}")
    return int(value)


def cache_bytes_per_token(config: dict, cache: str) -> tuple[int, int]:
    """(bytes per token, sink bytes per page) of a KV cache type, as cache/kv_cache.cpp counts them."""
    if cache not in CACHE_BITS:
        raise InvalidArgumentError(f"cache must be one of {', '.join(CACHE_BITS)}, got {cache!r}")
    bits = CACHE_BITS[cache]
    n_layers, n_kv, hd = int(config["num_hidden_layers"]), int(config["num_key_value_heads"]), int(config["head_dim"])
    if bits >= 16:
        return 2 * n_layers * n_kv * hd * bits // 8, 0
    row = hd * bits // 8 + hd // KV_BLOCK * (2 if bits == 4 else 1) * 2  # codes + f16 scales (Q4: scale and offset)
    return 2 * n_layers * n_kv * row, 2 * n_layers * n_kv * hd * 2


def cache_bytes(config: dict, cache: str, ctx: int, batch: int = 1) -> int:
    """Bytes of a cache holding ``batch`` sequences of ``ctx`` tokens (whole pages, the sink rows, the scratch page)."""
    per_token, sink = cache_bytes_per_token(config, cache)
    pages = batch * -(-int(ctx) // PAGE)
    return per_token * pages * PAGE + sink * (pages + 1)


@dataclass(frozen=True)
class Sizes:
    """The loader's weight bytes of a folder, split as the GPUs are filled: per decoder layer, the embedding side,
    the head (final norm + lm_head), and the RoPE tables per token of context (every GPU in use keeps them)."""

    layers: list[int]
    embed: int
    head: int
    rope_per_ctx: int  # RoPE bytes = aligned(ctx * rope_per_ctx) per table ...
    n_ropes: int  # ... times the number of tables

    def rope(self, ctx: int) -> int:
        return self.n_ropes * _aligned(ctx * self.rope_per_ctx)

    def total(self, ctx: int) -> int:
        return sum(self.layers) + self.embed + self.head + self.rope(ctx)


def loader_sizes(folder, ctx: int = 4096) -> Sizes:
    """The CUDA loader's weight sizes of ``folder`` (``_C.weight_load_bytes``, one walk for the whole model and one
    with every layer on its own index to split it per layer)."""
    from . import _C

    config = _C.load_config(str(folder))
    n = int(config["num_hidden_layers"])
    (single,), _ = _C.weight_load_bytes(str(folder), ctx)
    per, _ = _C.weight_load_bytes(str(folder), ctx, list(range(1, n + 1)), n + 1, 0)
    rope = (sum(per) - single) // (n + 1)  # each of the n + 1 extra indices keeps its own tables
    per_ctx = int(config["head_dim"]) * 4
    n_ropes = rope // _aligned(ctx * per_ctx)
    return Sizes(layers=[p - rope for p in per[1 : n + 1]], embed=per[0] - rope, head=per[n + 1] - rope,
                 rope_per_ctx=per_ctx, n_ropes=n_ropes)


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100 * MIB:
            raise ModelFileError(f"{path}: safetensors header of {n} bytes is implausible")
        h = json.loads(f.read(n))
    h.pop("__metadata__", None)
    return h


def is_exl2(folder) -> bool:
    cfg = json.loads((Path(folder) / "config.json").read_text())
    if (cfg.get("quantization_config") or {}).get("quant_method") == "exl2":
        return True
    return any(k.endswith(".q_weight") for f in sorted(Path(folder).glob("*.safetensors")) for k in _header(f))


def quantized_sizes(folder, bpw: float, head_bits: int = 6, ctx: int = 4096, dense: Sizes | None = None) -> Sizes:
    """The loader's sizes of ``folder`` (fp16/bf16/fp32) once converted at ``bpw`` with an lm_head of ``head_bits``."""
    from .convert.qparams import total_bits
    from .convert.allocate import head_qparams

    folder = Path(folder)
    dense = dense or loader_sizes(folder, ctx)
    layers = list(dense.layers)
    head = dense.head
    config = json.loads((folder / "config.json").read_text())
    n = len(layers)
    for f in sorted(folder.glob("*.safetensors")):
        for name, t in _header(f).items():
            parts = name.split(".")
            if name.startswith("model.layers.") and len(parts) >= 5 and parts[-2] in _LINEARS and parts[-1] == "weight":
                i = int(parts[2])
                if 0 <= i < n:
                    out_f, in_f = (int(x) for x in t["shape"])
                    q = bpw * in_f * out_f / 8
                    layers[i] += -_aligned(in_f * out_f * 2) + _aligned(int(q * (1 + LAYOUT_RESERVE)))
    h, v = int(config["hidden_size"]), int(config["vocab_size"])
    hq = head_qparams(head_bits)
    head_q = _aligned(int(total_bits(hq.groups(h), v) / 8 * (1 + LAYOUT_RESERVE)))
    head += head_q - _aligned(v * h * 2)  # the lm_head (or the tied copy the loader would make) becomes EXL2
    return Sizes(layers=layers, embed=dense.embed, head=head, rope_per_ctx=dense.rope_per_ctx, n_ropes=dense.n_ropes)


def _plan(sizes: Sizes, config: dict, vram: int, gpus: int, ctx: int, cache: str, batch: int) -> dict:
    """Whether ``sizes`` fit ``gpus`` GPUs of ``vram`` bytes at ``ctx``/``cache``/``batch``; the bytes per part."""
    from .multigpu import plan_layer_split, workspace_estimate

    kv = cache_bytes(config, cache, ctx, batch)
    n = len(sizes.layers)
    kv_layer = -(-kv // n)
    ws = workspace_estimate(config)
    per_gpu = ws + CUDA_CONTEXT + sizes.rope(ctx)
    need = sizes.total(ctx) - sizes.rope(ctx) + kv + gpus * per_gpu  # all GPUs used (an upper bound for the sum)
    out = {"weights": sizes.total(ctx), "kv_cache": kv, "workspace": ws, "cuda_context": CUDA_CONTEXT,
           "rope": sizes.rope(ctx), "budget": vram * gpus, "gpus": gpus}
    try:
        placement = plan_layer_split(sizes.layers, sizes.embed, sizes.head, [vram] * gpus,
                                     reserve_per_layer=kv_layer, reserve_per_gpu=per_gpu)
    except OutOfMemoryError:
        out.update(fits=False, need=need if gpus > 1 else sizes.total(ctx) + kv + ws + CUDA_CONTEXT)
        return out
    out.update(fits=True, need=sum(placement.planned), planned=placement.planned,
               layer_devices=placement.layer_devices)
    return out


def _check(vram, gpus, ctx, cache, batch):
    vram_b = parse_size(vram)
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise InvalidArgumentError(f"gpus must be a positive integer, got {gpus!r}")
    if not isinstance(ctx, int) or isinstance(ctx, bool) or ctx < 1:
        raise InvalidArgumentError(f"ctx must be a positive integer, got {ctx!r}")
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise InvalidArgumentError(f"batch must be a positive integer, got {batch!r}")
    if cache not in CACHE_BITS:
        raise InvalidArgumentError(f"cache must be one of {', '.join(CACHE_BITS)}, got {cache!r}")
    return vram_b


def fit_bpw(folder, vram, ctx: int = 4096, cache: str = "fp16", gpus: int = 1, batch: int = 1,
            head_bits: int = 6) -> dict:
    """The highest bpw (steps of ``BPW_STEP``) an fp16 model converts to and still fits; ``bpw`` None when not even
    ``BPW_MIN`` does. Also the accounting at that bpw (``plan``) and at one step up (``next``)."""
    vram_b = _check(vram, gpus, ctx, cache, batch)
    from . import _C

    config = _C.load_config(str(folder))
    dense = loader_sizes(folder, ctx)
    grid = [round(BPW_MIN + i * BPW_STEP, 2) for i in range(int(round((BPW_MAX - BPW_MIN) / BPW_STEP)) + 1)]

    def plan_at(b):
        return _plan(quantized_sizes(folder, b, head_bits, ctx, dense), config, vram_b, gpus, ctx, cache, batch)

    lo, hi = -1, len(grid)  # grid[lo] fits (lo = -1: none), grid[hi] does not (hi = len: all fit)
    while hi - lo > 1:  # the bytes grow with bpw: bisect
        mid = (lo + hi) // 2
        if plan_at(grid[mid])["fits"]:
            lo = mid
        else:
            hi = mid
    best = grid[lo] if lo >= 0 else None
    return {"source": str(folder), "kind": "fp16", "bpw": best, "head_bits": head_bits, "ctx": ctx, "cache": cache,
            "batch": batch, "gpus": gpus, "vram": vram_b,
            "plan": plan_at(best) if best is not None else plan_at(BPW_MIN),
            "next": plan_at(round(best + 0.1, 2)) if best is not None else None,
            "reserves": _reserves()}


def max_context(sizes: Sizes, config: dict, vram: int, gpus: int, cache: str, batch: int, limit: int) -> int:
    """The largest context (whole pages, at most ``limit``) at which ``sizes`` fit; 0 when not even one page does."""
    lo, hi = 0, limit // PAGE + 1  # pages: lo fits (0: none tried), hi does not
    if _plan(sizes, config, vram, gpus, hi * PAGE, cache, batch)["fits"]:
        return hi * PAGE
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _plan(sizes, config, vram, gpus, mid * PAGE, cache, batch)["fits"]:
            lo = mid
        else:
            hi = mid
    return lo * PAGE


def fit_quant(folder, vram, ctx: int = 4096, cache: str = "fp16", gpus: int = 1, batch: int = 1) -> dict:
    """Whether an EXL2 quant fits at ``ctx``/``cache``, and the largest context per cache type (capped at 1M)."""
    vram_b = _check(vram, gpus, ctx, cache, batch)
    from . import _C

    config = _C.load_config(str(folder))
    sizes = loader_sizes(folder, ctx)
    limit = 1 << 20
    return {"source": str(folder), "kind": "exl2", "ctx": ctx, "cache": cache, "batch": batch, "gpus": gpus,
            "vram": vram_b, "plan": _plan(sizes, config, vram_b, gpus, ctx, cache, batch),
            "max_ctx": {c: max_context(sizes, config, vram_b, gpus, c, batch, limit) for c in CACHE_BITS},
            "model_max_ctx": int(config.get("max_position_embeddings") or 0), "reserves": _reserves()}


def _reserves() -> dict:
    return {"cuda_context": CUDA_CONTEXT, "layout_reserve": LAYOUT_RESERVE,
            "workspace": "multigpu.workspace_estimate: 2048 activation rows, 64 kept logits rows, one dequantized "
                         "tile, cuBLAS workspace and allocator slack"}


def fit(model, vram, ctx: int = 4096, cache: str = "fp16", gpus: int = 1, batch: int = 1, head_bits: int = 6) -> dict:
    """What fits ``gpus`` GPUs of ``vram`` (e.g. ``"24GiB"``, or bytes) at ``ctx`` tokens of ``cache`` KV cache per
    sequence for ``batch`` sequences.

    An fp16/bf16 folder: ``{"kind": "fp16", "bpw": the highest bpw (0.05 steps) to convert it to, "plan": the bytes
    at that bpw, "next": the bytes at bpw + 0.1, ...}``. An EXL2 folder: ``{"kind": "exl2", "plan": {"fits", ...},
    "max_ctx": {cache type: largest context}, ...}``. See the module docstring for what is reserved.
    """
    from .models import resolve_model

    folder = resolve_model(model)
    if is_exl2(folder):
        return fit_quant(folder, vram, ctx, cache, gpus, batch)
    return fit_bpw(folder, vram, ctx, cache, gpus, batch, head_bits)


def format_fit(r: dict) -> str:
    """The lines ``exl2cpp fit`` prints."""
    g = f"{r['gpus']} x " if r["gpus"] > 1 else ""
    head = f"{r['source']}: {g}{r['vram'] / GIB:.2f} GiB, ctx {r['ctx']}, {r['cache']} cache, batch {r['batch']}"
    p = r["plan"]

    def parts(p):
        return (f"weights {p['weights'] / GIB:.3f} GiB (RoPE {p['rope'] / MIB:.1f} MiB) + KV cache "
                f"{p['kv_cache'] / GIB:.3f} GiB + workspace {p['workspace'] / MIB:.0f} MiB + CUDA context "
                f"{p['cuda_context'] / MIB:.0f} MiB{' per GPU' if p['gpus'] > 1 else ''} = {p['need'] / GIB:.3f} GiB "
                f"of {p['budget'] / GIB:.3f} GiB (headroom {(p['budget'] - p['need']) / MIB:.1f} MiB)")

    lines = [head]
    if r["kind"] == "fp16":
        if r["bpw"] is None:
            lines.append(f"nothing fits: even {BPW_MIN} bpw needs {parts(p)}")
        else:
            lines.append(f"highest bpw: {r['bpw']:.2f} (lm_head {r['head_bits']} bits): {parts(p)}")
            nx = r["next"]
            if r["bpw"] + 0.1 > BPW_MAX + 1e-9:
                lines.append(f"(the converter's highest target is {BPW_MAX}: more memory buys context or batch)")
            else:
                lines.append(f"{r['bpw'] + 0.1:.2f} bpw: {'fits' if nx['fits'] else 'does not fit'}: {parts(nx)}")
    else:
        lines.append(("fits: " if p["fits"] else "does not fit: ") + parts(p))
        cap = r["model_max_ctx"]
        lines.append("largest context: " + ", ".join(
            f"{c} {n}" + (" (over the model's " + str(cap) + ")" if cap and n > cap else "")
            for c, n in r["max_ctx"].items()))
    lines.append(f"reserved: CUDA context {CUDA_CONTEXT / MIB:.0f} MiB per GPU; working buffers per GPU "
                 "(2048 activation rows, kept logits, cuBLAS); EXL2 layout tables "
                 f"{LAYOUT_RESERVE * 100:.0f} % of each quantized linear (fp16 sources)")
    return "\n".join(lines)
