"""The decode step's small kernels folded into the v4 EXL2 GEMV (linear::forward_fused, cuda::exl2_gemm_fused): the
rms_norm and silu_mul prologues and the residual-add epilogue, fused against the composition of the separate ops
(linear::forward_composed) and against a NumPy float64 reference, at 1..16 rows of x, hidden sizes 576, 1000 (not a
multiple of 8: the scalar norm path), 1536 and 4096, groups of 1, 2 and 3 layers, f32 / f16 / bf16 norm weights,
with the automatic k split and with one slice (option gemv_slices=1); and whole models with option gemv_fuse on
against off (logits and 32 greedy tokens, eager and graphs).

Tolerances: fp16 outputs, rel L2 <= 2e-3 against the float64 reference of the same f16-rounded x and against the
composition (split-k fp32 atomics and the norm's reduction order differ; the fused add rounds once where the
composition rounds twice). With one slice the none and silu_mul prologues must match the composition bit for bit
(silu_mul computed exactly as cuda/silu_mul.cu). GPU tests are marked `cuda`; the CPU tests (the composition, which
the CPU model runs with gemv_fuse on) run everywhere.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest
from exl2cpp import _C
from test_exl2_cuda import TOL, random_layer, rel_l2, write_safetensors
from test_exl2_gemv_group import assert_near_baseline_and_cpu

HAVE_GPU = _C.cuda_compiled() and _C.cuda_device_count() > 0


def needs_gpu(f):
    return pytest.mark.cuda(pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU")(f))


# name -> (in, [(out, bits, rows, bias)]): q/k/v of SmolLM2-135M (576 -> 576, 192, 192), gate/up (576 -> 1536 x 2),
# down (1536 -> 576), a Llama-sized input (4096), an input that is no multiple of 8
CONFIGS = {
    "qkv576": (
        576,
        [
            (576, [5, 4, 4], [128, 192, 256], False),
            (192, [6, 4], [320, 256], True),
            (192, [8, 3], [64, 512], False),
        ],
    ),
    "gateup576": (
        576,
        [(1536, [4, 3], [448, 128], False), (1536, [5, 4, 2], [64, 384, 128], False)],
    ),
    "down1536": (1536, [(576, [6, 4, 3], [256, 1024, 256], False)]),
    "big4096": (4096, [(320, [5, 4, 3, 2], [1024, 2048, 768, 256], True)]),
    "odd1000": (1000, [(200, [8, 6, 5, 4, 4, 3, 2], [32, 64, 128, 256, 256, 128, 136], True)]),
}
_cache: dict[str, tuple[str, dict]] = {}


def config_layers(name: str, tmp_dir: Path):
    """(path, {prefix: tensors}) of config `name`, packed once per session."""
    if name not in _cache:
        n_in, specs = CONFIGS[name]
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        layers = {
            f"l{i}": random_layer(rng, n_in, o, b, r, bias=bias)
            for i, (o, b, r, bias) in enumerate(specs)
        }
        path = tmp_dir / f"{name}.safetensors"
        write_safetensors(path, {f"{p}.{k}": v for p, t in layers.items() for k, v in t.items()})
        _cache[name] = (str(path), layers)
    return _cache[name]


@pytest.fixture(scope="module")
def layer_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuse")


def f16(a):
    return np.asarray(a, np.float64).astype(np.float16).astype(np.float64)


def ref_x(prologue, src, w=None, eps=1e-5, up=None):
    """The f16 x the GEMV multiplies (float64 math, one f16 rounding, as both paths round it)."""
    s = src.astype(np.float64)
    if prologue == "rms_norm":
        inv = 1.0 / np.sqrt(np.mean(s * s, axis=1, keepdims=True) + eps)
        return f16(s * inv * w.astype(np.float64))
    if prologue == "silu_mul":
        return f16(s / (1.0 + np.exp(-s)) * up.astype(np.float64))
    return s


def ref_y(t, x, n_out):
    w = _C.exl2_dequantize(t, out_features=n_out).astype(np.float64)
    y = x @ w
    if "bias" in t:
        y += t["bias"].astype(np.float64)
    return y


def inputs(rng, prologue, m, n_in, norm_dtype):
    src = rng.standard_normal((m, n_in)).astype(np.float16)
    w = up = None
    if prologue == "rms_norm":
        w = rng.uniform(0.5, 1.5, n_in).astype(np.float32)
        if norm_dtype == "f16":
            w = w.astype(np.float16).astype(np.float32)
        elif norm_dtype == "bf16":  # values exact in bf16
            w = (np.round(w * 128) / 128).astype(np.float32)
    if prologue == "silu_mul":
        src = (3 * rng.standard_normal((m, n_in))).astype(np.float16)
        up = rng.standard_normal((m, n_in)).astype(np.float16)
    return src, w, up


def call(path, prefixes, outs, src, prologue, w, norm_dtype, up, y0, fused, device="cuda"):
    ys, ran, after = _C.exl2_linear_forward_fused(
        path,
        prefixes,
        src,
        outs,
        device,
        prologue,
        norm_w=w,
        norm_dtype=norm_dtype,
        eps=1e-5,
        up=up,
        y=y0,
        fused=fused,
    )
    return [np.asarray(y, np.float64) for y in ys], ran, after


ROWS = [1, 2, 3, 7, 8, 13, 16]
CASES = [
    (c, p, add)
    for c in CONFIGS
    for p in ("none", "rms_norm", "silu_mul")
    for add in ((False, True) if len(CONFIGS[c][1]) == 1 else (False,))
]


@pytest.fixture
def v4(options):
    """The shipped layout (v4) with grouping at its default."""
    options(gemv_group=True)
    return "v4"


def whole_slice(cfg: str, m: int) -> bool:
    """Whether gemv_slices=1 really gives every layer of cfg one k slice at m rows: a block stages at most
    40 KB of x (cuda/exl2_gemm.cu kV4SmemBytes), so layers of more chunks still split (with fp32 atomics)."""
    kernel_m = next(k for k in (1, 2, 4, 8, 16) if m <= k)
    max_cps = 40 * 1024 // (4 * (kernel_m * 64 + 4))
    for _, bits, rows, _ in CONFIGS[cfg][1]:
        units: dict[int, int] = {}
        for b, r in zip(bits, rows):
            units[b] = units.get(b, 0) + -(-r // 32)
        if sum(-(-u // 4) for u in units.values()) > max_cps:
            return False
    return True


def check_case(layer_dir, cfg, prologue, add, m, seed, exact_one_slice=False, expect_fused=True):
    path, layers = config_layers(cfg, layer_dir)
    n_in, specs = CONFIGS[cfg]
    prefixes, outs = list(layers), [s[0] for s in specs]
    rng = np.random.default_rng(seed)
    norm_dtype = ("f32", "f16", "bf16")[m % 3]
    src, w, up = inputs(rng, prologue, m, n_in, norm_dtype)
    y0 = None
    x = ref_x(prologue, src, w, 1e-5, up)
    want = [ref_y(layers[p], x, o) for p, o in zip(prefixes, outs)]
    if add:
        y0 = (rng.standard_normal((m, outs[0])) * np.std(want[0])).astype(np.float16)
        want = [y0.astype(np.float64) + want[0]]
    got, ran, _ = call(path, prefixes, outs, src, prologue, w, norm_dtype, up, y0, True)
    comp, ran_c, _ = call(path, prefixes, outs, src, prologue, w, norm_dtype, up, y0, False)
    assert ran == expect_fused and not ran_c
    for p, g, c, r in zip(prefixes, got, comp, want):
        assert rel_l2(g, r) < TOL, f"{p}: fused vs float64 rel L2 {rel_l2(g, r):.2e}"
        assert rel_l2(g, c) < TOL, f"{p}: fused vs composition rel L2 {rel_l2(g, c):.2e}"
        if add:  # the product was added, not just y0 kept
            assert rel_l2(g - y0, r - y0) < 1e-2, (
                f"{p}: added product rel L2 {rel_l2(g - y0, r - y0):.2e}"
            )
        if exact_one_slice and prologue != "rms_norm" and not add and whole_slice(cfg, m):
            np.testing.assert_array_equal(
                g, c, err_msg=f"{p}: one slice, {prologue}: not bit for bit"
            )


@needs_gpu
@pytest.mark.parametrize("cfg,prologue,add", CASES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("slices", [0, 1])
def test_fused_matches_composition_and_reference(layer_dir, options, cfg, prologue, add, m, slices):
    """slices 1 (no split-k): the none / silu_mul prologues equal the composition bit for bit."""
    if slices == 1 and m not in (1, 7, 16):
        pytest.skip("one slice: rows 1, 7 and 16")
    options(gemv_group=True, gemv_slices=slices)
    check_case(layer_dir, cfg, prologue, add, m, seed=17 * m + len(cfg), exact_one_slice=slices == 1)


@needs_gpu
def test_fused_twice_leaves_state_clean(layer_dir):
    """Two fused adds in a row (split-k acc and counters must be zero again after the first)."""
    for seed in (1, 2):
        check_case(layer_dir, "down1536", "silu_mul", True, 3, seed)


@needs_gpu
def test_fused_fallbacks(layer_dir, options):
    """What does not qualify runs the composition (forward_fused says so), with the same semantics."""
    path, layers = config_layers("gateup576", layer_dir)
    prefixes, outs = list(layers), [s[0] for s in CONFIGS["gateup576"][1]]
    rng = np.random.default_rng(3)

    def check(m, dtype, expect, prologue="rms_norm", pre=prefixes, o=outs):
        src, w, up = inputs(rng, prologue, m, 576, "f32")
        src = src.astype(dtype)
        got, ran, _ = call(path, pre, o, src, prologue, w, "", up, None, True)
        assert ran == expect, (m, dtype, prologue)
        x = ref_x(prologue, src.astype(np.float16) if dtype == np.float16 else src, w, 1e-5, up)
        for p, g, n in zip(pre, got, o):
            tol = TOL if dtype == np.float16 else 1e-3
            assert rel_l2(g, ref_y(layers[p], x, n)) < tol, p

    check(16, np.float16, True)
    check(17, np.float16, False)  # more rows than one launch: prefill's composition
    check(3, np.float32, False)  # f32 activations
    options(gemv_group=False)
    check(2, np.float16, False)  # a group of 2 when grouping is off
    check(2, np.float16, True, pre=prefixes[:1], o=outs[:1])  # one layer still fuses
    options(gemv_group=True, cuda_reference=True)
    check(2, np.float16, False)  # the reference kernels only


# ---- the composition on the CPU ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prologue,add",
    [("none", False), ("rms_norm", False), ("silu_mul", False), ("none", True), ("silu_mul", True)],
)
def test_composition_on_cpu(tmp_path, prologue, add):
    """The CPU runs forward_composed: the same float64 reference (f32 activations: rms_norm and silu_mul in f32)."""
    n_in, specs = CONFIGS["odd1000"]
    rng = np.random.default_rng(21)
    t = random_layer(rng, n_in, 200, *specs[0][1:3], bias=True)
    path = tmp_path / "l.safetensors"
    write_safetensors(path, {f"l0.{k}": v for k, v in t.items()})
    src, w, up = inputs(rng, prologue, 5, n_in, "f32")
    src = src.astype(np.float32)
    up = None if up is None else up.astype(np.float32)
    s = src.astype(np.float64)
    if prologue == "rms_norm":
        x = s / np.sqrt(np.mean(s * s, axis=1, keepdims=True) + 1e-5) * w
    elif prologue == "silu_mul":
        x = s / (1 + np.exp(-s)) * up
    else:
        x = s
    want = ref_y(t, x, 200)
    y0 = None
    if add:
        y0 = rng.standard_normal((5, 200)).astype(np.float32)
        want = want + y0
    got, ran, after = call(
        str(path), ["l0"], [200], src, prologue, w, "", up, y0, True, device="cpu"
    )
    assert not ran
    assert rel_l2(got[0], want) < 1e-5
    if prologue == "rms_norm" or prologue == "none":
        np.testing.assert_array_equal(after, src)  # the residual is left alone
    with pytest.raises(Exception, match="add_into takes exactly one"):
        _C.exl2_linear_forward_fused(
            str(path), ["l0", "l0"], src, [200, 200], "cpu", y=np.zeros((5, 200), np.float32)
        )


def test_fuse_option_rejects_bad_values(options):
    from exl2cpp import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="gemv_fuse must be true or false"):
        options(gemv_fuse="2")


# ---- whole models --------------------------------------------------------------------------------------------------

STEPS = {"seed": 5, "n_seqs": 12, "n_steps": 18, "tail": 8}


def model_runs(flags, device="cuda", steps_kw=STEPS, model="q40"):
    from test_exl2_gemv_group import model_runs as runs

    if model == "q40":
        return runs(flags, steps_kw, device=device)
    raise ValueError(model)


def greedy(flags, device="cuda", n=32, folder=None):
    """32 greedy tokens of one prompt, one row per step (the batch-1 decode step)."""
    import exl2cpp
    from conftest_exl2 import assemble_fixture_models

    with exl2cpp.options.scope():
        model = exl2cpp.load(folder or (assemble_fixture_models() / "q40"), device=device, options=flags)
        core = model._core
        prompt = [1, 415, 2936, 906, 285, 1142, 2870, 13]  # ids < 8192 (the q40 fixture vocabulary)
        page = 16
        pps = -(-(len(prompt) + n + 1) // page)
        cache = core.make_cache(pps * page + page, page, "auto")
        table = cache.pool.alloc(pps)
        logits = core.forward(
            cache,
            prompt,
            list(range(len(prompt))),
            [0] * len(prompt),
            table,
            pps,
            [len(prompt) - 1],
        )
        toks, allg = [], [np.asarray(logits)]
        for i in range(n):
            t = int(np.argmax(np.asarray(logits)[-1]))
            toks.append(t)
            logits = core.forward(cache, [t], [len(prompt) + i], [0], table, pps, None)
            allg.append(np.asarray(logits))
        return toks, allg


def test_model_fuse_composition_identical_on_cpu():
    """The CPU runs the composition with gemv_fuse on: the same ops as the unfused layer, so every logit bit
    of every step (prefill and decode batches) must be the same."""
    a = model_runs(
        {"gemv_fuse": False},
        device="cpu",
        steps_kw={"seed": 2, "n_seqs": 8, "n_steps": 6, "tail": 2},
    )
    b = model_runs(
        {"gemv_fuse": True},
        device="cpu",
        steps_kw={"seed": 2, "n_seqs": 8, "n_steps": 6, "tail": 2},
    )
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        np.testing.assert_array_equal(x, y, err_msg=f"step {i}")


@needs_gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_model_fused_matches_unfused(graphs):
    """Eager and with CUDA graphs: the fused step close to the unfused one (different roundings: the norm's sum
    order, one rounding of the residual add instead of two; test_exl2_gemv_group measured up to 1.7e-3 from the
    split-k atomics alone), no further from the CPU than the unfused step is, and 32 greedy tokens identical."""
    env = {"cuda_graphs": graphs}
    a = model_runs({**env, "gemv_fuse": False})
    b = model_runs({**env, "gemv_fuse": True})
    cpu = model_runs({}, device="cpu")
    assert_near_baseline_and_cpu(a, b, cpu, 1e-2, "fused vs unfused")
    ta, la = greedy({**env, "gemv_fuse": False})
    tb, lb = greedy({**env, "gemv_fuse": True})
    assert ta == tb
    for i, (x, y) in enumerate(zip(la, lb)):
        assert rel_l2(y, x) < 1e-2, f"greedy step {i}: rel L2 {rel_l2(y, x):.2e}"


@needs_gpu
def test_model_dense_fp16_composition(smollm2_dir):
    """A dense fp16 model on CUDA (no EXL2 layer: forward_fused composes the ops): greedy tokens as unfused."""
    ta, la = greedy({"gemv_fuse": False}, folder=smollm2_dir)
    tb, lb = greedy({"gemv_fuse": True}, folder=smollm2_dir)
    assert ta == tb
    for i, (x, y) in enumerate(zip(la, lb)):
        assert rel_l2(y, x) < 5e-3, f"step {i}: rel L2 {rel_l2(y, x):.2e}"


def test_model_dense_composition_identical_on_cpu(smollm2_dir):
    """The real SmolLM2-135M (dense) on the CPU: 8 greedy steps, every logit bit the same with the switch on."""
    ta, la = greedy({"gemv_fuse": False}, device="cpu", n=8, folder=smollm2_dir)
    tb, lb = greedy({"gemv_fuse": True}, device="cpu", n=8, folder=smollm2_dir)
    assert ta == tb
    for i, (x, y) in enumerate(zip(la, lb)):
        np.testing.assert_array_equal(x, y, err_msg=f"step {i}")
