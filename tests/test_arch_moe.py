"""Mixture-of-experts architectures (MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM) against HF
transformers in fp32 on tiny random-weight models with more experts than top-k, randomised norm weights and (Qwen)
dense layers in between; EXL2 experts against the same model with the dequantized weights; tensor parallel on CPU
ranks against one device; CUDA against the CPU (marker `cuda`). torch/transformers are test-only references."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import exl2cpp  # noqa: E402
from exl2cpp import _C  # noqa: E402
from exl2cpp import options as exl2_options
from exl2cpp.errors import UnsupportedError  # noqa: E402

VOCAB = 211
BASE = dict(
    hidden_size=128,
    intermediate_size=160,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
QWEN_MOE = dict(moe_intermediate_size=96, num_experts=6, num_experts_per_tok=2)

CASES = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=5, num_experts_per_tok=2, sliding_window=None)),
    "mixtral_top3_window": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=3, sliding_window=24)),
    # layers 1 and 3 sparse (decoder_sparse_step 2), 0 and 2 dense; top-k weights not renormalised
    "qwen2_moe": ("Qwen2MoeConfig", dict(QWEN_MOE, shared_expert_intermediate_size=64, decoder_sparse_step=2)),
    "qwen2_moe_norm": (
        "Qwen2MoeConfig",
        dict(QWEN_MOE, shared_expert_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=[0, 2]),
    ),
    "qwen3_moe": ("Qwen3MoeConfig", dict(QWEN_MOE, head_dim=48, norm_topk_prob=True, mlp_only_layers=[1])),
    "qwen3_moe_step": ("Qwen3MoeConfig", dict(QWEN_MOE, num_experts_per_tok=3, decoder_sparse_step=2)),
}


def rel_l2(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def make_hf_moe(kind: str, folder, seed=0, **extra):
    cfg = getattr(transformers, CASES[kind][0])(**{**BASE, **CASES[kind][1], **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(("gate.weight", "shared_expert_gate.weight")):
                p.normal_(0.0, 0.3)  # router logits spread well past rounding (no near-ties in the top k)
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(folder, safe_serialization=True)
    return model.eval()


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].double().numpy()


def moe_layers(folder):
    """Layer indices that hold experts in the saved checkpoint."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "np") as f:
        return sorted({int(k.split(".")[2]) for k in f.keys() if ".experts." in k})  # noqa: SIM118


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    made = {}

    def get(kind):
        if kind not in made:
            path = tmp_path_factory.mktemp(kind)
            made[kind] = (path, make_hf_moe(kind, path))
        return made[kind]

    return get


@pytest.mark.parametrize("kind", sorted(CASES))
def test_tiny_moe_matches_hf(kind, hf_moe):
    path, hf = hf_moe(kind)
    want = {"mixtral": [0, 1, 2, 3], "mixtral_top3_window": [0, 1, 2, 3], "qwen2_moe": [1, 3],
            "qwen2_moe_norm": [1, 3], "qwen3_moe": [0, 2, 3], "qwen3_moe_step": [1, 3]}[kind]  # fmt: skip
    assert moe_layers(path) == want  # dense layers in between where the config says so
    ids = np.random.default_rng(1).integers(0, VOCAB, size=90).tolist()
    ref = hf_logits(hf, ids)
    model = exl2cpp.load(path, device="cpu")
    out = model.forward(ids)
    assert out.shape == ref.shape
    assert rel_l2(out, ref) < 1e-4, kind
    # chunked prefill (the grouping spans chunks of 32 rows and single decode rows the same way)
    assert rel_l2(model.forward(ids, chunk_size=32), ref) < 1e-4, kind


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_greedy_tokens_through_the_engine(kind, hf_moe):
    """The engine's paged path (prefill chunks, then batch-1 decode steps): every greedy token is HF's argmax on our
    sequence (teacher-forced), and two jobs batched together give the same tokens as each alone."""
    path, hf = hf_moe(kind)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (37, 21)]
    model = exl2cpp.load(path)
    eng = exl2cpp.Engine(model, cache_tokens=512, page_size=16, max_batch_tokens=24)
    jobs = [eng.submit(p, max_new_tokens=12, temperature=0.0, ignore_eos=True) for p in prompts]
    for p, job in zip(prompts, jobs):
        job.result()
        got = list(job.token_ids)
        assert len(got) == 12
        ref = hf_logits(hf, p + got)
        assert np.argmax(ref[len(p) - 1 : -1], axis=1).tolist() == got, kind


def test_moe_info_lists_every_expert(hf_moe):
    path, _ = hf_moe("qwen2_moe")
    info = exl2cpp.load(path, device="cpu").info()
    names = [lin["name"] for lin in info["linears"]]
    for e in range(6):
        for leaf in ("gate_proj", "up_proj", "down_proj"):
            assert f"model.layers.1.mlp.experts.{e}.{leaf}" in names
    for n in ("model.layers.3.mlp.gate", "model.layers.3.mlp.shared_expert.down_proj",
              "model.layers.3.mlp.shared_expert_gate", "model.layers.0.mlp.down_proj"):  # fmt: skip
        assert n in names
    assert "model.layers.1.mlp.down_proj" not in names


# ---- refusals ----------------------------------------------------------------------------------------------------


def _edit_config(folder, **changes):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize(
    "kind, changes, words",
    [
        ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window"),
        ("qwen2_moe", {"use_sliding_window": True}, "use_sliding_window"),
        ("mixtral", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ("qwen3_moe", {"mlp_only_layers": [7]}, "mlp_only_layers"),
        ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ("mixtral", {"router_temperature": 2.0}, "router_temperature"),  # an unknown field
    ],
)
def test_moe_config_refusals(kind, changes, words, hf_moe, tmp_path):
    path = _copy(hf_moe(kind)[0], tmp_path / "m")
    _edit_config(path, **changes)
    with pytest.raises(UnsupportedError, match=words):
        exl2cpp.load(path, device="cpu")


def test_moe_unread_expert_tensors_are_refused(hf_moe, tmp_path):
    """An expert the config does not count (num_experts smaller than the checkpoint's) leaves tensors unread."""
    path = _copy(hf_moe("qwen3_moe")[0], tmp_path / "m")
    _edit_config(path, num_local_experts=5)
    with pytest.raises(UnsupportedError, match=r"experts\.5\."):
        exl2cpp.load(path, device="cpu")
    # a dense layer where the checkpoint has experts: the experts are unread
    path2 = _copy(hf_moe("qwen3_moe")[0], tmp_path / "m2")
    _edit_config(path2, mlp_only_layers=[0, 1])
    with pytest.raises(Exception, match="model.layers.0.mlp"):
        exl2cpp.load(path2, device="cpu")


# ---- EXL2 experts ------------------------------------------------------------------------------------------------

# (bits, rows) groups per expert input width: experts keep their own bit mix (ExLlamaV2 quantizes them apart)
EXL2_BITS = {128: [([4, 3], [64, 64]), ([5, 4, 2], [32, 64, 32]), ([8, 4], [32, 96]), ([6, 3], [96, 32])],
             96: [([4, 3], [64, 32]), ([5, 3], [32, 64]), ([3, 2], [32, 64]), ([6, 4], [64, 32])],
             160: [([4, 3], [96, 64]), ([5, 4, 2], [32, 96, 32]), ([8, 4], [64, 96]), ([6, 3], [128, 32])]}  # fmt: skip


def quantize_experts(src, dst_exl2, dst_dense, seed=5):
    """Replaces every expert linear of the checkpoint in `src` by a random EXL2 layer (the format's own packing,
    _C.exl2_pack) in dst_exl2, and by that layer's dequantized weight (fp32 [out, in]) in dst_dense; other tensors
    are copied. Returns the number of EXL2 layers written."""
    import shutil

    from safetensors.numpy import load_file, save_file
    from test_exl2_cuda import random_layer

    rng = np.random.default_rng(seed)
    tensors = load_file(str(src / "model.safetensors"))
    exl2, dense = {}, {}
    count = 0
    for name, t in tensors.items():
        if ".experts." not in name:
            exl2[name] = dense[name] = t
            continue
        prefix = name[: -len(".weight")]
        n_out, n_in = t.shape
        bits, rows = EXL2_BITS[n_in][count % 4]
        layer = random_layer(rng, n_in, n_out, bits, rows, qsm_log2=(-6.5, -5.5))
        count += 1
        exl2.update({f"{prefix}.{k}": v for k, v in layer.items()})
        w = _C.exl2_dequantize(layer, out_features=n_out)  # [in, out]
        dense[name] = np.ascontiguousarray(w.T.astype(np.float32))
    for dst, ts in ((dst_exl2, exl2), (dst_dense, dense)):
        dst.mkdir()
        for f in ("config.json", "generation_config.json"):
            if (src / f).exists():
                shutil.copy(src / f, dst / f)
        save_file(ts, str(dst / "model.safetensors"))
    return count


@pytest.fixture(scope="module")
def exl2_moe(tmp_path_factory, hf_moe):
    made = {}

    def get(kind):
        if kind not in made:
            base = tmp_path_factory.mktemp(f"exl2_{kind}")
            n = quantize_experts(hf_moe(kind)[0], base / "exl2", base / "dense")
            made[kind] = (base / "exl2", base / "dense", n)
        return made[kind]

    return get


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_exl2_experts_match_dequantized_dense(kind, exl2_moe):
    """EXL2 experts (several bit mixes) load like other EXL2 linears and compute what the dequantized dense model
    computes; HF fp32 on the dequantized weights agrees too."""
    q, d, n = exl2_moe(kind)
    assert n > 0
    qm, dm = exl2cpp.load(q, device="cpu"), exl2cpp.load(d, device="cpu")
    kinds = {lin["kind"] for lin in qm.info()["linears"] if ".experts." in lin["name"]}
    assert kinds == {"exl2"}
    ids = np.random.default_rng(2).integers(0, VOCAB, size=70).tolist()
    ref = hf_logits(transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval(), ids)
    dense = dm.forward(ids)
    assert rel_l2(dense, ref) < 1e-4
    assert rel_l2(qm.forward(ids), dense) < 1e-5
    assert rel_l2(qm.forward(ids, chunk_size=16), ref) < 1e-4


# ---- tensor parallel on CPU ranks --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, ranks", [("mixtral", 2), ("qwen2_moe", 2), ("qwen3_moe", 2), ("qwen2_moe_norm", 2)])
@pytest.mark.parametrize("executor", ["sequential", "threads"])
def test_tp_cpu_ranks_match_one_device(kind, ranks, executor, hf_moe, monkeypatch):
    """Experts split by columns over the ranks (each rank a column block of every expert's gate / up and of every
    down projection's output, router replicated): the same dot products as one device, so the logits agree to float
    rounding and greedy tokens are the same."""
    from test_multigpu import run_core

    exl2_options.set(tp_threads="1" if executor == "threads" else "0")
    path, _ = hf_moe(kind)
    one = exl2cpp.load(path, device="cpu")
    tp = exl2cpp.load(path, device="cpu", tensor_parallel=ranks)
    assert tp.tensor_parallel == ["cpu"] * ranks
    ids = np.random.default_rng(ranks).integers(0, VOCAB, 60).tolist()
    assert rel_l2(tp.forward(ids, chunk_size=24), one.forward(ids, chunk_size=24)) < 1e-6
    a, _ = run_core(one._core, ids[:20])
    b, _ = run_core(tp._core, ids[:20])  # batch-1 decode steps: P = top_k rows gathered
    assert rel_l2(b, a) < 1e-6
    ta = one.generate_ids(ids[:9], max_new_tokens=10, temperature=0.0)
    tb = tp.generate_ids(ids[:9], max_new_tokens=10, temperature=0.0)
    assert ta == tb


def test_tp_cpu_ranks_exl2_experts(exl2_moe):
    q, _, _ = exl2_moe("mixtral")  # expert width 160: column shards of 80 are not multiples of 32
    with pytest.raises(Exception, match="32"):
        exl2cpp.load(q, device="cpu", tensor_parallel=2)


def test_tp_cpu_ranks_exl2_experts_aligned(tmp_path):
    """EXL2 experts with widths that split into multiples of 32 columns: TP over 2 CPU ranks matches one device."""
    from test_multigpu import run_core

    src = tmp_path / "hf"
    make_hf_moe("mixtral", src, seed=2, hidden_size=128, intermediate_size=128)
    q, d = tmp_path / "q", tmp_path / "d"
    quantize_experts(src, q, d, seed=9)
    one = exl2cpp.load(q, device="cpu")
    tp = exl2cpp.load(q, device="cpu", tensor_parallel=2)
    ids = np.random.default_rng(8).integers(0, VOCAB, 40).tolist()
    assert rel_l2(tp.forward(ids), one.forward(ids)) < 1e-6
    a, _ = run_core(one._core, ids[:12])
    b, _ = run_core(tp._core, ids[:12])
    assert rel_l2(b, a) < 1e-6


def test_tp_cpu_ranks_refuse_indivisible_experts(hf_moe):
    path, _ = hf_moe("qwen3_moe")  # moe_intermediate_size 96 over 5 ranks
    with pytest.raises(Exception, match="divisible"):
        exl2cpp.load(path, device="cpu", tensor_parallel=5)


# ---- CUDA against the CPU (run on a GPU) -------------------------------------------------------------------------

N_GPUS = _C.cuda_device_count() if hasattr(_C, "cuda_device_count") else 0


def _fp16_copy(src, dst):
    """The checkpoint with every float tensor in fp16 (what a CUDA model computes with, so CPU and CUDA start from
    the same weights)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    dst.mkdir()
    for f in ("config.json", "generation_config.json"):
        if (src / f).exists():
            shutil.copy(src / f, dst / f)
    ts = load_file(str(src / "model.safetensors"))
    save_file({k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in ts.items()},
              str(dst / "model.safetensors"))
    return dst


def router_margins(hf, kind, ids) -> np.ndarray:
    """Per position, the smallest gap over the routed layers between the k-th and (k+1)-th router logits of HF fp32:
    where it is below the router's rounding (f16 logits on CUDA: ~2e-3 at these magnitudes) the top-k may flip."""
    k = CASES[kind][1]["num_experts_per_tok"]
    gaps = []

    def hook(_mod, _inp, out):
        out = out[0] if isinstance(out, tuple) else out
        s = np.sort(out.detach().double().numpy().reshape(-1, out.shape[-1]), axis=1)
        gaps.append(s[:, -k] - s[:, -k - 1])

    handles = [m.register_forward_hook(hook) for n, m in hf.named_modules() if n.endswith((".mlp.gate", "moe.gate"))]
    try:
        with torch.no_grad():
            hf(torch.tensor([list(ids)]))
    finally:
        for h in handles:
            h.remove()
    return np.stack(gaps).min(0)


def routing_stable_ids(hf, kind, n, seed, margin=0.02) -> list[int]:
    """n random token ids chosen position by position (causal: a later token cannot move an earlier row's routing)
    so that every routed layer's top-k is `margin` clear of the next expert, far above f16 rounding: CUDA and CPU
    route them alike and their logits can be held to fp16 tolerance."""
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    while len(ids) < n:
        for _ in range(200):
            cand = int(rng.integers(0, VOCAB))
            if router_margins(hf, kind, [*ids, cand])[-1] >= margin:
                ids.append(cand)
                break
        else:
            raise AssertionError(f"no routing-stable token at position {len(ids)}")
    return ids


def test_routing_stable_ids_keep_their_margin(hf_moe):
    """The CUDA comparison's token choice does what it says (and the random ids it replaces did not)."""
    path, hf = hf_moe("qwen3_moe")
    ids = routing_stable_ids(hf, "qwen3_moe", 60, seed=3)
    assert router_margins(hf, "qwen3_moe", ids).min() >= 0.02
    plain = np.random.default_rng(3).integers(0, VOCAB, 100).tolist()
    assert router_margins(hf, "qwen3_moe", plain).min() < 0.005  # near-ties are common in random text


@pytest.mark.cuda
@pytest.mark.skipif(N_GPUS < 1, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("weights", ["dense", "exl2"])
def test_cuda_moe_matches_cpu(kind, weights, hf_moe, exl2_moe, tmp_path):
    """Prefill (per-expert path above 64 rows, grouped kernels at or below), batch-1 decode steps as CUDA graphs
    (warm-up, capture, replays) and batched decode: CUDA within fp16 tolerance of the CPU on the same weights, and
    greedy tokens the same (up to near-ties). The tokens are routing-stable: on random tokens some rows' top-k
    experts are nearer than the f16 router logits on CUDA resolve, and a flipped expert is a different function
    (both choices right), not a rounding difference."""
    from test_multigpu import assert_same_greedy, run_core

    src = hf_moe(kind)[0] if weights == "dense" else exl2_moe(kind)[0]
    ref = hf_moe(kind)[1] if weights == "dense" else transformers.AutoModelForCausalLM.from_pretrained(
        exl2_moe(kind)[1], dtype=torch.float32).eval()  # fmt: skip
    path = _fp16_copy(src, tmp_path / "f16")
    cpu = exl2cpp.load(path, device="cpu")
    gpu = exl2cpp.load(path, device="cuda:0")
    ids = routing_stable_ids(ref, kind, 100, seed=3)
    assert rel_l2(gpu.forward(ids), cpu.forward(ids)) < 5e-3
    assert rel_l2(gpu.forward(ids, chunk_size=48), cpu.forward(ids)) < 5e-3
    a, _ = run_core(cpu._core, ids[:30], decode=8, decode_ids=ids[30:38])
    b, _ = run_core(gpu._core, ids[:30], decode=8, decode_ids=ids[30:38])  # 8 decode steps: eager, capture, replays
    assert rel_l2(b, a) < 5e-3
    ta = cpu.generate_ids(ids[:11], max_new_tokens=16, temperature=0.0)
    tb = gpu.generate_ids(ids[:11], max_new_tokens=16, temperature=0.0)
    if ta != tb:  # generated tokens are not chosen for margin: a router near-tie before the split explains it too
        first = next(i for i, (x, y) in enumerate(zip(ta, tb)) if x != y)
        if router_margins(ref, kind, ids[:11] + ta[:first]).min() >= 0.02:
            assert_same_greedy(cpu, ids[:11], ta, tb)


@pytest.mark.cuda
@pytest.mark.skipif(N_GPUS < 1, reason="needs a CUDA GPU")
def test_cuda_moe_engine_batch_matches_cpu(hf_moe, tmp_path):
    """Several jobs batched (decode rows 2..4 through graphs of those buckets, mixed prefill + decode steps)."""
    from test_multigpu import assert_same_engine_batch

    path = _fp16_copy(hf_moe("qwen2_moe")[0], tmp_path / "f16")
    assert_same_engine_batch(exl2cpp.load(path, device="cpu"), exl2cpp.load(path, device="cuda:0"), 4, 2048)


@pytest.mark.cuda
@pytest.mark.skipif(N_GPUS < 1, reason="needs a CUDA GPU")
def test_cuda_moe_decode_is_graphed(exl2_moe, tmp_path):
    """Batch-1 decode steps of an EXL2 MoE model replay a captured CUDA graph (no host sync in the MoE block): the
    capture-failure count does not move and replays give the eager step's logits bit for bit."""
    from test_multigpu import run_core

    path = _fp16_copy(exl2_moe("mixtral")[0], tmp_path / "f16")
    gpu = exl2cpp.load(path, device="cuda:0")
    before = _C.cuda_graph_capture_failures() if hasattr(_C, "cuda_graph_capture_failures") else None
    ids = np.random.default_rng(6).integers(0, VOCAB, 20).tolist()
    a, _ = run_core(gpu._core, ids, decode=6)
    b, _ = run_core(gpu._core, ids, decode=6)
    assert np.array_equal(a, b)
    if before is not None:
        assert _C.cuda_graph_capture_failures() == before


@pytest.mark.cuda2
@pytest.mark.skipif(N_GPUS < 2, reason="needs 2+ CUDA GPUs")
@pytest.mark.parametrize("mode", ["split", "tp"])
def test_cuda2_moe_split_and_tp_match_one_gpu(mode, hf_moe, tmp_path):
    from test_multigpu import assert_same_greedy

    path = _fp16_copy(hf_moe("qwen2_moe")[0], tmp_path / "f16")
    one = exl2cpp.load(path, device="cuda:0")
    kw = {"gpu_split": [0.001, 100]} if mode == "split" else {"tensor_parallel": 2}
    two = exl2cpp.load(path, device="cuda:0", **kw)
    ids = np.random.default_rng(5).integers(0, VOCAB, 50).tolist()
    assert rel_l2(two.forward(ids), one.forward(ids)) < 5e-3
    ta = one.generate_ids(ids[:8], max_new_tokens=12, temperature=0.0)
    tb = two.generate_ids(ids[:8], max_new_tokens=12, temperature=0.0)
    assert_same_greedy(one, ids[:8], ta, tb)


# ---- the synthetic Mixtral model of bench/ -----------------------------------------------------------------------


def test_bench_synth_moe_and_decode_smoke(tmp_path, capsys):
    """bench/synth_exl2.py's MoE presets write a MixtralForCausalLM folder of EXL2 experts at the target bpw (each
    expert its own random codes), and bench_moe_model.py runs on it (CPU smoke run; the numbers come from a GPU)."""
    import sys
    from pathlib import Path

    bench = str(Path(__file__).resolve().parents[1] / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import bench_moe_model
    import synth_exl2

    out = tmp_path / "m"
    summary = synth_exl2.synthesize(out, "tiny-moe", 4.0, seed=3, log=lambda *a: None)
    m = exl2cpp.load(out, device="cpu")
    info = m.info()
    assert abs(info["bpw_layers"] - 4.0) < 0.05 and abs(summary["planned_bpw"] - info["bpw_layers"]) < 1e-3
    experts = [lin for lin in info["linears"] if ".block_sparse_moe.experts." in lin["name"]]
    assert len(experts) == 2 * 4 * 3 and {lin["kind"] for lin in experts} == {"exl2"}
    from safetensors import safe_open

    with safe_open(str(out / "output.safetensors"), "np") as f:
        a, b = (f.get_tensor(f"model.layers.0.block_sparse_moe.experts.{e}.w1.q_weight") for e in (0, 1))
    assert a.shape == b.shape and not np.array_equal(a, b)  # one bit plan per layer, each expert its own codes
    assert m.generate_ids([1, 2, 3], max_new_tokens=4, temperature=0.0)
    assert bench_moe_model.main(["--dir", str(tmp_path / "b"), "--preset", "tiny-moe", "--device", "cpu",
                                 "--quick"]) == 0  # fmt: skip
    assert "exl2cpp" in capsys.readouterr().out

