"""Writes the converted model folder as ExLlamaV2 does (spec §1.1, §1.9, §1.10): output.safetensors or
output-0000i-of-0000N.safetensors shards of at most --shard-size MB (no index file), every non-weight file of the
source folder copied, and config.json with a ``quantization_config``."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack")
SKIP_NAMES = {"model.safetensors.index.json", "pytorch_model.bin.index.json", "measurement.json"}


def _new_file_mode() -> int:
    """The mode open() gives a new file here (0666 less the umask), read without changing the umask."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except OSError:
        pass
    return 0o644


def save_safetensors(tensors: dict[str, np.ndarray], path: Path, metadata: dict[str, str] | None = None) -> None:
    """save_file through a temporary file, renamed into place, with the mode of any new file (save_file alone
    creates it 0600)."""
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.chmod(tmp, _new_file_mode())
    tmp.replace(path)


def shard_tensors(tensors: dict[str, np.ndarray], shard_mb: float) -> list[dict[str, np.ndarray]]:
    """Split (in insertion order) into shards of at most shard_mb MB (a tensor larger than that gets its own)."""
    limit = shard_mb * 1024 * 1024
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for k, v in tensors.items():
        if shards[-1] and size + v.nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += v.nbytes
    return shards


def write_output(out_dir: Path, src_dir: Path, tensors: dict[str, np.ndarray], shard_mb: float,
                 qconfig: dict) -> list[Path]:  # fmt: skip
    shards = shard_tensors(tensors, shard_mb)
    n = len(shards)
    paths = []
    for i, shard in enumerate(shards):
        name = "output.safetensors" if n == 1 else f"output-{i + 1:05d}-of-{n:05d}.safetensors"
        save_safetensors({k: np.ascontiguousarray(v) for k, v in shard.items()}, out_dir / name, {"format": "pt"})
        paths.append(out_dir / name)
    for f in sorted(src_dir.iterdir()):
        if not f.is_file() or f.name in SKIP_NAMES or f.name.lower().endswith(WEIGHT_SUFFIXES):
            continue
        if f.name == "config.json":
            cfg = json.loads(f.read_text(encoding="utf-8"))
            cfg["quantization_config"] = qconfig
            (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
        else:
            shutil.copyfile(f, out_dir / f.name)
    return paths
