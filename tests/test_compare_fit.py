"""exl2cpp compare (quality.py) and exl2cpp fit (budget.py) on the EXL2 fixture quants (2.5 / 4.0 / 6.0 bpw) of the
fixture source model: the scores against a direct NumPy computation on full logits, their order with bpw, a model
against itself, the JSON output, the fit accounting against the loader's own numbers, its monotonicity, and the CLI's
argument errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

import exl2cpp
from exl2cpp import _C, budget, cli, quality
from exl2cpp.errors import InvalidArgumentError

REPO = Path(__file__).resolve().parents[1]
TEXT = (REPO / "README.md").read_text() + "\n\n" + (REPO / "docs" / "convert.md").read_text()
N_TOKENS, CTX = 300, 128  # 3 windows: 128, 128, 44 tokens


@pytest.fixture(scope="module")
def quants():
    from conftest_exl2 import assemble_fixture_models, require_fixtures

    src = require_fixtures() / "source"
    out = assemble_fixture_models()
    return {"source": src, "q25": out / "q25", "q40": out / "q40", "q60": out / "q60"}


@pytest.fixture(scope="module")
def table(quants):
    return exl2cpp.compare([quants["q25"], quants["q40"], quants["q60"]], reference=quants["source"], text=TEXT,
                           ctx=CTX, max_tokens=N_TOKENS)


def _direct_scores(ref, model, ids, ctx):
    """KL(ref || model), top-1 agreement and perplexity from whole-window logits (Model.forward), float64."""
    nll = kl = agree = count = 0.0
    for s in range(0, len(ids) - 1, ctx):
        w = ids[s : s + ctx]
        if len(w) < 2:
            break
        a = ref.forward(w)[:-1].astype(np.float64)
        b = model.forward(w)[:-1].astype(np.float64)
        la = a - a.max(1, keepdims=True)
        la -= np.log(np.exp(la).sum(1, keepdims=True))
        lb = b - b.max(1, keepdims=True)
        lb -= np.log(np.exp(lb).sum(1, keepdims=True))
        t = np.asarray(w[1:])
        nll -= lb[np.arange(len(t)), t].sum()
        kl += (np.exp(la) * (la - lb)).sum()
        agree += (la.argmax(1) == lb.argmax(1)).sum()
        count += len(t)
    return math.exp(nll / count), kl / count, agree / count


def test_scores_match_a_direct_computation(quants, table):
    ref = exl2cpp.load(quants["source"])
    q = exl2cpp.load(quants["q40"])
    ids = ref.tokenizer.encode(TEXT)[:N_TOKENS]
    ppl, kl, top1 = _direct_scores(ref, q, ids, CTX)
    row = table["models"][1]
    assert row["ppl"] == pytest.approx(ppl, rel=1e-6)
    assert row["kl"] == pytest.approx(kl, rel=1e-6)
    assert row["top1"] == pytest.approx(top1, abs=1e-12)
    assert row["tokens"] == table["tokens"] == N_TOKENS - 3  # each window's last token predicts nothing
    assert row["ppl"] == pytest.approx(q.perplexity(TEXT, ctx=CTX, max_tokens=N_TOKENS), rel=1e-6)


def test_kl_falls_and_agreement_rises_with_bpw(table):
    rows = table["models"]
    assert [Path(r["path"]).name for r in rows] == ["q25", "q40", "q60"]
    bpw = [r["bpw"] for r in rows]
    assert bpw == sorted(bpw) and abs(bpw[0] - 2.5) < 0.02 and abs(bpw[2] - 6.0) < 0.02
    kl = [r["kl"] for r in rows]
    top1 = [r["top1"] for r in rows]
    assert kl[0] > kl[1] > kl[2] > 0
    assert top1[0] < top1[1] < top1[2] < 1
    for r in rows:
        assert r["bpw_with_head"] > r["bpw"]
        assert r["file_bytes"] == sum(p.stat().st_size for p in Path(r["path"]).glob("*.safetensors"))
        assert r["memory_bytes"] is not None and r["memory_bytes"] >= 0
        ww = r["worst_windows"]
        assert [w["window"] for w in ww] and sorted(w["window"] for w in ww) == [0, 1, 2]
        assert [w["kl"] for w in ww] == sorted((w["kl"] for w in ww), reverse=True)
        assert sum(w["tokens"] for w in ww) == r["tokens"]
        assert sum(w["kl"] * w["tokens"] for w in ww) / r["tokens"] == pytest.approx(r["kl"], rel=1e-9)


def test_a_model_against_itself(quants):
    r = exl2cpp.compare([quants["q40"], quants["q40"]], text=TEXT, ctx=CTX, max_tokens=200)
    for row in r["models"]:
        assert row["kl"] == 0.0 and row["top1"] == 1.0
    assert r["models"][0]["ppl"] == r["models"][1]["ppl"]
    r = exl2cpp.compare([quants["q25"]], reference=quants["q25"], text=TEXT, ctx=CTX, max_tokens=200)
    assert r["models"][0]["kl"] == 0.0 and r["models"][0]["top1"] == 1.0


def test_steps_are_bounded_and_cover_every_position(quants):
    m = exl2cpp.load(quants["q25"])
    ids = m.tokenizer.encode(TEXT)[:700]
    seen = []
    for w, logits, targets in quality.window_logits(m, ids, 600, step_rows=256):
        assert logits.dtype == np.float32 and logits.shape == (len(targets), m.vocab_size)
        assert len(targets) <= 256
        seen.append((w, len(targets)))
    assert seen == [(0, 256), (0, 256), (0, 87), (1, 99)]
    assert quality.token_windows(700, 600) == [(0, 600), (600, 700)]
    assert quality.token_windows(601, 600) == [(0, 600)]  # a 1-token tail predicts nothing


class _Stub:
    def __init__(self, vocab):
        self.vocab_size, self.max_seq_len, self.path = vocab, 4096, f"stub{vocab}"


def test_a_different_vocabulary_is_refused():
    with pytest.raises(InvalidArgumentError, match="do not share a vocabulary"):
        quality.score([_Stub(100), _Stub(200)], list(range(10)), 8)
    with pytest.raises(InvalidArgumentError, match="do not share a vocabulary"):
        quality.score([_Stub(100)], list(range(10)), 8, reference=_Stub(99))
    with pytest.raises(InvalidArgumentError, match="too short"):
        quality.score([_Stub(100)], [1], 8)


def test_cli_json_round_trips_in_the_order_given(quants, table, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    argv = ["compare", str(quants["q60"]), str(quants["q25"]), "--reference", str(quants["source"]), "--text",
            str(text), "--ctx", str(CTX), "--max-tokens", str(N_TOKENS), "--json", "-q"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert json.loads(json.dumps(out)) == out
    assert [Path(m["path"]).name for m in out["models"]] == ["q60", "q25"]
    by_name = {Path(m["path"]).name: m for m in table["models"]}
    for m in out["models"]:
        want = by_name[Path(m["path"]).name]
        for key in ("path", "bpw", "bpw_with_head", "ppl", "kl", "top1", "file_bytes", "worst_windows"):
            assert m[key] == want[key], key
    assert cli.main(argv[:-2] + ["-q"]) == 0
    table_text = capsys.readouterr().out
    assert "KL to reference" in table_text and "q60" in table_text and "top-1 agreement" in table_text


def test_plot(table, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "kl.png"
    quality.plot(table, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv,msg", [
    (["compare", "x", "--ctx", "1"], "--ctx must be at least 2"),
    (["compare", "x", "--max-tokens", "1"], "--max-tokens must be at least 2"),
    (["compare", "x", "--text", "/nonexistent/t.txt"], "cannot read"),
    (["fit", "x", "--vram", "lots"], "a memory size must be like"),
    (["fit", "x", "--vram", "0GiB"], "must be positive"),
    (["fit", "x", "--vram", "24GiB", "--ctx", "0"], "--ctx must be a positive integer"),
    (["fit", "x", "--vram", "24GiB", "--gpus", "0"], "--gpus must be a positive integer"),
    (["fit", "x", "--vram", "24GiB", "--batch", "0"], "--batch must be a positive integer"),
    (["fit", "x", "--vram", "24GiB", "--cache", "q5"], "invalid choice"),
    (["fit", "x"], "--vram"),
    (["convert", "a", "b"], "give --bits BPW or --fit VRAM"),
    (["convert", "a", "b", "--bits", "4", "--fit", "24GiB"], "give --bits BPW or --fit VRAM"),
    (["convert", "a", "b", "--fit", "24 potatoes"], "a memory size must be like"),
])
def test_bad_arguments_exit_2(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


# ---- fit ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache", ["fp16", "q8", "q6", "q4"])
def test_cache_bytes_are_the_runtimes(quants, cache):
    m = exl2cpp.load(quants["q40"], max_seq_len=1024)
    c = m._core.make_cache(1000, 256, cache)
    per_token, sink = budget.cache_bytes_per_token(_C.load_config(str(quants["q40"])), cache)
    assert per_token + sink // 256 == c.bytes_per_token
    assert budget.cache_bytes(_C.load_config(str(quants["q40"])), cache, 1000) == per_token * 1024 + sink * 5


@pytest.mark.parametrize("tag", ["source", "q40"])
def test_loader_sizes_are_the_loaders(quants, tag):
    folder = quants[tag]
    for ctx in (256, 3000):
        s = budget.loader_sizes(folder, ctx)
        (single,), _ = _C.weight_load_bytes(str(folder), ctx)
        assert s.total(ctx) == single
        assert s.rope(ctx) == budget._aligned(ctx * _C.load_config(str(folder))["head_dim"] * 4)
    n = len(s.layers)
    per, _ = _C.weight_load_bytes(str(folder), 3000, [0] * (n // 2) + [1] * (n - n // 2), 1, 0)
    assert per == [s.embed + sum(s.layers[: n // 2]) + s.rope(3000),
                   sum(s.layers[n // 2 :]) + s.head + s.rope(3000)]


def test_the_fp16_prediction_bounds_the_real_quants(quants):
    """At each fixture quant's own bpw, the prediction from the fp16 source is at least what the loader counts for
    the quant (CPU build: q_weight + q_scale, without the permutation and group tables) and within 10 %."""
    if _C.cuda_compiled():
        pytest.skip("a CUDA build counts the CUDA layout (permutation and group tables): "
                    "test_gpu_prediction_bounds_the_cuda_layout checks that one")
    for tag in ("q25", "q40", "q60"):
        bpw = exl2cpp.load(quants[tag], max_seq_len=64).info()["bpw_layers"]
        real = budget.loader_sizes(quants[tag])
        pred = budget.quantized_sizes(quants["source"], bpw)
        assert sum(real.layers) <= sum(pred.layers) <= 1.10 * sum(real.layers), tag
        assert pred.embed == real.embed and real.head <= pred.head <= 1.10 * real.head


def _budget_sum(plan):
    return plan["weights"] + plan["kv_cache"] + plan["workspace"] + plan["cuda_context"]


def test_fit_picks_the_highest_bpw_that_fits(quants):
    src = quants["source"]
    seen = []
    for mib in (856, 857, 858, 860, 862, 870):
        r = exl2cpp.fit(src, f"{mib}MiB", ctx=2048)
        assert r["kind"] == "fp16" and r["bpw"] is not None
        b = r["bpw"]
        assert r["plan"]["fits"] and _budget_sum(r["plan"]) <= mib * 2**20
        assert round(b / budget.BPW_STEP) * budget.BPW_STEP == pytest.approx(b)
        if b + 0.1 <= budget.BPW_MAX:
            assert not r["next"]["fits"] and _budget_sum(r["next"]) > mib * 2**20
            up = budget._plan(budget.quantized_sizes(src, b + budget.BPW_STEP), _C.load_config(str(src)),
                              mib * 2**20, 1, 2048, "fp16", 1)
            assert not up["fits"]
        seen.append(b)
    assert seen == sorted(seen) and seen[0] < seen[-1]
    by_ctx = [exl2cpp.fit(src, "880MiB", ctx=c)["bpw"] or 0 for c in (256, 4096, 8192, 16384)]
    assert by_ctx == sorted(by_ctx, reverse=True) and by_ctx[0] > by_ctx[-1]
    q4 = exl2cpp.fit(src, "880MiB", ctx=16384, cache="q4")["bpw"]
    assert q4 > by_ctx[-1]
    assert exl2cpp.fit(src, "600MiB", ctx=2048)["bpw"] is None


def test_fit_of_a_quant_and_its_largest_context(quants):
    q = quants["q40"]
    config = _C.load_config(str(q))
    r = exl2cpp.fit(q, "900MiB", ctx=2048)
    assert r["kind"] == "exl2" and r["plan"]["fits"]
    sizes = budget.loader_sizes(q)
    last = None
    for cache, n in r["max_ctx"].items():
        assert n > 0 and n % budget.PAGE == 0
        assert budget._plan(sizes, config, 900 * 2**20, 1, n, cache, 1)["fits"]
        assert not budget._plan(sizes, config, 900 * 2**20, 1, n + budget.PAGE, cache, 1)["fits"]
        assert last is None or n > last  # fewer bytes per token, more context
        last = n
    small = exl2cpp.fit(q, "900MiB", ctx=r["max_ctx"]["fp16"] + 256)
    assert not small["plan"]["fits"]
    two = exl2cpp.fit(q, "450MiB", gpus=2, ctx=2048)
    assert not two["plan"]["fits"]  # each GPU keeps its own workspace and context reserve


def test_fit_cli_and_convert_fit(quants, monkeypatch, capsys, tmp_path):
    assert cli.main(["fit", str(quants["source"]), "--vram", "860MiB", "--ctx", "2048", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    want = exl2cpp.fit(quants["source"], "860MiB", ctx=2048)
    assert r["bpw"] == want["bpw"]
    assert cli.main(["fit", str(quants["q40"]), "--vram", "860MiB"]) == 0
    out = capsys.readouterr().out
    assert "largest context" in out and "reserved" in out
    got = {}

    def fake_convert(in_dir, out_dir, bits, **kw):
        got["bits"] = bits
        return out_dir

    import exl2cpp.convert as conv

    monkeypatch.setattr(conv, "convert", fake_convert)
    assert cli.main(["convert", str(quants["source"]), str(tmp_path / "o"), "--fit", "860MiB", "--ctx", "2048"]) == 0
    assert got["bits"] == want["bpw"]
    assert cli.main(["convert", str(quants["source"]), str(tmp_path / "o"), "--fit", "600MiB"]) == 1
    assert "does not fit" in capsys.readouterr().err


def test_parse_size():
    assert budget.parse_size("24GiB") == budget.parse_size("24GB") == budget.parse_size("24") == 24 * 2**30
    assert budget.parse_size("1536MiB") == budget.parse_size("1.5g") == budget.parse_size(1536 * 2**20) == 1536 * 2**20
    for bad in ("", "x", "-1GiB", "0", True, 0, -5, float("nan")):
        with pytest.raises(InvalidArgumentError):
            budget.parse_size(bad)


# ---- the GPU ------------------------------------------------------------------------------------------------------

n_gpus = getattr(_C, "cuda_device_count", lambda: 0)()


@pytest.mark.cuda
@pytest.mark.skipif(n_gpus == 0, reason="no CUDA device")
def test_gpu_compare_reports_vram_and_speed(quants):
    r = exl2cpp.compare([quants["q25"], quants["q60"]], reference=quants["source"], text=TEXT, ctx=CTX,
                        max_tokens=N_TOKENS, device="cuda")
    for row in r["models"]:
        assert row["memory_bytes"] > 0 and row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0
    assert r["models"][0]["kl"] > r["models"][1]["kl"]


@pytest.mark.cuda
@pytest.mark.skipif(n_gpus == 0, reason="no CUDA device")
def test_gpu_prediction_bounds_the_cuda_layout(quants):
    """On a CUDA build the loader counts an EXL2 linear at its upload layout: the fp16 prediction at the quant's bpw
    stays above it and within 10 %."""
    for tag in ("q25", "q40", "q60"):
        bpw = exl2cpp.load(quants[tag], max_seq_len=64).info()["bpw_layers"]
        real = budget.loader_sizes(quants[tag])
        pred = budget.quantized_sizes(quants["source"], bpw)
        assert sum(real.layers) <= sum(pred.layers) <= 1.10 * sum(real.layers), (tag, sum(real.layers),
                                                                                 sum(pred.layers))
