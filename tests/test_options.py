"""The runtime options registry (cpp/include/exl2/options.h, exl2cpp.options): typed get / set by name with clear
errors, defaults, scopes, load(options=...), and docs/options.md generated from the registry; no product source
reads an EXL2CPP_* variable that is not listed as an environment setting."""

from __future__ import annotations

import re
from pathlib import Path

import exl2cpp
import pytest
from exl2cpp import _C, InvalidArgumentError
from exl2cpp import options as opts

REPO = Path(__file__).resolve().parents[1]


def test_defaults_and_types():
    d = opts.defaults()
    assert d["gemv_max_rows"] == 32 and d["gemv_group"] is True and d["gemv_fuse"] is True
    assert d["gemv_m32"] is False and d["cuda_graphs"] is True and d["kv_k_centre"] == "rope"
    assert d["tp_graphs"] == "off" and d["tp_test_fail_rank"] == -1
    reg = {o["name"]: o for o in opts.registry()}
    assert set(reg) == set(d)
    for name, value in d.items():
        t = reg[name]["type"]
        assert {"bool": bool, "int": int, "choice": str}[t] is type(value), name
        assert reg[name]["doc"] and reg[name]["scope"]


def test_set_get_scope(options):
    with opts.scope(gemv_group=False, gemv_max_rows=7, kv_k_centre="fixed"):
        got = opts.get()
        assert (got["gemv_group"], got["gemv_max_rows"], got["kv_k_centre"]) == (False, 7, "fixed")
    assert opts.get() == opts.defaults()
    options(tp_graphs="cpu-pad")
    assert opts.get()["tp_graphs"] == "cpu-pad"


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"gemv_m32": "maybe"}, "gemv_m32 must be true or false"),
        ({"gemv_max_rows": -1}, r"gemv_max_rows must be an integer in 0\.\.2147483647"),
        ({"gemv_chunks": 0}, "gemv_chunks must be an integer in 1..1024"),
        ({"kv_k_centre": "mean"}, "kv_k_centre must be one of rope|fixed"),
        ({"no_such_option": 1}, "unknown option 'no_such_option'"),
        ({"gemv_fuse": 1.5}, "a bool, int or str expected"),
    ],
)
def test_bad_values_change_nothing(kw, match):
    before = opts.get()
    with pytest.raises(InvalidArgumentError, match=match):
        opts.set({"gemv_group": False, **kw})
    assert opts.get() == before


def test_load_sets_options(tmp_path):
    from conftest_exl2 import assemble_fixture_models

    folder = assemble_fixture_models() / "q40"
    with opts.scope():
        m = exl2cpp.load(folder, device="cpu", options={"gemv_fuse": False})
        assert opts.get()["gemv_fuse"] is False
        assert m.generate("Hi", max_new_tokens=2) is not None


def test_cpu_activations_option_rounds_like_the_gpu():
    """cpu_activations=f16 changes the CPU's logits (f16 rounding), f32 gives the default bits back."""
    import numpy as np
    from conftest_exl2 import assemble_fixture_models

    folder = assemble_fixture_models() / "q40"

    def logits(act):
        with opts.scope(cpu_activations=act):
            core = exl2cpp.load(folder, device="cpu")._core
            cache = core.make_cache(64, 16, "auto")
            table = cache.pool.alloc(1)
            return np.asarray(core.forward(cache, [1, 415, 2936], [0, 1, 2], [0, 0, 0], table, 1, None))

    a, b, c = logits("f32"), logits("f16"), logits("f32")
    assert np.array_equal(a, c)
    assert not np.array_equal(a, b)
    assert np.abs(a - b).max() < 0.1 * np.abs(a).max()


def test_doc_page_matches_the_registry():
    page = (REPO / "docs" / "options.md").read_text()
    assert page == opts.markdown(), "docs/options.md is stale: python -m exl2cpp.options > docs/options.md"


def test_no_product_source_reads_other_environment_switches():
    allowed = {name for name, _ in _C.environment_settings()}
    found = set()
    for root in ("cpp", "cuda", "python/exl2cpp"):
        for p in (REPO / root).rglob("*"):
            if p.suffix in {".h", ".cpp", ".cu", ".cuh", ".py"} and p.name != "options.py":
                found |= set(re.findall(r"EXL2CPP_[A-Z0-9_]+", p.read_text(errors="replace")))
    assert found <= allowed, sorted(found - allowed)


def test_parse_assignments_checks_without_setting():
    """NAME=VALUE texts (the bench / profile drivers' --option flags) as a dict, checked against the registry; the
    options in force do not change."""
    before = opts.get()
    got = opts.parse_assignments(["gemv_group=false", " pdl = 0 ", "gemv_slices=1", "gemv_slices=2"])
    assert got == {"gemv_group": "false", "pdl": "0", "gemv_slices": "2"}
    assert opts.get() == before
    with opts.scope(got):
        assert (opts.get()["gemv_group"], opts.get()["pdl"], opts.get()["gemv_slices"]) == (False, False, 2)
    assert opts.parse_assignments([]) == {}
    for bad, match in ((["gemv_group"], "expected NAME=VALUE"), (["=1"], "expected NAME=VALUE"),
                       (["nope=1"], "unknown option 'nope'"), (["kv_k_centre=mean"], "kv_k_centre must be one of")):  # fmt: skip
        with pytest.raises(InvalidArgumentError, match=match):
            opts.parse_assignments(bad)
        assert opts.get() == before


@pytest.mark.parametrize("name,now", [(n, now) for n, now in opts._FORMER])
def test_retired_environment_switches_name_their_replacement(monkeypatch, name, now):
    for n, _ in opts._FORMER:
        monkeypatch.delenv(n, raising=False)
    assert opts.warn_retired_environment() == []
    monkeypatch.setenv(name, "1")
    with pytest.warns(UserWarning, match=re.escape(f"{name} is no longer read; use {now}")):
        assert opts.warn_retired_environment() == [name]
