"""The source model for the converter: an unquantized HF model folder, its layout as the runtime's decoder spec
gives it (tensor names, each layer's linear tensors with their modules and shared inputs) and its weights read as
fp32. The forward is the runtime's own: :meth:`SourceModel.calibration` makes a ``_C.Calibration`` (the decoder
body one layer at a time over calibration states in fp32, with capture hooks on the linears;
cpp/model/calibration.h), so every architecture the runtime registers converts with no code here.

Measurement groups: a layer's linears are measured in groups keyed ``<layer prefix>.<module>`` (the first part of
the linear's name in the layer: ``model.layers.3.self_attn``, ``model.layers.3.mlp``), as ExLlamaV2's
measurement.json keys them; a group's option table follows its linears' roles (attention: q/k/v/o, MLP:
gate/up/down; a fused tensor takes its first part's column). A MoE layer's experts are one group
``<layer prefix>.block_sparse_moe`` for every family (ExLlamaV2's key, also for Qwen3-MoE's ``mlp.experts``) with
roles w1 / w3 / w2, one config per role for all experts; Qwen2-MoE's shared expert is the layer's ``mlp`` group
(gate/up/down). The router and the shared expert's gate are not quantized: they run in the calibration forward
(the router's input is the layer's MoE input) and are written as the file stores them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .. import _C
from ..errors import ModelFileError, ModelFormatError, UnsupportedError
from .qparams import ATTN_PROJS, EXPERT_PROJS, MLP_PROJS

PROBE_TOKENS = 16  # a minimal Calibration reads the model's layout (states for one row of 16 tokens)


def _f32(a: np.ndarray) -> np.ndarray:
    if a.dtype == np.uint16:  # bf16 bits
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def group_kind(roles) -> str:
    """"self_attn", "mlp" or "block_sparse_moe": the option table (qparams.block_options) of a group with these
    linear roles."""
    kinds = {"self_attn" if r in ATTN_PROJS else "mlp" if r in MLP_PROJS else "block_sparse_moe"
             if r in EXPERT_PROJS else None for r in roles}  # fmt: skip
    if len(kinds) != 1 or None in kinds:
        raise UnsupportedError(f"convert: a measurement group mixes or lacks known roles: {sorted(roles)}")
    return kinds.pop()


class SourceModel:
    """An unquantized HF model folder (config.json + *.safetensors in fp16/bf16/fp32) of any architecture the
    runtime registers."""

    def __init__(self, path: str | Path, device: str = "cpu"):
        self.path = Path(path)
        self.device = device
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
        probe = _C.Calibration(str(self.path), "cpu", 1, PROBE_TOKENS)  # the architecture's checks, its layout
        self.names = set(_C.safetensors_names(str(self.path)))
        self.tensor_names = probe.names
        self.n_layers = probe.n_layers
        self.hidden = probe.hidden
        self.vocab = self.config["vocab_size"]
        self.moe = probe.moe
        # every linear the forward runs (hook names), and the ones quantized (the router and shared gate are not)
        self.layer_inputs = [probe.linears(i) for i in range(self.n_layers)]
        self.layer_linears = [[d for d in li if d["quantized"]] for li in self.layer_inputs]
        self._info = [{d["name"]: d for d in li} for li in self.layer_inputs]
        head = self.tensor_names["head"]
        self.tied = head + ".weight" not in self.names
        self.head_name = head

    # -- layout ----------------------------------------------------------------------------------
    def linear_info(self, i: int) -> dict[str, dict]:
        """{name: {"name", "role", "input", "in", "out", "bias", "quantized"}} of every linear layer i runs (each
        expert's own), in file order."""
        return self._info[i]

    def group_key(self, i: int, name: str) -> str:
        """The measurement group of linear `name` of layer i: "<layers prefix><i>.<module>", for experts
        "<layers prefix><i>.block_sparse_moe"."""
        pre = f"{self.tensor_names['layers']}{i}."
        if not name.startswith(pre):
            raise ModelFormatError(f"convert: linear {name} is not under layer prefix {pre}")
        d = self._info[i].get(name)
        if d is not None and d["role"] in EXPERT_PROJS:
            return pre + "block_sparse_moe"
        return pre + name[len(pre) :].split(".")[0]

    def groups(self, i: int) -> dict[str, list[dict]]:
        """{group key: [linear info, ...]} of layer i, in file order."""
        out: dict[str, list[dict]] = {}
        for d in self.layer_linears[i]:
            out.setdefault(self.group_key(i, d["name"]), []).append(d)
        return out

    def shapes(self) -> dict[str, dict[str, tuple[int, int, bool, int]]]:
        """{group key: {role: (in, out, bias, count)}} over every layer (count: the linears of the role, the
        experts)."""
        out: dict = {}
        for i in range(self.n_layers):
            for k, g in self.groups(i).items():
                sh = out.setdefault(k, {})
                for d in g:
                    n = sh[d["role"]][3] + 1 if d["role"] in sh else 1
                    sh[d["role"]] = (d["in"], d["out"], d["bias"], n)
        return out

    # -- weights ---------------------------------------------------------------------------------
    def tensor(self, name: str) -> np.ndarray:
        if name not in self.names:
            raise ModelFormatError(f"convert: tensor {name} not found in {self.path}/*.safetensors")
        return _f32(_C.read_tensor(str(self.path), name, None, []))

    def maybe(self, name: str) -> np.ndarray | None:
        return self.tensor(name) if name in self.names else None

    def raw(self, name: str) -> np.ndarray:
        """A tensor as float16 (the EXL2 file stores embeddings and norms in fp16)."""
        return self.tensor(name).astype(np.float16)

    def head_weight(self) -> np.ndarray:
        return self.tensor(self.tensor_names["embed"] if self.tied else self.head_name + ".weight")

    # -- forward ---------------------------------------------------------------------------------
    def calibration(self, rows: int, tokens: int):
        """The runtime's calibration forward (_C.Calibration) for rows x tokens states on self.device."""
        return _C.Calibration(str(self.path), self.device, int(rows), int(tokens))
