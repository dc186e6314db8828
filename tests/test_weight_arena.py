"""The weight arena (cpp/core/weight_arena.h): model loads sub-allocate their weights from a few slabs. On the CPU:
the allocator itself through _C.weight_arena_script (alignment, packing, reserve and overflow, popping the top,
the bypass, slabs freed with their last tensor, the env switch), then model loads (a CPU EXL2 load's arena holds
exactly the model's tensors, freeing the model frees the slabs, logits identical with the arena on and off, tensor
parallel too). On the GPU (marker cuda): less VRAM than per-tensor allocations, logits identical, no staging left."""

from __future__ import annotations

import gc

import exl2cpp
import numpy as np
import pytest
from exl2cpp import _C
from exl2cpp import options as exl2_options

ALIGN = 256
SLAB = 256 << 20
MiB = 1 << 20


def aligned(n: int) -> int:
    return max(1, -(-n // ALIGN)) * ALIGN


def stats() -> dict:
    gc.collect()
    return dict(_C.weight_arena_stats())


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


@pytest.fixture(autouse=True)
def arena_on(monkeypatch):
    exl2_options.set(weight_arena=True)


# ---- the allocator ----------------------------------------------------------------------------------------------


def test_bump_allocation_is_aligned_and_packed():
    sizes = [100, 1, 300, 0, 256, 257, 4097]
    base = stats()
    out = _C.weight_arena_script("cpu", 0, [f"a{n}" for n in sizes] + ["s"])
    addrs = out["addrs"]
    assert all(a % ALIGN == 0 for a in addrs)
    assert np.diff(addrs).tolist() == [aligned(n) for n in sizes[:-1]]  # one slab, back to back
    d = delta(out["stats"][0], base)
    used = sum(aligned(n) for n in sizes)
    assert used == 256 + 256 + 512 + 256 + 256 + 512 + 4352
    assert d == {"slabs": 1, "slab_bytes": SLAB, "used_bytes": used, "live_bytes": used, "live_allocs": len(sizes),
                 "overflow_slabs": 0}
    # The scope has ended, the tensors are alive: the slab with them. Once they are gone, so is the slab.
    assert delta(out["stats"][1], base)["slabs"] == 1
    assert delta(stats(), base) == {k: 0 for k in base}


def test_reserve_is_one_slab_then_overflow_slabs_of_their_own_size():
    base = stats()
    # reserve 10000 -> one slab of 12288 (the CPU granule is 4 KiB): three 4000-byte tensors (4096 each) fill it.
    out = _C.weight_arena_script("cpu", 10000, ["a4000", "a4000", "a4000", "s", "a5000", "s", "a10", "s"])
    a = out["addrs"]
    s1, s2, s3 = (delta(x, base) for x in out["stats"][:3])
    assert s1["slabs"] == 1 and s1["slab_bytes"] == 12288 and s1["used_bytes"] == 12288
    assert a[1] - a[0] == 4096 and a[2] - a[1] == 4096
    # the reserve is spent: 5000 bytes (5120 aligned) get a slab of 8192; the next small one fills its tail
    assert s2["slabs"] == 2 and s2["slab_bytes"] == 12288 + 8192 and s2["overflow_slabs"] == 1
    assert s3["slabs"] == 2 and a[4] - a[3] == 5120
    assert delta(stats(), base)["slabs"] == 0


def test_a_large_request_gets_its_own_slab_and_later_ones_return_to_the_first():
    base = stats()
    out = _C.weight_arena_script("cpu", 0, ["a100", f"a{SLAB + 1}", "a100", "s"])
    a = out["addrs"]
    d = delta(out["stats"][0], base)
    assert d["slabs"] == 2 and d["slab_bytes"] == SLAB + (-(-(SLAB + 1) // 4096)) * 4096
    assert a[2] - a[0] == 256  # first fit: the third tensor follows the first in the first slab


def test_freeing_the_top_allocation_pops_it_and_below_the_top_does_not():
    base = stats()
    out = _C.weight_arena_script("cpu", 0, ["a1000", "f0", "a1000", "s", "a300", "f1", "s", "a10", "s"])
    a = out["addrs"]
    assert a[1] == a[0]  # the staging tensor freed at the top: the next allocation reuses its space
    s1, s2, s3 = (delta(x, base) for x in out["stats"][:3])
    assert s1["used_bytes"] == 1024 and s1["live_bytes"] == 1024 and s1["live_allocs"] == 1
    assert s2["used_bytes"] == 1024 + 512 and s2["live_bytes"] == 512  # freed below the top: lost until the slab goes
    assert s3["used_bytes"] == 1024 + 512 + 256 and a[3] - a[2] == 512


def test_bypass_allocations_are_not_in_the_arena():
    base = stats()
    out = _C.weight_arena_script("cpu", 0, ["a64", "b5000", "a64", "s"])
    d = delta(out["stats"][0], base)
    assert d["live_allocs"] == 2 and d["used_bytes"] == 512
    assert out["addrs"][2] - out["addrs"][0] == 256


def test_a_scope_covers_its_device_only():
    base = stats()
    out = _C.weight_arena_script("cuda:0", 1 << 30, ["c100", "c100", "s"])  # CPU tensors inside a cuda:0 scope
    d = delta(out["stats"][0], base)
    assert d["slabs"] == 0 and d["live_allocs"] == 0
    assert delta(_C.weight_arena_script("cpu", 0, ["c100", "s"])["stats"][0], base)["live_allocs"] == 1


def test_weight_arena_option():
    base = stats()
    exl2_options.set(weight_arena=False)
    out = _C.weight_arena_script("cpu", 0, ["a100", "a100", "s"])
    assert delta(out["stats"][0], base)["slabs"] == 0 and delta(out["stats"][0], base)["live_allocs"] == 0
    with pytest.raises(exl2cpp.InvalidArgumentError, match="weight_arena must be true or false"):
        exl2_options.set(weight_arena="2")
    exl2_options.set(weight_arena=True)
    assert delta(_C.weight_arena_script("cpu", 0, ["a1", "s"])["stats"][0], base)["slabs"] == 1


# ---- model loads (CPU) -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quant_models():
    from conftest_exl2 import assemble_fixture_models

    return assemble_fixture_models()


def cpu_exl2_expected_bytes(folder, max_seq_len: int) -> int:
    """What a CPU load of an EXL2 model allocates: each linear dequantized to f16 [out, in] (+ f32 bias), f16/bf16
    norms converted to f32 (f32 norms and the embedding stay mapped), the RoPE table f32 [max_seq_len, head_dim]."""
    c = _C.load_config(str(folder))
    H, I, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = c["head_dim"]
    nq, nkv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    shapes = {"q_proj": (nq, H), "k_proj": (nkv, H), "v_proj": (nkv, H), "o_proj": (H, nq), "gate_proj": (I, H),
              "up_proj": (I, H), "down_proj": (H, I)}
    names = _C.safetensors_names(str(folder))
    total = aligned(max_seq_len * hd * 4)
    for name in names:
        if name.endswith(".q_weight"):
            prefix = name[: -len(".q_weight")]
            out, inp = (V, H) if prefix == "lm_head" else shapes[prefix.rsplit(".", 1)[1]]
            total += aligned(out * inp * 2)
            if prefix + ".bias" in names:
                total += aligned(out * 4)
        elif name.endswith("norm.weight"):
            if _C.read_tensor(str(folder), name).dtype != np.float32:
                total += aligned(H * 4)
    return total


def test_cpu_exl2_load_holds_exactly_its_tensors_and_frees_them(quant_models):
    folder = quant_models / "q40"
    base = stats()
    model = exl2cpp.load(folder, device="cpu", max_seq_len=256)
    d = delta(stats(), base)
    expected = cpu_exl2_expected_bytes(folder, 256)
    assert d["live_bytes"] == expected
    assert d["used_bytes"] == expected  # no staging tensor left below a slab's top
    assert 1 <= d["slabs"] <= -(-expected // SLAB) + 1
    del model
    assert delta(stats(), base) == {k: 0 for k in base}


def test_cpu_logits_identical_with_the_arena_on_and_off(quant_models, monkeypatch):
    ids = list(range(5, 60))
    on = exl2cpp.load(quant_models / "q40", device="cpu", max_seq_len=256)
    assert stats()["slabs"] >= 1
    exl2_options.set(weight_arena="0")
    base = stats()
    off = exl2cpp.load(quant_models / "q40", device="cpu", max_seq_len=256)
    assert delta(stats(), base)["slabs"] == 0
    np.testing.assert_array_equal(on.forward(ids), off.forward(ids))


def test_cpu_tiny_dense_model_with_biases_on_and_off(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from test_models_hf import make_hf_model

    make_hf_model("qwen2", {}, tmp_path, dtype=torch.float16)  # f16 norms and biases: converted into the arena
    ids = np.random.default_rng(5).integers(0, 211, size=70).tolist()
    base = stats()
    on = exl2cpp.load(tmp_path, device="cpu")
    assert delta(stats(), base)["live_allocs"] > 0
    ref = on.forward(ids)
    exl2_options.set(weight_arena="0")
    np.testing.assert_array_equal(exl2cpp.load(tmp_path, device="cpu").forward(ids), ref)
    del on
    assert delta(stats(), base)["slabs"] == 0


def test_cpu_tensor_parallel_on_and_off(quant_models, monkeypatch):
    ids = list(range(7, 40))
    base = stats()
    tp = exl2cpp.load(quant_models / "q40", device="cpu", tensor_parallel=3, max_seq_len=128)
    d = delta(stats(), base)
    assert d["slabs"] >= 3 and d["used_bytes"] == d["live_bytes"]  # a scope per rank, one for rank 0's head
    on = tp.forward(ids)
    exl2_options.set(weight_arena="0")
    off = exl2cpp.load(quant_models / "q40", device="cpu", tensor_parallel=3, max_seq_len=128).forward(ids)
    np.testing.assert_array_equal(on, off)
    del tp
    assert delta(stats(), base)["slabs"] == 0


# ---- the GPU -----------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(getattr(_C, "cuda_device_count", lambda: 0)() == 0, reason="no CUDA device")


def gpu_used() -> int:
    gc.collect()
    free, total = _C.cuda_mem_info(0)
    return total - free


def load_and_measure(folder, **kw):
    before = gpu_used()
    m = exl2cpp.load(folder, device="cuda", **kw)
    return m, gpu_used() - before


@pytest.mark.cuda
@cuda
def test_gpu_dense_model_uses_less_vram_and_identical_logits(tmp_path, monkeypatch):
    """Linears of 1024 x 1056 .. 2112 x 1056 f16 (2.06 .. 4.25 MiB: the driver rounds each up to 4 or 6 MiB), 8 layers."""
    pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from test_models_hf import make_hf_model

    make_hf_model("llama", {"hidden_size": 1056, "intermediate_size": 2112, "num_hidden_layers": 8,
                            "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 128},
                  tmp_path, dtype=torch.float16)
    ids = list(range(3, 90))
    warm = exl2cpp.load(tmp_path, device="cuda", max_seq_len=256)  # the process's one-time CUDA state first
    warm.forward(ids)
    del warm
    exl2_options.set(weight_arena="0")
    off, used_off = load_and_measure(tmp_path, max_seq_len=256)
    ref = off.forward(ids)
    del off
    exl2_options.set(weight_arena="1")
    base = stats()
    on, used_on = load_and_measure(tmp_path, max_seq_len=256)
    d = delta(stats(), base)
    print(f"\nVRAM of the load: arena off {used_off / MiB:.1f} MiB, on {used_on / MiB:.1f} MiB; arena {d}")
    # the reserve is exact: one slab, its 2 MiB rounding the only slack
    assert d["used_bytes"] == d["live_bytes"] and d["overflow_slabs"] == 0 and d["slabs"] == 1
    assert d["slab_bytes"] - d["live_bytes"] < 2 * MiB
    assert used_on < used_off - 32 * MiB  # 56 linears save 1.5 .. 1.9 MiB each
    np.testing.assert_array_equal(on.forward(ids), ref)


@pytest.mark.cuda
@cuda
def test_gpu_exl2_load_no_staging_in_the_arena_and_identical_logits(quant_models, monkeypatch, capsys):
    ids = list(range(5, 60))
    warm = exl2cpp.load(quant_models / "q40", device="cuda", max_seq_len=1024)  # one-time CUDA state first
    warm.forward(ids)
    del warm
    exl2_options.set(weight_arena="0")
    off, used_off = load_and_measure(quant_models / "q40", max_seq_len=1024)
    ref = off.forward(ids)
    del off
    exl2_options.set(weight_arena="1")
    base = stats()
    on, used_on = load_and_measure(quant_models / "q40", max_seq_len=1024)
    d = delta(stats(), base)
    with capsys.disabled():
        print(f"\nq40 VRAM of the load: arena off {used_off / MiB:.1f} MiB, on {used_on / MiB:.1f} MiB; arena {d}")
    assert d["used_bytes"] == d["live_bytes"]  # exl2_upload's staging bypassed the arena
    # the reserve (cuda::exl2_upload_bytes for the EXL2 linears) is exact: one slab, its 2 MiB rounding the only slack
    assert d["overflow_slabs"] == 0 and d["slabs"] == 1 and d["slab_bytes"] - d["live_bytes"] < 2 * MiB
    assert used_on <= used_off
    np.testing.assert_array_equal(on.forward(ids), ref)
    del on
    assert delta(stats(), base)["slabs"] == 0


@pytest.mark.cuda
@pytest.mark.skipif(getattr(_C, "cuda_device_count", lambda: 0)() < 2, reason="needs 2 CUDA devices")
def test_gpu_layer_split_one_exact_slab_per_device(quant_models, monkeypatch):
    folder = quant_models / "q40"
    n_layers = _C.load_config(str(folder))["num_hidden_layers"]
    devs = [0] * (n_layers // 2) + [1] * (n_layers - n_layers // 2)
    ids = list(range(5, 60))
    base = stats()
    on = exl2cpp.load(folder, device="cuda", layer_devices=devs, max_seq_len=1024)
    d = delta(stats(), base)
    assert d["slabs"] == 2 and d["overflow_slabs"] == 0 and d["used_bytes"] == d["live_bytes"]
    assert d["slab_bytes"] - d["live_bytes"] < 2 * 2 * MiB
    exl2_options.set(weight_arena="0")
    off = exl2cpp.load(folder, device="cuda", layer_devices=devs, max_seq_len=1024)
    np.testing.assert_array_equal(on.forward(ids), off.forward(ids))
    del on
    assert delta(stats(), base)["slabs"] == 0
