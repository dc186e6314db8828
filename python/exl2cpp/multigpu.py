"""Layer split across GPUs: parsing ``gpu_split``, the sizes a model folder needs, and the placement planner.

``exl2cpp.load(path, device="cuda", gpu_split=[20, 24])`` gives GPU 0 at most 20 GB and GPU 1 at most 24 GB
(GB = 2**30 bytes, in device order); ``gpu_split="auto"`` uses each GPU's free memory. Both fill the GPUs in order:
the embedding, then the decoder layers, then the final norm + lm_head, each on the first GPU (from the current one
on) with room left for it. A layer's share is its weights plus its KV cache for ``max_seq_len`` tokens at fp16; each
GPU in use also keeps room for the working buffers (activations, logits, cuBLAS and kernel scratch). Everything is
checked here, before any weight is loaded: bad ``gpu_split`` values raise InvalidArgumentError, a model that does
not fit raises OutOfMemoryError with the numbers.

:func:`plan_layer_split` is a pure function (no GPU, no files), unit-tested on the CPU.
"""

from __future__ import annotations

import json
import math
import numbers
import struct
from dataclasses import dataclass, field
from pathlib import Path

from .errors import InvalidArgumentError, ModelFileError, OutOfMemoryError

GB = 1 << 30  # gpu_split unit
MIB = 1 << 20
PLAN_ROWS = 2048  # activation rows the working-buffer estimate covers (the engine's default max_batch_tokens)
KEPT_LOGIT_ROWS = 64  # logits rows every GPU's workspace keeps (model/workspace.h)
FIXED_RESERVE = 288 * MIB  # cuBLAS workspace (32 MiB) + kernel scratch and allocator slack per GPU


@dataclass(frozen=True)
class ModelSizes:
    """What a model folder needs on a GPU, from its safetensors headers and config (no weights read)."""

    layer_bytes: list[
        int
    ]  # weights of each decoder layer as loaded on a GPU (f32 stored -> f16 loaded)
    embed_bytes: int  # the token embedding (f16 on the GPU)
    head_bytes: int  # final norm + lm_head (a tied lm_head: an f16 copy of the embedding)
    kv_bytes_per_token_layer: int  # fp16 K + V of one token in one layer
    workspace_bytes: int  # working buffers per GPU in use (estimate, see workspace_estimate)


@dataclass(frozen=True)
class Placement:
    """Where each part of the model goes (CUDA indices) and the bytes planned on each GPU."""

    layer_devices: list[int]
    embed_device: int
    head_device: int
    planned: list[int] = field(default_factory=list)  # bytes planned per GPU (weights + reserves)
    budgets: list[int] = field(default_factory=list)  # bytes allowed per GPU

    @property
    def devices(self) -> list[int]:
        """The GPUs in use, in order."""
        return sorted({self.embed_device, self.head_device, *self.layer_devices})

    def describe(self) -> str:
        """One line: which layers went where, and the planned GB per GPU."""
        parts = []
        for d in self.devices:
            layers = [i for i, x in enumerate(self.layer_devices) if x == d]
            span = f"layers {layers[0]}-{layers[-1]}" if layers else "no layers"
            extra = [
                n
                for n, x in (("embedding", self.embed_device), ("lm_head", self.head_device))
                if x == d
            ]
            what = ", ".join([span, *extra])
            parts.append(
                f"cuda:{d}: {what} ({self.planned[d] / GB:.2f} of {self.budgets[d] / GB:.2f} GB)"
            )
        return "; ".join(parts)


def parse_gpu_split(gpu_split, n_gpus: int) -> list[float] | str:
    """Validate ``gpu_split``: ``"auto"``, a list of GB per GPU (numbers >= 0, at least one > 0, at most one per
    visible GPU), or the CLI form ``"20,24"``. Returns ``"auto"`` or the list of GB as floats."""
    if isinstance(gpu_split, str):
        text = gpu_split.strip().lower()
        if text == "auto":
            return "auto"
        if not text:
            raise InvalidArgumentError(
                'gpu_split must be "auto" or GB per GPU such as "20,24", got an empty string'
            )
        items = [t.strip() for t in text.split(",")]
        values = []
        for t in items:
            try:
                values.append(float(t))
            except ValueError:
                raise InvalidArgumentError(
                    f'gpu_split must be "auto" or comma-separated GB per GPU such as "20,24", got {gpu_split!r} '
                    f"({t!r} is not a number)"
                ) from None
        gpu_split = values
    if isinstance(gpu_split, (bytes, dict, set)) or not hasattr(gpu_split, "__len__"):
        raise InvalidArgumentError(
            f'gpu_split must be "auto" or a list of GB per GPU such as [20, 24], got {gpu_split!r}'
        )
    values = list(gpu_split)
    if not values:
        raise InvalidArgumentError("gpu_split must list GB for at least one GPU, got an empty list")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise InvalidArgumentError(f"gpu_split[{i}] must be a number of GB, got {v!r}")
        v = float(v)
        if not math.isfinite(v) or v < 0:
            raise InvalidArgumentError(
                f"gpu_split[{i}] must be a finite number of GB >= 0, got {v}"
            )
        out.append(v)
    if not any(v > 0 for v in out):
        raise InvalidArgumentError(f"gpu_split gives no GPU any memory: {out}")
    if len(out) > n_gpus:
        raise InvalidArgumentError(
            f"gpu_split lists {len(out)} GPUs but {n_gpus} CUDA device(s) are visible (check CUDA_VISIBLE_DEVICES)"
        )
    return out


def plan_layer_split(
    layer_bytes,
    embed_bytes: int,
    head_bytes: int,
    budgets,
    reserve_per_layer: int = 0,
    reserve_per_gpu: int = 0,
) -> Placement:
    """Fill GPUs in order: the embedding, layers 0..N-1 (each with ``reserve_per_layer`` bytes of KV cache), then
    the head, each on the current GPU while it fits in that GPU's budget, else on the next GPU. A GPU's first item
    also charges ``reserve_per_gpu`` (working buffers). GPUs with budget 0 are skipped. Raises OutOfMemoryError
    with the numbers when something fits nowhere, InvalidArgumentError for negative sizes or budgets."""
    layer_bytes = [int(b) for b in layer_bytes]
    budgets = [int(b) for b in budgets]
    sizes = [("the embedding", int(embed_bytes))]
    sizes += [(f"layer {i}", b + int(reserve_per_layer)) for i, b in enumerate(layer_bytes)]
    sizes.append(("the final norm + lm_head", int(head_bytes)))
    if not budgets:
        raise InvalidArgumentError("plan_layer_split: no GPU budgets given")
    if any(b < 0 for b in budgets):
        raise InvalidArgumentError(f"plan_layer_split: budgets must be >= 0, got {budgets}")
    if any(s < 0 for _, s in sizes) or reserve_per_gpu < 0:
        raise InvalidArgumentError("plan_layer_split: sizes and reserves must be >= 0")
    planned = [0] * len(budgets)
    opened = [False] * len(budgets)
    where = []
    d = 0
    for name, size in sizes:
        start = d
        while d < len(budgets):
            cost = size + (0 if opened[d] else int(reserve_per_gpu))
            if budgets[d] > 0 and planned[d] + cost <= budgets[d]:
                planned[d] += cost
                opened[d] = True
                where.append(d)
                break
            d += 1
        else:
            total_need = sum(s for _, s in sizes) + int(reserve_per_gpu)
            have = ", ".join(
                f"cuda:{i} {planned[i] / GB:.2f}/{budgets[i] / GB:.2f} GB"
                for i in range(len(budgets))
            )
            raise OutOfMemoryError(
                f"layer split: {name} ({size / MIB:.1f} MiB"
                + (
                    f" incl. {reserve_per_layer / MIB:.1f} MiB KV cache"
                    if name.startswith("layer")
                    else ""
                )
                + f") does not fit on cuda:{start} or a later GPU "
                f"(planned so far / budget: {have}; the whole model needs about {total_need / GB:.2f} GB plus "
                f"{reserve_per_gpu / MIB:.0f} MiB of working buffers per GPU, the budgets total "
                f"{sum(budgets) / GB:.2f} GB); give the GPUs more in gpu_split, lower max_seq_len, or use a smaller "
                "quant"
            )
    return Placement(
        layer_devices=where[1:-1],
        embed_device=where[0],
        head_device=where[-1],
        planned=planned,
        budgets=budgets,
    )


# ---- sizes of a model folder ------------------------------------------------------------------------------------

_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}


def _safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ModelFileError(f"{path}: too short for a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * MIB:
            raise ModelFileError(f"{path}: safetensors header of {n} bytes is implausible")
        try:
            return json.loads(f.read(n))
        except ValueError as e:
            raise ModelFileError(f"{path}: safetensors header is not JSON ({e})") from None


def workspace_estimate(config: dict, rows: int = PLAN_ROWS) -> int:
    """Bytes of working buffers one GPU keeps for a model of ``config`` (as ``_C.load_config`` parses it) (model/
    workspace.h at ``rows`` rows, the kept logits, the largest dequantized EXL2 weight tile, cuBLAS and allocator
    slack). An estimate, on the safe side."""
    h = int(config["hidden_size"])
    n_heads = int(config["num_attention_heads"])
    hd = int(config.get("head_dim") or h // n_heads)
    n_kv = int(config.get("num_key_value_heads") or n_heads)
    inter = int(config["intermediate_size"])
    vocab = int(config["vocab_size"])
    act = (
        rows * (4 * h + 2 * n_heads * hd + 2 * n_kv * hd + 2 * inter) * 2
    )  # f16 h, x, picked, normed, q, attn, ...
    logits = KEPT_LOGIT_ROWS * vocab * (2 + 4)
    return act + logits + h * inter * 2 + FIXED_RESERVE


def model_config(folder) -> tuple[dict, dict]:
    """The model in ``folder`` as the runtime reads it: its parsed config (``_C.load_config``: a multimodal file's
    text model, every size filled in) and where its tensors are (``_C.decoder_names``)."""
    from . import _C

    return _C.load_config(str(folder)), _C.decoder_names(str(folder))


def model_sizes(folder) -> ModelSizes:
    """Sizes of the model in ``folder`` from its safetensors headers (no weights read); tensors of parts the
    runtime does not run (a vision tower) count nowhere."""
    folder = Path(folder)
    config, names = model_config(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"{folder}: no .safetensors files")
    n_layers = int(config["num_hidden_layers"])
    prefix = names["layers"]
    head_prefix = names["head"] + "."
    unused = tuple(names["unused_prefixes"])
    layers = [0] * n_layers
    embed = head = 0
    own_head = False
    for path in files:
        for name, info in _safetensors_header(path).items():
            if name == "__metadata__" or name.startswith(unused):
                continue
            begin, end = info["data_offsets"]
            size = int(end) - int(begin)
            if info.get("dtype") == "F32":
                size //= 2
            if name.startswith(prefix):
                i = name[len(prefix) :].split(".")[0]
                if i.isdigit() and int(i) < n_layers:
                    layers[int(i)] += size
            elif name.startswith(head_prefix):
                head += size
                own_head = True
            elif name == names["final_norm"]:
                head += size
            else:
                embed += size
    h = int(config["hidden_size"])
    if not own_head:
        head += int(config["vocab_size"]) * h * 2
    return ModelSizes(
        layer_bytes=layers,
        embed_bytes=embed,
        head_bytes=head,
        kv_bytes_per_token_layer=2 * int(config["num_key_value_heads"]) * int(config["head_dim"]) * 2,
        workspace_bytes=workspace_estimate(config),
    )


def plan_for_model(folder, gpu_split, max_seq_len: int, n_gpus: int, free_bytes=None) -> Placement:
    """The placement of the model in ``folder`` for ``gpu_split`` (validated here) on ``n_gpus`` visible GPUs.
    ``free_bytes(i)`` gives GPU i's free memory for ``"auto"`` (default: ``_C.cuda_mem_info``)."""
    if n_gpus <= 0:
        raise InvalidArgumentError(
            "gpu_split needs CUDA GPUs but none is visible (check the driver and "
            'CUDA_VISIBLE_DEVICES, or load with device="cpu" without gpu_split)'
        )
    split = parse_gpu_split(gpu_split, n_gpus)
    sizes = model_sizes(folder)
    if split == "auto":
        if free_bytes is None:
            from . import _C

            def free_bytes(i):
                return _C.cuda_mem_info(i)[0]

        budgets = [int(free_bytes(i)) for i in range(n_gpus)]
    else:
        budgets = [int(g * GB) for g in split]
    return plan_layer_split(
        sizes.layer_bytes,
        sizes.embed_bytes,
        sizes.head_bytes,
        budgets,
        reserve_per_layer=sizes.kv_bytes_per_token_layer * int(max_seq_len),
        reserve_per_gpu=sizes.workspace_bytes,
    )


def default_cache_tokens(model, fraction: float, bytes_per_value: float) -> int:
    """Engine cache size for a split model: the most tokens whose per-GPU share (the layers on each GPU) fits in
    ``fraction`` of that GPU's free memory."""
    from . import _C
    from .model import kv_values_per_layer

    per_layer = kv_values_per_layer(model.text_config) * bytes_per_value  # K and V of one token
    ranks = list(getattr(model, "tensor_parallel", []) or [])
    if ranks:  # tensor parallel: every GPU holds 1/T of every layer's KV heads
        best = None
        for dev in ranks:
            free, _total = _C.cuda_mem_info(int(dev.split(":")[1]) if ":" in dev else 0)
            tokens = int(free * fraction / (per_layer / len(ranks) * len(model.layer_devices)))
            best = tokens if best is None else min(best, tokens)
        return max(256, best or 256)
    best = None
    for dev in sorted(set(model.layer_devices)):
        n = sum(1 for d in model.layer_devices if d == dev)
        free, _total = _C.cuda_mem_info(int(dev.split(":")[1]) if ":" in dev else 0)
        tokens = int(free * fraction / (per_layer * n))
        best = tokens if best is None else min(best, tokens)
    return max(256, best or 256)
