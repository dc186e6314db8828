"""Tests of the benchmark tools on the CPU: the synthetic EXL2 writer (bit plans, files exl2cpp and ExLlamaV2 accept,
determinism), the benches in their quick CPU modes, the report table, and scripts/device_bench.sh --dry-run/--cpu."""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import common
import exl2cpp
import synth_exl2 as S
from exl2cpp import _C


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("synth")
    out = {}
    for bpw in (2.5, 4.0, 6.0):
        out[bpw] = base / f"tiny-{bpw}"
        S.synthesize(out[bpw], "tiny", bpw, seed=1, threads=2, log=lambda s: None)
    return out


# ---- bit plans ----------------------------------------------------------------------------------------------------


def test_total_bits_hand_computed():
    # two 4-bit groups of 128 rows, in 256, out 64: q_weight 256*64*4, scale_max 2*16, q_groups 2*32,
    # q_scale 2*64*4, invperm 256*32
    assert S.total_bits([(4, 128), (4, 128)], 256, 64) == 65536 + 32 + 64 + 512 + 8192
    assert S.split_groups([(8, 96, 32), (4, 200, 128)]) == [
        (8, 32),
        (8, 32),
        (8, 32),
        (4, 128),
        (4, 72),
    ]


@pytest.mark.parametrize("preset", ["llama2-7b", "llama3-8b", "tiny"])
@pytest.mark.parametrize("bpw", [2.5, 3.0, 4.0, 5.0, 6.0])
def test_plan_hits_target_and_is_valid(preset, bpw):
    shape = S.PRESETS[preset]
    for distinct in (0, 4):
        plans, head = S.plan_model(shape, bpw, distinct)
        got = S.plan_bpw(shape, plans)
        assert abs(got - bpw) < (0.005 if preset != "tiny" else 0.05), (preset, bpw, distinct, got)
        dims = S.linear_dims(shape)
        for plan in plans:
            for role, groups in plan.items():
                fin, _ = dims[role]
                bits = [b for b, _ in groups]
                assert bits == sorted(bits, reverse=True), (role, bits)  # 8 -> 6 -> ... -> 2 order
                assert all(b in S.WIDTHS for b in bits)
                assert all(r % 32 == 0 and r > 0 for _, r in groups)
                assert sum(r for _, r in groups) == fin
        assert sum(r for _, r in head) == shape["hidden"] and {b for b, _ in head} == {8, 6}
    # ExLlamaV2 style: down_proj opens with ~5% of rows at 8 bits from 3.5 bpw up
    down = S.plan_model(shape, 4.0, 1)[0][0]["down_proj"]
    assert down[0][0] == 8 and 0.04 <= sum(r for b, r in down if b == 8) / shape["inter"] <= 0.1


def test_plan_at_4bpw_llama2_uses_4bit_mostly():
    plans, _ = S.plan_model(S.PRESETS["llama2-7b"], 4.0, 0)
    rows = {}
    for plan in plans:
        for groups in plan.values():
            for b, r in groups:
                rows[b] = rows.get(b, 0) + r
    assert max(rows, key=rows.get) == 4 and set(rows) <= {3, 4, 5, 8}


# ---- the synthetic folders ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("bpw", [2.5, 4.0, 6.0])
def test_synth_loads_in_exl2cpp_at_target_bpw(tiny_dirs, bpw):
    m = exl2cpp.load(tiny_dirs[bpw])
    info = m.info()
    assert info["quantization"] == "exl2"
    assert abs(info["bpw_layers"] - bpw) < 0.05, info["bpw_layers"]
    names = {x["name"]: x for x in info["linears"]}
    assert names["lm_head"]["kind"] == "exl2" and 6.0 < names["lm_head"]["bits_per_weight"] < 8.0
    assert all(x["kind"] == "exl2" for x in info["linears"])
    # the model runs: finite logits that differ between positions, and greedy generation of ids
    ids = m.tokenizer.encode("Benchmarks measure speed, not sense.")
    logits = m.forward(ids)
    assert logits.shape == (len(ids), 1024) and np.isfinite(logits).all()
    assert np.abs(logits[0] - logits[-1]).max() > 1e-3
    out = m.generate_ids(ids, max_new_tokens=5, temperature=0.0)
    assert len(out) == 5 and all(0 <= t < 1024 for t in out)


def test_synth_tensors_are_exl2_files(tiny_dirs):
    d = tiny_dirs[4.0]
    cfg = json.loads((d / "config.json").read_text())
    assert (
        cfg["quantization_config"]["quant_method"] == "exl2"
        and cfg["quantization_config"]["bits"] == 4.0
    )
    assert cfg["vocab_size"] == 1024 and cfg["head_dim"] == 64 and cfg["num_key_value_heads"] == 2
    from safetensors import safe_open

    with safe_open(str(d / "output.safetensors"), "np") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == np.float16
        assert (f.get_tensor("model.norm.weight") == 1).all()
        for layer in range(2):
            for role in S.ROLES:
                sub = "self_attn" if role in S.ROLES[:4] else "mlp"
                for t in ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm"):
                    assert f"model.layers.{layer}.{sub}.{role}.{t}" in keys
        # every linear validates, and the weights have the intended size: std ~ 1/sqrt(in)
        for prefix, fin, fout in (
            ("model.layers.1.mlp.down_proj", 704, 256),
            ("lm_head", 256, 1024),
            ("model.layers.0.self_attn.k_proj", 256, 128),
        ):
            tensors = {
                t: f.get_tensor(f"{prefix}.{t}")
                for t in ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm")
            }
            lay = _C.exl2_validate(tensors, fin, fout)
            assert lay["in_features"] == fin and lay["out_features"] == fout
            w = _C.exl2_dequantize(tensors).astype(np.float32)
            assert np.isfinite(w).all()
            assert 0.4 < w.std() * math.sqrt(fin) < 2.5, (prefix, w.std())
    assert len(keys) == 1 + 2 * (2 + 7 * 5) + 1 + 5


def test_synth_is_deterministic(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    S.synthesize(a, "tiny", 3.0, seed=5, threads=1, log=lambda s: None)
    S.synthesize(b, "tiny", 3.0, seed=5, threads=3, log=lambda s: None)
    S.synthesize(c, "tiny", 3.0, seed=6, threads=2, log=lambda s: None)

    def digest(p):
        return hashlib.sha256((p / "output.safetensors").read_bytes()).hexdigest()

    assert digest(a) == digest(b)
    assert digest(a) != digest(c)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    # warm reruns keep a folder made by the same request, and rewrite one made by another
    kept = S.synthesize(a, "tiny", 3.0, seed=5, log=lambda s: None, skip_existing=True)
    assert kept.get("kept") and digest(a) == digest(b)
    redo = S.synthesize(a, "tiny", 3.0, seed=6, log=lambda s: None, skip_existing=True)
    assert not redo.get("kept") and digest(a) == digest(c)


def test_synth_distinct_layers_repeat(tmp_path):
    S.synthesize(
        tmp_path,
        "tiny",
        4.0,
        seed=0,
        threads=2,
        distinct=1,
        shape_overrides={"layers": 3},
        log=lambda s: None,
    )
    from safetensors import safe_open

    with safe_open(str(tmp_path / "output.safetensors"), "np") as f:
        w0 = f.get_tensor("model.layers.0.mlp.up_proj.q_weight")
        w2 = f.get_tensor("model.layers.2.mlp.up_proj.q_weight")
        assert np.array_equal(w0, w2)
    assert exl2cpp.load(tmp_path).info()["num_hidden_layers"] == 3


@pytest.mark.parametrize("vocab", [259, 1024, 32000, 70000])
def test_tokenizer_vocab_matches(vocab):
    from tokenizers import Tokenizer

    text, cfg = S.tokenizer_files(vocab, 4096)
    tk = Tokenizer.from_str(text)
    assert tk.get_vocab_size(with_added_tokens=True) == vocab
    assert [tk.token_to_id(t) for t in ("<unk>", "<s>", "</s>")] == [0, 1, 2]
    assert cfg["bos_token"] == "<s>" and cfg["added_tokens_decoder"]["2"]["content"] == "</s>"
    s = "Hello, wörld!\n\tcode = 42 ✓"
    ids = tk.encode(s).ids
    assert max(ids) < vocab and tk.decode(ids) == s
    if vocab >= 32000:
        assert len(ids) < len(s.encode())  # merges apply
    with pytest.raises(ValueError):
        S.tokenizer_files(100, 4096)


def _exllamav2_wheel():
    cands = [os.environ.get("EXL2CPP_EXLLAMAV2_WHEEL", "")] + glob.glob(
        str(ROOT / ".whl" / "exllamav2-*.whl")
    )
    return next((c for c in cands if c and os.path.isfile(c)), None)


def test_exllamav2_reads_synth_config_and_tokenizer(tiny_dirs, tmp_path):
    """ExLlamaV2 0.3.2's own ExLlamaV2Config and ExLlamaV2Tokenizer accept the folder (its CUDA extension stubbed:
    these two classes never call it). Needs the wheel (.whl/ or EXL2CPP_EXLLAMAV2_WHEEL) and torch."""
    wheel = _exllamav2_wheel()
    if wheel is None:
        pytest.skip("no exllamav2 wheel in .whl/ (set EXL2CPP_EXLLAMAV2_WHEEL)")
    pytest.importorskip("torch")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp_path)
    code = f"""
import sys, types
pkg = types.ModuleType("exllamav2"); pkg.__path__ = [{str(tmp_path / "exllamav2")!r}]; sys.modules["exllamav2"] = pkg
ext = types.ModuleType("exllamav2.ext"); ext.none_tensor = None; ext.exllamav2_ext = None
sys.modules["exllamav2.ext"] = ext
from exllamav2.config import ExLlamaV2Config
from exllamav2.tokenizer.tokenizer import ExLlamaV2Tokenizer
cfg = ExLlamaV2Config(sys.argv[1])
assert (cfg.vocab_size, cfg.hidden_size, cfg.num_key_value_heads, cfg.head_dim) == (1024, 256, 2, 64), cfg.vocab_size
tok = ExLlamaV2Tokenizer(cfg)
assert (tok.bos_token_id, tok.eos_token_id, tok.get_vocab_size()) == (1, 2, 1024)
ids = tok.encode("Hello world\\nfoo")
assert tok.decode(ids)[0] == "Hello world\\nfoo", tok.decode(ids)
assert len(tok.get_id_to_piece_list()) == 1024
print("ok")
"""
    r = subprocess.run(
        [sys.executable, "-c", code, str(tiny_dirs[2.5])],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


# ---- benches in quick CPU modes, report, device script ------------------------------------------------------------


def test_bench_model_cpu_quick(tiny_dirs, tmp_path, capsys):
    import bench_model

    out = tmp_path / "r.jsonl"
    assert (
        bench_model.main(
            [
                str(tiny_dirs[4.0]),
                str(tiny_dirs[2.5]),
                "--device",
                "cpu",
                "--quick",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    recs = common.read_records(out)
    assert [r["model"] for r in recs] == ["tiny-4.0", "tiny-2.5"]
    for r in recs:
        assert abs(r["bpw"] - (4.0 if r["model"] == "tiny-4.0" else 2.5)) < 0.05
        for path in ("raw", "engine"):
            for k in ("decode0_tok_s", "decode64_tok_s", "prefill_tok_s"):
                assert r[path][k] > 0, (path, k)
        assert r["decode0_tok_s"] == max(r["raw"]["decode0_tok_s"], r["engine"]["decode0_tok_s"])
        assert r["ceiling"]["decode0_tok_s"] is None  # no CUDA: no ceilings
        # bytes per decode step = the quantized linears + norms + one embedding row
        assert r["decode_bytes_per_token_weights"] < r["weight_bytes"]
    text = capsys.readouterr().out
    assert "tiny-2.5" in text and "prefill64" in text


def test_bench_engine_cpu_quick(tiny_dirs, tmp_path, capsys):
    import bench_engine

    out = tmp_path / "e.jsonl"
    assert (
        bench_engine.main([str(tiny_dirs[4.0]), "--device", "cpu", "--quick", "--json", str(out)])
        == 0
    )
    (rec,) = common.read_records(out)
    assert [lv["jobs"] for lv in rec["levels"]] == [1, 3]
    for lv in rec["levels"]:
        assert lv["tokens"] == lv["jobs"] * 6 and lv["jobs_done"] == lv["jobs"] and not lv["capped"]
    assert "fp16" in rec["cache_bytes_per_1k"] and rec["cache_bytes_per_1k"]["fp16"] > 0
    assert "total tok/s" in capsys.readouterr().out


def test_bench_drivers_pass_options(tiny_dirs, tmp_path):
    """--option NAME=VALUE (repeatable) reaches load(options=...) and the record; bad ones are refused naming them."""
    import bench_engine
    import bench_model
    from exl2cpp import InvalidArgumentError
    from exl2cpp import options as opts

    m = str(tiny_dirs[4.0])
    for i, driver in enumerate((bench_model, bench_engine)):
        out = tmp_path / f"o{i}.jsonl"
        with opts.scope():
            assert driver.main([m, "--device", "cpu", "--quick", "--json", str(out), "--option", "cpu_activations=f16",
                                "--option", "weight_arena=false"]) == 0  # fmt: skip
            assert opts.get()["cpu_activations"] == "f16" and opts.get()["weight_arena"] is False
        (rec,) = common.read_records(out)
        assert rec["options"] == {"cpu_activations": "f16", "weight_arena": "false"}
        for bad, match in ((["--option", "gemv_group"], "expected NAME=VALUE"),
                           (["--option", "no_such=1"], "unknown option 'no_such'"),
                           (["--option", "gemv_chunks=0"], "gemv_chunks must be an integer in 1..1024")):  # fmt: skip
            with pytest.raises(InvalidArgumentError, match=match):
                driver.main([m, "--device", "cpu", "--quick", *bad])
        assert opts.get() == opts.defaults()


def test_engine_cap_cancels_and_counts(tiny_dirs):
    import bench_engine
    from exl2cpp.engine import _sampler_settings

    m = exl2cpp.load(tiny_dirs[2.5])
    eng = bench_engine.make_engine(m, 4096, 4, 256)
    tokens, _, done, capped = bench_engine.run_load(
        eng, [[5] * 8] * 3, 2000, _sampler_settings({"temperature": 0.0}), max_seconds=0.05
    )
    assert capped and done == 0 and 0 < tokens < 3 * 2000 and eng.idle
    assert eng.stats()["pages_used"] == 0


def _rec(bench, model, **kw):
    r = {"bench": bench, "model": model, "gpu": "TestGPU", "bpw": 4.0, "raw": {}, "engine": {}}
    r.update(kw)
    return r


def test_report_table_ratios(tmp_path, capsys):
    import report

    f = tmp_path / "r.jsonl"
    common.write_record(
        f,
        _rec(
            "exl2cpp",
            "m-4.0",
            decode0_tok_s=900.0,
            prefill_tok_s=10000.0,
            ceiling={"decode0_tok_s": 1200.0, "prefill_tok_s": 20000.0},
            vram_model_bytes=3 * 2**30,
            copy_bw_bytes_s=4.0e12,
        ),
    )
    common.write_record(
        f,
        _rec(
            "exllamav2",
            "m-4.0",
            decode0_tok_s=300.0,
            prefill_tok_s=12500.0,
            mode="ExLlamaV2 0.3.2: flash-attn NO (ran without flash-attn)",
        ),
    )
    common.write_record(f, {"bench": "exllamav2", "model": "m-6.0", "error": "RuntimeError: boom"})
    common.write_record(
        f,
        {
            "bench": "exl2cpp_engine",
            "model": "m-4.0",
            "levels": [{"jobs": 1, "tok_s": 800.0}, {"jobs": 8, "tok_s": 5000.0, "capped": True}],
            "cache_bytes_per_1k": {"fp16": 512 * 2**20},
        },
    )
    assert report.main([str(f)]) == 0
    out = capsys.readouterr().out
    assert (
        "900 (75%)" in out and "300 (25%)" in out and "3.00" in out
    )  # 900/1200, 300/1200, 900/300
    assert "10000 (50%)" in out and "0.80" in out  # prefill: 10000/20000, 10000/12500
    assert "ran without flash-attn" in out and "boom" in out
    assert "5000*" in out and "512.0" in out
    assert "exl2cpp ahead in 1 of 2" in out


def test_bench_exllamav2_dry_run(tiny_dirs, capsys):
    import bench_exllamav2

    assert (
        bench_exllamav2.main(
            [str(tiny_dirs[4.0]), "--engine-model", str(tiny_dirs[4.0]), "--dry-run"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "EXLLAMA_NO_SDPA=1" in out and "tiny-4.0" in out and "[1, 8, 32, 128]" in out
    with pytest.raises(FileNotFoundError):
        bench_exllamav2.main(["/nonexistent/model", "--dry-run"])


def test_device_script_dry_run(tmp_path):
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "device_bench.sh"), "--dry-run"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, OUT=str(tmp_path)),
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for want in (
        "scripts/dev_build.sh cuda",
        "llama2-7b,llama3-8b --bpw 2.5,4.0,6.0",
        "bench_model.py",
        "bench_engine.py",
        "llama2-7b-4.0",
        "bench_exllamav2.py",
        "report.py",
        "import exllamav2",
    ):
        assert want in out, want
    assert not (tmp_path / "results.jsonl").exists()
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "device_bench.sh"), "--bogus"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2


def test_device_script_cpu_mode(tmp_path):
    env = dict(
        os.environ,
        OUT=str(tmp_path),
        BENCH_SKIP_BUILD="1",
        PYTHON=sys.executable,
        PYTHONPATH=os.pathsep.join(
            [str(Path(exl2cpp.__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]
        ),
    )
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "device_bench.sh"), "--cpu"],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = (tmp_path / "summary.txt").read_text()
    assert "tiny-2.5" in summary and "tiny-4.0" in summary and "exl2cpp Engine" in summary
    assert r.stdout.rstrip().endswith(
        summary.rstrip().splitlines()[-1]
    )  # the table is printed last
    recs = common.read_records(tmp_path / "results.jsonl")
    assert {r["bench"] for r in recs} == {"exl2cpp", "exl2cpp_engine"}


def test_common_table_and_prompt():
    t = common.table([["a", 1], ["bbb", 22]], ["name", "n"])
    assert t.splitlines() == ["name   n", "----  --", "a      1", "bbb   22"]
    p = common.random_prompt(3, 50, 100)
    assert p == common.random_prompt(3, 50, 100) and min(p) >= 3 and max(p) < 100
    assert common.kv_bytes_per_token({"layers": 32, "kv_heads": 8, "head_dim": 128}) == 131072
