"""Issue 4 flake hunt: run the EXL2 fixture schedule of tests/test_cuda_graphs.py several times eager and with CUDA
graphs, print the worst rel L2 of each run against the first eager run, and the steps (batch sizes) that differ.
    PYTHONPATH=python:tests python3 dev/profile/flaky_graphs.py [RUNS]"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
import exl2cpp  # noqa: E402
import exl2cpp.options  # noqa: E402
from conftest_exl2 import assemble_fixture_models  # noqa: E402
from test_cuda_graphs import rel_l2, run_schedule, schedule  # noqa: E402

runs = int(sys.argv[1]) if len(sys.argv) > 1 else 6
model = exl2cpp.load(assemble_fixture_models() / "q40", device="cuda")
prompts, steps = schedule(seed=1, n_seqs=12, n_steps=20, tail=40)
ref = None
for r in range(runs):
    for flag in ("0", "1"):
        exl2cpp.options.set(cuda_graphs=flag == "1")
        out = run_schedule(model, prompts, steps)
        if ref is None:
            ref = out
            continue
        errs = [rel_l2(b, a) for a, b in zip(ref, out)]
        bad = [(i, len(steps[i - 1][0]) if i else -1, f"{e:.1e}") for i, e in enumerate(errs) if e > 2e-3]
        print(f"run {r} graphs={flag}: max rel L2 {max(errs):.2e}, {len(bad)} steps > 2e-3: {bad[:8]}", flush=True)
