"""One launch for the EXL2 linears that share x (q/k/v, gate/up: linear::forward_group, cuda::exl2_gemm_group, the
v4 GEMV's V4Group): grouped outputs against each layer alone and a float64 reference, for groups of 2 and 3 random
layers with different out widths, bit mixes and biases at 1..16 rows of x (both mma n-tile variants);
weights read back exactly through one-hot rows; the fallbacks (17+ rows, option gemv_group off,
f32 x, the CPU) say they did not group and still give the same outputs; and a fixture EXL2 model whose decode steps
group q/k/v and gate/up, against the same model with grouping off (eager and CUDA graphs) and against the CPU.

Split-k sums meet by fp32 atomics in an order that varies between runs, so grouped and separate launches agree to
f16 output rounding (rel L2 < 1e-3), not bit for bit; with one k slice per block (option gemv_slices=1: every warp
sums all of k and writes y itself) the whole model is deterministic and grouping must not change a single bit.
GPU tests are marked `cuda` and skipped without a GPU; the CPU fallback test runs everywhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import exl2cpp
import numpy as np
import pytest
from exl2cpp import _C, InvalidArgumentError
from test_exl2_cuda import TOL, random_layer, reference, rel_l2, write_safetensors

HAVE_GPU = _C.cuda_compiled() and _C.cuda_device_count() > 0


def needs_gpu(f):
    return pytest.mark.cuda(pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU")(f))


REPO = Path(__file__).resolve().parents[1]
PKG_PARENT = str(Path(exl2cpp.__file__).resolve().parents[1])


def save_layers(tmp_path: Path, layers: dict[str, dict]) -> str:
    """Several layers (prefix -> suffix-keyed tensors) in one .safetensors file."""
    path = tmp_path / "group.safetensors"
    write_safetensors(path, {f"{p}.{k}": v for p, t in layers.items() for k, v in t.items()})
    return str(path)


def run(path, prefixes, x, outs, device="cuda", group=True):
    ys, grouped = _C.exl2_linear_forward_group(path, prefixes, x, outs, device, group)
    return [np.asarray(y) for y in ys], grouped


# (in, [(out, bits, rows, bias)]): q/k/v-like (GQA widths), gate/up-like, awkward widths; bit mixes differ per layer
GROUPS = [
    (
        256,
        [
            (256, [4, 4], [128, 128], False),
            (64, [6, 5, 4, 3], [32, 64, 96, 64], True),
            (64, [8, 3], [64, 192], False),
        ],
    ),
    (
        512,
        [
            (800, [5, 4, 4, 3], [64, 128, 192, 128], True),
            (800, [8, 6, 4, 2], [32, 96, 256, 128], False),
        ],
    ),
    (
        224,
        [
            (7, [8, 6, 5, 4, 3, 2], [32, 32, 32, 32, 64, 32], True),
            (257, [6, 3, 2], [96, 64, 64], True),
        ],
    ),
    (
        1000,
        [
            (1100, [8, 6, 5, 4, 4, 3, 2], [32, 64, 128, 256, 256, 128, 136], False),
            (96, [2] * 8, [128] * 7 + [104], True),  # ragged last group
        ],
    ),
]


def make_group(rng, n_in, specs, tmp_path):
    layers = {
        f"l{i}": random_layer(rng, n_in, o, b, r, bias=bias)
        for i, (o, b, r, bias) in enumerate(specs)
    }
    return save_layers(tmp_path, layers), layers


@pytest.fixture
def v4(options):
    """The shipped layout (v4) with grouping at its default."""
    options(gemv_group=True)
    return "v4"


def run_child(args, env, timeout):
    """python3 `args` in a child process (for switches read once per process) with this environment plus `env`,
    the folder this process imported exl2cpp from (the checkout's python/ or an installed wheel) and tests/ first on
    PYTHONPATH, in the repository root; output captured as text."""
    env = {**os.environ, **env}
    env["PYTHONPATH"] = os.pathsep.join([PKG_PARENT, str(REPO / "tests"), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, *args],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def switched_run(option, launches, *args, **kw):
    """run() with the bool option `option` on for this call only; returns the outputs, whether it grouped, and how
    much the launch counter `launches()` (e.g. _C.exl2_gemv_m32_launches) rose: proof the variant ran."""
    from exl2cpp import options

    before = launches()
    with options.scope({option: True}):
        ys, grouped = run(*args, **kw)
    return ys, grouped, launches() - before


def check_one_hot_rows_exact(tmp_path, seed, m, runner):
    """x = m distinct rows of the identity through `runner(path, prefixes, x, outs)` -> (ys, launches of the variant
    under test): every layer's y must be its f16 reference weights bit for bit (split-k adds exact zeros), over
    every width and a ragged row split; at least one launch must have used the variant."""
    rng = np.random.default_rng(seed)
    n_in = 1000
    specs = [(136, [8, 6, 5, 4, 3, 2], [64, 128, 256, 256, 192, 104]), (40, [4, 2], [512, 488])]
    layers = {
        f"l{i}": random_layer(rng, n_in, o, b, r, qsm_log2=(-16, 0))
        for i, (o, b, r) in enumerate(specs)
    }
    path = save_layers(tmp_path, layers)
    eye = np.eye(n_in, dtype=np.float16)
    sel = rng.choice(n_in, m, replace=False)
    got, launches = runner(path, list(layers), eye[sel], [s[0] for s in specs])
    assert launches >= 1
    for (p, t), (o, *_), g in zip(layers.items(), specs, got):
        w = _C.exl2_dequantize(t, out_features=o).astype(np.float32)
        np.testing.assert_array_equal(g, w[sel], err_msg=p)


@needs_gpu
@pytest.mark.parametrize("gi", range(len(GROUPS)))
@pytest.mark.parametrize("m", [1, 2, 8, 9, 16])
def test_group_matches_alone_and_reference(tmp_path, v4, gi, m):
    n_in, specs = GROUPS[gi]
    rng = np.random.default_rng(1000 * gi + m)
    path, layers = make_group(rng, n_in, specs, tmp_path)
    prefixes, outs = list(layers), [s[0] for s in specs]
    for _ in range(
        2
    ):  # fresh x; the second call also checks that the first left acc and counters zero
        x = rng.standard_normal((m, n_in)).astype(np.float16)
        got, grouped = run(path, prefixes, x, outs)
        alone, grouped_alone = run(path, prefixes, x, outs, group=False)
        assert grouped and not grouped_alone
        for p, o, g, a in zip(prefixes, outs, got, alone):
            assert g.shape == (m, o)
            want = reference(layers[p], x, o)
            assert rel_l2(g, want) < TOL, f"{p}: rel L2 {rel_l2(g, want):.2e}"
            assert rel_l2(g, a) < 1e-3, f"{p}: grouped vs alone rel L2 {rel_l2(g, a):.2e}"


@needs_gpu
@pytest.mark.parametrize("m", [1, 2, 8, 9, 16])
def test_group_one_hot_rows_exact(tmp_path, v4, m):
    """x = rows of the identity: every layer's y = its f16 reference weights, bit for bit (split-k adds zeros)."""
    rng = np.random.default_rng(200 + m)
    n_in = 224
    specs = [
        (72, [8, 6, 5, 4, 3, 2], [32, 32, 32, 32, 64, 32], False),
        (40, [4, 2], [160, 64], False),
        (136, [6, 3, 3], [64, 96, 64], False),
    ]
    layers = {
        f"l{i}": random_layer(rng, n_in, o, b, r, qsm_log2=(-16, 0))
        for i, (o, b, r, _) in enumerate(specs)
    }
    path = save_layers(tmp_path, layers)
    eye = np.eye(n_in, dtype=np.float16)
    sel = rng.choice(n_in, m, replace=False)
    got, grouped = run(path, list(layers), eye[sel], [s[0] for s in specs])
    assert grouped
    for (p, t), (o, *_), g in zip(layers.items(), specs, got):
        w = _C.exl2_dequantize(t, out_features=o).astype(np.float32)
        np.testing.assert_array_equal(g, w[sel], err_msg=p)


@needs_gpu
def test_group_fallbacks(tmp_path, options):
    """What does not qualify runs each layer alone (forward_group says so) with the same results."""
    rng = np.random.default_rng(7)
    n_in, specs = GROUPS[1]
    path, layers = make_group(rng, n_in, specs, tmp_path)
    prefixes, outs = list(layers), [s[0] for s in specs]

    def check(x, expect_grouped):
        got, grouped = run(path, prefixes, x, outs)
        assert grouped == expect_grouped
        for p, o, g in zip(prefixes, outs, got):
            assert rel_l2(g, reference(layers[p], x, o)) < TOL, p

    options(gemv_group=True)
    check(rng.standard_normal((16, n_in)).astype(np.float16), True)
    check(
        rng.standard_normal((17, n_in)).astype(np.float16), False
    )  # more rows than one launch covers
    check(
        rng.standard_normal((3, n_in)).astype(np.float32), False
    )  # f32 activations: dequantize + SGEMM
    options(gemv_group=False)
    check(rng.standard_normal((2, n_in)).astype(np.float16), False)
    with pytest.raises(InvalidArgumentError, match="gemv_group"):
        options(gemv_group="2")
    options(gemv_group=True, gemv_max_rows=1)
    check(rng.standard_normal((2, n_in)).astype(np.float16), False)  # above the GEMV's row limit


@pytest.mark.parametrize("gi", range(len(GROUPS)))
def test_group_on_cpu_is_each_forward(tmp_path, gi):
    """The CPU (any build): forward_group runs forward() on each layer, which is what the model's CPU path uses."""
    rng = np.random.default_rng(11 + gi)
    n_in, specs = GROUPS[gi]
    path, layers = make_group(rng, n_in, specs, tmp_path)
    prefixes, outs = list(layers), [s[0] for s in specs]
    x = rng.standard_normal((5, n_in)).astype(np.float32)
    got, grouped = run(path, prefixes, x, outs, device="cpu")
    alone, _ = run(path, prefixes, x, outs, device="cpu", group=False)
    assert not grouped
    for p, o, g, a in zip(prefixes, outs, got, alone):
        np.testing.assert_array_equal(g, a)
        assert rel_l2(g, reference(layers[p], x, o)) < 1e-5, p
    with pytest.raises(Exception, match="out_features"):
        _C.exl2_linear_forward_group(path, prefixes, x, outs[:1], "cpu")


# ---- a fixture model ----------------------------------------------------------------------------------------------

# Decode steps of 1..16 rows (grouped) and 17+ rows (not), as in test_cuda_graphs.
MODEL_STEPS = {"seed": 3, "n_seqs": 20, "n_steps": 24, "tail": 12}


def model_runs(opts: dict, steps_kw=MODEL_STEPS, device="cuda"):
    """Logits of every step of a test_cuda_graphs schedule on the q40 fixture, one fresh model per options setting
    (exl2cpp.options names; restored afterwards)."""
    import exl2cpp
    from conftest_exl2 import assemble_fixture_models
    from test_cuda_graphs import run_schedule, schedule

    prompts, steps = schedule(**steps_kw)
    with exl2cpp.options.scope():
        model = exl2cpp.load(assemble_fixture_models() / "q40", device=device, options=opts)
        return run_schedule(model, prompts, steps)


def assert_near_baseline_and_cpu(base, variant, cpu, tol, what):
    """Per step of a schedule: `variant`'s logits within rel L2 `tol` of `base`'s, and no further from the CPU's than
    base's are (1.5x + 1e-3, and < 1e-2 in any case)."""
    for i, (a, b, c) in enumerate(zip(base, variant, cpu)):
        assert a.shape == b.shape == c.shape
        assert rel_l2(b, a) < tol, f"step {i}: {what} rel L2 {rel_l2(b, a):.2e}"
        e_var, e_base = rel_l2(b, c), rel_l2(a, c)
        assert e_var < 1.5 * e_base + 1e-3 and e_var < 1e-2, (
            f"step {i}: {what}: vs CPU {e_var:.2e}, baseline vs CPU {e_base:.2e}"
        )


@needs_gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_model_grouped_matches_separate_and_cpu(graphs):
    """Eager and with CUDA graphs: grouped within the run-to-run spread of the split-k atomics of the separate
    launches (test_cuda_graphs measured up to 1.7e-3 eager vs eager on this model), and as close to the CPU as the
    separate launches are."""
    pytest.importorskip("torch")
    opts = {"cuda_graphs": graphs}
    sep = model_runs({**opts, "gemv_group": False})
    grp = model_runs({**opts, "gemv_group": True})
    cpu = model_runs({}, device="cpu")
    assert_near_baseline_and_cpu(sep, grp, cpu, 5e-3, "grouped vs separate")


DETERMINISTIC = """
import sys, numpy as np
sys.path.insert(0, {tests!r})
from test_exl2_gemv_group import model_runs
steps = dict(seed=4, n_seqs=10, n_steps=16, tail=8)
one = {{"gemv_slices": 1, "gemv_fuse": False}}
for graphs in (False, True):
    a = model_runs({{**one, "cuda_graphs": graphs, "gemv_group": False}}, steps)
    b = model_runs({{**one, "cuda_graphs": graphs, "gemv_group": True}}, steps)
    for i, (x, y) in enumerate(zip(a, b)):
        assert np.array_equal(x, y), (graphs, i, float(np.abs(x - y).max()))
print("bitwise equal")
"""


@needs_gpu
def test_model_grouped_bitwise_with_one_slice():
    """Option gemv_slices=1 (in a child process, so the split-k state starts fresh): no atomics in any v4 launch, so
    the model is deterministic and grouping must leave every logit bit unchanged, eager and with graphs. The fused
    step (option gemv_fuse, the default) is off here: its norm prologue and one-rounding residual add differ from the
    separate kernels by design (test_exl2_gemv_fuse bounds that); this test is about grouping alone."""
    pytest.importorskip("torch")
    from conftest_exl2 import assemble_fixture_models, require_fixtures

    assemble_fixture_models()  # skips here when the fixtures are absent; the child finds them through the env
    env = {"EXL2CPP_FIXTURES": str(require_fixtures().parent)}
    code = textwrap.dedent(DETERMINISTIC.format(tests=str(REPO / "tests")))
    r = run_child(["-c", code], env, timeout=300)
    assert r.returncode == 0 and "bitwise equal" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
