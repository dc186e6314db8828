"""Model.perplexity scores window by window in bounded memory: the same value as the whole-window float64
computation it replaced (written out here), progress reported per step, and a peak RSS growth for SmolLM2 at
ctx 2048 that a [ctx, vocab] float64 copy alone would exceed."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import exl2cpp
import numpy as np
import pytest

PKG_PARENT = str(Path(exl2cpp.__file__).resolve().parent.parent)


def whole_window_perplexity(model, ids: list[int], ctx: int) -> float:
    """The reference: each window's full logits in float64, log-softmax over the vocabulary, one sum."""
    nll, count = 0.0, 0
    for s in range(0, len(ids) - 1, ctx):
        window = ids[s : s + ctx]
        if len(window) < 2:
            break
        logits = model.forward(window).astype(np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        targets = np.asarray(window[1:])
        nll -= float(logp[np.arange(len(targets)), targets].sum())
        count += len(targets)
    return math.exp(nll / count)


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    return exl2cpp.load(smollm2_dir)


@pytest.mark.parametrize("ctx,n_tokens", [(100, 350), (1024, 1100), (600, 601)])
def test_matches_the_whole_window_computation(smol, gpl3_text, ctx, n_tokens):
    """Short windows, a window of several 512-token steps plus a short last one, and a last window of one token
    (nothing to score in it)."""
    ids = smol.tokenizer.encode(gpl3_text)[:n_tokens]
    assert len(ids) == n_tokens
    seen = []
    ours = smol.perplexity(gpl3_text, ctx=ctx, max_tokens=n_tokens, progress=lambda d, t: seen.append((d, t)))
    ref = whole_window_perplexity(smol, ids, ctx)
    assert abs(ours - ref) <= 1e-6 * ref, (ours, ref)
    total = sum(len(ids[s : s + ctx]) - 1 for s in range(0, n_tokens - 1, ctx) if len(ids[s : s + ctx]) >= 2)
    assert seen[-1] == (total, total)
    assert all(t == total for _, t in seen) and [d for d, _ in seen] == sorted({d for d, _ in seen})
    assert len(seen) == sum(-(-(len(ids[s : s + ctx]) - 1) // 512) for s in range(0, n_tokens - 1, ctx))


def test_short_text_is_refused(smol):
    with pytest.raises(exl2cpp.InvalidArgumentError, match="at least 2 tokens"):
        smol.perplexity("", ctx=16)
    with pytest.raises(exl2cpp.InvalidArgumentError, match="ctx must be >= 2"):
        smol.perplexity("hello there", ctx=1)


PEAK = """
import sys, threading, time
import psutil, exl2cpp

text = open(sys.argv[2], encoding="utf-8").read()
model = exl2cpp.load(sys.argv[1])
model.perplexity(text, ctx=2048, max_tokens=64)  # the 2048-token cache and the small buffers exist now
proc = psutil.Process()
base = proc.memory_info().rss
peak = [base]
done = threading.Event()

def watch():
    while not done.is_set():
        peak[0] = max(peak[0], proc.memory_info().rss)
        time.sleep(0.002)

t = threading.Thread(target=watch)
t.start()
ppl = model.perplexity(text, ctx=2048, max_tokens=4096)
done.set()
t.join()
print(ppl, (peak[0] - base) / 2**20)
"""


def test_peak_memory_is_bounded_by_the_step(smollm2_dir, tmp_path):
    """SmolLM2 at ctx 2048 (vocab 49152): one window's logits in float64 are 768 MiB, and the old computation
    held three such arrays at once (3.2 GB peak). The steps keep the growth under 400 MiB."""
    pytest.importorskip("psutil")
    gpl3 = Path("/usr/share/common-licenses/GPL-3")
    if not gpl3.is_file():
        pytest.skip(f"{gpl3} is not present")
    text = (gpl3.read_text(encoding="utf-8") + "\n") * 2  # over 4096 tokens: two full windows
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=PKG_PARENT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(PEAK), str(smollm2_dir), str(tmp_path / "t.txt")],
                       capture_output=True, text=True, env=env, timeout=600, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr
    ppl, growth_mib = map(float, r.stdout.split())
    assert math.isfinite(ppl) and ppl > 1
    assert growth_mib < 400, f"perplexity grew RSS by {growth_mib:.0f} MiB"
