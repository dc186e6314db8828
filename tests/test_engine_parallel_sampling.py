"""The engine samples a step's rows on the CPU thread pool (engine.cpp, cpu::parallel_for): every job's tokens,
log-probabilities and top alternatives must be the same as with one thread (EXL2CPP_NUM_THREADS=1, read once per
process, hence subprocesses), for a batch mixing greedy, temperature + top-p / top-k / min-p / typical, penalties,
a token mask and logit bias, on a model with a 32000-token vocabulary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]

RUN = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    import numpy as np, exl2cpp
    from exl2cpp import _C
    m = exl2cpp.load({folder!r})
    eng = _C.Engine(m._core, cache_tokens=4096, page_size=16, max_batch_tokens=256)
    rng = np.random.default_rng(0)
    settings = [
        dict(temperature=0.0),
        dict(temperature=0.8, top_p=0.9, seed=11),
        dict(temperature=1.2, top_k=40, seed=12),
        dict(temperature=1.0, min_p=0.05, seed=13),
        dict(temperature=0.9, typical=0.8, seed=14),
        dict(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1, seed=15),
        dict(temperature=1.0, top_p=0.95, seed=16, top_logprobs=3),
    ]
    ids = {{}}
    for i in range(24):
        s = _C.SamplerSettings(**settings[i % len(settings)])
        prompt = rng.integers(0, 32000, int(rng.integers(3, 40))).tolist()
        kw = {{}}
        if i % 5 == 4:
            kw["token_mask"] = [0xFFFFFFFF] * 200  # ids 0..6399 allowed
        ids[eng.submit(prompt, max_new_tokens=12, stop_tokens=[], sampler=s, **kw)] = i
    out = {{}}
    while not eng.idle:
        for e in eng.step():
            assert not e[6], e[6]
            if e[1] >= 0:
                out.setdefault(ids[e[0]], []).append([e[1], round(float(e[2]), 6), [list(t) for t in e[3]]])
    print(json.dumps(out, sort_keys=True))
    """
)


@pytest.fixture(scope="module")
def big_vocab_model(tmp_path_factory):
    sys.path.insert(0, str(REPO / "tests"))
    from test_models_hf import make_hf_model

    folder = tmp_path_factory.mktemp("vocab32k")
    make_hf_model("llama", {"vocab_size": 32000, "max_position_embeddings": 1024}, folder, seed=9)
    return folder


def run_with_threads(folder, threads: int) -> dict:
    env = {**os.environ, "EXL2CPP_NUM_THREADS": str(threads), "PYTHONPATH": os.pathsep.join(sys.path)}
    code = RUN.format(tests=str(REPO / "tests"), folder=str(folder))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_parallel_sampling_matches_one_thread(big_vocab_model):
    one = run_with_threads(big_vocab_model, 1)
    many = run_with_threads(big_vocab_model, 4)
    assert len(one) == 24 and all(len(v) == 12 for v in one.values())
    assert many == one
    masked = [k for k in one if int(k) % 5 == 4]
    assert masked and all(t[0] < 6400 for k in masked for t in one[k])  # the mask held
