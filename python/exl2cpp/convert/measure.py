"""The layer-by-layer passes of the converter over calibration states, on the runtime's own forward
(``_C.Calibration``: the decoder body one layer at a time in fp32, cpp/model/calibration.h). A layer runs as its
residual blocks (attention, then MLP; one block for a parallel residual); the capture hook reports each linear's
input before its product (the Hessians), and the quantized weights go back in through ``set_weight``.

measure_layer: on the *clean* states, for each measurement group (source.SourceModel.groups) quantize every
distinct candidate config of its linears with GPTQ (Hessians from the clean block's inputs; linears that read the
same input share it), then put each option row of ExLlamaV2's table into the block and record
``accuracy = 1 - mean_rows(|y_q - y|_F / |y|_F)`` of the block output y (residual included) and its total bits
(spec §2.4); the clean output is the next block's input.

quantize_layer: quantize one layer with its chosen configs on the *quantized* model's states, sequentially
inside the layer: the hook quantizes each linear when its product is reached (o_proj's Hessian comes from
attention with the quantized q/k/v, down_proj's from the quantized gate/up) and installs the result before the
product runs; the block's output is the next block's input.

MoE layers: each expert's Hessians come from the tokens the router sent it (its gate / up from those tokens'
normed states, its down from their GLU products: the capture hook reports only an expert's routed rows). An expert
with fewer routed rows than its input width has a singular Hessian; expert_hessian fills it up with a prior worth
the missing rows (gate / up: the MoE input's mean per-token Hessian, from the router's hook; down: a scaled
identity), so a rarely chosen expert is quantized much as ExLlamaV2 quantizes every expert (gate / up Hessians from
all tokens, down's the identity when it got none). An expert that got no token at all is quantized from the prior
alone after the layer (its weights changed nothing in the layer's output).
Every phase is timed (timing.timer).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import numpy as np

from .. import _C
from ..errors import InvalidArgumentError
from . import gptq
from .pool import GPTQPool
from .qparams import QParams, block_options, total_bits
from .source import SourceModel, group_kind
from .timing import timer

# The allocation weights each block's measured error by how much outlier tokens inflate the block output's norm
# (outlier_scale). A token is an outlier when its residual-stream norm exceeds OUTLIER_K x the median token norm of
# its row: SmolLM2-135M's first token carries a "massive activation" from layer 11's MLP to layer 28, 8x the norm of
# all other tokens of a 512-token row together, which made the relative errors of those blocks look 3-8x smaller
# than the other tokens see them (docs/convert.md, "Allocation"). convert's ``alloc_outlier_k`` sets K; 0 turns the
# weighting off (every weight 1: the plain relative errors, as ExLlamaV2 allocates).
OUTLIER_K = 8.0


def check_outlier_k(k: float) -> float:
    """``k`` as a float when it is 0 (no weighting) or a finite number >= 1 (convert's ``alloc_outlier_k``), else
    InvalidArgumentError naming the parameter."""
    if isinstance(k, bool) or not isinstance(k, numbers.Real) or not math.isfinite(k) or not (k == 0 or k >= 1):
        raise InvalidArgumentError(f"--alloc-outlier-k must be 0 (off) or a number >= 1 (default {OUTLIER_K}), "
                                   f"got {k!r}")  # fmt: skip
    return float(k)


def outlier_scale(y: np.ndarray, k: float) -> float:
    """mean over rows of |y_r|_F divided by the mean over rows of the same norm without the row's outlier tokens
    (token norm > k x the row's median token norm; the kept tokens' squared sum is scaled up to the row's token
    count), for y [rows, T, hidden]; 1 when no token is an outlier."""
    tn = np.stack([np.sum(np.square(r, dtype=np.float64), axis=1) for r in y])  # [rows, T], a row at a time
    keep = tn <= (k * k) * np.median(tn, axis=1, keepdims=True)
    full = np.sqrt(np.sum(tn, axis=1))
    kept = np.sqrt(np.sum(np.where(keep, tn, 0.0), axis=1) * tn.shape[1] / np.maximum(keep.sum(axis=1), 1))
    return float(np.mean(full) / max(float(np.mean(kept)), 1e-30))


def block_scales(src: SourceModel, cal, k: float, tick: Callable[[], None] = lambda: None) -> dict:
    """{group key: outlier_scale of the output of the block that runs the group} over the clean model's forward
    from cal's states (the embedded measurement rows), one layer at a time."""
    out = {}
    for i in range(src.n_layers):
        cal.load_layer(i)
        info = src.linear_info(i)
        for b in range(cal.n_blocks):
            keys: list[str] = []

            def seen(name: str, i=i) -> None:
                if info[name]["quantized"]:
                    keys.append(src.group_key(i, name))

            with timer("scales.forward", sync=cal.sync):
                cal.run(b, seen)
                cal.commit(False)
            s = outlier_scale(cal.states(), k)
            for key in dict.fromkeys(keys):
                out[key] = s
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


def _input_hessian(src: SourceModel, cal, phase: str) -> np.ndarray:
    """Inside a hook: x^T x of the product's input (the CPU: NumPy's BLAS on a copy, faster than the C++ loops)."""
    with timer(f"{phase}.hessian"):
        if src.device == "cpu":
            a = cal.input()
            return a.T @ a
        return cal.input_hessian()


EXPERT_ROLES = ("w1", "w3", "w2")


def expert_hessian(h: np.ndarray | None, m: int, n_in: int, prior: np.ndarray | None = None) -> np.ndarray:
    """The GPTQ Hessian of an expert's linear from the m rows routed to it (h: their x^T x [n_in, n_in]; None when
    m = 0). With m >= n_in, h; with fewer rows, h plus (n_in - m) rows' worth of a prior: `prior` (a mean per-token
    x^T x: the MoE input's, for gate and up) or, when None (down), the identity times the routed rows' mean
    diagonal (1 without rows)."""
    if m >= n_in and h is not None:
        return h
    if prior is None:
        tr = float(np.trace(h)) if h is not None and m > 0 else 0.0
        prior = np.eye(n_in, dtype=np.float32) * np.float32(tr / (n_in * m) if tr > 0 else 1.0)
    fill = np.float32(n_in - m) * prior.astype(np.float32)
    return fill if h is None else h + fill


def _moe_prior(info: dict, hess: dict, counts: dict) -> np.ndarray | None:
    """The MoE input's mean per-token Hessian of a block's run (the router's input), or None (no router ran)."""
    lead = next((d["input"] for d in info.values() if d["role"] == "router"), None)
    if lead is None or lead not in hess:
        return None
    return hess[lead] / np.float32(max(1, counts[lead]))


def _expert_leads(info: dict) -> list[dict]:
    """The experts' linears that lead an input: each expert's gate (w1, its up shares it) and down (w2)."""
    return [d for d in info.values() if d["role"] in ("w1", "w2") and d["input"] == d["name"]]


def linear_bits(d: dict, qp: QParams) -> int:
    return total_bits(qp.groups(d["in"]), d["out"], d["bias"])


def _columns(group: list[dict]) -> tuple[tuple[str, ...], tuple[tuple[QParams, ...], ...], list[int]]:
    """(table projections, option rows, each linear's column) of a measurement group."""
    projs, options = block_options(group_kind(d["role"] for d in group))
    return projs, options, [projs.index(d["role"]) for d in group]


def measure_layer(src: SourceModel, cal, i: int, pool: GPTQPool | None = None,
                  tick: Callable[[], None] = lambda: None, damp: float = gptq.DAMP,
                  search: str = gptq.SCALE_SEARCH) -> dict:  # fmt: skip
    """Measurement entries {group key: [...]} (ExLlamaV2's measurement.json rows) of layer i over cal's states, GPTQ
    with relative damping ``damp`` and group scale search ``search``; cal's states become the clean states after layer i."""
    info = src.linear_info(i)
    groups = src.groups(i)
    cal.load_layer(i)
    out = {}
    for b in range(cal.n_blocks):
        seen: list[str] = []
        hess: dict[str, np.ndarray] = {}
        counts: dict[str, int] = {}  # rows of each lead's input (an expert's: its routed tokens)

        def capture(name: str) -> None:
            if info[name]["quantized"]:
                seen.append(name)
            lead = info[name]["input"]
            if lead not in hess:
                hess[lead] = _input_hessian(src, cal, "measure")
                counts[lead] = cal.input_rows()

        with timer("measure.forward", sync=cal.sync):
            cal.run(b, capture)
            cal.set_ref()
        prior = _moe_prior(info, hess, counts)
        if prior is not None:  # this block runs the experts: every expert's Hessians, also the unrouted ones'
            for d in _expert_leads(info):
                h = expert_hessian(hess.get(d["name"]), counts.get(d["name"], 0), d["in"],
                                   prior if d["role"] == "w1" else None)  # fmt: skip
                hess[d["name"]] = h
        leads = {d["input"] for d in info.values() if d["quantized"]}  # not the router's alone
        preps = {lead: gptq.prepare(h, damp, search) for lead, h in hess.items() if lead in leads}
        del hess
        for key in dict.fromkeys(src.group_key(i, n) for n in seen):
            group = groups[key]
            projs, options, cols = _columns(group)
            kind = {"self_attn": "attention", "mlp": "mlp"}.get(group_kind(d["role"] for d in group), "experts")
            deq = _quantize_distinct(src, group, cols, options, preps, pool, tick)
            rows, cur = [], {}
            for row in options:
                for d, j in zip(group, cols):
                    if cur.get(d["name"]) != row[j]:
                        cur[d["name"]] = row[j]
                        cal.set_weight(d["name"], deq[d["name"]][row[j]])
                with timer(f"measure.eval.{kind}", sync=cal.sync):
                    cal.run(b)
                with timer("measure.eval.err"):
                    err = cal.rel_err()
                bits = sum(linear_bits(d, row[j]) for d, j in zip(group, cols))
                rows.append(_entry(err, bits, [d["role"] for d in group], [row[j] for j in cols]))
                tick()
            for d in group:
                cal.reset_weight(d["name"])
            out[key] = rows
        cal.commit(True)
    return out


def measure_steps(groups: dict[str, list[dict]]) -> int:
    """Progress ticks of measure_layer for a layer's groups (SourceModel.groups): one per distinct GPTQ of each
    linear plus one per option row."""
    n = 0
    for group in groups.values():
        _projs, options, cols = _columns(group)
        n += len(options) + sum(len({row[j] for row in options}) for j in cols)
    return n


def _quantize_distinct(src: SourceModel, group: list[dict], cols: list[int], options, preps: dict, pool,
                       tick) -> dict:  # fmt: skip
    """{name: {config: dequantized weight}} of every distinct candidate config of the group's linears."""
    jobs: list[tuple[dict, QParams]] = []
    for d, j in zip(group, cols):
        for qp in dict.fromkeys(row[j] for row in options):
            jobs.append((d, qp))
    pool = pool or GPTQPool(1)
    deq: dict = {d["name"]: {} for d in group}
    step = max(1, pool.workers)
    perm: dict[str, np.ndarray] = {}  # each linear's act-order weight, shared by its candidate configs
    with timer("gptq.host"):
        for d in group:
            perm[d["name"]] = gptq.permuted(src.tensor(d["name"] + ".weight"), preps[d["input"]])
    for s in range(0, len(jobs), step):  # in chunks, so the progress bar moves
        chunk = jobs[s : s + step]
        with timer("measure.gptq"):
            res = pool.map([(None, preps[d["input"]], qp.groups(d["in"]), src.device, perm[d["name"]])
                            for d, qp in chunk])  # fmt: skip
        for (d, qp), ql in zip(chunk, res):
            deq[d["name"]][qp] = ql.weight.astype(np.float16)  # fp16-exact: half the memory (MoE: every expert)
            tick()
    return deq


def _entry(err: float, bits: int, roles, qps) -> dict:
    e = {"accuracy": max(1e-6, 1.0 - err), "total_bits": int(bits)}
    for r, qp in zip(roles, qps):
        e[r] = qp.to_json()
    return e


def quantize_layer(src: SourceModel, cal, i: int, configs: dict[str, dict], pool: GPTQPool | None = None,
                   hook: Callable[[str], None] = lambda s: None, tick: Callable[[], None] = lambda: None,
                   damp: float = gptq.DAMP, search: str = gptq.SCALE_SEARCH) -> dict:  # fmt: skip
    """Packed EXL2 tensors of layer i's linears ({"model.layers.i.self_attn.q_proj.q_weight": ...}) with
    configs[group key][role] = [(bits, rows), ...], quantized (GPTQ, relative damping ``damp``, scale search ``search``) over cal's states,
    which become the states after the quantized layer. hook(f"block{b}") runs before block b."""
    info = src.linear_info(i)
    tensors: dict[str, np.ndarray] = {}
    pool = pool or GPTQPool(1)
    done: set[str] = set()
    prior: list[np.ndarray] = []  # the MoE input's mean per-token Hessian (the router's hook)

    def quantize(name: str) -> None:
        if name in done:
            return
        d0 = info[name]
        lead = d0["input"]
        members = [d for d in info.values() if d["input"] == lead and d["quantized"] and d["name"] not in done]
        if not members and d0["role"] != "router":
            return
        h = _input_hessian(src, cal, "quant")
        if d0["role"] == "router":
            prior[:] = [h / np.float32(cal.input_rows())]
        elif d0["role"] in EXPERT_ROLES:
            h = expert_hessian(h, cal.input_rows(), d0["in"], prior[0] if d0["role"] == "w1" else None)
        if members:
            quantize_members(members, gptq.prepare(h, damp, search))

    def quantize_members(members: list[dict], prep) -> None:
        weights = {d["name"]: src.tensor(d["name"] + ".weight") for d in members}
        groups = {d["name"]: [tuple(g) for g in configs[src.group_key(i, d["name"])][d["role"]]] for d in members}
        with timer("quant.gptq"):
            res = pool.map([(weights[d["name"]], prep, groups[d["name"]], src.device) for d in members])
        with timer("quant.pack"):
            for d, ql in zip(members, res):
                bias = src.tensor(d["name"] + ".bias") if d["bias"] else None
                packed = ql.pack(bias)
                gptq.check_packed(packed, ql, d["name"])
                for k, v in packed.items():
                    tensors[f"{d['name']}.{k}"] = v
                cal.set_weight(d["name"], ql.weight)
                done.add(d["name"])
                tick()

    cal.load_layer(i)
    for b in range(cal.n_blocks):
        hook(f"block{b}")
        with timer("quant.forward", sync=cal.sync):
            cal.run(b, quantize)
            cal.commit(False)
    for d in _expert_leads(info):  # experts no token was routed to: from the prior alone
        if d["name"] not in done:
            h = expert_hessian(None, 0, d["in"], prior[0] if d["role"] == "w1" else None)
            quantize_members([e for e in info.values() if e["input"] == d["name"] and e["name"] not in done],
                             gptq.prepare(h, damp, search))  # fmt: skip
    return tensors


def quantize_head(src: SourceModel, cal, qp: QParams, pool: GPTQPool | None = None, damp: float = gptq.DAMP,
                  search: str = gptq.SCALE_SEARCH) -> dict:  # fmt: skip
    """lm_head's packed tensors, GPTQ (relative damping ``damp``, scale search ``search``) with the final-norm outputs' Hessian (cal's
    states: the last layer's)."""
    with timer("head.forward"):
        xn = cal.head_input()
        wh = src.head_weight()
    with timer("head.hessian"):
        h = hessian(xn, src.device)
    prep = gptq.prepare(h, damp, search)
    with timer("head.gptq"):
        (ql,) = (pool or GPTQPool(1)).map([(wh, prep, qp.groups(wh.shape[1]), src.device)])
    with timer("head.pack"):
        packed = ql.pack()
        gptq.check_packed(packed, ql, "lm_head")
    return {f"{src.head_name}.{k}": v for k, v in packed.items()}


# The KL sensitivity pass measures each block at its option nearest KL_REF_BPW bits per weight.
KL_REF_BPW = 3.0


def ref_option(entries: list[dict], numel: int, ref_bpw: float = KL_REF_BPW) -> int:
    """Index of the measurement row whose bits per weight (total_bits / numel) is nearest ref_bpw (the lower on
    ties)."""
    return min(range(len(entries)), key=lambda k: (abs(entries[k]["total_bits"] / numel - ref_bpw), k))


def kl_sensitivity(src: SourceModel, cal, ids: np.ndarray, meas: dict, pool: GPTQPool | None = None,
                   tick: Callable[[], None] = lambda: None, ref_bpw: float = KL_REF_BPW,
                   damp: float = gptq.DAMP, search: str = gptq.SCALE_SEARCH) -> dict:  # fmt: skip
    """{group key: {"kl", "err", "option"}}: the mean KL of the final logits to the clean model's on cal's rows
    (ids, embedded here) when only that block is quantized, GPTQ from its clean inputs at its measurement row
    nearest ref_bpw (`option`), and that row's measured block error 1 - accuracy (`err`). The allocation's
    error scale of the block is then sqrt(kl) / err (convert: alloc_sensitivity="kl")."""
    from ..errors import UnsupportedError

    if src.moe and src.moe.get("experts"):
        raise UnsupportedError("convert: the KL sensitivity allocation does not handle MoE layers")
    pool = pool or GPTQPool(1)
    head = src.head_weight()
    cal.embed(ids)
    inputs = []
    for i in range(src.n_layers):  # the clean forward: each layer's input states, then the reference output
        inputs.append(cal.states())
        cal.load_layer(i)
        for b in range(cal.n_blocks):
            cal.run(b)
            cal.commit(False)
    cal.set_head_ref(head)  # the clean output distribution, kept on the calibration device
    out: dict = {}
    for i in range(src.n_layers):
        info = src.linear_info(i)
        groups = src.groups(i)
        n_blocks = None
        b = 0
        while n_blocks is None or b < n_blocks:
            cal.set_states(inputs[i])
            cal.load_layer(i)
            n_blocks = cal.n_blocks
            for c in range(b):
                cal.run(c)
                cal.commit(False)
            hess: dict[str, np.ndarray] = {}
            seen: list[str] = []

            def capture(name: str, info=info, hess=hess, seen=seen) -> None:
                if info[name]["quantized"]:
                    seen.append(name)
                lead = info[name]["input"]
                if lead not in hess:
                    hess[lead] = _input_hessian(src, cal, "kl")

            cal.run(b, capture)
            keys = list(dict.fromkeys(src.group_key(i, n) for n in seen))
            for key in keys:
                group = groups[key]
                numel = sum(d["in"] * d["out"] for d in group)
                k = ref_option(meas[key], numel, ref_bpw)
                e = meas[key][k]
                jobs = [(src.tensor(d["name"] + ".weight"), gptq.prepare(hess[d["input"]], damp, search),
                         QParams.from_json(e[d["role"]]).groups(d["in"]), src.device) for d in group]  # fmt: skip
                for d, ql in zip(group, pool.map(jobs)):
                    cal.set_weight(d["name"], ql.weight)
                out[key] = {"option": k, "err": 1.0 - float(e["accuracy"])}
            cal.run(b)
            cal.commit(False)
            for key in keys:
                for d in groups[key]:
                    cal.reset_weight(d["name"])
            for c in range(b + 1, n_blocks):
                cal.run(c)
                cal.commit(False)
            for j in range(i + 1, src.n_layers):
                cal.load_layer(j)
                for c in range(cal.n_blocks):
                    cal.run(c)
                    cal.commit(False)
            kl = cal.head_kl()
            for key in keys:
                out[key]["kl"] = kl
            b += 1
        tick()
    return out


def kl_scales(sens: dict) -> dict:
    """{group key: sqrt(kl) / err} from kl_sensitivity: with these scales the allocation's sum((scale * err)^2) is,
    to first order, the sum of the blocks' output KLs."""
    return {k: float(np.sqrt(max(v["kl"], 0.0)) / max(v["err"], 1e-12)) for k, v in sens.items()}
