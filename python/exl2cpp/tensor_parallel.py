"""Tensor parallelism: the shard plan, the EXL2 column slice, device selection and finding NCCL.

``exl2cpp.load(path, device="cuda", tensor_parallel=True)`` splits every layer over all visible GPUs (or
``devices=[0, 1]``): attention by KV-head groups, the MLP by intermediate columns, and o_proj / down_proj by
output columns over the full (all-gathered) input, so every shard is a block of rows of the full ``[out, in]``
weight, EXL2 included (``q_weight`` / ``q_scale`` column slices; the act-order permutation is never cut). The C++
graph (``cpp/model/tensor_parallel.h``) makes the same plan; the functions here are pure and unit-tested on the CPU
against the unsharded weights. ``device="cpu", tensor_parallel=N`` runs N virtual ranks on the CPU (the same
sharded graph with a memcpy all-gather), for tests.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import InvalidArgumentError

EXL2_ALIGN = 32  # EXL2 pads output columns to 32; a shard must start and span multiples of it

# (linear suffix, which plan width splits its OUTPUT columns)
_SPLIT = {
    "self_attn.q_proj": "q_cols",
    "self_attn.k_proj": "kv_cols",
    "self_attn.v_proj": "kv_cols",
    "self_attn.o_proj": "hidden_cols",
    "mlp.gate_proj": "inter_cols",
    "mlp.up_proj": "inter_cols",
    "mlp.down_proj": "hidden_cols",
}


@dataclass(frozen=True)
class ShardPlan:
    """Per-rank widths of a tensor-parallel split over ``ranks`` ranks (every rank the same)."""

    ranks: int
    q_heads: int
    kv_heads: int
    q_cols: int
    kv_cols: int
    inter_cols: int
    hidden_cols: int

    def columns(self, linear: str, rank: int) -> tuple[int, int]:
        """Output columns ``[begin, end)`` of ``linear`` (``"down_proj"``, ``"mlp.down_proj"`` or a full tensor
        prefix) that ``rank`` holds."""
        if not 0 <= rank < self.ranks:
            raise InvalidArgumentError(f"rank {rank} outside [0, {self.ranks})")
        last = linear.rsplit(".", 1)[-1]
        key = next((k for k in _SPLIT if k.rsplit(".", 1)[-1] == last), None)
        if key is None:
            raise InvalidArgumentError(
                f"{linear!r} is not a split linear (one of {', '.join(_SPLIT)})"
            )
        w = getattr(self, _SPLIT[key])
        return rank * w, (rank + 1) * w


def plan_tensor_parallel(config: dict, ranks: int, exl2: bool = False) -> ShardPlan:
    """The shard plan of a model of ``config`` (its sizes as ``_C.load_config`` parses them) over ``ranks`` ranks.
    Raises InvalidArgumentError naming the numbers when it does not split: KV heads, heads, hidden and intermediate
    sizes must divide by ``ranks``; with ``exl2`` every shard width must also be a multiple of 32."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise InvalidArgumentError(
            f"tensor parallel needs a positive number of ranks, got {ranks!r}"
        )
    h = int(config["hidden_size"])
    nh = int(config["num_attention_heads"])
    nkv = int(config.get("num_key_value_heads") or nh)
    hd = int(config.get("head_dim") or h // nh)
    inter = int(config["intermediate_size"])
    if nkv % ranks:
        raise InvalidArgumentError(
            f"tensor parallel over {ranks} GPUs splits attention by KV heads, but num_key_value_heads = {nkv} is not "
            f"divisible by {ranks}; use a GPU count that divides it, or a layer split (gpu_split) instead"
        )
    for name, v in (("num_attention_heads", nh), ("hidden_size", h), ("intermediate_size", inter)):
        if v % ranks:
            raise InvalidArgumentError(
                f"tensor parallel over {ranks}: {name} = {v} is not divisible by {ranks}"
            )
    plan = ShardPlan(
        ranks,
        nh // ranks,
        nkv // ranks,
        nh // ranks * hd,
        nkv // ranks * hd,
        inter // ranks,
        h // ranks,
    )
    if exl2:
        for what in ("q_cols", "kv_cols", "inter_cols", "hidden_cols"):
            w = getattr(plan, what)
            if w % EXL2_ALIGN:
                raise InvalidArgumentError(
                    f"tensor parallel over {ranks}: EXL2 shards must span multiples of {EXL2_ALIGN} output columns, "
                    f"but {what} = {w}; use fewer GPUs or a layer split (gpu_split)"
                )
    return plan


def slice_exl2_columns(t: dict, c0: int, c1: int) -> dict:
    """Output columns ``[c0, c1)`` of one EXL2 linear given as ``{suffix: array}`` (``q_weight``, ``q_scale``,
    ``q_scale_max``, ``q_groups``, ``q_invperm``, optional ``q_perm``, ``bias``): a valid EXL2 linear whose
    dequantized weight is exactly ``W[:, c0:c1]`` of the full one (``W`` = ``[in, out]``). ``c0`` and the width must
    be multiples of 32 (InvalidArgumentError otherwise). Shared tensors are returned as they are."""
    out_pad = int(t["q_weight"].shape[1])
    if not (0 <= c0 < c1 <= out_pad) or c0 % EXL2_ALIGN or (c1 - c0) % EXL2_ALIGN:
        raise InvalidArgumentError(
            f"EXL2 column slice [{c0}, {c1}) must lie in [0, {out_pad}) and start and span multiples of {EXL2_ALIGN}"
        )
    s = dict(t)
    s["q_weight"] = np.ascontiguousarray(t["q_weight"][:, c0:c1])
    s["q_scale"] = np.ascontiguousarray(t["q_scale"][:, c0 // 8 : c1 // 8])
    if t.get("bias") is not None:
        s["bias"] = np.ascontiguousarray(t["bias"][c0:c1])
    return s


def resolve_devices(tensor_parallel, devices, device: str, n_gpus: int) -> list[str]:
    """The rank devices for ``exl2cpp.load``'s ``tensor_parallel`` / ``devices`` / ``device`` arguments.

    CUDA: ``tensor_parallel=True`` uses ``devices`` (CUDA indices) or every visible GPU (2 at least);
    ``tensor_parallel=N`` the first N (or ``devices``, which must then have N entries). CPU: ``tensor_parallel=N``
    makes N virtual ranks (testing). Raises InvalidArgumentError with the fix for anything else."""
    dev = str(device).strip().lower()
    if isinstance(tensor_parallel, bool):
        count = None
    elif isinstance(tensor_parallel, int) and tensor_parallel >= 1:
        count = int(tensor_parallel)
    else:
        raise InvalidArgumentError(
            f"tensor_parallel must be True or a number of ranks >= 1, got {tensor_parallel!r}"
        )
    if dev == "cpu":
        if devices is not None:
            raise InvalidArgumentError(
                "devices= lists CUDA GPUs; on the CPU give tensor_parallel=N virtual ranks"
            )
        if count is None:
            raise InvalidArgumentError(
                'tensor_parallel on device="cpu" runs virtual ranks for testing: give their number, e.g. '
                'tensor_parallel=2 (or load with device="cuda" to split over GPUs)'
            )
        return ["cpu"] * count
    if dev not in ("cuda", "cuda:0"):
        raise InvalidArgumentError(
            f'tensor_parallel splits a model over CUDA GPUs (pick them with devices=[0, 1]): load with device="cuda", '
            f"got device={device!r}"
        )
    if n_gpus <= 0:
        raise InvalidArgumentError(
            "tensor_parallel needs CUDA GPUs but none is visible (check the driver and CUDA_VISIBLE_DEVICES)"
        )
    if devices is not None:
        try:
            idx = [int(d) for d in devices]
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                f"devices must be a list of CUDA indices such as [0, 1], got {devices!r}"
            ) from None
        if not idx or any(i < 0 or i >= n_gpus for i in idx):
            raise InvalidArgumentError(
                f"devices must be CUDA indices in [0, {n_gpus}), got {list(devices)}"
            )
        if len(set(idx)) != len(idx):
            raise InvalidArgumentError(f"devices lists a GPU twice: {list(devices)}")
        if count is not None and count != len(idx):
            raise InvalidArgumentError(f"tensor_parallel={count} but devices lists {len(idx)} GPUs")
    else:
        want = n_gpus if count is None else count
        if count is None and n_gpus < 2:
            raise InvalidArgumentError(
                f"tensor_parallel=True needs 2 or more GPUs, {n_gpus} visible (check CUDA_VISIBLE_DEVICES, or pass "
                "devices=[0] to run the tensor-parallel path on one GPU)"
            )
        if want > n_gpus:
            raise InvalidArgumentError(
                f"tensor_parallel={count} but only {n_gpus} CUDA GPU(s) are visible"
            )
        idx = list(range(want))
    return [f"cuda:{i}" for i in idx]


def find_nccl_library() -> str | None:
    """libnccl.so.2 to load: ``$NCCL_LIBRARY``, else ``nvidia/nccl/lib/libnccl.so.2`` of NVIDIA's wheel
    (``nvidia-nccl-cu13`` / ``-cu12``; or ``nvidia/cu13/lib``) on ``sys.path``, else None (the loader's search path is
    tried last)."""
    env = os.environ.get("NCCL_LIBRARY")
    if env:
        return env
    for entry in sys.path:
        base = Path(entry or ".") / "nvidia"
        for sub in (
            "nccl",
            "cu13",
            "cu12",
        ):  # the wheel's layout; CUDA-versioned layouts of other NVIDIA wheels
            cand = base / sub / "lib" / "libnccl.so.2"
            if cand.is_file():
                return str(cand)
    return None


def prepare_nccl() -> None:
    """Before the first communicator: NVLink multicast off unless the user set it (NCCL_NVLS_ENABLE=0), and tell
    the C++ loader where NVIDIA's wheel put libnccl.so.2."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    from . import _C

    path = find_nccl_library()
    if path and hasattr(_C, "nccl_set_library"):
        _C.nccl_set_library(path)


def is_exl2_folder(folder) -> bool:
    """Whether the model folder holds EXL2 tensors (any ``*.q_weight`` in its safetensors headers)."""
    from .multigpu import _safetensors_header

    for path in sorted(Path(folder).glob("*.safetensors")):
        if any(k.endswith(".q_weight") for k in _safetensors_header(path)):
            return True
    return False


def tensor_parallel_kwargs(spec) -> dict:
    """exl2cpp.load's tensor_parallel/devices for a --tensor-parallel or serve.yml value: "all" / True (every
    visible GPU), an integer N (N ranks), or GPU indices ("0,1" or [0, 1]); False / None / "off": {}."""
    if spec is None or spec is False or (isinstance(spec, str) and spec.strip().lower() in ("", "off", "false", "no")):
        return {}
    if spec is True or (isinstance(spec, str) and spec.strip().lower() in ("all", "true", "yes", "on")):
        return {"tensor_parallel": True}
    if isinstance(spec, int):
        return {"tensor_parallel": spec}
    items = spec if isinstance(spec, (list, tuple)) else str(spec).split(",")
    try:
        idx = [int(str(x).strip()) for x in items]
    except ValueError:
        raise InvalidArgumentError(
            f'tensor_parallel must be "all", a rank count or GPU indices such as "0,1", got {spec!r}'
        ) from None
    if len(idx) == 1:
        return {"tensor_parallel": idx[0]}
    return {"tensor_parallel": True, "devices": idx}
