"""Layer split across GPUs (exl2cpp/multigpu.py, LoadOptions::layer_devices).

CPU part (always runs): gpu_split parsing, the placement planner on fake sizes (hand-computed and random cases),
model sizes from safetensors headers, "auto" with faked free memory, and the clear errors of gpu_split on the CPU.
GPU part (marker `cuda2`, skipped unless 2+ CUDA GPUs are visible): split models against one GPU on logits, greedy
tokens, the engine and a quantized KV cache."""

from __future__ import annotations

import itertools
import math

import exl2cpp
import numpy as np
import pytest
from exl2cpp import _C, cli
from exl2cpp.errors import InvalidArgumentError, OutOfMemoryError
from exl2cpp.multigpu import (
    GB,
    MIB,
    Placement,
    model_sizes,
    parse_gpu_split,
    plan_for_model,
    plan_layer_split,
    workspace_estimate,
)

N_GPUS = _C.cuda_device_count() if hasattr(_C, "cuda_device_count") else 0


def rel_l2(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ---- gpu_split parsing ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, n, want",
    [
        ([20, 24], 2, [20.0, 24.0]),
        ((1.5,), 4, [1.5]),
        ([0, 8], 2, [0.0, 8.0]),  # GPU 0 skipped
        (np.array([3.0, 4.0]), 2, [3.0, 4.0]),
        ([np.float32(2.5), np.int64(3)], 2, [2.5, 3.0]),
        ("20,24", 2, [20.0, 24.0]),
        (" 7.5 , 0.25 ", 3, [7.5, 0.25]),
        ("auto", 1, "auto"),
        (" AUTO ", 8, "auto"),
    ],
)
def test_parse_gpu_split_accepts(value, n, want):
    assert parse_gpu_split(value, n) == want


@pytest.mark.parametrize(
    "value, n, words",
    [
        ([20, 24, 8], 2, "3 GPUs but 2"),
        ([1], 0, "1 GPUs but 0"),
        ([-1, 4], 2, "gpu_split[0]"),
        ([4, float("nan")], 2, "gpu_split[1]"),
        ([math.inf], 2, "finite"),
        (["20", 4], 2, "gpu_split[0] must be a number"),
        ([True, 4], 2, "gpu_split[0] must be a number"),
        ([None], 2, "must be a number"),
        ([], 2, "at least one GPU"),
        ([0, 0], 2, "no GPU any memory"),
        ("20,,24", 2, "is not a number"),
        ("lots", 2, "is not a number"),
        ("", 2, "empty string"),
        (12, 2, "list of GB"),
        ({"a": 1}, 2, "list of GB"),
        (b"20", 2, "list of GB"),
    ],
)
def test_parse_gpu_split_rejects(value, n, words):
    with pytest.raises(InvalidArgumentError, match="gpu_split") as e:
        parse_gpu_split(value, n)
    assert words in str(e.value)


# ---- the planner ------------------------------------------------------------------------------------------------


def test_plan_everything_fits_on_gpu0():
    p = plan_layer_split([10] * 4, 5, 7, [100, 100])
    assert p.layer_devices == [0, 0, 0, 0] and p.embed_device == 0 and p.head_device == 0
    assert p.planned == [5 + 40 + 7, 0] and p.devices == [0]


def test_plan_split_at_known_layer():
    # GPU 0: reserve 3 + embed 5 + layers 0..2 (3 x (10 + 2)) = 44 <= 45; layer 3 would make 56.
    p = plan_layer_split([10] * 6, 5, 7, [45, 100], reserve_per_layer=2, reserve_per_gpu=3)
    assert p.layer_devices == [0, 0, 0, 1, 1, 1]
    assert (p.embed_device, p.head_device) == (0, 1)
    assert p.planned == [3 + 5 + 36, 3 + 36 + 7]
    assert p.devices == [0, 1]


def test_plan_exact_fit_is_allowed():
    assert plan_layer_split([10, 10], 5, 5, [25, 30]).layer_devices == [
        0,
        0,
    ]  # 5 + 10 + 10 = 25 exactly
    p = plan_layer_split([10, 10], 5, 5, [24, 30])
    assert p.layer_devices == [0, 1] and p.head_device == 1


def test_plan_reserve_per_layer_moves_the_boundary():
    a = plan_layer_split([10] * 8, 0, 0, [50, 1000])
    b = plan_layer_split([10] * 8, 0, 0, [50, 1000], reserve_per_layer=15)
    assert a.layer_devices.count(0) == 5 and b.layer_devices.count(0) == 2


def test_plan_reserve_per_gpu_charged_once_per_gpu_in_use():
    p = plan_layer_split([10] * 4, 0, 0, [30, 30, 30], reserve_per_gpu=10)
    assert p.layer_devices == [0, 0, 1, 1]
    assert p.planned == [30, 30, 0]  # GPU 2 unused: no reserve charged


def test_plan_zero_budget_gpu_is_skipped():
    p = plan_layer_split([10] * 3, 5, 5, [0, 100])
    assert p.layer_devices == [1, 1, 1] and p.embed_device == 1 and p.devices == [1]


def test_plan_head_alone_on_the_last_gpu():
    p = plan_layer_split([10] * 2, 0, 50, [20, 10, 60])
    assert p.layer_devices == [0, 0] and p.head_device == 2  # GPU 1 too small for the head: skipped
    assert p.devices == [0, 2]


def test_plan_embedding_too_big_for_gpu0():
    p = plan_layer_split([1, 1], 50, 1, [40, 100])
    assert p.embed_device == 1 and p.layer_devices == [1, 1]


def test_plan_no_layers():
    p = plan_layer_split([], 5, 5, [100])
    assert p.layer_devices == [] and p.embed_device == 0 and p.head_device == 0


def test_plan_out_of_memory_names_the_numbers():
    with pytest.raises(OutOfMemoryError) as e:
        plan_layer_split(
            [GB] * 4,
            GB // 2,
            GB // 2,
            [2 * GB, 2 * GB],
            reserve_per_layer=64 * MIB,
            reserve_per_gpu=256 * MIB,
        )
    msg = str(e.value)
    # cuda:0: 256 MiB reserve + 512 MiB embedding + layer 0 (1088 MiB); cuda:1: reserve + layer 1; layer 2: nowhere
    assert "layer 2 " in msg and "1088.0 MiB" in msg and "64.0 MiB KV cache" in msg
    assert "budgets total 4.00 GB" in msg and "gpu_split" in msg
    with pytest.raises(OutOfMemoryError, match="the final norm \\+ lm_head"):
        plan_layer_split([10], 0, 100, [50])
    with pytest.raises(OutOfMemoryError, match="the embedding"):
        plan_layer_split([10], 100, 0, [50, 60])


@pytest.mark.parametrize("bad", [{"budgets": [-1, 10]}, {"budgets": []}, {"reserve_per_gpu": -1}])
def test_plan_rejects_bad_arguments(bad):
    args = {"layer_bytes": [1, 2], "embed_bytes": 1, "head_bytes": 1, "budgets": [100, 100]}
    args.update(bad)
    with pytest.raises(InvalidArgumentError):
        plan_layer_split(**args)


def greedy_reference(items, budgets, reserve_gpu):
    """A second, independent statement of the rule: walk the GPUs; an item goes on the first GPU from the current one
    on whose running total (plus its one-off reserve) stays within budget."""
    where, totals, d = [], {}, 0
    for size in items:
        while True:
            if d >= len(budgets):
                return None
            extra = size + (reserve_gpu if d not in totals else 0)
            if budgets[d] > 0 and totals.get(d, 0) + extra <= budgets[d]:
                totals[d] = totals.get(d, 0) + extra
                where.append(d)
                break
            d += 1
    return where


def test_plan_random_cases_match_the_rule():
    rng = np.random.default_rng(0)
    for _ in range(400):
        n_layers = int(rng.integers(0, 40))
        layers = rng.integers(0, 1000, n_layers).tolist()
        embed, head = int(rng.integers(0, 3000)), int(rng.integers(0, 3000))
        kv, ws = int(rng.integers(0, 200)), int(rng.integers(0, 500))
        budgets = rng.integers(0, 12000, int(rng.integers(1, 5))).tolist()
        items = [embed] + [b + kv for b in layers] + [head]
        want = greedy_reference(items, budgets, ws)
        if want is None:
            with pytest.raises(OutOfMemoryError):
                plan_layer_split(layers, embed, head, budgets, kv, ws)
            continue
        p = plan_layer_split(layers, embed, head, budgets, kv, ws)
        assert [p.embed_device, *p.layer_devices, p.head_device] == want
        assert all(a <= b for a, b in itertools.pairwise(want))  # GPUs filled in order
        for d, budget in enumerate(budgets):
            assert p.planned[d] <= budget
            on = [s for s, w in zip(items, want) if w == d]
            assert p.planned[d] == (sum(on) + ws if on else 0)


def test_placement_describe():
    p = Placement(
        layer_devices=[0, 0, 1],
        embed_device=0,
        head_device=1,
        planned=[GB, GB // 2],
        budgets=[2 * GB, GB],
    )
    assert p.describe() == (
        "cuda:0: layers 0-1, embedding (1.00 of 2.00 GB); "
        "cuda:1: layers 2-2, lm_head (0.50 of 1.00 GB)"
    )


# ---- model sizes and plans for real folders ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    """A tiny random Llama with 4 layers (f32 safetensors), and the same in fp16."""
    pytest.importorskip("transformers")
    import torch
    from test_models_hf import make_hf_model

    out = {}
    for name, dtype in (("f32", torch.float32), ("f16", torch.float16)):
        path = tmp_path_factory.mktemp(f"tiny4_{name}")
        make_hf_model(
            "llama",
            {"num_hidden_layers": 4, "max_position_embeddings": 512},
            path,
            dtype=dtype,
            seed=2,
        )
        out[name] = path
    return out


def test_model_sizes_from_headers(tiny4):
    from safetensors.numpy import load_file

    h, inter, vocab, kvw = 96, 160, 211, 2 * 16
    for name, elem in (("f32", 2), ("f16", 2)):  # f32 counts as f16: the GPU loader converts
        s = model_sizes(tiny4[name])
        norms = 2 * h * elem
        linears = (h * h + 2 * h * kvw + h * h + 3 * h * inter) * elem
        assert s.layer_bytes == [linears + norms] * 4, name
        assert s.embed_bytes == vocab * h * elem
        assert s.head_bytes == vocab * h * elem + h * elem  # lm_head + final norm
        assert s.kv_bytes_per_token_layer == 2 * 2 * 16 * 2
        tensors = load_file(str(tiny4[name] / "model.safetensors"))
        total = sum(t.nbytes // (2 if t.dtype == np.float32 else 1) for t in tensors.values())
        assert sum(s.layer_bytes) + s.embed_bytes + s.head_bytes == total


def test_model_sizes_tied_head_counts_a_copy(tmp_path):
    pytest.importorskip("transformers")
    from test_models_hf import make_hf_model

    make_hf_model("llama_tied", {}, tmp_path)
    s = model_sizes(tmp_path)
    assert s.head_bytes == 211 * 96 * 2 + 96 * 2


def test_workspace_estimate_grows_with_rows():
    cfg = {
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
    }
    a, b = workspace_estimate(cfg, rows=1), workspace_estimate(cfg, rows=2048)
    assert b - a == 2047 * (4 * 4096 + 2 * 4096 + 2 * 1024 + 2 * 14336) * 2
    assert 0.5 * GB < b < 2 * GB  # Llama-3-8B-shaped: under a GB or so


def test_plan_for_model_auto_uses_free_memory(tiny4):
    s = model_sizes(tiny4["f16"])
    seq = 512
    per_layer = s.layer_bytes[0] + s.kv_bytes_per_token_layer * seq
    # GPU 0 free: room for its reserve, the embedding and two layers (+ half a layer of slack).
    free0 = s.workspace_bytes + s.embed_bytes + 2 * per_layer + per_layer // 2
    p = plan_for_model(tiny4["f16"], "auto", seq, 2, free_bytes=lambda i: [free0, 10 * GB][i])
    assert p.layer_devices == [0, 0, 1, 1] and p.head_device == 1
    assert p.budgets == [free0, 10 * GB]
    # Explicit GB, same boundary; and everything on GPU 0 when it has room.
    p2 = plan_for_model(tiny4["f16"], [free0 / GB, 1], seq, 2)
    assert p2.layer_devices == [0, 0, 1, 1]
    assert (
        plan_for_model(tiny4["f16"], "auto", seq, 2, free_bytes=lambda i: 10 * GB).layer_devices
        == [0] * 4
    )
    with pytest.raises(OutOfMemoryError, match="layer split"):
        plan_for_model(
            tiny4["f16"], "auto", seq, 2, free_bytes=lambda i: s.workspace_bytes + per_layer // 2
        )
    with pytest.raises(InvalidArgumentError, match="none is visible"):
        plan_for_model(tiny4["f16"], "auto", seq, 0)


@pytest.fixture(scope="module")
def nested_models(tmp_path_factory):
    """A tiny Gemma3ForConditionalGeneration (text model under text_config, tensors under language_model., a vision
    tower) and a tiny Phi-3 (fused qkv_proj / gate_up_proj), random fp32 weights."""
    pytest.importorskip("transformers")
    import test_arch_families
    import test_arch_gemma

    out = {}
    for kind, make in (("gemma3_vlm", test_arch_gemma.make_model), ("phi3", test_arch_families.make_model)):
        out[kind] = tmp_path_factory.mktemp(f"nested_{kind}")
        make(kind, out[kind])
    return out


@pytest.mark.parametrize("kind", ["gemma3_vlm", "phi3"])
def test_model_sizes_follow_the_runtime_names(nested_models, kind):
    """Layers under the architecture's prefix (language_model.model.layers.), the sizes from the text config, the
    vision tower counted nowhere; a plan for two GPUs splits those layers."""
    from safetensors.numpy import load_file

    folder = nested_models[kind]
    c = _C.load_config(str(folder))
    s = model_sizes(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    prefix = "language_model.model.layers." if kind == "gemma3_vlm" else "model.layers."

    def half(t):  # f32 counts as f16: the GPU loader converts
        return t.nbytes // 2

    n = c["num_hidden_layers"]
    want = [sum(half(t) for k, t in tensors.items() if k.startswith(f"{prefix}{i}.")) for i in range(n)]
    assert len(s.layer_bytes) == n and s.layer_bytes == want and min(want) > 0
    run = [t for k, t in tensors.items() if not k.startswith(("vision_tower.", "multi_modal_projector."))]
    tied = c["tie_word_embeddings"] and not any(k.endswith("lm_head.weight") for k in tensors)
    copy = c["vocab_size"] * c["hidden_size"] * 2 if tied else 0
    assert sum(s.layer_bytes) + s.embed_bytes + s.head_bytes == sum(half(t) for t in run) + copy
    assert s.kv_bytes_per_token_layer == 2 * c["num_key_value_heads"] * c["head_dim"] * 2
    assert s.workspace_bytes == workspace_estimate(c)
    seq = 64
    per_layer = s.layer_bytes[0] + s.kv_bytes_per_token_layer * seq
    free0 = s.workspace_bytes + s.embed_bytes + per_layer + per_layer // 2
    p = plan_for_model(folder, "auto", seq, 2, free_bytes=lambda i: [free0, 10 * GB][i])
    assert p.layer_devices == [0] + [1] * (n - 1) and p.head_device == 1


# ---- clear errors on the CPU ----------------------------------------------------------------------------------------


def test_gpu_split_on_cpu_is_a_clear_error(tiny4):
    for kw in ({"gpu_split": [1, 1]}, {"gpu_split": "auto"}, {"layer_devices": [0, 0, 0, 0]}):
        with pytest.raises(InvalidArgumentError, match='load with device="cuda"'):
            exl2cpp.load(tiny4["f32"], device="cpu", **kw)
    with pytest.raises(InvalidArgumentError, match="device='cuda:1'"):
        exl2cpp.load(tiny4["f32"], device="cuda:1", gpu_split=[1, 1])
    with pytest.raises(InvalidArgumentError, match="not both"):
        exl2cpp.load(tiny4["f32"], device="cuda", gpu_split="auto", layer_devices=[0, 0, 0, 0])
    # The C++ loader checks on its own too.
    with pytest.raises(InvalidArgumentError, match="layer split"):
        _C.Model.load(str(tiny4["f32"]), device="cpu", layer_devices=[0, 0, 0, 0])


@pytest.mark.skipif(N_GPUS > 0, reason="checks the no-GPU message")
def test_gpu_split_without_gpus(tiny4):
    """No GPU: a CUDA build says none is visible; a build without the CUDA backend says so and why."""
    from exl2cpp.errors import UnsupportedError

    built = _C.cuda_missing_reason() == ""
    with pytest.raises(InvalidArgumentError if built else UnsupportedError,
                       match="none is visible" if built else "no CUDA backend"):  # fmt: skip
        exl2cpp.load(tiny4["f32"], device="cuda", gpu_split=[1, 1])
    with pytest.raises(InvalidArgumentError if built else UnsupportedError,
                       match="layer_devices must be CUDA indices" if built else "no CUDA backend"):  # fmt: skip
        exl2cpp.load(tiny4["f32"], device="cuda", layer_devices=[0, 0, 0, 0])


def test_unsplit_model_reports_one_device(tiny4):
    m = exl2cpp.load(tiny4["f32"], device="cpu")
    assert m.layer_devices == ["cpu"] * 4 and m.head_device == "cpu" and not m.split
    info = m.info()
    assert info["layer_devices"] == ["cpu"] * 4 and info["head_device"] == "cpu"
    assert cli._summary(info["layer_devices"]) == "cpu, cpu, cpu, cpu"
    assert cli._summary(["cuda:0"] * 16 + ["cuda:1"] * 16) == "cuda:0 x16, cuda:1 x16"


def test_cli_gpu_split_reaches_load(monkeypatch, tiny4):
    seen = {}

    def fake_load(path, **kw):
        seen.update(kw)
        raise SystemExit(0)

    monkeypatch.setattr(
        "exl2cpp.models.resolve_model", lambda name=None, progress=None: tiny4["f32"]
    )
    monkeypatch.setattr(exl2cpp, "load", fake_load)
    with pytest.raises(SystemExit):
        cli.main(["info", "x", "--device", "cuda", "--gpu-split", "20,24"])
    assert seen == {"device": "cuda", "max_seq_len": None, "gpu_split": "20,24"}
    args = cli.build_parser().parse_args(["serve", "x", "--device", "cuda", "--gpu-split", "auto"])
    assert args.gpu_split == "auto"


def test_serve_config_takes_gpu_split():
    from exl2cpp.server.config import load_config

    assert load_config(None, gpu_split="auto").gpu_split == "auto"
    assert load_config(None).gpu_split is None


# ---- on two GPUs ----------------------------------------------------------------------------------------------------


def greedy_pair(one, two, prompt, n, cache_tokens=4096):
    """Greedy tokens of `one` and `two` through their default engines, each made with a cache of `cache_tokens`: the
    default engine of a CUDA model takes 90% of the GPU's free memory, which leaves nothing for the other model."""
    for m in (one, two):
        m.engine(cache_tokens=cache_tokens)
    return tuple(m.generate_ids(prompt, max_new_tokens=n, temperature=0.0) for m in (one, two))


def assert_same_greedy(ref_model, prompt, ta, tb, tol=0.05):
    """Greedy token lists from two placements agree, or first differ where the reference's top two logits are within
    `tol` (a near-tie that last-bit differences, e.g. another reduction order, may flip)."""
    if ta == tb:
        return
    assert len(ta) == len(tb)
    k = next(i for i, (x, y) in enumerate(zip(ta, tb)) if x != y)
    logits = ref_model.forward(list(prompt) + list(ta[:k]))[-1]
    assert abs(float(logits[ta[k]] - logits[tb[k]])) < tol, (k, ta, tb)


def assert_same_engine_batch(one, two, n_jobs, cache_tokens, new_tokens=24):
    """n_jobs greedy jobs of random lengths through an engine on each model: the same tokens (up to near-ties
    of `one`). Returns (prompts, [tokens per job of one, of two])."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 211, int(rng.integers(5, 60))).tolist() for _ in range(n_jobs)]
    results = []
    for model in (one, two):
        eng = exl2cpp.Engine(model, cache_tokens=cache_tokens, page_size=16, max_batch_tokens=256)
        jobs = [eng.submit(p, max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True) for p in prompts]
        for j in jobs:
            j.result(timeout=120)
        results.append([list(j.token_ids) for j in jobs])
        eng.close()
    for p, ta, tb in zip(prompts, results[0], results[1]):
        assert len(tb) == new_tokens
        assert_same_greedy(one, p, ta, tb)
    return prompts, results


def run_core(core, ids, cache_type="auto", page=16, decode=6, decode_ids=None):
    """Prefill `ids` then decode `decode` fixed tokens (`decode_ids`, else ids[:decode]) on a fresh cache; logits of
    every step (last rows)."""
    cache = core.make_cache(len(ids) + decode + page, page, cache_type)
    n_pages = -(-(len(ids) + decode) // page)
    pages = cache.pool.alloc(n_pages)
    out = [core.forward(cache, ids, list(range(len(ids))), [0] * len(ids), pages, n_pages)]
    for k in range(decode):
        pos = len(ids) + k
        out.append(core.forward(cache, [(decode_ids or ids)[k]], [pos], [0], pages, n_pages))
    return np.concatenate(out), cache


@pytest.fixture(scope="module")
def fixture_q40():
    from conftest_exl2 import assemble_fixture_models

    return assemble_fixture_models() / "q40"


@pytest.mark.cuda2
@pytest.mark.skipif(N_GPUS < 2, reason="needs 2+ CUDA GPUs")
@pytest.mark.parametrize("name", ["f16", "f32"])
def test_split_logits_match_one_gpu(tiny4, name):
    ids = np.random.default_rng(4).integers(0, 211, 150).tolist()
    one = exl2cpp.load(tiny4[name], device="cuda")
    two = exl2cpp.load(tiny4[name], device="cuda", layer_devices=[0, 0, 1, 1])
    assert (
        two.split
        and two.layer_devices == ["cuda:0"] * 2 + ["cuda:1"] * 2
        and two.head_device == "cuda:1"
    )
    a, b = one.forward(ids, chunk_size=64), two.forward(ids, chunk_size=64)
    assert rel_l2(b, a) < 1e-3
    a_steps, _ = run_core(one._core, ids[:40])
    b_steps, cache = run_core(two._core, ids[:40])
    assert cache.layer_devices == two.layer_devices
    assert rel_l2(b_steps, a_steps) < 1e-3


@pytest.mark.cuda2
@pytest.mark.skipif(N_GPUS < 2, reason="needs 2+ CUDA GPUs")
@pytest.mark.parametrize("kind", ["gemma3_vlm", "phi3"])
def test_split_nested_and_fused_match_one_gpu(nested_models, kind):
    """gpu_split over two GPUs of a model whose layers sit under language_model. (Gemma 3 multimodal) or whose
    linears are fused (Phi-3): the plan splits the layers, and the logits and greedy tokens are one GPU's."""
    folder = nested_models[kind]
    one = exl2cpp.load(folder, device="cuda")
    c = _C.load_config(str(folder))
    n = c["num_hidden_layers"]
    s = model_sizes(folder)
    per_layer = s.layer_bytes[0] + s.kv_bytes_per_token_layer * c["max_position_embeddings"]
    free0 = s.workspace_bytes + s.embed_bytes + per_layer + per_layer // 2
    two = exl2cpp.load(folder, device="cuda", gpu_split=[free0 / GB, 4])
    assert two.layer_devices == ["cuda:0"] + ["cuda:1"] * (n - 1)
    ids = np.random.default_rng(5).integers(0, 200, 40).tolist()
    assert rel_l2(two.forward(ids), one.forward(ids)) < 1e-3
    ta, tb = greedy_pair(one, two, ids[:12], 16)
    assert_same_greedy(one, ids[:12], ta, tb)


@pytest.mark.cuda2
@pytest.mark.skipif(N_GPUS < 2, reason="needs 2+ CUDA GPUs")
def test_split_back_and_forth_and_separate_head(tiny4):
    """Placements the planner never makes (embedding on GPU 1, layers 0 -> 1 -> 0, head alone) still match."""
    ids = np.random.default_rng(5).integers(0, 211, 70).tolist()
    ref = exl2cpp.load(tiny4["f16"], device="cuda").forward(ids)
    for device, layers, head in (
        ("cuda:1", [0, 1, 1, 0], 1),
        ("cuda:0", [0, 0, 0, 0], 1),
        ("cuda:1", [1] * 4, 0),
    ):
        core = _C.Model.load(
            str(tiny4["f16"]), device=device, layer_devices=layers, head_device=head
        )
        assert core.split
        m = exl2cpp.model.Model(core, tiny4["f16"])
        assert rel_l2(m.forward(ids), ref) < 1e-3, (device, layers, head)


@pytest.mark.cuda2
@pytest.mark.skipif(N_GPUS < 2, reason="needs 2+ CUDA GPUs")
def test_split_greedy_tokens_and_engine_match_one_gpu(tiny4):
    """fp16 dense weights: the same kernels on both placements, so greedy tokens agree (one prompt through
    generate_ids, four at once through the engine); a difference is allowed only at a near-tie, since the one-GPU
    decode steps pad the page table for their CUDA graphs while split steps run unpadded."""
    one = exl2cpp.load(tiny4["f16"], device="cuda")
    two = exl2cpp.load(tiny4["f16"], device="cuda", layer_devices=[0, 1, 1, 1])
    prompt = np.random.default_rng(6).integers(0, 211, 33).tolist()
    ta, tb = greedy_pair(one, two, prompt, 40)
    assert len(tb) == 40
    assert_same_greedy(one, prompt, ta, tb)
    assert_same_engine_batch(one, two, n_jobs=4, cache_tokens=2048)


@pytest.mark.cuda2
@pytest.mark.skipif(N_GPUS < 2, reason="needs 2+ CUDA GPUs")
def test_split_exl2_fixture_and_quantized_cache(fixture_q40):
    """The EXL2 fixture quant (real weights) split 2 + 2: logits against one GPU with an fp16 and a q8/q4 cache,
    and greedy tokens (EXL2 decode uses fp32 atomics, so a divergence is allowed only at a near-tie)."""
    from conftest_exl2 import require_fixtures

    ids = np.load(require_fixtures() / "fx_logits.npz")["ids"].astype(np.int64).tolist()
    one = exl2cpp.load(fixture_q40, device="cuda")
    two = exl2cpp.load(fixture_q40, device="cuda", layer_devices=[0, 0, 1, 1])
    assert rel_l2(two.forward(ids), one.forward(ids)) < 1e-3
    for cache_type in ("fp16", "q8", "q4"):
        a, _ = run_core(one._core, ids[:100], cache_type)
        b, cache = run_core(two._core, ids[:100], cache_type)
        assert cache.cache_type == cache_type and cache.layer_devices == two.layer_devices
        assert rel_l2(b, a) < (5e-3 if cache_type == "q4" else 1e-3), cache_type  # q4 can round near-ties apart
    prompt = ids[:24]
    ta, tb = greedy_pair(one, two, prompt, 24)
    assert_same_greedy(one, prompt, ta, tb)
    eng = exl2cpp.Engine(two, cache_tokens=4096, page_size=256, cache_type="q8")
    job = eng.submit(prompt, max_new_tokens=16, temperature=0.0, ignore_eos=True)
    job.result(timeout=120)
    assert len(job.token_ids) == 16
    eng.close()


@pytest.mark.cuda2
@pytest.mark.skipif(N_GPUS < 2, reason="needs 2+ CUDA GPUs")
def test_gpu_split_explicit_and_auto_place_by_memory(tiny4, monkeypatch):
    s = model_sizes(tiny4["f16"])
    seq = 512
    per_layer = s.layer_bytes[0] + s.kv_bytes_per_token_layer * seq
    budget0 = (
        s.workspace_bytes + s.embed_bytes + 3 * per_layer + per_layer // 2
    )  # room for 3 layers
    m = exl2cpp.load(tiny4["f16"], device="cuda", max_seq_len=seq, gpu_split=[budget0 / GB, 4])
    assert m.layer_devices == ["cuda:0"] * 3 + ["cuda:1"] and m.head_device == "cuda:1" and m.split
    ids = list(range(1, 60))
    ref = exl2cpp.load(tiny4["f16"], device="cuda", max_seq_len=seq).forward(ids)
    assert rel_l2(m.forward(ids), ref) < 1e-3
    # auto with the real free memory: a tiny model fits on GPU 0 whole.
    m2 = exl2cpp.load(tiny4["f16"], device="cuda", max_seq_len=seq, gpu_split="auto")
    assert m2.layer_devices == ["cuda:0"] * 4 and not m2.split
    # auto where GPU 0 reports room for one layer only (the planner's view of free memory is faked).
    real = _C.cuda_mem_info
    free0 = s.workspace_bytes + s.embed_bytes + per_layer + per_layer // 2
    monkeypatch.setattr(_C, "cuda_mem_info", lambda i: (free0, real(i)[1]) if i == 0 else real(i))
    m3 = exl2cpp.load(tiny4["f16"], device="cuda", max_seq_len=seq, gpu_split="auto")
    monkeypatch.undo()
    assert m3.layer_devices == ["cuda:0"] + ["cuda:1"] * 3
    assert rel_l2(m3.forward(ids), ref) < 1e-3
    with pytest.raises(InvalidArgumentError, match=f"{N_GPUS + 1} GPUs but"):
        exl2cpp.load(tiny4["f16"], device="cuda", gpu_split=[1] * (N_GPUS + 1))
    with pytest.raises(OutOfMemoryError, match="layer split"):
        exl2cpp.load(tiny4["f16"], device="cuda", gpu_split=[1e-6] * 2)


def test_bench_multigpu_cpu_quick(tmp_path, capsys):
    """The bench's CPU smoke run: one-device row, the split row skipped without GPUs, the tensor-parallel row on two
    virtual CPU ranks (code path only)."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import bench_multigpu

    out = tmp_path / "r.jsonl"
    assert bench_multigpu.main(["--preset", "tiny", "--device", "cpu", "--quick", "--models-dir", str(tmp_path),
                                "--json", str(out)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "layer split x2: skipped" in text
    assert "tensor parallel x2 (CPU ranks) / CPU" in text
    rec = json.loads(out.read_text().splitlines()[-1])
    assert rec["tensor_parallel"] == "virtual CPU ranks (code path only)"
    assert rec["results"][0]["config"] == "CPU" and rec["results"][0]["decode_b32_tok_s"] > 0
    tp = rec["results"][1]
    assert tp["tp_devices"] == ["cpu", "cpu"] and tp["decode_b1_tok_s"] > 0 and tp["prefill_tok_s"] > 0
