"""The two layer-by-layer passes of the converter over calibration hidden states (NumPy fp32).

measure_layer: for one decoder layer on the *clean* states, quantize every distinct candidate config of every
linear with GPTQ (Hessians from the layer's real inputs; k/v share q's, gate shares up's), then put each
option row of ExLlamaV2's table into the block and record ``accuracy = 1 - mean_rows(|y_q - y|_F / |y|_F)`` of
the block output y (residual included) and its total bits (spec §2.4).

quantize_layer: quantize one layer with its chosen configs on the *quantized* model's states, sequentially
inside the layer (o_proj's Hessian comes from attention with the quantized q/k/v, down_proj's from the
quantized gate/up), and return the packed tensors and the next states.

Two implementations of the layer forward: NumPy (SourceModel's, the CPU default) and ``_C.GptqLayerEval``
(cpp/quant/gptq.h: the layer's states stay on the device for the whole layer, the candidate errors are summed
there, only weights go in and Hessians / errors / the next states come out; the default on CUDA, and usable on
the CPU backend, where the measurement uses it too; the tests compare it against the NumPy path). ``LAYER_EVAL``
overrides the choice.
Every phase is timed (timing.timer).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .. import _C
from . import gptq
from .layers import SourceModel
from .pool import GPTQPool
from .qparams import QParams, block_options, total_bits
from .timing import timer

# None: the evaluator for the measurement everywhere (on the CPU too: 2.1x faster than NumPy's forward there on
# SmolLM2's layers) and for the quantization pass on CUDA (on the CPU NumPy's BLAS projections win at 16k tokens);
# True / False force one path for both passes (tests).
LAYER_EVAL: bool | None = None


def use_layer_eval(src: SourceModel, phase: str = "measure") -> bool:
    if LAYER_EVAL is None:
        return phase == "measure" or src.device != "cpu"
    return bool(LAYER_EVAL)


class _Eval:
    """_C.GptqLayerEval for one layer of SourceModel src over states x [rows, T, hidden], with timed calls."""

    def __init__(self, src: SourceModel, w: dict, x: np.ndarray, phase: str):
        R, T, hid = x.shape
        self.shape = x.shape
        self.src, self.w, self.p = src, w, phase
        cos, sin = src.rope(T)
        cs = np.ascontiguousarray(np.concatenate([cos, sin], axis=1), dtype=np.float32)
        with timer(f"{phase}.eval.upload"):
            self.ev = _C.GptqLayerEval(np.ascontiguousarray(x, dtype=np.float32).reshape(R * T, hid), cs, R, T,
                                       src.n_heads, src.n_kv, src.head_dim, src.eps, src.device)  # fmt: skip

    def t(self, name: str):
        return timer(f"{self.p}.{name}", sync=self.ev.sync)

    def norm(self, key: str) -> None:
        with self.t("eval.forward"):
            self.ev.norm(self.w[key])

    def attention(self, wq, wk, wv, name: str = "eval.forward") -> None:
        w = self.w
        with self.t(name):
            self.ev.attention(wq, wk, wv, w.get("q_proj.bias"), w.get("k_proj.bias"), w.get("v_proj.bias"),
                              w.get("q_norm"), w.get("k_norm"))  # fmt: skip

    def mlp(self, wg, wu, name: str = "eval.forward") -> None:
        with self.t(name):
            self.ev.mlp(wg, wu, self.w.get("gate_proj.bias"), self.w.get("up_proj.bias"))

    def out(self, wo, proj: str, name: str = "eval.forward") -> None:
        with self.t(name):
            self.ev.out(wo, self.w.get(proj + ".bias"))

    def hessian(self, of_mid: bool) -> np.ndarray:
        with self.t("hessian"):
            if self.src.device == "cpu":  # BLAS beats the C++ loops on the CPU (same fp32 sums as hessian())
                a = self.ev.mid() if of_mid else self.ev.xn()
                return a.T @ a
            return self.ev.hessian(of_mid)

    def rel_err(self) -> float:
        with self.t("eval.err"):
            return self.ev.rel_err()

    def states(self) -> np.ndarray:
        with self.t("eval.download"):
            return self.ev.states().reshape(self.shape)


# The allocation weights each block's measured error by how much outlier tokens inflate the block output's norm
# (outlier_scale). A token is an outlier when its residual-stream norm exceeds OUTLIER_K x the median token norm of
# its row: SmolLM2-135M's first token carries a "massive activation" from layer 11's MLP to layer 28, 8x the norm of
# all other tokens of a 512-token row together, which made the relative errors of those blocks look 3-8x smaller
# than the other tokens see them (docs/convert.md, "Allocation"). EXL2CPP_ALLOC_OUTLIER overrides K; 0 turns the
# weighting off (every weight 1: the plain relative errors, as ExLlamaV2 allocates).
OUTLIER_K = 8.0


def outlier_k() -> float:
    """OUTLIER_K, or EXL2CPP_ALLOC_OUTLIER when set (a number >= 1, or 0 for no weighting)."""
    return gptq.env_number("EXL2CPP_ALLOC_OUTLIER", OUTLIER_K, lambda k: k == 0 or k >= 1, "0 (off) or a number >= 1")


def outlier_scale(y: np.ndarray, k: float) -> float:
    """mean over rows of |y_r|_F divided by the mean over rows of the same norm without the row's outlier tokens
    (token norm > k x the row's median token norm; the kept tokens' squared sum is scaled up to the row's token
    count), for y [rows, T, hidden]; 1 when no token is an outlier."""
    tn = np.stack([np.sum(np.square(r, dtype=np.float64), axis=1) for r in y])  # [rows, T], a row at a time
    keep = tn <= (k * k) * np.median(tn, axis=1, keepdims=True)
    full = np.sqrt(np.sum(tn, axis=1))
    kept = np.sqrt(np.sum(np.where(keep, tn, 0.0), axis=1) * tn.shape[1] / np.maximum(keep.sum(axis=1), 1))
    return float(np.mean(full) / max(float(np.mean(kept)), 1e-30))


def block_scales(src: SourceModel, x: np.ndarray, k: float, tick: Callable[[], None] = lambda: None) -> dict:
    """{"model.layers.i.self_attn" / ".mlp": outlier_scale of the block's output} over the clean model's forward
    from the embedded rows x [rows, T, hidden] (the measurement's rows), one layer at a time."""
    out = {}
    for i in range(src.n_layers):
        w = src.layer(i)
        if use_layer_eval(src):
            ev = _Eval(src, w, x, "scales")
            for mode in ("self_attn", "mlp"):
                attn = mode == "self_attn"
                ev.norm("attn_norm" if attn else "mlp_norm")
                if attn:
                    ev.attention(w["q_proj"], w["k_proj"], w["v_proj"])
                    ev.out(w["o_proj"], "o_proj")
                else:
                    ev.mlp(w["gate_proj"], w["up_proj"])
                    ev.out(w["down_proj"], "down_proj")
                ev.ev.commit(False)
                x = ev.states()
                out[f"model.layers.{i}.{mode}"] = outlier_scale(x, k)
        else:
            with timer("scales.forward"):
                x = src.attn_block(x, w)
                out[f"model.layers.{i}.self_attn"] = outlier_scale(x, k)
                x = src.mlp_block(x, w)
                out[f"model.layers.{i}.mlp"] = outlier_scale(x, k)
        tick()
    return out


def hessian(x: np.ndarray, device: str = "cpu") -> np.ndarray:
    """sum over tokens of x^T x, float32 [in, in], for x [rows, T, in]; fp32 accumulation, on a CUDA device via
    cuBLAS (``_C.gptq_hessian``)."""
    f = x.reshape(-1, x.shape[-1])
    if device == "cpu":
        return f.T @ f
    return _C.gptq_hessian(np.ascontiguousarray(f, dtype=np.float32), device)


def rel_err(y: np.ndarray, ref: np.ndarray) -> float:
    """mean over rows of |y - ref|_F / |ref|_F (ExLlamaV2's test_error)."""
    num = np.sqrt(np.sum(np.square(y - ref, dtype=np.float64), axis=(1, 2)))
    den = np.sqrt(np.sum(np.square(ref, dtype=np.float64), axis=(1, 2)))
    return float(np.mean(num / np.maximum(den, 1e-30)))


def _in_out(w: dict, proj: str) -> tuple[int, int]:
    o, i = w[proj].shape
    return i, o


def option_bits(w: dict, projs: tuple[str, ...], row: tuple[QParams, ...]) -> int:
    return sum(total_bits(qp.groups(_in_out(w, p)[0]), _in_out(w, p)[1], p + ".bias" in w)
               for p, qp in zip(projs, row))  # fmt: skip


def measure_layer(src: SourceModel, i: int, w: dict, x: np.ndarray, pool: GPTQPool | None = None,
                  tick: Callable[[], None] = lambda: None) -> tuple[dict, np.ndarray]:  # fmt: skip
    """Measurement entries {"model.layers.i.self_attn": [...], "model.layers.i.mlp": [...]} (ExLlamaV2's
    measurement.json rows) and the clean states after layer i."""
    if use_layer_eval(src):
        return _measure_layer_eval(src, i, w, x, pool, tick)
    out = {}
    for mode in ("self_attn", "mlp"):
        attn = mode == "self_attn"
        projs, options = block_options(mode)
        last, n_mid = projs[-1], len(projs) - 1

        with timer("measure.forward"):
            xn = src.norm(x, w["attn_norm" if attn else "mlp_norm"])
        with timer("measure.hessian"):
            h = hessian(xn, src.device)
        p_in = gptq.prepare(h)
        mid = _middle(src, attn, xn, w, [w[p] for p in projs[:n_mid]], "measure.forward")
        with timer("measure.hessian"):
            h = hessian(mid, src.device)
        p_mid = gptq.prepare(h)
        with timer("measure.forward"):
            ref = x + src.linear(mid, w[last], w.get(f"{last}.bias"))
        del mid
        preps = {p: (p_mid if p == last else p_in) for p in projs}
        deq = _quantize_distinct(w, projs, options, preps, pool, tick, src.device)
        rows, cur, mid = [], None, None
        for row in options:
            if row[:n_mid] != cur:  # option rows that share the first projections share the block's middle
                cur = row[:n_mid]
                mid = None  # free the previous one first
                mid = _middle(src, attn, xn, w, [deq[p][qp] for p, qp in zip(projs[:n_mid], cur)],
                              "measure.eval.attention" if attn else "measure.eval.mlp")  # fmt: skip
            with timer("measure.eval.out"):
                y = x + src.linear(mid, deq[last][row[-1]], w.get(f"{last}.bias"))
            with timer("measure.eval.err"):
                err = rel_err(y, ref)
            rows.append(_entry(err, option_bits(w, projs, row), projs, row))
            tick()
        out[f"model.layers.{i}.{mode}"] = rows
        x = ref
    return out, x


def _middle(src: SourceModel, attn: bool, xn: np.ndarray, w: dict, ws: list, name: str) -> np.ndarray:
    """A block's states up to its last projection's input: attention output or the MLP's gated activation."""
    with timer(name):
        return src.attention(xn, w, *ws) if attn else src.mlp_act(xn, w, *ws)


def _measure_layer_eval(src: SourceModel, i: int, w: dict, x: np.ndarray, pool: GPTQPool | None,
                        tick: Callable[[], None]) -> tuple[dict, np.ndarray]:  # fmt: skip
    """measure_layer on _C.GptqLayerEval: the states stay on the device for the whole layer."""
    ev = _Eval(src, w, x, "measure")
    out = {}
    for mode in ("self_attn", "mlp"):
        attn = mode == "self_attn"
        projs, options = block_options(mode)
        ev.norm("attn_norm" if attn else "mlp_norm")
        p_in = gptq.prepare(ev.hessian(False))
        if attn:
            ev.attention(w["q_proj"], w["k_proj"], w["v_proj"])
        else:
            ev.mlp(w["gate_proj"], w["up_proj"])
        p_mid = gptq.prepare(ev.hessian(True))
        last = projs[-1]
        ev.out(w[last], last)
        with ev.t("eval.forward"):
            ev.ev.set_ref()
        preps = {p: (p_mid if p == last else p_in) for p in projs}
        deq = _quantize_distinct(w, projs, options, preps, pool, tick, src.device, phase="measure")
        rows, cur = [], None
        n_mid = len(projs) - 1
        for row in options:
            if row[:n_mid] != cur:  # option rows that share the first projections share the block's middle
                cur = row[:n_mid]
                ws = [deq[p][qp] for p, qp in zip(projs[:n_mid], cur)]
                if attn:
                    ev.attention(*ws, name="eval.attention")
                else:
                    ev.mlp(*ws, name="eval.mlp")
            ev.out(deq[last][row[-1]], last, name="eval.out")
            rows.append(_entry(ev.rel_err(), option_bits(w, projs, row), projs, row))
            tick()
        out[f"model.layers.{i}.{mode}"] = rows
        ev.ev.commit(True)
    return out, ev.states()


def measure_steps(w: dict | None = None) -> int:
    """Progress ticks of measure_layer: one per distinct GPTQ plus one per option row."""
    n = 0
    for mode in ("self_attn", "mlp"):
        projs, options = block_options(mode)
        n += len(options) + sum(len({row[j] for row in options}) for j in range(len(projs)))
    return n


def _quantize_distinct(w, projs, options, preps, pool, tick, device, phase: str = "measure") -> dict:
    jobs: list[tuple[str, QParams]] = []
    for j, p in enumerate(projs):
        for row in options:
            if (p, row[j]) not in jobs:
                jobs.append((p, row[j]))
    pool = pool or GPTQPool(1)
    deq: dict = {p: {} for p in projs}
    step = max(1, pool.workers)
    perm: dict[str, np.ndarray] = {}  # each projection's act-order weight, shared by its candidate configs
    with timer("gptq.host"):
        for p in projs:
            perm[p] = gptq.permuted(w[p], preps[p])
    for s in range(0, len(jobs), step):  # in chunks, so the progress bar moves
        chunk = jobs[s : s + step]
        with timer(f"{phase}.gptq"):
            res = pool.map([(None, preps[p], qp.groups(_in_out(w, p)[0]), device, perm[p]) for p, qp in chunk])
        for (p, qp), ql in zip(chunk, res):
            deq[p][qp] = ql.weight
            tick()
    return deq


def _entry(err: float, bits: int, projs, row) -> dict:
    e = {"accuracy": max(1e-6, 1.0 - err), "total_bits": int(bits)}
    for p, qp in zip(projs, row):
        e[p] = qp.to_json()
    return e


def quantize_layer(src: SourceModel, i: int, w: dict, x: np.ndarray, groups: dict[str, list],
                   pool: GPTQPool | None = None, hook: Callable[[str], None] = lambda s: None,
                   tick: Callable[[], None] = lambda: None) -> tuple[dict, np.ndarray]:  # fmt: skip
    """Packed EXL2 tensors of layer i's seven linears ({"model.layers.i.self_attn.q_proj.q_weight": ...}) with
    groups[proj] = [(bits, rows), ...], and the states after the quantized layer."""
    tensors: dict[str, np.ndarray] = {}
    pre = f"model.layers.{i}."

    pool = pool or GPTQPool(1)

    def q(projs: tuple[str, ...], prep: gptq.Prepared, kind: str) -> list[np.ndarray]:
        with timer("quant.gptq"):
            res = pool.map([(w[p], prep, [tuple(g) for g in groups[p]], src.device) for p in projs])
        with timer("quant.pack"):
            for proj, ql in zip(projs, res):
                name = f"{pre}{kind}.{proj}"
                packed = ql.pack(w.get(proj + ".bias"))
                gptq.check_packed(packed, ql, name)
                for k, v in packed.items():
                    tensors[f"{name}.{k}"] = v
                tick()
        return [ql.weight for ql in res]

    if use_layer_eval(src, "quant"):
        ev = _Eval(src, w, x, "quant")
        ev.norm("attn_norm")
        wq, wk, wv = q(("q_proj", "k_proj", "v_proj"), gptq.prepare(ev.hessian(False)), "self_attn")
        ev.attention(wq, wk, wv)
        (wo,) = q(("o_proj",), gptq.prepare(ev.hessian(True)), "self_attn")
        ev.out(wo, "o_proj")
        ev.ev.commit(False)
        hook("mlp")
        ev.norm("mlp_norm")
        wg, wu = q(("gate_proj", "up_proj"), gptq.prepare(ev.hessian(False)), "mlp")
        ev.mlp(wg, wu)
        (wd,) = q(("down_proj",), gptq.prepare(ev.hessian(True)), "mlp")
        ev.out(wd, "down_proj")
        ev.ev.commit(False)
        return tensors, ev.states()

    def t(name: str):
        return timer(f"quant.{name}")

    with t("forward"):
        xn = src.norm(x, w["attn_norm"])
    with t("hessian"):
        h = hessian(xn, src.device)
    wq, wk, wv = q(("q_proj", "k_proj", "v_proj"), gptq.prepare(h), "self_attn")
    with t("forward"):
        a = src.attention(xn, w, wq, wk, wv)
    with t("hessian"):
        h = hessian(a, src.device)
    (wo,) = q(("o_proj",), gptq.prepare(h), "self_attn")
    with t("forward"):
        x = x + src.linear(a, wo, w.get("o_proj.bias"))
    del a, xn
    hook("mlp")
    with t("forward"):
        xn = src.norm(x, w["mlp_norm"])
    with t("hessian"):
        h = hessian(xn, src.device)
    wg, wu = q(("gate_proj", "up_proj"), gptq.prepare(h), "mlp")
    with t("forward"):
        act = src.mlp_act(xn, w, wg, wu)
    with t("hessian"):
        h = hessian(act, src.device)
    (wd,) = q(("down_proj",), gptq.prepare(h), "mlp")
    with t("forward"):
        x = x + src.linear(act, wd, w.get("down_proj.bias"))
    return tensors, x


def quantize_head(src: SourceModel, x: np.ndarray, qp: QParams, pool: GPTQPool | None = None) -> dict:
    """lm_head's packed tensors, GPTQ with the final-norm outputs' Hessian."""
    with timer("head.forward"):
        xn = src.norm(x, src.tensor("model.norm.weight"))
        wh = src.head_weight()
    with timer("head.hessian"):
        h = hessian(xn, src.device)
    prep = gptq.prepare(h)
    with timer("head.gptq"):
        (ql,) = (pool or GPTQPool(1)).map([(wh, prep, qp.groups(wh.shape[1]), src.device)])
    with timer("head.pack"):
        packed = ql.pack()
        gptq.check_packed(packed, ql, "lm_head")
    return {f"lm_head.{k}": v for k, v in packed.items()}
