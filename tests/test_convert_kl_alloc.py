"""The KL-sensitivity allocation (convert alloc_sensitivity="kl", measure.kl_sensitivity): each block quantized
alone changes the final logits by a positive KL that grows as its option's bits fall, the KL of a block equals the
one HF transformers' fp32 model gives with the same quantized weights, and the scales weigh the allocation."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from exl2cpp import _C
from exl2cpp import convert as conv
from exl2cpp.convert import measure
from exl2cpp.convert.source import SourceModel
from test_convert import TINY, add_tokenizer, kl_mean
from test_models_hf import make_hf_model


@pytest.fixture(scope="module")
def tiny_measured(tmp_path_factory):
    d = tmp_path_factory.mktemp("kl_src")
    make_hf_model("llama", TINY, d)
    add_tokenizer(d)
    out = tmp_path_factory.mktemp("kl_q") / "q"
    conv.convert(d, out, bits=4.0, rows=4, length=64, measure_rows=2, workers=1, progress=False)
    meas = json.loads((out / "measurement.json").read_text())["measurement"]
    return d, meas


def test_kl_sensitivity_matches_hf_and_falls_with_bits(tiny_measured, monkeypatch):
    src_dir, meas = tiny_measured
    src = SourceModel(src_dir, "cpu")
    rng = np.random.default_rng(5)
    ids = rng.integers(3, 200, size=(2, 48)).astype(np.int32)
    kept: dict = {}
    real_set = None

    lo = measure.kl_sensitivity(src, src.calibration(2, 48), ids, meas, ref_bpw=2.0)
    hi = measure.kl_sensitivity(src, src.calibration(2, 48), ids, meas, ref_bpw=8.0)
    keys = [f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn", "mlp")]
    assert sorted(lo) == sorted(keys) and sorted(hi) == sorted(keys)
    for k in keys:
        assert lo[k]["kl"] > 0 and hi[k]["kl"] >= 0, (k, lo[k], hi[k])
        assert lo[k]["kl"] > 10 * hi[k]["kl"], (k, lo[k], hi[k])  # ~2 bpw against ~8 bpw
        assert lo[k]["err"] == pytest.approx(1 - meas[k][lo[k]["option"]]["accuracy"])
    scales = measure.kl_scales(lo)
    assert all(scales[k] == pytest.approx(np.sqrt(lo[k]["kl"]) / lo[k]["err"]) for k in keys)

    # the KL of one block against HF fp32 with the same weights: capture them through Calibration.set_weight
    cls = type(src.calibration(1, 16))
    real_set = cls.set_weight

    def spy(self, name, w):
        kept[name] = np.array(w, np.float32)
        return real_set(self, name, w)

    monkeypatch.setattr(cls, "set_weight", spy, raising=False)
    if cls.set_weight is not spy:  # a pybind11 class may refuse attributes: then the HF check is not possible
        pytest.skip("Calibration.set_weight cannot be wrapped")
    kept.clear()
    one = measure.kl_sensitivity(src, src.calibration(2, 48), ids, meas, ref_bpw=2.0)
    assert one["model.layers.1.mlp"]["kl"] == pytest.approx(lo["model.layers.1.mlp"]["kl"], rel=1e-9)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src_dir, dtype=torch.float32).eval()
    t = torch.tensor(ids.astype(np.int64))
    with torch.no_grad():
        ref = hf(t).logits.numpy().reshape(-1, src.vocab)
        for name in ("model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj"):
            hf.get_submodule(name).weight.copy_(torch.from_numpy(kept[name]))
        q = hf(t).logits.numpy().reshape(-1, src.vocab)
    want = kl_mean(ref, q)
    assert lo["model.layers.1.mlp"]["kl"] == pytest.approx(want, rel=0.05, abs=1e-6), want


def test_kl_allocation_end_to_end_and_recorded(tiny_measured, tmp_path):
    src_dir, _ = tiny_measured
    out = conv.convert(src_dir, tmp_path / "q", bits=3.0, rows=4, length=64, measure_rows=2, workers=1,
                       progress=False, alloc_sensitivity="kl")  # fmt: skip
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["alloc_sensitivity"] == "kl" and cfg["gptq_scale_search"] == "hmse"
    sens = json.loads((out / "kl_sensitivity.json").read_text())
    assert len(sens["sensitivity"]) == 4 and all(v["kl"] > 0 for v in sens["sensitivity"].values())
    # reused beside the measurement: the same files without the pass
    again = conv.convert(src_dir, tmp_path / "q2", bits=3.0, rows=4, length=64, measure_rows=2, workers=1,
                         progress=False, alloc_sensitivity="kl", measurement=out / "measurement.json")  # fmt: skip
    assert json.loads((again / "kl_sensitivity.json").read_text()) == sens
    # the scale search's switch: recorded, and the environment is restored afterwards
    off = conv.convert(src_dir, tmp_path / "q4", bits=3.0, rows=4, length=64, measure_rows=2, workers=1,
                       progress=False, scale_search="absmax", measurement=out / "measurement.json")  # fmt: skip
    old = conv.convert(src_dir, tmp_path / "q6", bits=3.0, rows=4, length=64, measure_rows=2, workers=1,
                       progress=False, alloc_sensitivity="outlier", measurement=out / "measurement.json")  # fmt: skip
    assert json.loads((old / "config.json").read_text())["quantization_config"]["alloc_sensitivity"] == "outlier"
    assert not (old / "kl_sensitivity.json").exists()
    cfg = json.loads((off / "config.json").read_text())["quantization_config"]
    assert cfg["gptq_scale_search"] == "absmax" and cfg["alloc_sensitivity"] == "kl"  # the default
    assert "EXL2CPP_GPTQ_SCALE_SEARCH" not in os.environ
    assert (off / "output.safetensors").read_bytes() != (again / "output.safetensors").read_bytes()
    with pytest.raises(conv.InvalidArgumentError, match="--scale-search"):
        conv.convert(src_dir, tmp_path / "q5", bits=3.0, scale_search="mse")
    with pytest.raises(conv.InvalidArgumentError, match="--alloc-sensitivity"):
        conv.convert(src_dir, tmp_path / "q3", bits=3.0, alloc_sensitivity="bogus")


def _kl_direct(ref_x, q_x, head):
    """mean KL(p || q) over tokens, both distributions materialised in float64."""

    def logp(x):
        z = x.astype(np.float64) @ head.astype(np.float64).T
        z -= z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    la, lb = logp(ref_x), logp(q_x)
    return float(np.sum(np.exp(la) * (la - lb))) / len(ref_x)


_HAS_CUDA = _C.cuda_compiled() and _C.cuda_device_count() > 0
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda,
                                               pytest.mark.skipif(not _HAS_CUDA, reason="needs a CUDA GPU")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block", [0, 7])
@pytest.mark.parametrize("noise", [0.0, 1e-3, 3e-2, 0.3])
def test_head_kl_matches_the_direct_kl(tiny_measured, noise, block, device):
    """Calibration.head_kl (the KL sensitivity pass's) against its kept reference equals the KL with both
    distributions materialised in float64, in one block of positions and in blocks of 7, from no change (exactly 0)
    to a large one; on CUDA too (cuBLAS fp32 logits: the same bound)."""
    src = SourceModel(tiny_measured[0], device)
    cal = src.calibration(2, 19)
    rng = np.random.default_rng(int(noise * 1e4) + 3)
    head = rng.normal(0, 0.3, (301, cal.hidden)).astype(np.float32)
    x = rng.normal(0, 3, (2, 19, cal.hidden)).astype(np.float32)
    cal.set_states(x)
    ref_x = cal.head_input().reshape(-1, cal.hidden)
    cal.set_head_ref(head)
    cal.set_states((x + rng.normal(0, noise, x.shape) * np.abs(x).mean()).astype(np.float32))
    q_x = cal.head_input().reshape(-1, cal.hidden)
    got = cal.head_kl(block)
    want = _kl_direct(ref_x, q_x, head)
    if noise == 0.0:
        assert got == 0.0
    else:
        assert want > 0 and abs(got - want) <= 1e-6 * want + 1e-12, (got, want)


def test_head_kl_errors(tiny_measured):
    src = SourceModel(tiny_measured[0], "cpu")
    cal = src.calibration(1, 8)
    with pytest.raises(conv.InvalidArgumentError, match="set_head_ref first"):
        cal.head_kl()
    with pytest.raises(conv.InvalidArgumentError, match=r"head must be a float \[vocab, "):
        cal.set_head_ref(np.ones((5, cal.hidden + 1), np.float32))
    cal.set_head_ref(np.ones((5, cal.hidden), np.float32))
    with pytest.raises(conv.InvalidArgumentError, match="block must be >= 0"):
        cal.head_kl(-1)
