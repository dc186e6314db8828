"""Tensor parallel (exl2cpp/tensor_parallel.py, cpp/model/tensor_parallel.h, cuda/nccl.h).

CPU part (always runs): the shard plan (hand-computed cases and errors), the EXL2 column slice against the NumPy
reference dequantizer on the real fixture quants (every rank's slice is exactly its block of the full weight, and
the blocks concatenate to it), and the whole sharded graph on N virtual CPU ranks (a memcpy all-gather) against the
unsharded model: logits of prefill and decode steps, fp32 and q8 caches, dense (Llama, Qwen2 biases, Qwen3
qk-norm) and EXL2 weights, the engine, info() and the clear errors.
GPU part (marker `cuda2`, skipped unless 2+ CUDA GPUs are visible): NCCL tensor parallel over two GPUs against one
GPU (logits, greedy tokens, engine batch, EXL2, quantized cache), and bad configurations."""

from __future__ import annotations

import itertools
import json
import os

import exl2cpp
import numpy as np
import pytest
from exl2cpp import _C
from exl2cpp import options as exl2_options
from exl2cpp.errors import InternalError, InvalidArgumentError
from exl2cpp.tensor_parallel import (
    ShardPlan,
    find_nccl_library,
    plan_tensor_parallel,
    resolve_devices,
    slice_exl2_columns,
)
from test_multigpu import (  # noqa: F401 (nested_models: a fixture)
    N_GPUS,
    assert_same_engine_batch,
    assert_same_greedy,
    greedy_pair,
    nested_models,
    rel_l2,
    run_core,
)

LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
             "num_hidden_layers": 32, "vocab_size": 128256}  # fmt: skip
SMOL = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64}  # fmt: skip
TINY = {
    "hidden_size": 96,
    "intermediate_size": 160,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
}


# ---- the shard plan ---------------------------------------------------------------------------------------------


def test_plan_llama3_8b_over_two_by_hand():
    p = plan_tensor_parallel(LLAMA3_8B, 2, exl2=True)
    assert p == ShardPlan(ranks=2, q_heads=16, kv_heads=4, q_cols=2048, kv_cols=512, inter_cols=7168,
                          hidden_cols=2048)  # fmt: skip
    assert p.columns("model.layers.3.self_attn.k_proj", 1) == (512, 1024)
    assert p.columns("mlp.gate_proj", 1) == (7168, 14336)
    assert p.columns("self_attn.o_proj", 0) == (0, 2048)
    assert p.columns("mlp.down_proj", 1) == (2048, 4096)


@pytest.mark.parametrize("ranks", [1, 3])
def test_plan_columns_tile_every_linear(ranks):
    p = plan_tensor_parallel(SMOL, ranks, exl2=True)
    full = {"q_proj": 576, "k_proj": 192, "v_proj": 192, "o_proj": 576, "gate_proj": 1536, "up_proj": 1536,
            "down_proj": 576}  # fmt: skip
    for name, out in full.items():
        spans = [p.columns(name, r) for r in range(ranks)]
        assert spans[0][0] == 0 and spans[-1][1] == out, name
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans)), name
    # GQA groups stay whole: rank r's q heads are exactly those whose KV head it holds.
    group = SMOL["num_attention_heads"] // SMOL["num_key_value_heads"]
    for r in range(ranks):
        q_heads = range(r * p.q_heads, (r + 1) * p.q_heads)
        assert {h // group for h in q_heads} == set(range(r * p.kv_heads, (r + 1) * p.kv_heads))


@pytest.mark.parametrize(
    "config, ranks, exl2, words",
    [
        (SMOL, 2, False, "num_key_value_heads = 3 is not divisible by 2"),
        (LLAMA3_8B, 3, False, "num_key_value_heads = 8 is not divisible by 3"),
        (dict(SMOL, num_key_value_heads=9, hidden_size=577), 3, False, "hidden_size = 577"),
        (dict(SMOL, intermediate_size=1537), 3, False, "intermediate_size = 1537"),
        (TINY, 2, True, "multiples of 32"),
        (SMOL, 0, False, "positive number of ranks"),
        (SMOL, True, False, "positive number of ranks"),
    ],
)
def test_plan_rejects(config, ranks, exl2, words):
    with pytest.raises(InvalidArgumentError, match=words):
        plan_tensor_parallel(config, ranks, exl2=exl2)


def test_plan_dense_needs_no_alignment():
    p = plan_tensor_parallel(TINY, 2)
    assert (p.q_cols, p.kv_cols, p.inter_cols, p.hidden_cols) == (48, 16, 80, 48)


# ---- EXL2 column slices against the NumPy reference ------------------------------------------------------------


@pytest.mark.parametrize("tag", ["q25", "q40", "q60"])
def test_exl2_column_slices_are_exact_blocks(tag):
    from conftest_exl2 import layer, linear_prefixes, load_quant, np_dequantize, short

    tensors, config = load_quant(tag)
    plan = plan_tensor_parallel(config, 3, exl2=True)
    prefixes = [p for p in linear_prefixes(tensors) if p.startswith("model.layers.")]
    assert len(prefixes) == 28
    for prefix in prefixes[::3] + [prefixes[-1]]:  # every linear kind, several layers
        t = short(layer(tensors, prefix))
        out = t["q_weight"].shape[1]
        full = np_dequantize(t)
        blocks = []
        for r in range(3):
            c0, c1 = plan.columns(prefix, r)
            s = slice_exl2_columns(t, c0, c1)
            assert s["q_groups"] is t["q_groups"] and s["q_invperm"] is t["q_invperm"]
            w = np_dequantize(s)
            assert w.shape == (full.shape[0], c1 - c0)
            np.testing.assert_array_equal(
                w.view(np.uint16), full[:, c0:c1].view(np.uint16), err_msg=prefix
            )
            blocks.append(w)
        np.testing.assert_array_equal(
            np.concatenate(blocks, axis=1).view(np.uint16), full[:, :out].view(np.uint16)
        )
        # the sharded matmul, concatenated, is the full matmul
        x = np.random.default_rng(0).standard_normal((5, full.shape[0])).astype(np.float32)
        ref = x @ full.astype(np.float32)
        got = np.concatenate([x @ b.astype(np.float32) for b in blocks], axis=1)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)


def test_exl2_column_slice_rejects_misaligned():
    from conftest_exl2 import layer, load_quant, short

    tensors, _ = load_quant("q40")
    t = short(layer(tensors, "model.layers.0.mlp.up_proj"))
    for c0, c1 in ((8, 40), (0, 40), (0, 0), (1536, 1568), (-32, 32)):
        with pytest.raises(InvalidArgumentError, match="multiples of 32"):
            slice_exl2_columns(t, c0, c1)


# ---- device selection and NCCL lookup ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tp, devices, device, n, want",
    [
        (3, None, "cpu", 0, ["cpu"] * 3),
        (True, None, "cuda", 2, ["cuda:0", "cuda:1"]),
        (True, None, "cuda", 4, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]),
        (2, None, "cuda", 4, ["cuda:0", "cuda:1"]),
        (True, [1, 0], "cuda", 2, ["cuda:1", "cuda:0"]),
        (True, [0], "cuda", 1, ["cuda:0"]),
        (2, (2, 3), "cuda:0", 4, ["cuda:2", "cuda:3"]),
    ],
)
def test_resolve_devices(tp, devices, device, n, want):
    assert resolve_devices(tp, devices, device, n) == want


@pytest.mark.parametrize(
    "tp, devices, device, n, words",
    [
        (True, None, "cpu", 0, "give their number"),
        (2, [0, 1], "cpu", 0, "on the CPU"),
        (True, None, "cuda:1", 2, 'device="cuda"'),
        (True, None, "cuda", 0, "none is visible"),
        (True, None, "cuda", 1, "needs 2 or more GPUs, 1 visible"),
        (3, None, "cuda", 2, "only 2 CUDA GPU"),
        (True, [0, 2], "cuda", 2, r"indices in \[0, 2\)"),
        (True, [1, 1], "cuda", 2, "twice"),
        (3, [0, 1], "cuda", 2, "devices lists 2"),
        (True, ["a"], "cuda", 2, "list of CUDA indices"),
        (0, None, "cuda", 2, "True or a number"),
        ("2", None, "cuda", 2, "True or a number"),
    ],
)
def test_resolve_devices_rejects(tp, devices, device, n, words):
    with pytest.raises(InvalidArgumentError, match=words):
        resolve_devices(tp, devices, device, n)


def test_find_nccl_library(tmp_path, monkeypatch):
    lib = tmp_path / "site" / "nvidia" / "nccl" / "lib"
    lib.mkdir(parents=True)
    (lib / "libnccl.so.2").write_bytes(b"")
    monkeypatch.delenv("NCCL_LIBRARY", raising=False)
    monkeypatch.setattr("sys.path", ["/nonexistent", str(tmp_path / "site")])
    assert find_nccl_library() == str(lib / "libnccl.so.2")
    monkeypatch.setenv("NCCL_LIBRARY", "/opt/x/libnccl.so.2")
    assert find_nccl_library() == "/opt/x/libnccl.so.2"
    monkeypatch.delenv("NCCL_LIBRARY")
    monkeypatch.setattr("sys.path", [str(tmp_path / "empty")])
    assert find_nccl_library() is None


# ---- the sharded graph on virtual CPU ranks ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def fixture_models():
    from conftest_exl2 import assemble_fixture_models

    return assemble_fixture_models()


@pytest.fixture(scope="module")
def fixture_ids():
    from conftest_exl2 import require_fixtures

    return np.load(require_fixtures() / "fx_logits.npz")["ids"].astype(np.int64).tolist()


@pytest.fixture(params=["sequential", "threads"])
def executor(request, monkeypatch):
    """Both executors of the sharded step: one host thread over all ranks, or one thread per rank."""
    exl2_options.set(tp_threads="1" if request.param == "threads" else "0")
    return request.param


@pytest.mark.parametrize("tag, ranks", [("q40", 3), ("q25", 3), ("q60", 1)])
def test_cpu_ranks_match_unsharded_exl2(fixture_models, fixture_ids, tag, ranks, executor):
    """Column-split shards over virtual ranks compute every output from the same dot products as the unsharded
    model, so the CPU logits agree to float rounding (in practice bit for bit)."""
    one = exl2cpp.load(fixture_models / tag, device="cpu")
    tp = exl2cpp.load(fixture_models / tag, device="cpu", tensor_parallel=ranks)
    assert tp.tensor_parallel == ["cpu"] * ranks and not tp.split
    ids = fixture_ids[:96]
    assert rel_l2(tp.forward(ids, chunk_size=40), one.forward(ids, chunk_size=40)) < 1e-6
    a, _ = run_core(one._core, ids[:30])
    b, cache = run_core(tp._core, ids[:30])
    assert cache.tp == ranks and cache.n_layers == 4
    assert rel_l2(b, a) < 1e-6


def test_cpu_ranks_quantized_cache_and_multi_sequence_batch(fixture_models, fixture_ids, executor):
    one = exl2cpp.load(fixture_models / "q40", device="cpu")
    tp = exl2cpp.load(fixture_models / "q40", device="cpu", tensor_parallel=3)
    a, _ = run_core(one._core, fixture_ids[:40], cache_type="q8")
    b, cache = run_core(tp._core, fixture_ids[:40], cache_type="q8")
    assert cache.cache_type == "q8" and cache.tp == 3
    assert rel_l2(b, a) < 1e-6
    # Two sequences in one step, mixed prefill and logit rows picked.
    for core in (one._core, tp._core):
        cache = core.make_cache(256, 16, "auto")
        pages = cache.pool.alloc(4)
        ids = fixture_ids[:20] + fixture_ids[50:63]
        pos = list(range(20)) + list(range(13))
        seq = [0] * 20 + [1] * 13
        out = core.forward(cache, ids, pos, seq, pages, 2, [19, 32, 5])
        if core is one._core:
            ref = out
    assert out.shape == (3, 8192) and rel_l2(out, ref) < 1e-6


def test_cpu_threads_executor_runs_one_thread_per_rank(fixture_models, fixture_ids, monkeypatch):
    """Option tp_threads starts ranks - 1 worker threads (rank 0 runs on the caller) and gives the same logits."""
    tp = exl2cpp.load(fixture_models / "q40", device="cpu", tensor_parallel=3)
    ids = fixture_ids[:40]
    exl2_options.set(tp_threads="0")
    a = tp.forward(ids)
    before = len(os.listdir("/proc/self/task"))
    exl2_options.set(tp_threads="1")
    b = tp.forward(ids)
    assert len(os.listdir("/proc/self/task")) == before + 2
    np.testing.assert_array_equal(a, b)


def test_cpu_threads_executor_warms_up_each_shape_on_one_thread(fixture_models, fixture_ids, monkeypatch):
    """The threaded executor runs a step shape (rows, pages per sequence, page size, cache bits) on the rank threads
    only after one step of that shape ran on one thread (on CUDA that step grows the lazily sized buffers and loads
    the kernels, which must never happen on a rank thread between collectives: the issue-8 hang), and a quantized
    cache only once its K centring is fixed. Observable here: the worker threads start with the second step of a
    shape, never the first; the logits are the same either way."""
    exl2_options.set(tp_threads="1")
    tp = exl2cpp.load(fixture_models / "q40", device="cpu", tensor_parallel=3)
    ids = fixture_ids[:33]
    before = len(os.listdir("/proc/self/task"))
    a = tp.forward(ids)  # a new shape: one thread
    b = tp.forward(ids[:20])  # another new shape: one thread
    assert len(os.listdir("/proc/self/task")) == before
    np.testing.assert_array_equal(tp.forward(ids), a)  # warm: the rank threads
    assert len(os.listdir("/proc/self/task")) == before + 2
    np.testing.assert_array_equal(tp.forward(ids[:20]), b)
    # q8 cache: a fresh cache fixes its K centring in its first step, so that step runs on one thread even when the
    # shape is warm; later steps of the shape on the threads. Same logits as the one-thread executor.
    core = tp._core
    outs = {}
    for mode in ("0", "1"):
        exl2_options.set(tp_threads=mode)
        cache = core.make_cache(64, 16, "q8")
        pages = cache.pool.alloc(3)
        steps = [core.forward(cache, ids, list(range(33)), [0] * 33, pages, 3)]
        steps += [core.forward(cache, [ids[k]], [33 + k], [0], pages, 3) for k in range(4)]
        outs[mode] = np.concatenate(steps)
    np.testing.assert_array_equal(outs["1"], outs["0"])


def test_cpu_threads_failure_on_one_rank_raises_and_recovers(fixture_models, fixture_ids, monkeypatch):
    """A rank that fails mid-step (option tp_test_fail_rank: after its first all-gather) aborts the collectives: the
    step raises that rank's error, the ranks waiting for it do not hang, and the next step works."""
    exl2_options.set(tp_threads="1")
    tp = exl2cpp.load(fixture_models / "q40", device="cpu", tensor_parallel=3)
    ids = fixture_ids[:24]
    ref = tp.forward(ids)
    for rank in (1, 0, 2):
        exl2_options.set(tp_test_fail_rank=str(rank))
        with pytest.raises(InternalError, match=f"rank {rank} fails on purpose"):
            tp.forward(ids)
        exl2_options.set(tp_test_fail_rank=-1)
        np.testing.assert_array_equal(tp.forward(ids), ref)


def test_cpu_padded_decode_layout(fixture_models, fixture_ids, monkeypatch):
    """Option tp_graphs="cpu-pad" runs decode steps in the bucket layout the CUDA graphs use (pages_per_seq bucketed
    to a power of two, the cache's scratch page past each sequence's pages, logit rows through the index): the
    logits are unchanged, for one sequence and for a batch of 4 with picked logit rows. (Padding ROWS write to the
    scratch page, which the CPU kernels refuse as out of range; they run on the GPU only.)"""
    one = exl2cpp.load(fixture_models / "q40", device="cpu")
    tp = exl2cpp.load(fixture_models / "q40", device="cpu", tensor_parallel=3)
    ref, _ = run_core(one._core, fixture_ids[:30], decode=5)
    exl2_options.set(tp_graphs="cpu-pad")
    got, _ = run_core(tp._core, fixture_ids[:30], decode=5)
    assert rel_l2(got, ref) < 1e-6
    outs = []
    for core in (one._core, tp._core):
        cache = core.make_cache(1024, 16)
        pages = cache.pool.alloc(12)  # 4 sequences x 3 pages
        for s in range(4):  # prefill sequence s with 20 + s tokens
            ids = fixture_ids[s * 10 : s * 10 + 20 + s]
            core.forward(
                cache, ids, list(range(len(ids))), [s] * len(ids), pages, 3, [len(ids) - 1]
            )
        toks = [fixture_ids[100 + s] for s in range(4)]
        pos = [20 + s for s in range(4)]
        outs.append(core.forward(cache, toks, pos, [0, 1, 2, 3], pages, 3, [3, 0, 2]))
    assert outs[1].shape == (3, 8192) and rel_l2(outs[1], outs[0]) < 1e-6


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    pytest.importorskip("transformers")
    from test_models_hf import make_hf_model

    out = {}
    for kind, extra in (
        ("llama", {}),
        ("qwen2", {}),
        ("qwen3", {}),
        ("llama_bias", {}),
        ("llama_mha", {"intermediate_size": 192}),
    ):
        path = tmp_path_factory.mktemp(f"tp_{kind}")
        make_hf_model(kind, dict(extra, num_hidden_layers=2), path, seed=3)
        out[kind] = path
    return out


@pytest.mark.parametrize("kind, ranks", [("llama", 2), ("qwen2", 2), ("qwen3", 2), ("llama_bias", 2),
                                         ("llama_mha", 3), ("llama_mha", 6)])  # fmt: skip
def test_cpu_ranks_match_unsharded_dense(hf_models, kind, ranks, executor):
    """Dense fp32 weights: biases (q/k/v/o and MLP), Qwen3's per-head q/k norm and MHA split the same way."""
    one = exl2cpp.load(hf_models[kind], device="cpu")
    tp = exl2cpp.load(hf_models[kind], device="cpu", tensor_parallel=ranks)
    ids = np.random.default_rng(ranks).integers(0, 211, 70).tolist()
    assert rel_l2(tp.forward(ids, chunk_size=32), one.forward(ids, chunk_size=32)) < 1e-6
    a, _ = run_core(one._core, ids[:20])
    b, _ = run_core(tp._core, ids[:20])
    assert rel_l2(b, a) < 1e-6


@pytest.mark.parametrize("kind", ["gemma3_vlm", "phi3"])
def test_cpu_ranks_nested_and_fused(nested_models, kind, executor):
    """The text model of Gemma3ForConditionalGeneration (sizes under text_config, tensors under language_model.)
    and Phi-3 (fused qkv_proj / gate_up_proj) over two ranks: the one-device logits and greedy tokens."""
    folder = nested_models[kind]
    one = exl2cpp.load(folder, device="cpu")
    tp = exl2cpp.load(folder, device="cpu", tensor_parallel=2)
    assert tp.tensor_parallel == ["cpu"] * 2
    ids = np.random.default_rng(4).integers(0, 200, 50).tolist()
    assert rel_l2(tp.forward(ids, chunk_size=32), one.forward(ids, chunk_size=32)) < 1e-6
    ta, tb = greedy_pair(one, tp, ids[:12], 16)
    assert ta == tb


def test_cpu_ranks_engine_and_generate(fixture_models, fixture_ids, executor):
    """The engine and generate run a TP model unchanged: greedy tokens equal the unsharded model's."""
    one = exl2cpp.load(fixture_models / "q40", device="cpu")
    tp = exl2cpp.load(fixture_models / "q40", device="cpu", tensor_parallel=3)
    prompt = fixture_ids[:24]
    assert tp.generate_ids(prompt, max_new_tokens=12, temperature=0.0) == one.generate_ids(
        prompt, max_new_tokens=12, temperature=0.0
    )
    prompts = [fixture_ids[s : s + n] for s, n in ((0, 9), (10, 30), (40, 17))]
    results = []
    for model in (one, tp):
        eng = exl2cpp.Engine(model, cache_tokens=1024, page_size=16, max_batch_tokens=64)
        jobs = [eng.submit(p, max_new_tokens=10, temperature=0.0, ignore_eos=True) for p in prompts]
        for j in jobs:
            j.result(timeout=120)
        results.append([list(j.token_ids) for j in jobs])
        eng.close()
    assert results[0] == results[1]


def test_cpu_ranks_info(fixture_models):
    one = exl2cpp.load(fixture_models / "q40", device="cpu").info()
    tp_model = exl2cpp.load(fixture_models / "q40", device="cpu", tensor_parallel=3)
    info = tp_model.info()
    assert info["tp_devices"] == ["cpu"] * 3 and one["tp_devices"] == []
    names = [x["name"] for x in info["linears"]]
    assert "model.layers.0.mlp.down_proj[2]" in names and "lm_head" in names
    by = {x["name"]: x for x in info["linears"]}
    assert by["model.layers.1.self_attn.k_proj[1]"]["out_features"] == 64
    assert by["model.layers.1.self_attn.o_proj[0]"]["in_features"] == 576
    assert by["model.layers.1.self_attn.o_proj[0]"]["out_features"] == 192
    # The shards hold the same codes and scales; each repeats the shared per-group and permutation metadata.
    assert one["bpw_layers"] < info["bpw_layers"] < one["bpw_layers"] + 0.15
    assert "tensor parallel cpu, cpu, cpu" in repr(tp_model)


def test_tp_bad_configs_are_clear_errors(fixture_models, hf_models):
    q40 = fixture_models / "q40"
    with pytest.raises(InvalidArgumentError, match="num_key_value_heads = 3 is not divisible by 2"):
        exl2cpp.load(q40, device="cpu", tensor_parallel=2)
    with pytest.raises(InvalidArgumentError, match="cannot be combined"):
        exl2cpp.load(q40, device="cuda", tensor_parallel=True, gpu_split=[1, 1])
    with pytest.raises(InvalidArgumentError, match="add tensor_parallel=True"):
        exl2cpp.load(q40, device="cuda", devices=[0, 1])
    with pytest.raises(InvalidArgumentError, match="give their number"):
        exl2cpp.load(q40, device="cpu", tensor_parallel=True)
    # The C++ loader checks the same (a caller that skips the Python layer).
    with pytest.raises(InvalidArgumentError, match="num_key_value_heads = 3 is not divisible by 2"):
        _C.Model.load(str(q40), device="cpu", tp_devices=["cpu", "cpu"])
    with pytest.raises(InvalidArgumentError, match="cannot be combined"):
        _C.Model.load(str(q40), device="cpu", tp_devices=["cpu"] * 3, layer_devices=[0, 0, 0, 0])
    with pytest.raises(InvalidArgumentError, match="all CUDA or all CPU"):
        _C.Model.load(str(q40), device="cpu", tp_devices=["cpu", "cuda:0", "cpu"])
    # A cache made by another model does not fit the shards.
    tp = _C.Model.load(str(q40), device="cpu", tp_devices=["cpu"] * 3)
    plain = _C.Model.load(str(q40), device="cpu")
    cache = plain.make_cache(64, 16)
    pages = cache.pool.alloc(1)
    with pytest.raises(InvalidArgumentError, match="make the cache with this model's make_cache"):
        tp.forward(cache, [1, 2], [0, 1], [0, 0], pages, 1)
    cache3 = tp.make_cache(64, 16)
    with pytest.raises(InvalidArgumentError, match="not tensor-parallel; make the cache"):
        plain.forward(cache3, [1, 2], [0, 1], [0, 0], pages, 1)


@pytest.mark.skipif(N_GPUS > 0, reason="checks the no-GPU message")
def test_tp_on_cuda_without_gpus(fixture_models):
    """No GPU: a CUDA build says none is visible; a build without the CUDA backend says so and why."""
    from exl2cpp.errors import UnsupportedError

    built = _C.cuda_missing_reason() == ""
    with pytest.raises(InvalidArgumentError if built else UnsupportedError,
                       match="none is visible" if built else "no CUDA backend"):  # fmt: skip
        exl2cpp.load(fixture_models / "q40", device="cuda", tensor_parallel=True)


# ---- on two GPUs ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_f16(tmp_path_factory):
    pytest.importorskip("transformers")
    import torch
    from test_models_hf import make_hf_model

    path = tmp_path_factory.mktemp("tp_f16")
    make_hf_model("llama", {"num_hidden_layers": 4, "max_position_embeddings": 512}, path, dtype=torch.float16,
                  seed=2)  # fmt: skip
    return path


@pytest.fixture(scope="module")
def synth_exl2(tmp_path_factory):
    """bench/synth_exl2.py's tiny preset (hidden 256, 4 heads / 2 KV heads, MLP 704) at 4.0 bpw: EXL2 shards of 32+
    columns over two GPUs."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import synth_exl2

    out = tmp_path_factory.mktemp("tp_synth") / "tiny-4.0"
    synth_exl2.synthesize(out, preset="tiny", bpw=4.0, seed=1, log=lambda *a: None)
    return out


def test_cpu_ranks_synth_exl2_over_two(synth_exl2):
    """The model the two-GPU EXL2 test uses, on two virtual CPU ranks: the same logits as unsharded."""
    one = exl2cpp.load(synth_exl2, device="cpu")
    two = exl2cpp.load(synth_exl2, device="cpu", tensor_parallel=2)
    ids = np.random.default_rng(8).integers(0, 1024, 50).tolist()
    assert rel_l2(two.forward(ids), one.forward(ids)) < 1e-6
    a, _ = run_core(one._core, ids[:20])
    b, _ = run_core(two._core, ids[:20])
    assert rel_l2(b, a) < 1e-6


@pytest.mark.parametrize("devices", [[0, 1], [1, 0]])
@pytest.mark.cuda2
@pytest.mark.skipif(N_GPUS < 2, reason="needs 2+ CUDA GPUs")
def test_gpu_tp_fp16_matches_one_gpu(tiny_f16, devices):
    """fp16 dense: TP over two GPUs vs one GPU, prefill and decode logits (rel L2 < 1e-3) and greedy tokens."""
    one = exl2cpp.load(tiny_f16, device="cuda")
    two = exl2cpp.load(tiny_f16, device="cuda", tensor_parallel=True, devices=devices)
    assert two.tensor_parallel == [f"cuda:{d}" for d in devices] and two.split
    assert os.environ.get("NCCL_NVLS_ENABLE") == "0"
    ids = np.random.default_rng(4).integers(0, 211, 150).tolist()
    assert rel_l2(two.forward(ids, chunk_size=64), one.forward(ids, chunk_size=64)) < 1e-3
    a, _ = run_core(one._core, ids[:40])
    b, cache = run_core(two._core, ids[:40])
    assert cache.tp == 2
    assert rel_l2(b, a) < 1e-3
    prompt = ids[:33]
    ta, tb = greedy_pair(one, two, prompt, 40)
    assert_same_greedy(one, prompt, ta, tb)


@pytest.mark.cuda2
@pytest.mark.skipif(N_GPUS < 2, reason="needs 2+ CUDA GPUs")
def test_gpu_tp_engine_batch(tiny_f16):
    one = exl2cpp.load(tiny_f16, device="cuda")
    two = exl2cpp.load(tiny_f16, device="cuda", tensor_parallel=True)
    prompts, results = assert_same_engine_batch(one, two, n_jobs=8, cache_tokens=4096)
    eng = exl2cpp.Engine(
        two
    )  # the default cache size (each GPU holds half of every layer's KV heads)
    job = eng.submit(prompts[0], max_new_tokens=4, temperature=0.0, ignore_eos=True)
    job.result(timeout=60)
    assert_same_greedy(one, prompts[0], results[0][0][:4], list(job.token_ids))
    eng.close()


@pytest.mark.cuda2
@pytest.mark.skipif(N_GPUS < 2, reason="needs 2+ CUDA GPUs")
def test_gpu_tp_exl2_matches_one_gpu(synth_exl2):
    """EXL2 (random codes, 4.0 bpw): the shards dequantize bit-exactly, so the only differences are the GEMMs' fp32
    accumulation order (split-k atomics in decode, another cuBLAS tiling for half the columns) and fp16 rounding of
    the activations. Bound rel L2 < 5e-3: the same as tests/test_cuda_graphs.py's, where two eager runs of one EXL2
    model on one GPU already differ by up to 1.7e-3 (fp32 atomics)."""
    one = exl2cpp.load(synth_exl2, device="cuda")
    two = exl2cpp.load(synth_exl2, device="cuda", tensor_parallel=True, devices=[0, 1])
    ids = np.random.default_rng(8).integers(0, 1024, 120).tolist()
    assert rel_l2(two.forward(ids), one.forward(ids)) < 5e-3
    for cache_type in ("fp16", "q8"):
        a, _ = run_core(one._core, ids[:60], cache_type)
        b, cache = run_core(two._core, ids[:60], cache_type)
        assert cache.cache_type == cache_type and cache.tp == 2
        assert rel_l2(b, a) < 5e-3, cache_type
    prompt = ids[:20]
    ta, tb = greedy_pair(one, two, prompt, 16)
    assert_same_greedy(one, prompt, ta, tb)


@pytest.mark.cuda2
@pytest.mark.skipif(N_GPUS < 2, reason="needs 2+ CUDA GPUs")
def test_gpu_tp_one_rank_and_bad_configs(tiny_f16, tmp_path):
    """devices=[0]: the TP path (NCCL with one rank) on one GPU; models that do not split are refused clearly."""
    import torch
    from test_models_hf import make_hf_model

    ref = exl2cpp.load(tiny_f16, device="cuda")
    one_rank = exl2cpp.load(tiny_f16, device="cuda", tensor_parallel=True, devices=[0])
    ids = list(range(1, 50))
    assert rel_l2(one_rank.forward(ids), ref.forward(ids)) < 1e-3
    make_hf_model(
        "llama", {"num_key_value_heads": 3, "num_hidden_layers": 1}, tmp_path, dtype=torch.float16
    )
    with pytest.raises(InvalidArgumentError, match="num_key_value_heads = 3 is not divisible by 2"):
        exl2cpp.load(tmp_path, device="cuda", tensor_parallel=True, devices=[0, 1])
    with pytest.raises(InvalidArgumentError, match="num_key_value_heads = 3 is not divisible by 2"):
        _C.Model.load(str(tmp_path), device="cuda:0", tp_devices=["cuda:0", "cuda:1"])
    with pytest.raises(InvalidArgumentError, match="twice"):
        exl2cpp.load(tiny_f16, device="cuda", tensor_parallel=True, devices=[1, 1])
    with pytest.raises(InvalidArgumentError, match="twice"):
        _C.Model.load(str(tiny_f16), device="cuda:0", tp_devices=["cuda:0", "cuda:0"])
    with pytest.raises(InvalidArgumentError, match="not a visible CUDA device"):
        _C.Model.load(str(tiny_f16), device="cuda:0", tp_devices=["cuda:0", f"cuda:{N_GPUS}"])
    print("NCCL", _C.nccl_describe())


_GRAPH_SCRIPT = r"""
import json, os, sys
import numpy as np
import exl2cpp
from exl2cpp import _C
path, mode = sys.argv[1], sys.argv[2]
exl2cpp.options.set(tp_threads=True, tp_graphs="on" if mode.startswith("graphs") else "off")
cache_type = "q8" if mode.endswith("q8") else "auto"
one = exl2cpp.load(path, device="cuda")
two = exl2cpp.load(path, device="cuda", tensor_parallel=True, devices=[0, 1])
rng = np.random.default_rng(11)
prompts = [rng.integers(0, 200, int(rng.integers(5, 40))).tolist() for _ in range(5)]
res = []
for model in (one, two):
    before = _C.cuda_graph_stats()  # the TP model's own captures are what the last loop measures
    eng = exl2cpp.Engine(model, cache_tokens=2048, page_size=16, max_batch_tokens=256, cache_type=cache_type)
    jobs = [eng.submit(p, max_new_tokens=20, temperature=0.0, ignore_eos=True) for p in prompts]
    for j in jobs:
        j.result(timeout=100)
    res.append([list(j.token_ids) for j in jobs])
    eng.close()
after = _C.cuda_graph_stats()
print(json.dumps({"one": res[0], "two": res[1], "prompts": prompts,
                  "captures": after["captures"] - before["captures"],
                  "launches": after["launches"] - before["launches"]}))
"""


@pytest.mark.parametrize("mode", ["threads", "graphs", "graphs-q8"])
@pytest.mark.cuda2
@pytest.mark.skipif(N_GPUS < 2, reason="needs 2+ CUDA GPUs")
def test_gpu_tp_threads_and_graphs_match_one_gpu(tmp_path_factory, mode):
    """Options tp_threads (one host thread per GPU) and tp_graphs "on" (plus per-GPU CUDA graphs of decode
    steps, experimental; also with a q8 cache, whose K centring is fixed in an eager step first): the engine's
    greedy tokens for 5 prompts match one GPU's (same cache type). Runs in a subprocess with a
    time limit, so a deadlock fails the test instead of hanging the run."""
    import subprocess
    import sys

    import torch
    from test_models_hf import make_hf_model

    tiny_f16 = tmp_path_factory.mktemp("tp_hd64")  # head_dim 64: the CUDA q8 cache takes 64, 96, 128 or 256
    make_hf_model("llama", {"num_hidden_layers": 3, "head_dim": 64, "max_position_embeddings": 512}, tiny_f16,
                  dtype=torch.float16, seed=5)  # fmt: skip
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    proc = subprocess.run([sys.executable, "-c", _GRAPH_SCRIPT, str(tiny_f16), mode], check=False,
                          capture_output=True, text=True, timeout=150, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    one = exl2cpp.load(tiny_f16, device="cuda")
    for p, ta, tb in zip(out["prompts"], out["one"], out["two"]):
        assert len(tb) == 20
        assert_same_greedy(one, p, ta, tb)
    if mode.startswith("graphs"):
        assert out["captures"] > 0 and out["launches"] > 0, out


_EXL2_THREADS_SCRIPT = r"""
import faulthandler, json, os, sys
import numpy as np
faulthandler.dump_traceback_later(120, exit=True)  # a hang: every Python thread's stack on stderr, then exit
path, mode, tests = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, tests)
import exl2cpp
exl2cpp.options.set(tp_threads=True, tp_graphs="on" if mode == "graphs" else "off", tp_trace=True)
from test_multigpu import greedy_pair, rel_l2, run_core
one = exl2cpp.load(path, device="cuda")
two = exl2cpp.load(path, device="cuda", tensor_parallel=True, devices=[0, 1])
ids = np.random.default_rng(8).integers(0, 1024, 120).tolist()
out = {}
if mode == "abort":
    ref = [two.forward(ids[:40]) for _ in range(2)][-1]  # the second step of the shape runs on the rank threads
    for rank in (1, 0):
        exl2cpp.options.set(tp_test_fail_rank=rank)
        try:
            two.forward(ids[:40])
            out[f"raised{rank}"] = ""
        except Exception as e:  # the failing rank's error, not a hang
            out[f"raised{rank}"] = f"{type(e).__name__}: {e}"
        exl2cpp.options.set(tp_test_fail_rank=-1)
        out[f"after{rank}"] = rel_l2(two.forward(ids[:40]), ref)  # new communicators, same logits
else:  # test_gpu_tp_exl2_matches_one_gpu's steps, in its order
    out["forward"] = rel_l2(two.forward(ids), one.forward(ids))
    ref = {}
    for cache_type in ("fp16", "q8"):
        ref[cache_type], _ = run_core(one._core, ids[:60], cache_type)
        b, _ = run_core(two._core, ids[:60], cache_type)
        out[cache_type] = rel_l2(b, ref[cache_type])
    b, _ = run_core(two._core, ids[:60], "fp16")  # again: now the prefill on a fresh cache runs on the rank threads
    out["fp16 again"] = rel_l2(b, ref["fp16"])
    out["prompt"] = ids[:20]
    out["ta"], out["tb"] = greedy_pair(one, two, ids[:20], 16)
print(json.dumps(out))
"""


@pytest.mark.parametrize("mode", ["threads", "graphs", "abort"])
@pytest.mark.cuda2
@pytest.mark.skipif(N_GPUS < 2, reason="needs 2+ CUDA GPUs")
def test_gpu_tp_exl2_threads_match_one_gpu(synth_exl2, mode):
    """EXL2 under options tp_threads (and tp_graphs "on"), in a fresh process with a time limit: the steps
    of test_gpu_tp_exl2_matches_one_gpu, which hung on two H200s before rank threads stopped growing buffers between
    collectives (rank 1's GEMV accumulator, first grown at gate_proj of the first decode step). "abort": a rank that
    fails mid-step (option tp_test_fail_rank) raises its error instead of leaving the other GPU waiting in an
    all-gather (ncclCommAbort), and the next step, on new communicators, gives the same logits."""
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, NCCL_NVLS_ENABLE="0")  # the script turns on tp_trace: where each rank stopped
    try:
        proc = subprocess.run([sys.executable, "-c", _EXL2_THREADS_SCRIPT, str(synth_exl2), mode,
                               str(Path(__file__).resolve().parent)], check=False, capture_output=True, text=True,
                              timeout=150, env=env)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"tensor parallel EXL2 ({mode}) hung for 150 s: {(e.stderr or b'')[-3000:]!r}")
    if proc.returncode != 0:
        lines = proc.stderr.splitlines()
        last = {}  # the last trace line of each rank, and the last step decision
        for line in lines:
            w = line.split()
            if line.startswith("[tp] step"):
                last[f"rank {w[4]}" if len(w) > 4 and w[3] == "rank" else "step"] = line
        other = [x for x in lines if not x.startswith("[tp]")]
        pytest.fail(f"rc {proc.returncode}; last trace lines {sorted(last.values())}; stderr: "
                    + "\n".join(other)[-3000:])
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if mode == "abort":
        for rank in (1, 0):
            assert f"rank {rank} fails on purpose" in out[f"raised{rank}"], out
            assert out[f"after{rank}"] < 1e-6, out
        return
    assert max(out["forward"], out["fp16"], out["q8"], out["fp16 again"]) < 5e-3, out
    one = exl2cpp.load(synth_exl2, device="cuda")
    assert_same_greedy(one, out["prompt"], out["ta"], out["tb"])


@pytest.mark.cuda2
@pytest.mark.skipif(N_GPUS < 2, reason="needs 2+ CUDA GPUs")
@pytest.mark.parametrize("kind", ["gemma3_vlm", "phi3"])
def test_gpu_tp_nested_and_fused_match_one_gpu(nested_models, kind):
    """NCCL tensor parallel over two GPUs for the Gemma 3 multimodal text model and Phi-3's fused linears: one
    GPU's logits (rel L2 < 1e-3) and greedy tokens."""
    one = exl2cpp.load(nested_models[kind], device="cuda")
    two = exl2cpp.load(nested_models[kind], device="cuda", tensor_parallel=2)
    ids = np.random.default_rng(4).integers(0, 200, 60).tolist()
    assert rel_l2(two.forward(ids, chunk_size=32), one.forward(ids, chunk_size=32)) < 1e-3
    ta, tb = greedy_pair(one, two, ids[:12], 16)
    assert_same_greedy(one, ids[:12], ta, tb)


def test_default_cache_tokens_counts_each_gpus_share(monkeypatch):
    """The engine's default cache size for a TP model: each GPU holds 1/T of every layer's KV heads, so the tokens
    that fit are T times what one GPU holding all heads would fit (hand-computed)."""
    from types import SimpleNamespace

    from exl2cpp import multigpu

    cfg = {
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 32,
        "head_dim": 128,
    }
    per_token_layer = 2 * 8 * 128 * 2  # K and V, fp16
    free = {0: 10 * 2**30, 1: 12 * 2**30}
    monkeypatch.setattr(_C, "cuda_mem_info", lambda i: (free[i], 2 * free[i]), raising=False)
    tp2 = SimpleNamespace(
        text_config=cfg, tensor_parallel=["cuda:0", "cuda:1"], layer_devices=["cuda:0"] * 32
    )
    want = int(10 * 2**30 * 0.5 / (per_token_layer / 2 * 32))  # the smaller GPU decides
    assert multigpu.default_cache_tokens(tp2, 0.5, 2) == want
    split = SimpleNamespace(
        text_config=cfg, tensor_parallel=[], layer_devices=["cuda:0"] * 16 + ["cuda:1"] * 16
    )
    assert multigpu.default_cache_tokens(split, 0.5, 2) == int(
        10 * 2**30 * 0.5 / (per_token_layer * 16)
    )


def test_cpu_ranks_server_matches_unsharded(smollm2_dir):
    """The OpenAI server runs a tensor-parallel model unchanged (serve.yml `tensor_parallel: 3`, SmolLM2's 9 heads /
    3 KV heads over 3 CPU ranks): a greedy chat completion equals the unsharded model's greedy tokens."""
    import time

    from exl2cpp.server import create_app
    from exl2cpp.server.config import ServeConfig
    from fastapi.testclient import TestClient

    messages = [{"role": "user", "content": "Name three colours."}]
    one = exl2cpp.load(smollm2_dir, device="cpu")
    prompt = one.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    want = one.generate_ids(prompt, max_new_tokens=12, temperature=0.0)

    cfg = ServeConfig(model=str(smollm2_dir), model_name="smol", tensor_parallel=3, cache_tokens=2048, page_size=16)
    with TestClient(create_app(cfg)) as http:
        deadline = time.time() + 120
        while http.get("/health").json().get("status") != "ready":
            assert time.time() < deadline, http.get("/health").json()
            time.sleep(0.2)
        slot = http.app.state.slot
        assert slot.model.tensor_parallel == ["cpu"] * 3
        r = http.post("/v1/chat/completions", json={"model": "smol", "messages": messages, "max_tokens": 12,
                                                    "temperature": 0, "logprobs": True, "stop": []})  # fmt: skip
        assert r.status_code == 200, r.text
        body = r.json()
    assert body["usage"]["completion_tokens"] == 12
    assert len(body["choices"][0]["logprobs"]["content"]) == 12
    assert body["choices"][0]["message"]["content"] == one.tokenizer.decode(want)
