"""The EXL2 converter (exl2cpp.convert): candidate tables and bits vs ExLlamaV2's own measurement, GPTQ packing
bit-exact and better than round-to-nearest, the allocator against brute force, and end to end on tiny random HF
Llamas: bpw on target, KL falling as bits rise, byte-identical resume, calibration files, clear errors."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import exl2cpp
from exl2cpp import _C
from exl2cpp import convert as conv
from exl2cpp.cli import main as cli_main
from exl2cpp.convert import allocate as alloc
from exl2cpp.convert import gptq, measure
from exl2cpp.convert.calibration import read_calibration_file
from exl2cpp.convert.source import SourceModel
from exl2cpp.convert.qparams import (
    ATTN_OPTIONS,
    ATTN_PROJS,
    HEAD_OPTIONS,
    MLP_OPTIONS,
    MLP_PROJS,
    QParams,
    block_options,
    total_bits,
)
from test_models_hf import make_hf_model

LICENSE = "/usr/share/common-licenses/Apache-2.0"
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
# wide enough that EXL2's per-linear overhead (32 bits per input row for q_invperm, 4 per column and group for
# scales) leaves 2.5 bpw reachable: its cheapest option mix averages 2.42 bpw
SMALL = {"hidden_size": 320, "intermediate_size": 864, "num_hidden_layers": 2, "num_attention_heads": 10,
         "num_key_value_heads": 5, "head_dim": 32, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip


def add_tokenizer(folder, vocab=211):
    """A small BPE tokenizer (vocab 211, <s> = 1) so the tiny models can read calibration text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([LICENSE], trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                             limit_alphabet=60, show_progress=False))  # fmt: skip
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}, f)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_src")
    make_hf_model("llama", TINY, d)
    add_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    d = tmp_path_factory.mktemp("small_src")
    make_hf_model("llama", SMALL, d)
    add_tokenizer(d)
    return d


def kl_mean(p_logits, q_logits):
    p = p_logits.astype(np.float64)
    q = q_logits.astype(np.float64)
    lp = p - p.max(1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(1, keepdims=True))
    lq = q - q.max(1, keepdims=True)
    lq -= np.log(np.exp(lq).sum(1, keepdims=True))
    return float(np.mean(np.sum(np.exp(lp) * (lp - lq), axis=1)))


def files_of(folder):
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir()) if f.is_file()}


# -- building blocks ---------------------------------------------------------------------------------


def test_candidate_tables_and_bits_match_exllamav2_measurement(fixtures_dir):
    """Our option tables equal ExLlamaV2's (its measurement.json lists every config), and our group layout +
    bits accounting gives its total_bits for every option of the SmolLM2 shapes."""
    meas = json.loads((fixtures_dir / "fx_measurement.json").read_text())["measurement"]
    shapes = {"q_proj": (576, 576), "k_proj": (576, 192), "v_proj": (576, 192), "o_proj": (576, 576),
              "gate_proj": (576, 1536), "up_proj": (576, 1536), "down_proj": (1536, 576)}  # fmt: skip
    for mode in ("self_attn", "mlp"):
        projs, options = block_options(mode)
        for layer in range(4):
            rows = meas[f"model.layers.{layer}.{mode}"]
            assert len(rows) == len(options)
            for row, opt in zip(rows, options):
                assert tuple(QParams.from_json(row[p]) for p in projs) == opt
                bits = sum(total_bits(q.groups(shapes[p][0]), shapes[p][1]) for p, q in zip(projs, opt))
                assert bits == row["total_bits"]


def test_group_layout_hand_cases():
    # in=576, 5% at 3 bits in groups of 64: ceil(28.8/64) = 1 group; the rest 512 rows = 8 groups of 64
    assert QParams.parse("0.05:3b_64g/0.95:2b_64g").groups(576) == [(3, 64)] + [(2, 64)] * 8
    # last group clipped to in: 96 rows with 64-row groups
    assert QParams.parse("1:4b_64g").groups(96) == [(4, 64), (4, 32)]
    # hand count: 2 groups (4b, 64 rows) of a 64x40 linear: codes 64*40*4 + 2*(16+32) + 2*40*4 + 64*32
    assert total_bits([(4, 32), (4, 32)], 40) == 10240 + 96 + 320 + 2048
    assert HEAD_OPTIONS[6].groups(576)[:1] == [(8, 128)]


def test_runtime_scale_hand_cases():
    # qs^2 * fp16(q_scale_max/256): qs=16, max 1.0 -> 1.0; qs=1 -> 1/256; max 2^-10 (msc subnormal 2^-18), qs=3
    qs = np.array([16, 1, 3], np.float32)
    got = gptq.runtime_scale(qs, np.array([1.0, 1.0, 2.0**-10], np.float16))
    assert got.tolist() == [1.0, 1.0 / 256, 9 * 2.0**-18]


def test_gptq_bit_exact_pack_and_better_than_rtn():
    rng = np.random.default_rng(0)
    n_out, n_in = 72, 160  # out not a multiple of 32: padded columns
    w = rng.normal(0, 0.05, (n_out, n_in)).astype(np.float32)
    mix = rng.normal(0, 1, (n_in, n_in)) * 0.3 + np.eye(n_in)  # correlated inputs, unequal scales
    x = (rng.normal(0, 1, (3000, n_in)) @ mix * rng.uniform(0.2, 3, n_in)).astype(np.float32)
    h = x.T @ x
    y = x @ w.T
    for spec in ("1:4b_32g", "0.1:8b_32g/0.9:4b_64g", "0.05:6b_32g/0.2:3b_64g/0.75:2b_64g"):
        groups = QParams.parse(spec).groups(n_in)
        q = gptq.quantize(w, h, groups)
        packed = q.pack()
        gptq.check_packed(packed, q, "t")  # runtime dequantization == GPTQ's own, bit for bit
        layout = _C.exl2_validate(packed, out_features=n_out)
        assert layout["total_bits"] == total_bits(groups, n_out)
        assert layout["bits_per_group"] == [b for b, _ in groups]
        assert np.array_equal(q.perm, np.argsort(-np.diag(h), kind="stable"))  # act order
        # same groups, scales and order without error feedback (identity Hessian) = round to nearest
        rtn = gptq.quantize(w[:, q.perm], np.eye(n_in, dtype=np.float32) * 1e3, groups)
        w_rtn = np.empty_like(w)
        w_rtn[:, q.perm] = rtn.weight
        e_gptq = np.linalg.norm(x @ q.weight.T - y)
        e_rtn = np.linalg.norm(x @ w_rtn.T - y)
        assert e_gptq < 0.9 * e_rtn, (spec, e_gptq, e_rtn)


def test_allocate_matches_brute_force_and_fill_hits_target():
    rng = np.random.default_rng(5)
    blocks = []
    for b in range(4):
        costs = np.sort(rng.uniform(1000, 9000, 6))
        errs = np.sort(rng.uniform(0.001, 0.2, 6))[::-1]
        blocks.append({"key": f"b{b}", "options": [{"cost": c, "err": e} for c, e in zip(costs, errs)]})
    numel = 4000
    lo = sum(b["options"][0]["cost"] for b in blocks) / numel
    hi = sum(b["options"][-1]["cost"] for b in blocks) / numel
    for target in (lo, lo + 0.3 * (hi - lo), lo + 0.71 * (hi - lo), hi):
        picks, info = alloc.allocate(blocks, target, numel, norm=1.0)
        best = None
        for combo in itertools.product(range(6), repeat=4):
            c = sum(blocks[i]["options"][j]["cost"] for i, j in enumerate(combo))
            e = sum(blocks[i]["options"][j]["err"] for i, j in enumerate(combo))
            if c <= target * numel and (best is None or e < best[0] - 1e-12):
                best = (e, combo)
        got = sum(blocks[i]["options"][j]["err"] for i, j in enumerate(picks))
        assert got == pytest.approx(best[0], rel=1e-9), target
        assert info["dp_bits"] <= target * numel
    with pytest.raises(exl2cpp.InvalidArgumentError, match="below the smallest"):
        alloc.allocate(blocks, lo - 0.01, numel)
    # fill: promotes groups until less than one promotion of budget is left
    configs = {"a": {"p": [[4, 64], [4, 64]]}, "b": {"p": [[3, 32], [2, 32], [2, 32]]}}
    shapes = {"a": {"p": (128, 48, False)}, "b": {"p": (96, 48, False)}}
    used0 = sum(alloc.linear_cost(c["p"], shapes[k]["p"]) for k, c in configs.items())
    new, used = alloc.fill(configs, shapes, {"a": 0.1, "b": 0.2}, used0 + 5000)
    assert used <= used0 + 5000 and used0 + 5000 - used < 32 * 48 * 2
    assert new["b"]["p"][1][0] == 3  # the worst block promoted its first 2-bit group to the run above
    for c in new.values():
        bits = [g[0] for g in c["p"]]
        assert bits == sorted(bits, reverse=True)


# -- end to end on tiny models -------------------------------------------------------------------------


@pytest.mark.slow
def test_convert_hits_bpw_and_kl_falls_with_bits(small, tmp_path):
    ids = np.random.default_rng(11).integers(3, 211, size=200).tolist()
    ref = exl2cpp.load(small).forward(ids)
    kls = {}
    meas = None
    for bits in (2.5, 4.0, 6.0):  # the first run measures, the others reuse its measurement.json
        out = conv.convert(small, tmp_path / f"q{bits}", bits=bits, rows=8, length=96, measure_rows=4,
                           measurement=meas, progress=False)  # fmt: skip
        meas = meas or out / "measurement.json"
        model = exl2cpp.load(out)
        info = model.info()
        assert info["quantization"] == "exl2"
        assert bits - 0.02 <= info["bpw_layers"] <= bits + 1e-9, (bits, info["bpw_layers"])
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        assert qc["quant_method"] == "exl2" and qc["bits"] == bits and qc["head_bits"] == 6
        assert qc["calibration"]["dataset"] == "(default)" and qc["calibration"]["rows"] == 8
        assert qc["calibration"]["length"] == 96 and qc["calibration"]["measure_rows"] == 4 and qc["gptq_damp"] == 0.12
        assert qc["calibration"]["sources"] == {"model_generated": 2, "python_stdlib": 2, "licenses": 4}
        kls[bits] = kl_mean(ref, model.forward(ids))
    assert kls[2.5] > kls[4.0] > kls[6.0] > 0, kls
    assert kls[6.0] < 0.02, kls


def test_written_files_get_the_umask_mode(tmp_path):
    """output*.safetensors and the state files have the mode any new file gets (safetensors' save_file alone
    writes 0600)."""
    from exl2cpp.convert.writer import write_output

    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    (src / "config.json").write_text("{}")
    (tmp_path / "probe").write_text("")
    want = (tmp_path / "probe").stat().st_mode & 0o777
    tensors = {"a": np.zeros((4, 4), np.float16), "b": np.ones(8, np.float32)}
    for shard_mb, n in ((1.0, 1), (40 / 2**20, 2)):
        for f in out.iterdir():
            f.unlink()
        paths = write_output(out, src, tensors, shard_mb, {"bits": 4.0})
        assert len(paths) == n
        for f in out.iterdir():
            assert f.stat().st_mode & 0o777 == want, (f.name, oct(f.stat().st_mode))
    conv._save_tensors(tmp_path / "state.safetensors", tensors)
    assert (tmp_path / "state.safetensors").stat().st_mode & 0o777 == want


@pytest.mark.slow
def test_resume_after_interrupts_gives_identical_files(tiny, tmp_path):
    args = {"bits": 3.5, "rows": 6, "length": 64, "seed": 3, "shard_size": 0.05, "workers": 2, "progress": False}
    a = conv.convert(tiny, tmp_path / "a", **args)
    assert len(list(a.glob("output-*-of-*.safetensors"))) > 1  # sharded
    assert not (a / conv.STATE_DIR).exists()

    def interrupt_at(phase, layer, where):
        def hook(p, i, w):
            if (p, i, w) == (phase, layer, where):
                raise KeyboardInterrupt(f"simulated kill in {p} layer {i} {w}")

        return hook

    b = tmp_path / "b"
    try:
        conv._test_hook = interrupt_at("measure", 1, "start")
        with pytest.raises(KeyboardInterrupt):
            conv.convert(tiny, b, **args)
        with pytest.raises(exl2cpp.InvalidArgumentError, match="--resume continues it"):
            conv.convert(tiny, b, **args)
        conv._test_hook = interrupt_at("quant", 1, "block1")  # in the middle of layer 1 (before its MLP)
        with pytest.raises(KeyboardInterrupt):
            conv.convert(tiny, b, resume=True, **args)
        assert (b / conv.STATE_DIR / "quant_0000.safetensors").is_file()
        with pytest.raises(exl2cpp.InvalidArgumentError, match="different arguments.*bits"):
            conv.convert(tiny, b, resume=True, **{**args, "bits": 4.0})
    finally:
        conv._test_hook = None
    conv.convert(tiny, b, resume=True, **args)
    fa, fb = files_of(a), files_of(b)
    assert sorted(fa) == sorted(fb)
    for name in fa:
        assert fa[name] == fb[name], name
    # reusing the measurement skips that pass and gives the same weights
    c = conv.convert(tiny, tmp_path / "c", measurement=a / "measurement.json", **args)
    fc = files_of(c)
    for name in fa:
        if name.endswith(".safetensors"):
            assert fa[name] == fc[name], name


# alloc_outlier_k weighs the outlier allocation ("kl", the default, does not use it)
KNOB_ARGS = {"bits": 3.5, "rows": 6, "length": 64, "seed": 3, "workers": 1, "progress": False, "device": "cpu",
             "alloc_sensitivity": "outlier"}


@pytest.fixture(scope="module")
def tiny_default_quant(tiny, tmp_path_factory):
    return conv.convert(tiny, tmp_path_factory.mktemp("knobs") / "default", **KNOB_ARGS)


@pytest.mark.slow
@pytest.mark.parametrize("damp,k", [(0.01, None), (None, 0), (0.5, 2.0)])
def test_convert_gptq_damp_and_alloc_outlier_k(tiny, tiny_default_quant, tmp_path, monkeypatch, damp, k):
    """Every GPTQ of the run (measurement, layers, head) gets gptq_damp, the outlier scales are computed with
    alloc_outlier_k (not at all for 0), and quantization_config records both (None: the defaults)."""
    damps, ks = [], []
    prepare, block_scales = gptq.prepare, measure.block_scales

    def spy_prepare(h, damp=gptq.DAMP, search=gptq.SCALE_SEARCH):
        damps.append(damp)
        return prepare(h, damp, search)

    def spy_scales(src, cal, k, *a, **kw):
        ks.append(k)
        return block_scales(src, cal, k, *a, **kw)

    monkeypatch.setattr(gptq, "prepare", spy_prepare)
    monkeypatch.setattr(conv, "block_scales", spy_scales)
    out = conv.convert(tiny, tmp_path / "q", gptq_damp=damp, alloc_outlier_k=k, **KNOB_ARGS)
    want_damp, want_k = 0.12 if damp is None else damp, 8.0 if k is None else float(k)
    assert len(damps) >= 2 * 7 + 1 and set(damps) == {want_damp}  # every linear of 2 layers, the head
    assert ks == ([] if want_k == 0 else [want_k])
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (qc["gptq_damp"], qc["alloc_outlier_k"]) == (want_damp, want_k)
    ref = files_of(tiny_default_quant)
    got = files_of(out)
    weights_differ = any(got[n] != ref[n] for n in got if n.endswith(".safetensors"))
    assert weights_differ == (damp is not None)  # the tiny random model has no outlier tokens: K changes nothing
    assert exl2cpp.load(out).info()["quantization"] == "exl2"


@pytest.mark.slow
def test_resume_keeps_gptq_damp_and_alloc_outlier_k(tiny, tmp_path, capsys):
    """An interrupted run's gptq_damp / alloc_outlier_k are saved in its job.json: a resume that leaves them out
    continues with them (files identical to an uninterrupted run's), one that passes other values is refused
    naming the field; the CLI flags reach the same parameters."""
    knobs = {"gptq_damp": 0.01, "alloc_outlier_k": 2.0}
    cli = ["convert", str(tiny), "--bits", "3.5", "--rows", "6", "--length", "64", "--seed", "3", "--workers", "1",
           "--device", "cpu", "--alloc-sensitivity", "outlier", "-q"]  # KNOB_ARGS  # fmt: skip
    a = tmp_path / "a"
    assert cli_main([*cli[:2], str(a), *cli[2:], "--gptq-damp", "0.01", "--alloc-outlier-k", "2"]) == 0
    qc = json.loads((a / "config.json").read_text())["quantization_config"]
    assert (qc["gptq_damp"], qc["alloc_outlier_k"]) == (0.01, 2.0)
    b = tmp_path / "b"

    def interrupt(p, i, w):
        if (p, i, w) == ("quant", 1, "block0"):
            raise KeyboardInterrupt("simulated kill")

    try:
        conv._test_hook = interrupt
        with pytest.raises(KeyboardInterrupt):
            conv.convert(tiny, b, **KNOB_ARGS, **knobs)
    finally:
        conv._test_hook = None
    job = json.loads((b / conv.STATE_DIR / "job.json").read_text())
    assert (job["gptq_damp"], job["alloc_outlier_k"]) == (0.01, 2.0)
    for field, value in (("gptq_damp", 0.12), ("alloc_outlier_k", 8.0), ("alloc_outlier_k", 0)):
        with pytest.raises(exl2cpp.InvalidArgumentError, match=rf"different arguments \({field}\)"):
            conv.convert(tiny, b, resume=True, **KNOB_ARGS, **{**knobs, field: value})
    with pytest.raises(exl2cpp.InvalidArgumentError, match="not empty"):  # without --resume it is not continued
        conv.convert(tiny, b, **KNOB_ARGS, **knobs)
    capsys.readouterr()
    assert cli_main([*cli[:2], str(b), *cli[2:], "--resume"]) == 0  # no knobs given: the saved ones
    fa, fb = files_of(a), files_of(b)
    assert sorted(fa) == sorted(fb)
    for name in fa:
        assert fa[name] == fb[name], name


@pytest.mark.slow
def test_calibration_from_txt_and_jsonl(tiny, tmp_path):
    text = Path(LICENSE).read_text()
    txt = tmp_path / "cal.txt"
    txt.write_text(text)
    jl = tmp_path / "cal.jsonl"
    jl.write_text("".join(json.dumps({"text": p, "id": 1}) + "\n" for p in reversed(text.split("\n\n"))))
    assert read_calibration_file(jl)[-1] == text.split("\n\n")[0]
    outs = {}
    for name, files in (("txt", [txt]), ("jsonl", [jl])):
        out = conv.convert(tiny, tmp_path / name, bits=3.0, calibration=files, rows=4, length=64,
                           progress=False)  # fmt: skip
        cal = json.loads((out / "config.json").read_text())["quantization_config"]["calibration"]
        assert cal["dataset"] == files[0].name and cal["rows"] == 4 and cal["length"] == 64
        outs[name] = out
        assert 2.98 <= exl2cpp.load(out).info()["bpw_layers"] <= 3.0
    # different calibration, different measurement
    assert (outs["txt"] / "measurement.json").read_bytes() != (outs["jsonl"] / "measurement.json").read_bytes()


def test_calibration_defaults_per_device():
    size = conv.calibration_size
    assert size("cpu", None, None, None, 8192) == (32, 512, 8)
    assert size("cuda", None, None, None, 8192) == (100, 2048, 16)  # ExLlamaV2 0.3.2's -r / -l / -mr
    assert size("cuda:1", None, None, None, 300) == (100, 300, 16)  # the default length fits the model
    assert size("cuda", 32, 512, 8, 8192) == (32, 512, 8)
    assert size("cpu", None, None, None, None) == (32, 512, 8)
    assert size("cuda", 12, 300, None, 8192) == (12, 300, 12)
    assert size("cuda", 6, 300, None, 8192) == (6, 300, 6)  # measure_rows <= rows
    assert size("cpu", 4, 64, 2, 128) == (4, 64, 2)
    assert size("cuda", 64, None, 40, 4096) == (64, 2048, 40)


def test_calibration_default_fits_gpu_memory():
    """On CUDA the default amount shrinks to what fits in 60% of free memory: fewer rows of 2048 tokens, then rows
    of 512; given rows or length are kept as asked."""
    size = conv.calibration_size
    llama8b = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8}
    ptb = conv.state_bytes_per_token(llama8b)
    assert ptb == 4 * (4 * 4096 + 2 * 4096 + 4 * 1024 + 2 * 14336)
    gib = 1 << 30
    assert 46e9 < 100 * 2048 * ptb < 48e9  # the docs' ~47 GB
    assert size("cuda", None, None, None, 8192, ptb, 140 * gib) == (100, 2048, 16)  # an H200
    assert size("cuda", None, None, None, 8192, ptb, 40 * gib) == (54, 2048, 16)  # 25.4 GB of states
    r, n, m = size("cuda", None, None, None, 8192, ptb, 8 * gib)  # < 32 rows of 2048 fit: rows of 512
    assert (n, m) == (512, 16) and 32 <= r <= 100 and r * 512 * ptb <= 0.6 * 8 * gib < (r + 1) * 512 * ptb
    assert size("cuda", None, None, None, 8192, ptb, 1 * gib) == (32, 512, 16)  # the floor (may then run out)
    assert size("cuda", 100, None, None, 8192, ptb, 1 * gib) == (100, 2048, 16)  # asked for: kept
    assert size("cpu", None, None, None, 8192, ptb, 1 * gib) == (32, 512, 8)


@pytest.mark.parametrize("damp,d", [(None, 0.24), (0.01, 0.02), (1, 2.0), (np.float32(0.5), 1.0)])
def test_gptq_damp_parameter(damp, d):
    """prepare(H, damp) adds damp x mean(diag H) to the diagonal (mean diagonal 2 here; None: the default 0.12)."""
    assert gptq.DAMP == 0.12
    h = np.diag([4.0, 2.0, 1.0, 1.0])  # U = diag(1 / sqrt(h + d))
    kw = {} if damp is None else {"damp": damp}
    u = gptq._upper_inverse_cholesky(h, **kw)
    np.testing.assert_allclose(np.diag(u), 1 / np.sqrt(np.diag(h) + d), rtol=1e-6)
    p = gptq.prepare(h.astype(np.float32), *([] if damp is None else [damp]))
    np.testing.assert_allclose(np.sort(np.diag(p.u)), np.sort(1 / np.sqrt(np.diag(h) + d)), rtol=1e-6)


@pytest.mark.parametrize("bad", [0, -1, 0.0, "0.1", float("nan"), float("inf"), True, None])
def test_gptq_damp_bad_values(bad):
    with pytest.raises(exl2cpp.InvalidArgumentError, match="--gptq-damp must be a positive number"):
        gptq.check_damp(bad)
    with pytest.raises(exl2cpp.InvalidArgumentError, match="--gptq-damp"):
        gptq.prepare(np.eye(3, dtype=np.float32), bad)


@pytest.mark.parametrize("k", [0, 1, 1.5, 8, 200.0])
def test_alloc_outlier_k_good_values(k):
    assert measure.check_outlier_k(k) == float(k)


@pytest.mark.parametrize("bad", [0.5, -1, "8", float("inf"), float("nan"), True, None])
def test_alloc_outlier_k_bad_values(bad):
    with pytest.raises(exl2cpp.InvalidArgumentError, match=r"--alloc-outlier-k must be 0 \(off\) or a number >= 1"):
        measure.check_outlier_k(bad)


@pytest.mark.parametrize(
    "kw,match",
    [({"gptq_damp": 0}, "--gptq-damp"), ({"gptq_damp": "x"}, "--gptq-damp"),
     ({"alloc_outlier_k": 0.9}, "--alloc-outlier-k"), ({"alloc_outlier_k": -8}, "--alloc-outlier-k")],
)  # fmt: skip
def test_convert_rejects_bad_knobs_before_any_work(tmp_path, kw, match):
    with pytest.raises(exl2cpp.InvalidArgumentError, match=match):
        conv.convert(tmp_path / "no_such_model", tmp_path / "out", bits=4.0, **kw)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bits", [2.0, 8.5])
def test_unreachable_bits_fail_before_any_calibration(tiny, tmp_path, monkeypatch, bits):
    """A target outside the averages the candidate rows reach on this model fails before calibration, with the
    range (the allocation would find out only after the measurement)."""

    def no_calibration(*a, **k):
        raise AssertionError("calibrated before checking --bits")

    monkeypatch.setattr(conv.SourceModel, "calibration", no_calibration)
    with pytest.raises(exl2cpp.InvalidArgumentError, match=r"--bits .* (smallest|largest) average this model's "
                                                           r"candidates reach \(\d\.\d{3}\)"):  # fmt: skip
        conv.convert(tiny, tmp_path / "out", bits=bits, rows=2, length=32, workers=1, progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "var,replacement",
    [("EXL2CPP_GPTQ_DAMP", "gptq_damp"), ("EXL2CPP_ALLOC_OUTLIER", "alloc_outlier_k"),
     ("EXL2CPP_CONVERT_TIMING", "verbose")],
)  # fmt: skip
def test_retired_converter_variables_name_their_parameter(tmp_path, monkeypatch, var, replacement):
    """The converter no longer reads its former environment switches; one still set draws a warning that names the
    parameter that replaced it."""
    monkeypatch.setenv(var, "1")
    with pytest.warns(UserWarning, match=rf"{var} is no longer read; use `convert\({replacement}="):
        with pytest.raises(exl2cpp.ModelFileError, match="does not exist"):
            conv.convert(tmp_path / "no_such_model", tmp_path / "out", bits=4.0)


def test_outlier_scale_hand_cases():
    # row 0: tokens of norm 1, 1, 1 and 100 (> 8 x median 1): |y| = sqrt(10003), kept sqrt(3 * 4 / 3) = 2;
    # row 1: no outlier (norms 2, 2, 2, 2: |y| = 4 = kept). Scale = mean(sqrt(10003), 4) / mean(2, 4).
    y = np.zeros((2, 4, 3))
    y[0, :3, 0] = 1.0
    y[0, 3, 1] = 100.0
    y[1, :, 2] = 2.0
    assert measure.outlier_scale(y, 8.0) == pytest.approx((np.sqrt(10003) + 4) / 2 / 3, rel=1e-12)
    assert measure.outlier_scale(y, 200.0) == pytest.approx(1.0, rel=1e-12)  # nothing exceeds 200 x the median
    rng = np.random.default_rng(5)
    z = rng.standard_normal((3, 37, 16))
    assert measure.outlier_scale(z, 8.0) == pytest.approx(1.0, rel=1e-12)
    z[1, 0] *= 500  # one massive token in one row of 3: only that row's norm is inflated
    full = np.sqrt(np.sum(z**2, axis=(1, 2)))
    kept = full.copy()
    kept[1] = np.sqrt(np.sum(z[1, 1:] ** 2) * 37 / 36)
    assert measure.outlier_scale(z, 8.0) == pytest.approx(full.mean() / kept.mean(), rel=1e-12)
    assert measure.OUTLIER_K == 8.0


def test_block_scales_weight_the_allocation(tiny):
    # block_scales over a clean forward (each measurement group gets its block's output scale; after layer 0's
    # MLP that of HF's hidden states after layer 0); a massive token in the embedded rows makes every block's
    # scale > 1; a scale multiplies the block's errors in the allocation.
    src = SourceModel(tiny, "cpu")
    rng = np.random.default_rng(2)
    ids = rng.integers(3, 200, size=(2, 24)).astype(np.int32)
    cal = src.calibration(2, 24)
    cal.embed(ids)
    res = measure.block_scales(src, cal, 8.0)
    assert list(res) == [f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn", "mlp")]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    with torch.no_grad():
        hs = hf(torch.tensor(ids.astype(np.int64)), output_hidden_states=True).hidden_states
    assert res["model.layers.0.mlp"] == pytest.approx(measure.outlier_scale(hs[1].numpy(), 8.0), rel=1e-4)
    cal.embed(ids)
    x = cal.states()
    x[:, 0] *= 1e4
    cal.set_states(x)
    assert all(v > 2 for v in measure.block_scales(src, cal, 8.0).values())
    # allocation: two identical blocks; weighting the second one's errors makes it take the better option
    e = {"accuracy": 0.0}
    opts = [{**e, "accuracy": 0.9, **dict(zip(ATTN_PROJS, (q.to_json() for q in ATTN_OPTIONS[0])))},
            {**e, "accuracy": 0.95, **dict(zip(ATTN_PROJS, (q.to_json() for q in ATTN_OPTIONS[4])))}]
    mopts = [{"accuracy": 0.9, **dict(zip(MLP_PROJS, (q.to_json() for q in MLP_OPTIONS[0])))}]
    meas = {f"model.layers.{i}.{m}": (opts if m == "self_attn" else mopts) for i in range(2)
            for m in ("self_attn", "mlp")}  # fmt: skip
    numel = sum(a * b * n for d in src.shapes().values() for a, b, _, n in d.values())
    costs = [sum(alloc.linear_cost(QParams.from_json(o[p]).groups(src.shapes()["model.layers.0.self_attn"][p][0]),
                                   src.shapes()["model.layers.0.self_attn"][p]) for p in ATTN_PROJS) for o in opts]  # fmt: skip
    mcost = sum(alloc.linear_cost(QParams.from_json(mopts[0][p]).groups(src.shapes()["model.layers.0.mlp"][p][0]),
                                  src.shapes()["model.layers.0.mlp"][p]) for p in MLP_PROJS)  # fmt: skip
    bits = (costs[0] + costs[1] + 2 * mcost + 1) / numel  # room for one upgrade only
    for heavy, want in ((0, [1, 0]), (1, [0, 1])):
        st = conv._allocate(src, meas, bits, 2.0, {f"model.layers.{heavy}.self_attn": 3.0})
        assert [st["picks"][f"model.layers.{i}.self_attn"] for i in range(2)] == want


def test_bad_arguments(tiny, tmp_path, capsys):
    E = exl2cpp.InvalidArgumentError
    with pytest.raises(E, match="--bits must be"):
        conv.convert(tiny, tmp_path / "x", bits=1.0)
    with pytest.raises(E, match="--head-bits must be one of"):
        conv.convert(tiny, tmp_path / "x", bits=4.0, head_bits=7)
    with pytest.raises(E, match="--rows"):
        conv.convert(tiny, tmp_path / "x", bits=4.0, rows=0)
    with pytest.raises(E, match="max_position_embeddings"):
        conv.convert(tiny, tmp_path / "x", bits=4.0, length=100000)
    with pytest.raises(exl2cpp.ModelFileError, match="does not exist"):
        conv.convert(tmp_path / "nope", tmp_path / "x", bits=4.0)
    with pytest.raises(exl2cpp.ModelFileError, match="calibration file"):
        conv.convert(tiny, tmp_path / "x", bits=4.0, calibration=[tmp_path / "missing.txt"])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    with pytest.raises(E, match="not empty"):
        conv.convert(tiny, tmp_path / "full", bits=4.0)
    bad = tmp_path / "m.json"
    bad.write_text(json.dumps({"measurement": {"model.layers.0.self_attn": []}}))
    with pytest.raises(E, match="no entries for model.layers.0.self_attn"):
        conv.convert(tiny, tmp_path / "y", bits=4.0, measurement=bad)
    csv = tmp_path / "c.csv"
    csv.write_text("a,b")
    with pytest.raises(E, match="unknown type .csv"):
        read_calibration_file(csv)
    # CLI: bad arguments exit 2 (argparse's and the library's checks of the values alike), other errors 1
    for extra, msg in (([], "give --bits BPW or --fit VRAM"), (["--bits", "9"], "--bits must be a number between 2.0 and 8.5"),
                       (["--bits", "4", "--head-bits", "7"], "invalid choice"),
                       (["--bits", "4", "--workers", "0"], "must be an integer >= 1"),
                       (["--bits", "4", "--length", "8"], "must be an integer >= 16"),
                       (["--bits", "4", "--device", "gpu"], "expected"),
                       (["--bits", "4", "--gptq-damp", "0"], "--gptq-damp must be a positive number"),
                       (["--bits", "4", "--gptq-damp", "x"], "invalid float value"),
                       (["--bits", "4", "--alloc-outlier-k", "0.5"],
                        "--alloc-outlier-k must be 0 (off) or a number >= 1"),
                       (["--bits", "4", "--alloc-outlier-k", "nan"], "--alloc-outlier-k must be")):  # fmt: skip
        with pytest.raises(SystemExit) as ex:
            cli_main(["convert", str(tiny), str(tmp_path / "z"), "-q", *extra])
        assert ex.value.code == 2, extra
        assert msg in capsys.readouterr().err, extra
    assert cli_main(["convert", str(tmp_path / "nowhere"), str(tmp_path / "z"), "--bits", "4", "-q"]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_parquet_needs_pyarrow(tmp_path):
    p = tmp_path / "c.parquet"
    p.write_bytes(b"PAR1")
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        with pytest.raises(exl2cpp.UnsupportedError, match="needs pyarrow"):
            read_calibration_file(p)
    else:
        pytest.skip("pyarrow is installed")


@pytest.mark.slow
def test_real_weights_with_exllamav2_measurement_vs_exllamav2_quant(fixtures_dir, tmp_path):
    """SmolLM2's first 4 layers (real weights, fixture source): our quant at 4.0 bpw driven by ExLlamaV2's own
    measurement.json loads, lands on target and is closer to HF fp32 than ExLlamaV2's own q40 (0.054 vs 0.112
    KL when measured)."""
    out = conv.convert(fixtures_dir / "source", tmp_path / "q40", bits=4.0,
                       measurement=fixtures_dir / "fx_measurement.json", rows=8, length=256,
                       progress=False)  # fmt: skip
    model = exl2cpp.load(out)
    assert 3.98 <= model.info()["bpw_layers"] <= 4.0
    ref = np.load(fixtures_dir / "fx_logits.npz")
    ours = kl_mean(ref["hf_float32"].astype(np.float32), model.forward(ref["ids"].tolist()))
    theirs = kl_mean(ref["hf_float32"].astype(np.float32), ref["ex2_q40"].astype(np.float32))
    print(f"KL to HF fp32 at 4.0 bpw: exl2cpp {ours:.4f}, ExLlamaV2 {theirs:.4f}")
    assert ours < theirs


@pytest.mark.slow
def test_measurement_reuse_skips_calibration_and_timing_file(tiny, tmp_path, monkeypatch):
    """A run with our measurement.json and the same calibration arguments reuses its calibration rows (no model
    text generated again) and matches a run that builds them; other arguments build new rows. The timing file
    names every phase."""
    args = {"rows": 4, "length": 64, "seed": 5, "progress": False, "workers": 1}
    a = conv.convert(tiny, tmp_path / "a", bits=3.0, timing_file=tmp_path / "ta.json", **args)
    tim = json.loads((tmp_path / "ta.json").read_text())
    assert tim["measured"] and tim["device"] == "cpu"
    for phase in ("calibration", "measure", "measure.gptq", "measure.eval.attention", "measure.eval.err", "prepare",
                  "gptq.op", "quant", "quant.gptq", "head", "write", "total"):  # fmt: skip
        assert tim["timing"][phase]["s"] >= 0 and tim["timing"][phase]["n"] >= 1, phase
    meas = json.loads((a / "measurement.json").read_text())
    assert len(meas["calibration"]["ids"]) == 4 and len(meas["calibration"]["ids"][0]) == 64
    bare = tmp_path / "bare.json"  # the same measurement without the rows: this run builds them again
    bare.write_text(json.dumps({k: v for k, v in meas.items() if k != "calibration"}))
    ref = conv.convert(tiny, tmp_path / "ref", bits=4.0, measurement=bare, **args)

    def no_calibration(*a, **k):
        raise AssertionError("calibration rebuilt")

    monkeypatch.setattr(conv, "build_calibration", no_calibration)
    b = conv.convert(tiny, tmp_path / "b", bits=4.0, measurement=a / "measurement.json", **args)
    fr, fb = files_of(ref), files_of(b)
    assert sorted(fr) == sorted(fb)
    for name in fr:
        if name.endswith(".safetensors") or name == "config.json":
            assert fr[name] == fb[name], name
    with pytest.raises(AssertionError, match="calibration rebuilt"):
        conv.convert(tiny, tmp_path / "c", bits=4.0, measurement=a / "measurement.json", **{**args, "seed": 6})


# -- worker processes end with the converter, whatever ends it ----------------------------------------------------


@pytest.fixture(scope="module")
def small4(tmp_path_factory):
    """SMALL with 4 layers: a CPU conversion that runs several seconds with its workers up."""
    d = tmp_path_factory.mktemp("small4_src")
    make_hf_model("llama", {**SMALL, "num_hidden_layers": 4}, d)
    add_tokenizer(d)
    return d


def _convert_workers(proc, psutil, timeout=120.0) -> list:
    """The converter's worker processes once both are up (the parent still running)."""
    import time

    deadline = time.monotonic() + timeout
    parent = psutil.Process(proc.pid)
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            kids = parent.children(recursive=True)
            workers = [k for k in kids if "spawn_main" in " ".join(k.cmdline())]
        except psutil.Error:
            continue
        if len(workers) >= 2:
            # past their start-up: the pool's initializer starts a thread in each (give up waiting after 3 s)
            up = time.monotonic() + 3
            while time.monotonic() < up and not all(_threads(w, psutil) >= 2 for w in workers):
                time.sleep(0.05)
            time.sleep(0.3)  # into the measurement: the jobs are running
            return parent.children(recursive=True)
        time.sleep(0.05)
    pytest.fail(f"the converter's workers did not start (parent rc {proc.poll()})")


def _threads(proc, psutil) -> int:
    try:
        return proc.num_threads()
    except psutil.Error:
        return 0


@pytest.mark.parametrize("how", ["kill-9", "sigterm", "ctrl-c"])
def test_workers_die_with_the_converter(small4, tmp_path, how):
    """`kill -9` and a plain SIGTERM of `exl2cpp convert` (one signal to the parent alone, as kill, timeout and CI
    cancels send) and Ctrl-C (SIGINT to the whole process group) leave no worker process behind; SIGTERM exits
    143 and Ctrl-C 130."""
    import signal
    import subprocess
    import sys
    import time

    psutil = pytest.importorskip("psutil")
    env = dict(os.environ, PYTHONPATH=str(Path(exl2cpp.__file__).resolve().parent.parent))
    cmd = [sys.executable, "-m", "exl2cpp", "convert", str(small4), str(tmp_path / "out"), "--bits", "4",
           "--workers", "2", "--rows", "8", "--length", "128", "-q"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    kids = []
    try:
        kids = _convert_workers(proc, psutil)
        assert proc.poll() is None, "the conversion ended before the signal: make the model larger"
        if how == "kill-9":
            proc.send_signal(signal.SIGKILL)
        elif how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        want = {"kill-9": -signal.SIGKILL, "sigterm": 143, "ctrl-c": 130}[how]
        assert proc.returncode == want, err.decode(errors="replace")
        if how != "kill-9":
            assert b"Traceback" not in err, err.decode(errors="replace")
        deadline = time.monotonic() + 5
        alive = kids
        while alive and time.monotonic() < deadline:
            alive = [k for k in alive if k.is_running() and k.status() != psutil.STATUS_ZOMBIE]
            time.sleep(0.1)
        assert not alive, f"still running 5 s after the parent: {[k.cmdline() for k in alive]}"
    finally:
        for p in [proc, *kids]:  # never leave a stray worker to the next test
            try:
                p.kill()
            except (ProcessLookupError, psutil.Error):
                pass


def test_pool_left_by_an_exception_kills_every_worker():
    """An exception through the pool (Ctrl-C inside convert) ends all its workers at once and returns: killing
    only some (an idle one holds the job queue's lock) used to leave the others, and the executor, waiting
    forever. Several rounds, in a child with a timeout, since which worker holds the lock varies."""
    import subprocess
    import sys

    code = """if True:
        import multiprocessing, os, time
        from exl2cpp.convert.pool import GPTQPool
        for _ in range(4):
            try:
                with GPTQPool(2) as pool:
                    pool._start()
                    time.sleep(0.3)  # both workers idle, one of them inside the queue's get
                    pids = [p.pid for p in multiprocessing.active_children()]
                    raise KeyboardInterrupt
            except KeyboardInterrupt:
                pass
            assert len(pids) == 2, pids
            for pid in pids:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    continue
                raise AssertionError(f"worker {pid} is still running")
        print("ok")
    """
    env = dict(os.environ, PYTHONPATH=str(Path(exl2cpp.__file__).resolve().parent.parent))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and r.stdout == "ok\n", (r.returncode, r.stdout, r.stderr)


def test_worker_exits_when_its_parent_is_already_gone():
    """A worker whose parent died before prctl took hold (its parent pid is no longer the one it was given)
    exits at once instead of running unowned."""
    import subprocess
    import sys

    code = "import os; from exl2cpp.convert.pool import _worker_init; _worker_init(os.getppid() + 1); print('alive')"
    env = dict(os.environ, PYTHONPATH=str(Path(exl2cpp.__file__).resolve().parent.parent))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "alive" not in r.stdout, (r.returncode, r.stdout, r.stderr)


def test_worker_parent_watch_exits_when_the_pipe_closes():
    """The portable half of the tie (where prctl is missing or came too late): a worker's watch thread ends the
    process once the parent's end of the pipe closes."""
    import subprocess
    import sys

    code = """if True:
        import os, threading, time
        from exl2cpp.convert.pool import _exit_when_closed
        r, w = os.pipe()
        threading.Thread(target=_exit_when_closed, args=(r,), daemon=True).start()
        time.sleep(0.2)
        print("watching", flush=True)
        os.close(w)  # what the parent's death does to its end
        time.sleep(30)
        print("still alive", flush=True)
    """
    env = dict(os.environ, PYTHONPATH=str(Path(exl2cpp.__file__).resolve().parent.parent))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=25)
    assert r.returncode == 1 and r.stdout == "watching\n", (r.returncode, r.stdout, r.stderr)



def test_pool_worker_errors_reach_the_caller_and_the_pool_recovers():
    """A job that raises in a worker raises the same exception in the caller, and a dead worker is an error naming
    it; either way the pool ends its workers (no answer to an old job can reach a later map) and the next map starts
    fresh ones."""
    import signal
    import time

    from exl2cpp.convert import pool as pool_mod

    with pool_mod.GPTQPool(2) as pool:
        with pytest.raises(ValueError, match="unpack"):
            pool.map([("not a job",), ("nor this",), ("nor that",)])
        assert pool._procs == []
        pool._start()
        pids = [p.pid for p, _ in pool._procs]
        os.kill(pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while pool._procs[1][0].is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(pool_mod.WorkerError, match=str(pids[1])):
            pool.map([("not a job",), ("nor this",)])
        assert pool._procs == []
        with pytest.raises(ValueError, match="unpack"):
            pool.map([("not a job",)] * 2)
