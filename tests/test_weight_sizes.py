"""The CUDA loaders' weight sizes (cpp/model/graph.h weight_bytes_per_device / tp_weight_bytes, one walk over the
tensors feeding both): against a reference from the safetensors headers, on tiny dense models (tied head, biases, a
stray tensor) and the EXL2 fixture (CPU builds: an EXL2 linear counts q_weight + q_scale + f32 bias there). A load
sizes its weights once (Model::load's out-of-memory check and the graph's weight-arena reserves share the numbers):
_C.weight_sizing_walks counts the walks; CPU loads make none, a CUDA load exactly one (marker cuda)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

import exl2cpp
from exl2cpp import _C

ALIGN = 256
FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}


def aligned(n: int) -> int:
    return max(1, -(-n // ALIGN)) * ALIGN


def header(folder) -> dict:
    with open(folder / "model.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        h = json.loads(f.read(n))
    h.pop("__metadata__", None)
    return h


def reference_buckets(folder, max_seq_len: int):
    """(per-layer bytes, stray, head, other, rope) as the loaders place them, each tensor 256-byte aligned: float
    tensors f16 on the device except norms and biases (f32); an EXL2 linear q_weight + q_scale + f32 bias (a build
    without the CUDA EXL2 kernels), its other tensors 0."""
    c = _C.load_config(str(folder))
    h = header(folder)
    n_layers = c["num_hidden_layers"]
    layer, stray, head, other = [0] * n_layers, 0, 0, 0
    exl2_parts = (".q_weight", ".q_scale", ".q_scale_max", ".q_groups", ".q_invperm", ".q_perm", ".bias")
    own_head = False
    for name, t in h.items():
        numel = int(np.prod(t["shape"], dtype=np.int64))
        file_bytes = t["data_offsets"][1] - t["data_offsets"][0]
        part = next((s for s in exl2_parts if name.endswith(s) and name[: -len(s)] + ".q_weight" in h), None)
        if part == ".q_weight":
            p = name[: -len(".q_weight")]
            qs = h[p + ".q_scale"]["data_offsets"]
            b = aligned(file_bytes) + aligned(qs[1] - qs[0])
            if p + ".bias" in h:
                b += aligned(int(np.prod(h[p + ".bias"]["shape"])) * 4)
        elif part is not None:
            b = 0
        elif t["dtype"] not in FLOAT_DTYPES:
            b = aligned(file_bytes)
        else:
            b = aligned(numel * (4 if name.endswith("norm.weight") or name.endswith(".bias") else 2))
        if name.startswith("model.layers."):
            i = int(name.split(".")[2])
            if 0 <= i < n_layers:
                layer[i] += b
            else:
                stray += b
        elif name.startswith("lm_head.") or name == "model.norm.weight":
            head += b
            own_head = own_head or name.startswith("lm_head.")
        else:
            other += b
    if not own_head:
        head += aligned(c["vocab_size"] * c["hidden_size"] * 2)
    rope = aligned(max_seq_len * c["head_dim"] * 4)
    return layer, stray, head, other, rope


def reference_per_device(folder, max_seq_len, layer_devices=(), head_device=-1, device=0):
    layer, stray, head, other, rope = reference_buckets(folder, max_seq_len)
    devs = list(layer_devices) or [device] * len(layer)
    head_dev = head_device if head_device >= 0 else (devs[-1] if devs else device)
    need = [0] * (max([device, head_dev, *devs]) + 1)
    for d, b in zip(devs, layer):
        need[d] += b
    need[head_dev] += head
    need[device] += other + stray + rope
    return [n + rope if n and d != device else n for d, n in enumerate(need)]


def reference_tp(folder, max_seq_len, T):
    layer, stray, head, other, rope = reference_buckets(folder, max_seq_len)
    return [(sum(layer) + stray) // T + other + rope] * T, head


@pytest.fixture(scope="module")
def dense_models(tmp_path_factory):
    """Tiny f16 models of 4 layers: untied; tied with biases (qwen2); untied with biases and a stray tensor of a
    layer index the config does not have (an i32 one: sized as its file bytes)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from safetensors.numpy import load_file, save_file
    from test_models_hf import make_hf_model

    out = {}
    for kind in ("llama", "qwen2", "llama_bias"):
        path = tmp_path_factory.mktemp(f"sizes_{kind}")
        make_hf_model(kind, {"num_hidden_layers": 4}, path, dtype=torch.float16, seed=3)
        out[kind] = path
    f = out["llama_bias"] / "model.safetensors"
    tensors = load_file(str(f))
    tensors["model.layers.7.extra"] = np.arange(1000, dtype=np.int32)
    tensors["model.layers.7.extra_f"] = np.ones((33, 5), np.float16)
    save_file(tensors, str(f), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def quant_models():
    from conftest_exl2 import assemble_fixture_models

    return assemble_fixture_models()


PLACEMENTS = [  # (layer_devices, head_device, device)
    ((), -1, 0),
    ((), -1, 2),
    ((0, 0, 1, 1), -1, 0),
    ((0, 1, 1, 0), 2, 0),
    ((1, 1, 1, 1), -1, 0),  # the embedding alone on device 0
    ((2, 2, 3, 3), 1, 0),
]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama_bias"])
def test_dense_sizes_match_the_header_reference(dense_models, kind):
    folder = dense_models[kind]
    for seq in (1, 100, 4096):
        for layer_devices, head_device, device in PLACEMENTS:
            per, head = _C.weight_load_bytes(str(folder), seq, list(layer_devices), head_device, device)
            assert head == 0
            assert per == reference_per_device(folder, seq, layer_devices, head_device, device), (layer_devices, seq)
        for T in (1, 2, 3, 4):
            per, head = _C.weight_load_bytes(str(folder), seq, tp=T)
            assert (per, head) == reference_tp(folder, seq, T), (T, seq)


def test_hand_computed_single_device_llama(dense_models):
    """llama, 4 layers of H=96, I=160, 6 q heads, 2 KV heads of 16, vocab 211: every tensor under 256 bytes rounds
    up, so the sum is countable by hand."""
    a = aligned
    H, I, V, kv = 96, 160, 211, 32
    per_layer = 2 * a(H * 4) + 2 * a(H * H * 2) + 2 * a(kv * H * 2) + 3 * a(I * H * 2)
    embed, head = a(V * H * 2), a(V * H * 2) + a(H * 4)
    rope = a(64 * 16 * 4)
    per, _ = _C.weight_load_bytes(str(dense_models["llama"]), 64)
    assert per == [4 * per_layer + embed + head + rope]
    tp, head_tp = _C.weight_load_bytes(str(dense_models["llama"]), 64, tp=2)
    assert tp == [2 * per_layer + embed + rope] * 2 and head_tp == head


def test_stray_layer_tensors_go_to_the_model_device_or_the_tp_layers(dense_models):
    folder = dense_models["llama_bias"]
    stray = aligned(1000 * 4) + aligned(33 * 5 * 2)
    assert reference_buckets(folder, 8)[1] == stray
    base, _ = _C.weight_load_bytes(str(dense_models["llama_bias"]), 8, [1, 1, 1, 1], -1, 0)
    layer, _, head, other, rope = reference_buckets(folder, 8)
    assert base == [other + stray + rope, sum(layer) + head + rope]


def test_exl2_sizes_match_the_header_reference(quant_models):
    if _C.cuda_compiled():
        pytest.skip("the CUDA build sizes EXL2 linears by their upload layout (exact there, not from the header)")
    for tag in ("q25", "q40"):
        folder = quant_models / tag
        n = _C.load_config(str(folder))["num_hidden_layers"]
        for seq in (16, 2048):
            per, _ = _C.weight_load_bytes(str(folder), seq)
            assert per == reference_per_device(folder, seq)
            devs = [0] * (n // 2) + [1] * (n - n // 2)
            per, _ = _C.weight_load_bytes(str(folder), seq, devs, 2)
            assert per == reference_per_device(folder, seq, devs, 2)
            for T in (2, 3):
                assert _C.weight_load_bytes(str(folder), seq, tp=T) == reference_tp(folder, seq, T)


def test_one_device_equals_one_rank_plus_head(quant_models):
    """Both functions from the same walk: a single device holds what tensor parallel over one rank does plus the head
    (either build: the EXL2 layers' sizes cancel)."""
    folder = quant_models / "q40"
    (one,), _ = _C.weight_load_bytes(str(folder), 512)
    (rank,), head = _C.weight_load_bytes(str(folder), 512, tp=1)
    assert one == rank + head and head > 0


def test_each_call_is_one_walk_and_cpu_loads_make_none(quant_models):
    folder = quant_models / "q40"
    w0 = _C.weight_sizing_walks()
    _C.weight_load_bytes(str(folder), 64)
    _C.weight_load_bytes(str(folder), 64, tp=3)
    assert _C.weight_sizing_walks() == w0 + 2
    exl2cpp.load(folder, device="cpu", max_seq_len=64)
    exl2cpp.load(folder, device="cpu", tensor_parallel=3, max_seq_len=64)
    assert _C.weight_sizing_walks() == w0 + 2  # CPU loads reserve no arena and check no device memory


# ---- the GPU -----------------------------------------------------------------------------------------------------

n_gpus = getattr(_C, "cuda_device_count", lambda: 0)()


@pytest.mark.cuda
@pytest.mark.skipif(n_gpus == 0, reason="no CUDA device")
def test_gpu_load_sizes_once(quant_models):
    """One walk per CUDA load (before: the OOM check and the arena reserve each made one, the EXL2 layers' tables
    built for both), and the reserve is still exact: one slab, no overflow."""
    folder = quant_models / "q40"
    w0 = _C.weight_sizing_walks()
    s0 = dict(_C.weight_arena_stats())
    m = exl2cpp.load(folder, device="cuda", max_seq_len=256)
    s1 = dict(_C.weight_arena_stats())
    assert _C.weight_sizing_walks() == w0 + 1
    assert s1["overflow_slabs"] == s0["overflow_slabs"] and s1["slabs"] - s0["slabs"] == 1
    del m


@pytest.mark.cuda
@pytest.mark.skipif(n_gpus < 2, reason="needs 2 CUDA devices")
def test_gpu_split_and_tensor_parallel_loads_size_once(quant_models):
    folder = quant_models / "q40"
    n = _C.load_config(str(folder))["num_hidden_layers"]
    w0 = _C.weight_sizing_walks()
    m = exl2cpp.load(folder, device="cuda", layer_devices=[0] * (n // 2) + [1] * (n - n // 2), max_seq_len=256)
    assert _C.weight_sizing_walks() == w0 + 1
    del m
    m = exl2cpp.load(folder, device="cuda", tensor_parallel=2, max_seq_len=256)
    assert _C.weight_sizing_walks() == w0 + 2
    del m
