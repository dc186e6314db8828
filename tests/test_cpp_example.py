"""The C++ example host (examples/cpp/generate.cpp, built by .ci/run) loads a model and generates the same greedy
tokens as the Python API."""

from __future__ import annotations

import os
import subprocess

import pytest

import exl2cpp
from test_models_hf import make_hf_model

BIN = os.environ.get("EXL2_EXAMPLE_BIN")


@pytest.mark.skipif(not BIN or not os.path.exists(BIN), reason="EXL2_EXAMPLE_BIN not built (.ci/run builds it)")
def test_cpp_example_greedy_matches_python(tmp_path):
    pytest.importorskip("transformers")
    make_hf_model("llama", {}, tmp_path)
    prompt = [5, 17, 99, 3, 42]
    want = exl2cpp.load(tmp_path).generate_ids(prompt, max_new_tokens=12, temperature=0.0)
    out = subprocess.run([BIN, str(tmp_path), "--max-new-tokens", "12", *map(str, prompt)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert [int(t) for t in out.stdout.split()] == want


@pytest.mark.skipif(not BIN or not os.path.exists(BIN), reason="EXL2_EXAMPLE_BIN not built (.ci/run builds it)")
def test_cpp_example_reports_errors(tmp_path):
    out = subprocess.run([BIN, str(tmp_path / "missing"), "1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "config.json" in out.stderr
