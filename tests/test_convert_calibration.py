"""The converter's calibration forward (_C.Calibration: the runtime's decoder body one layer at a time in fp32 with
capture hooks, cpp/model/calibration.h) against HF transformers fp32: the layer-by-layer forward gives HF's logits,
each linear's reported input is the input HF's nn.Linear receives, replaced weights compute what HF computes with
them; and architectures convert through the generic path (Qwen3, Mistral with a sliding window)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import exl2cpp  # noqa: E402
from exl2cpp import _C  # noqa: E402
from exl2cpp.convert import convert  # noqa: E402
from exl2cpp.convert.measure import rel_err  # noqa: E402
from exl2cpp.convert.source import SourceModel  # noqa: E402
from test_convert import kl_mean  # noqa: E402
from test_models_hf import make_hf_model, rel_l2  # noqa: E402

HAS_CUDA = _C.cuda_compiled() and _C.cuda_device_count() > 0
ROWS, TOKENS = 3, 45  # awkward: windows of 24 / 20 tokens inside, a partial cache page


def _ids(vocab=211, seed=3):
    return np.random.default_rng(seed).integers(0, vocab, size=(ROWS, TOKENS)).astype(np.int32)


def _hf_inputs(hf, ids, replace=None):
    """(logits, {module name: input [rows * tokens, in]}) of HF's forward, with weights replaced first."""
    seen = {}
    hooks = []

    def keep(name):
        def hook(module, args, output):
            seen.setdefault(name, args[0].reshape(-1, args[0].shape[-1]).numpy().copy())

        return hook

    for name, mod in hf.named_modules():
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            hooks.append(mod.register_forward_hook(keep(name)))
    with torch.no_grad():
        for name, w in (replace or {}).items():
            hf.get_submodule(name).weight.copy_(torch.from_numpy(w))
        logits = hf(torch.tensor(ids.astype(np.int64))).logits.numpy()
    for h in hooks:
        h.remove()
    return logits, seen


def _forward(src, cal, ids, hook=None):
    cal.embed(ids)
    for i in range(src.n_layers):
        cal.load_layer(i)
        for b in range(cal.n_blocks):
            cal.run(b, hook)
            cal.commit(False)
    return cal.head_input() @ src.head_weight().T


@pytest.mark.parametrize("kind", ["llama", "llama_tied", "llama_bias", "qwen3", "mistral_window", "qwen2_window",
                                  "llama_rope_llama3"])  # fmt: skip
def test_forward_and_captured_inputs_match_hf(kind, tmp_path):
    hf = make_hf_model(kind, {}, tmp_path)
    src = SourceModel(tmp_path)
    ids = _ids()
    ref, hf_in = _hf_inputs(hf, ids)
    cal = src.calibration(ROWS, TOKENS)
    got: dict[str, np.ndarray] = {}

    def hook(name):
        assert name not in got, f"{name} reported twice"
        got[name] = cal.input()

    logits = _forward(src, cal, ids, hook)
    assert rel_l2(logits, ref) < 1e-5
    assert sorted(got) == sorted(hf_in)  # HF's module names are the file's prefixes
    for name, x in got.items():
        assert x.shape == hf_in[name].shape
        assert rel_l2(x, hf_in[name]) < 1e-5, name
    infos = [d for i in range(src.n_layers) for d in src.layer_linears[i]]
    assert [d["name"] for d in infos] == [n for n in got]  # file order is the order the body calls them
    lead = {d["name"]: d["input"] for d in infos}
    for name, x in got.items():  # linears said to share an input get the same one
        np.testing.assert_array_equal(x, got[lead[name]])
    assert lead["model.layers.0.self_attn.v_proj"] == "model.layers.0.self_attn.q_proj"
    assert lead["model.layers.1.mlp.up_proj"] == "model.layers.1.mlp.gate_proj"
    assert lead["model.layers.1.mlp.down_proj"] == "model.layers.1.mlp.down_proj"


def test_replaced_weights_match_hf_and_block_errors(tmp_path):
    # set_weight before a run and inside a hook (for the linear being called) computes what HF computes with the
    # same weights; rel_err is the NumPy formula on the block outputs; reset_weight restores the file's weight
    hf = make_hf_model("qwen3", {}, tmp_path)
    src = SourceModel(tmp_path)
    ids = _ids(seed=5)
    rng = np.random.default_rng(1)
    new = {n: (src.tensor(n + ".weight") * rng.uniform(0.8, 1.2, src.tensor(n + ".weight").shape)).astype(np.float32)
           for n in ("model.layers.0.self_attn.o_proj", "model.layers.1.mlp.down_proj", "model.layers.1.self_attn.k_proj")}  # fmt: skip
    ref, _ = _hf_inputs(hf, ids, new)  # HF's module names are the file's prefixes
    cal = src.calibration(ROWS, TOKENS)
    cal.embed(ids)
    errs = []
    for i in range(src.n_layers):
        cal.load_layer(i)
        for b in range(cal.n_blocks):
            cal.run(b)
            cal.set_ref()
            clean = cal.output()

            def hook(name):
                if name in new:
                    cal.set_weight(name, new[name])

            cal.run(b, hook)
            y = cal.output()
            errs.append((cal.rel_err(), rel_err(y, clean)))
            cal.commit(False)
    logits = cal.head_input() @ src.head_weight().T
    assert rel_l2(logits, ref) < 1e-5
    assert sum(e > 0 for e, _ in errs) == 3  # the three blocks with a replaced weight
    for e, want in errs:
        assert e == pytest.approx(want, rel=1e-6, abs=1e-12)
    cal.load_layer(0)
    cal.embed(ids)
    cal.run(0)
    cal.set_ref()
    cal.set_weight("model.layers.0.self_attn.o_proj", new["model.layers.0.self_attn.o_proj"])
    cal.run(0)
    assert cal.rel_err() > 0
    cal.reset_weight("model.layers.0.self_attn.o_proj")
    cal.run(0)
    assert cal.rel_err() == 0.0


def test_errors(tmp_path):
    make_hf_model("llama", {}, tmp_path)
    src = SourceModel(tmp_path)
    cal = src.calibration(2, 16)
    with pytest.raises(exl2cpp.InvalidArgumentError, match="load_layer first"):
        cal.run(0)
    cal.embed(np.zeros((2, 16), np.int32))
    cal.load_layer(0)
    with pytest.raises(exl2cpp.InvalidArgumentError, match="only inside a run's hook"):
        cal.input()
    with pytest.raises(exl2cpp.InvalidArgumentError, match="block 2 is not in"):
        cal.run(2)
    with pytest.raises(exl2cpp.InvalidArgumentError, match="has no linear 'model.layers.1.mlp.up_proj'"):
        cal.set_weight("model.layers.1.mlp.up_proj", np.zeros((160, 96), np.float32))
    with pytest.raises(exl2cpp.InvalidArgumentError, match=r"must be \[160, 96\]"):
        cal.set_weight("model.layers.0.mlp.up_proj", np.zeros((96, 160), np.float32))
    with pytest.raises(exl2cpp.InvalidArgumentError, match="ids must be i32"):
        cal.embed(np.zeros((2, 15), np.int32))

    def boom(name):
        raise KeyError(f"from the hook at {name}")

    with pytest.raises(KeyError, match="from the hook at model.layers.0.self_attn.q_proj"):
        cal.run(0, boom)
    cal.run(0)  # the hook is gone after a raising run


def test_unknown_architecture_lists_the_known_ones(tmp_path):
    import json

    make_hf_model("llama", {}, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["NoSuchForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(exl2cpp.UnsupportedError, match="LlamaForCausalLM"):
        SourceModel(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3", "mistral_window"])
def test_generic_architectures_convert_and_run(kind, tmp_path):
    # no per-architecture code in the converter: q/k norms (Qwen3) and a 24-token window shorter than the
    # calibration rows (Mistral v0.1) come from the runtime's decoder spec
    src = tmp_path / "src"
    hf = make_hf_model(kind, {"num_hidden_layers": 3}, src)
    ids = np.random.default_rng(11).integers(0, 211, size=80)
    with torch.no_grad():
        ref = hf(torch.tensor(ids[None].astype(np.int64))).logits[0].numpy()
    kls = {}
    meas = None
    for bits in (3.5, 6.0):  # the tiny layers' EXL2 overhead puts the cheapest mix above 3.0
        out = convert(src, tmp_path / f"q{bits}", bits=bits, rows=4, length=64, measure_rows=2, measurement=meas,
                      progress=False, workers=1)  # fmt: skip
        meas = meas or out / "measurement.json"
        model = exl2cpp.load(out)
        info = model.info()
        assert info["quantization"] == "exl2" and bits - 0.02 <= info["bpw_layers"] <= bits + 1e-9, info
        kls[bits] = kl_mean(ref, model.forward(ids.tolist()))
    assert kls[3.5] > kls[6.0] > 0, kls
    assert kls[6.0] < 0.02, kls


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["llama_bias", "qwen3", "mistral_window"])
def test_cuda_calibration_matches_cpu(kind, tmp_path):
    # the same body on the CUDA backend in fp32 (cuBLAS products, the fp32 attention kernels): inputs, Hessians
    # (on the device), block errors and states agree with the CPU's to fp32 rounding
    make_hf_model(kind, {}, tmp_path)
    src_c, src_g = SourceModel(tmp_path, "cpu"), SourceModel(tmp_path, "cuda")
    ids = _ids()
    res = {}
    for src in (src_c, src_g):
        cal = src.calibration(ROWS, TOKENS)
        cal.embed(ids)
        got, hs, errs = {}, {}, []
        for i in range(src.n_layers):
            cal.load_layer(i)
            for b in range(cal.n_blocks):

                def hook(name, cal=cal, got=got, hs=hs):
                    got[name] = cal.input()
                    hs[name] = cal.input_hessian()

                cal.run(b, hook)
                cal.set_ref()
                for d in src.layer_linears[i]:
                    if d["name"] in got and d["name"].endswith(("o_proj", "down_proj")):
                        cal.set_weight(d["name"], src.tensor(d["name"] + ".weight") * np.float32(1.01))
                cal.run(b)
                errs.append(cal.rel_err())
                cal.commit(True)
        res[src.device] = (got, hs, errs, cal.states())
    (gc, hc, ec, xc), (gg, hg, eg, xg) = res["cpu"], res["cuda"]
    for n in gc:
        assert rel_l2(gg[n], gc[n]) < 1e-5, n
        assert np.max(np.abs(hg[n] - hc[n])) <= 5e-5 * np.max(np.abs(hc[n])), n
    np.testing.assert_allclose(eg, ec, rtol=1e-3)
    assert rel_l2(xg, xc) < 1e-5


def test_quantize_layer_states_are_the_quantized_layers_forward(tmp_path):
    # the quantization pass installs exactly the packed weights before each product: its states after layer 0
    # equal a fresh run of layer 0 with the packed tensors' dequantized weights, and its measurement's clean
    # states equal the clean forward
    from exl2cpp.convert import measure

    make_hf_model("qwen3", {}, tmp_path)
    src = SourceModel(tmp_path)
    ids = _ids(seed=7)
    cal = src.calibration(ROWS, TOKENS)
    cal.embed(ids)
    configs = {key: {d["role"]: [(4, 32)] * (d["in"] // 32) for d in g} for key, g in src.groups(0).items()}
    tensors = measure.quantize_layer(src, cal, 0, configs)
    got = cal.states()
    ref = src.calibration(ROWS, TOKENS)
    ref.embed(ids)
    ref.load_layer(0)
    for d in src.layer_linears[0]:
        part = {k[len(d["name"]) + 1 :]: v for k, v in tensors.items() if k.startswith(d["name"] + ".")}
        w = _C.exl2_dequantize(part, in_features=d["in"], out_features=d["out"]).astype(np.float32).T
        ref.set_weight(d["name"], np.ascontiguousarray(w))
    for b in range(ref.n_blocks):
        ref.run(b)
        ref.commit(False)
    np.testing.assert_array_equal(got, ref.states())
    clean = src.calibration(ROWS, TOKENS)
    clean.embed(ids)
    measure.measure_layer(src, clean, 0)
    ref.embed(ids)
    ref.load_layer(0)
    for b in range(ref.n_blocks):
        ref.run(b)
        ref.commit(False)
    np.testing.assert_array_equal(clean.states(), ref.states())
