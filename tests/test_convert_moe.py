"""Converting mixture-of-experts models (MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM) on tiny
random-weight HF models: the calibration forward reports each expert's routed rows (checked against a NumPy routing
of HF's MoE inputs), rarely and never chosen experts get a full-rank Hessian, and converted quants carry ExLlamaV2's
tensor names and measurement keys, keep the router and shared-expert gate unquantized, and load and run against HF
transformers fp32 (8 bits close, 4 bits bounded). torch/transformers are test-only references."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import exl2cpp  # noqa: E402
from exl2cpp import _C  # noqa: E402
from exl2cpp.convert import convert  # noqa: E402
from exl2cpp.convert.measure import expert_hessian, quantize_layer  # noqa: E402
from exl2cpp.convert.qparams import MLP_OPTIONS, block_options  # noqa: E402
from exl2cpp.convert.source import SourceModel, group_kind  # noqa: E402
from test_arch_moe import VOCAB, make_hf_moe, moe_layers, rel_l2  # noqa: E402
from test_convert import kl_mean  # noqa: E402
from test_convert_calibration import _forward  # noqa: E402

HAS_CUDA = _C.cuda_compiled() and _C.cuda_device_count() > 0
ROWS, TOKENS = 3, 45
EXPERT_ROLES = {"w1": "gate", "w3": "up", "w2": "down"}


def _hf_moe_inputs(hf, ids):
    """(logits, {layer: the MoE block's input [rows * tokens, hidden]}) of HF's forward."""
    seen, hooks = {}, []

    def keep(i):
        def hook(module, args, output):
            seen.setdefault(i, args[0].reshape(-1, args[0].shape[-1]).numpy().copy())

        return hook

    for i, layer in enumerate(hf.model.layers):
        hooks.append(layer.mlp.register_forward_hook(keep(i)))
    with torch.no_grad():
        logits = hf(torch.tensor(ids.astype(np.int64))).logits.numpy()
    for h in hooks:
        h.remove()
    return logits, seen


def _silu(x):
    return x / (1.0 + np.exp(-x))


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe_step"])
def test_calibration_reports_each_experts_routed_rows(kind, tmp_path):
    """The layer-by-layer forward gives HF's logits; in each MoE layer the router reports the whole MoE input and
    expert e's gate / up its rows routed to e (top-k of the router's softmax, token order), its down their GLU
    products; an expert no token chose is not reported."""
    hf = make_hf_moe(kind, tmp_path)
    src = SourceModel(tmp_path)
    ids = np.random.default_rng(3).integers(0, VOCAB, size=(ROWS, TOKENS)).astype(np.int32)
    ref, moe_in = _hf_moe_inputs(hf, ids)
    cal = src.calibration(ROWS, TOKENS)
    got: dict[str, np.ndarray] = {}

    def hook(name):
        assert name not in got, f"{name} reported twice"
        got[name] = cal.input()
        assert cal.input_rows() == got[name].shape[0]

    assert rel_l2(_forward(src, cal, ids, hook), ref) < 1e-5
    k, n_experts = src.moe["top_k"], src.moe["experts"]
    unrouted = 0
    for i in moe_layers(tmp_path):
        info = src.linear_info(i)
        roles = {d["role"]: d for d in info.values() if not d["role"].startswith("w")}
        router = roles["router"]["name"]
        assert not roles["router"]["quantized"]
        assert ("shared_expert_gate" in roles) == (kind == "qwen2_moe")
        x = moe_in[i]
        assert rel_l2(got[router], x) < 1e-5
        lg = x.astype(np.float64) @ src.tensor(router + ".weight").T.astype(np.float64)
        top = np.argsort(-lg, axis=1, kind="stable")[:, :k]
        experts = [d for d in info.values() if d["role"] in EXPERT_ROLES]
        assert len(experts) == 3 * n_experts and all(d["quantized"] for d in experts)
        by = {(int(d["name"].split(".experts.")[1].split(".")[0]), EXPERT_ROLES[d["role"]]): d for d in experts}
        for e in range(n_experts):
            rows = np.nonzero((top == e).any(axis=1))[0]
            gate, up, down = by[(e, "gate")], by[(e, "up")], by[(e, "down")]
            assert up["input"] == gate["name"] and down["input"] == down["name"]
            if len(rows) == 0:
                unrouted += 1
                assert gate["name"] not in got and down["name"] not in got
                continue
            xe = x[rows]
            glu = _silu(xe @ src.tensor(gate["name"] + ".weight").T) * (xe @ src.tensor(up["name"] + ".weight").T)
            assert rel_l2(got[gate["name"]], xe) < 1e-5 and rel_l2(got[up["name"]], xe) < 1e-5
            assert rel_l2(got[down["name"]], glu) < 1e-5
    assert unrouted < n_experts


def test_expert_hessian_fills_rare_experts():
    """Enough rows: the routed x^T x as it is; fewer than the input width: plus the missing rows' worth of the
    prior (gate / up: the MoE input's per-token Hessian) or of a scaled identity (down); no rows: the prior alone."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 8)).astype(np.float32)
    h = x.T @ x
    assert expert_hessian(h, 40, 8) is h
    prior = (x.T @ x / 40).astype(np.float32)
    few = x[:3].T @ x[:3]
    np.testing.assert_allclose(expert_hessian(few, 3, 8, prior), few + 5 * prior, rtol=1e-6)
    np.testing.assert_allclose(expert_hessian(None, 0, 8, prior), 8 * prior, rtol=1e-6)
    mean_diag = np.trace(few) / (8 * 3)
    np.testing.assert_allclose(expert_hessian(few, 3, 8), few + 5 * mean_diag * np.eye(8), rtol=1e-6)
    np.testing.assert_array_equal(expert_hessian(None, 0, 8), 8 * np.eye(8, dtype=np.float32))
    for m in (0, 3):  # full rank either way
        assert np.linalg.matrix_rank(expert_hessian(few if m else None, m, 8, prior)) == 8
        assert np.linalg.matrix_rank(expert_hessian(few if m else None, m, 8)) == 8


def test_unrouted_experts_are_quantized(tmp_path):
    """Top-1 routing over 16 tokens leaves experts of layer 0 without a token; its quantization still writes every
    expert (those from the prior alone), and at 8 bits each dequantizes close to its file weight; the router stays
    out of the quantized tensors."""
    make_hf_moe("mixtral", tmp_path, num_experts_per_tok=1, num_local_experts=6)
    src = SourceModel(tmp_path)
    ids = np.random.default_rng(2).integers(0, VOCAB, size=(1, 16)).astype(np.int32)
    cal = src.calibration(1, 16)
    cal.embed(ids)
    cal.load_layer(0)
    seen: set[str] = set()
    for b in range(cal.n_blocks):
        cal.run(b, seen.add)
        cal.commit(False)
    gates = {d["name"] for d in src.layer_linears[0] if d["role"] == "w1"}
    assert 0 < len(gates & seen) < len(gates)  # some experts routed, some not
    cal.embed(ids)
    configs = {}
    for key, g in src.groups(0).items():
        projs, options = block_options(group_kind(d["role"] for d in g))
        best = dict(zip(projs, options[-1]))  # the 8-bit row
        configs[key] = {d["role"]: best[d["role"]].groups(d["in"]) for d in g}
    tens = quantize_layer(src, cal, 0, configs)
    for d in src.layer_linears[0]:
        part = {k[len(d["name"]) + 1 :]: v for k, v in tens.items() if k.startswith(d["name"] + ".")}
        assert "q_weight" in part, d["name"]
        w = _C.exl2_dequantize(part, out_features=d["out"]).astype(np.float32).T
        assert rel_l2(w, src.tensor(d["name"] + ".weight")) < 0.01, d["name"]
    assert not any(".block_sparse_moe.gate." in k for k in tens)


CONVERT_CASES = ["mixtral", pytest.param("qwen2_moe", marks=pytest.mark.slow),
                 pytest.param("qwen3_moe", marks=pytest.mark.slow)]  # fmt: skip


@pytest.mark.parametrize("kind", CONVERT_CASES)
def test_convert_moe_names_and_quality(kind, tmp_path):
    """exl2cpp convert of a tiny MoE model: experts under ExLlamaV2's names as EXL2 (Mixtral
    block_sparse_moe.experts.N.w1 / w3 / w2, Qwen mlp.experts.N.gate_proj / up_proj / down_proj), the router and the
    shared expert's gate as fp16 weights, the shared expert quantized; measurement.json keys every MoE layer's
    experts model.layers.N.block_sparse_moe (w1 / w3 / w2); the result loads through the runtime, 8 bits close to
    HF fp32, 4 bits bounded and worse than 8."""
    from safetensors.numpy import load_file

    src = tmp_path / "src"
    hf = make_hf_moe(kind, src)
    ids = np.random.default_rng(11).integers(0, VOCAB, size=96)
    with torch.no_grad():
        ref = hf(torch.tensor(ids[None].astype(np.int64))).logits[0].numpy()
    kl, meas = {}, None
    for bits in (8.0, 4.0):
        out = convert(src, tmp_path / f"q{bits}", bits=bits, head_bits=8, rows=6, length=64, measure_rows=3,
                      measurement=meas, progress=False, workers=1)  # fmt: skip
        meas = meas or out / "measurement.json"
        model = exl2cpp.load(out)
        info = model.info()
        # a promotion of the fill raises one group of every expert: coarse steps on a tiny model
        assert info["quantization"] == "exl2" and bits - 0.1 <= info["bpw_layers"] <= bits + 1e-9, info
        logits = model.forward(ids.tolist())
        kl[bits] = kl_mean(ref, logits)
        if bits == 8.0:
            assert rel_l2(logits, ref) < 0.15, kind
    assert kl[8.0] < 0.01 and kl[8.0] < kl[4.0] < 0.15, kl
    tensors = load_file(str(tmp_path / "q4.0" / "output.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    n_experts = cfg.get("num_local_experts") or cfg["num_experts"]
    names = ("block_sparse_moe.experts.", ("w1", "w3", "w2")) if kind == "mixtral" else \
        ("mlp.experts.", ("gate_proj", "up_proj", "down_proj"))  # fmt: skip
    router = "block_sparse_moe.gate" if kind == "mixtral" else "mlp.gate"
    measured = json.loads(meas.read_text())["measurement"]
    for i in moe_layers(src):
        p = f"model.layers.{i}."
        for e in range(n_experts):
            for leaf in names[1]:
                assert f"{p}{names[0]}{e}.{leaf}.q_weight" in tensors
                assert f"{p}{names[0]}{e}.{leaf}.weight" not in tensors
        assert tensors[f"{p}{router}.weight"].dtype == np.float16
        assert not any(k.startswith(f"{p}{router}.q_") for k in tensors)
        if kind == "qwen2_moe":
            assert tensors[f"{p}mlp.shared_expert_gate.weight"].dtype == np.float16
            assert not any(k.startswith(f"{p}mlp.shared_expert_gate.q_") for k in tensors)
            for leaf in ("gate_proj", "up_proj", "down_proj"):
                assert f"{p}mlp.shared_expert.{leaf}.q_weight" in tensors
            assert {"gate_proj", "up_proj", "down_proj"} <= set(measured[f"{p}mlp"][0])
        rows = measured[f"{p}block_sparse_moe"]
        assert all({"w1", "w3", "w2", "accuracy", "total_bits"} <= set(r) for r in rows)
        assert len(rows) == len(MLP_OPTIONS)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_cuda_moe_calibration_matches_cpu(kind, tmp_path):
    """The MoE calibration forward on the CUDA backend (fp32, the experts' per-expert path): every reported input
    (each expert's routed rows) and the states agree with the CPU's to fp32 rounding."""
    make_hf_moe(kind, tmp_path)
    ids = np.random.default_rng(3).integers(0, VOCAB, size=(ROWS, TOKENS)).astype(np.int32)
    res = {}
    for device in ("cpu", "cuda"):
        src = SourceModel(tmp_path, device)
        cal = src.calibration(ROWS, TOKENS)
        got: dict[str, np.ndarray] = {}
        _forward(src, cal, ids, lambda name, cal=cal, got=got: got.setdefault(name, cal.input()))
        res[device] = (got, cal.states())
    (gc, xc), (gg, xg) = res["cpu"], res["cuda"]
    assert sorted(gc) == sorted(gg)
    for n in gc:
        assert rel_l2(gg[n], gc[n]) < 1e-5, n
    assert rel_l2(xg, xc) < 1e-5


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_convert_mixtral_runs(tmp_path):
    """exl2cpp convert on the CUDA backend of a tiny Mixtral: loads on the GPU, 8 bits close to HF fp32."""
    src = tmp_path / "src"
    hf = make_hf_moe("mixtral", src)
    ids = np.random.default_rng(11).integers(0, VOCAB, size=96)
    with torch.no_grad():
        ref = hf(torch.tensor(ids[None].astype(np.int64))).logits[0].numpy()
    out = convert(src, tmp_path / "q8", bits=8.0, head_bits=8, rows=6, length=64, measure_rows=3, progress=False,
                  device="cuda")  # fmt: skip
    assert kl_mean(ref, exl2cpp.load(out, device="cuda").forward(ids.tolist())) < 0.01
