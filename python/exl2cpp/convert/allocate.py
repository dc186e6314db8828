"""Bit allocation: one measured option per block (attention, MLP of every layer) so that the decoder's average
bits per weight (format overhead included, as ``Model.info()["bpw_layers"]`` counts it) is at most the target and
the summed error ``sum(err^norm)`` is minimal (exact DP over a fine cost grid), then a deterministic fill that
spends the leftover bits by promoting whole groups to the next bit width, so the average lands within a group's
worth of bits below the target.
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidArgumentError
from .qparams import VALID_BITS, QParams, total_bits

N_BINS = 20000  # DP resolution over the budget above the cheapest choice


def linear_cost(groups: list, shape: tuple) -> float:
    """Bits of a linear weighted as info() averages them: total_bits * numel / (numel (+ out with bias)); shape
    (in, out, bias) or (in, out, bias, count): count linears of that shape with one config (a MoE layer's experts)."""
    i, o, bias = shape[:3]
    count = shape[3] if len(shape) > 3 else 1
    tb = total_bits([tuple(g) for g in groups], o, bias)
    numel = i * o
    return count * tb * numel / (numel + (o if bias else 0))


def allocate(blocks: list[dict], target_bpw: float, numel: int, norm: float = 2.0) -> tuple[list[int], dict]:
    """blocks: [{"key", "options": [{"cost", "err"}, ...]}] in model order; numel = weights of all decoder
    linears. Returns the chosen option index per block and a summary."""
    budget = target_bpw * numel
    costs = [np.array([o["cost"] for o in b["options"]], np.float64) for b in blocks]
    vals = [np.array([max(o["err"], 0.0) ** norm for o in b["options"]], np.float64) for b in blocks]
    lo = sum(c.min() for c in costs)
    hi = sum(c.max() for c in costs)
    if budget < lo - 1e-6:
        raise InvalidArgumentError(
            f"--bits {target_bpw} is below the smallest average this model's candidates reach ({lo / numel:.3f})"
        )
    if budget > hi + 1e-6:
        raise InvalidArgumentError(
            f"--bits {target_bpw} is above the largest average this model's candidates reach ({hi / numel:.3f})"
        )
    room = budget - lo
    unit = room / N_BINS if room > 0 else 1.0
    nb = N_BINS if room > 0 else 0
    dp = np.full(nb + 1, np.inf)
    dp[0] = 0.0
    choice = []
    for c, v in zip(costs, vals):
        cu = np.ceil((c - c.min()) / unit - 1e-9).astype(np.int64) if room > 0 else np.where(c == c.min(), 0, 1)
        new = np.full(nb + 1, np.inf)
        arg = np.zeros(nb + 1, np.int16)
        for j in range(len(c)):
            k = int(cu[j])
            if k > nb:
                continue
            cand = np.full(nb + 1, np.inf)
            cand[k:] = dp[: nb + 1 - k] + v[j]
            better = cand < new
            new[better] = cand[better]
            arg[better] = j
        dp = new
        choice.append(arg)
    b = int(np.argmin(dp))
    picks = [0] * len(blocks)
    for s in range(len(blocks) - 1, -1, -1):
        j = int(choice[s][b])
        picks[s] = j
        c = costs[s]
        k = int(np.ceil((c[j] - c.min()) / unit - 1e-9)) if room > 0 else int(c[j] != c.min())
        b -= k
    picks = _improve(picks, costs, vals, budget)
    used = float(sum(costs[s][j] for s, j in enumerate(picks)))
    return picks, {"budget_bits": budget, "dp_bits": used, "dp_bpw": used / numel, "objective": float(sum(vals[s][j] for s, j in enumerate(picks)))}


def _improve(picks: list[int], costs: list, vals: list, budget: float) -> list[int]:
    """Exact-cost local search after the grid DP (whose rounded-up costs can miss a fitting optimum): best
    single-slot change, then best change of a pair of slots, while either lowers the objective."""
    picks = list(picks)
    used = sum(costs[s][j] for s, j in enumerate(picks))
    for _ in range(1000):
        best = (0.0, None)
        for s in range(len(picks)):
            c0, v0 = costs[s][picks[s]], vals[s][picks[s]]
            gain = vals[s] - v0
            ok = used - c0 + costs[s] <= budget
            if ok.any():
                j = int(np.argmin(np.where(ok, gain, np.inf)))
                if gain[j] < best[0] - 1e-15:
                    best = (float(gain[j]), ((s, j),))
        for s in range(len(picks)):
            for t in range(s + 1, len(picks)):
                cs = costs[s][:, None] + costs[t][None, :] - costs[s][picks[s]] - costs[t][picks[t]]
                gs = vals[s][:, None] + vals[t][None, :] - vals[s][picks[s]] - vals[t][picks[t]]
                gs = np.where(used + cs <= budget, gs, np.inf)
                k = int(np.argmin(gs))
                if gs.flat[k] < best[0] - 1e-15:
                    i, j = divmod(k, gs.shape[1])
                    best = (float(gs.flat[k]), ((s, i), (t, j)))
        if best[1] is None:
            return picks
        for s, j in best[1]:
            used += costs[s][j] - costs[s][picks[s]]
            picks[s] = j
    return picks


def _next_bits(b: int) -> int | None:
    higher = [x for x in VALID_BITS if x > b]
    return higher[0] if higher else None


def fill(configs: dict, shapes: dict, block_err: dict, budget: float) -> tuple[dict, float]:
    """Spend leftover bits: repeatedly promote the first group of a linear's lowest-width run to the width of the
    run above it (or the next width when the linear has one width) while one fits the budget. Blocks take turns,
    largest measured error first; in its turn a block makes its largest promotion that fits. configs: {block: {proj: [[bits,
    rows], ...]}}, shapes: {block: {proj: (in, out, bias[, count])}}. Returns the new configs and the bits used."""
    configs = {k: {p: [list(g) for g in v] for p, v in d.items()} for k, d in configs.items()}
    used = sum(linear_cost(g, shapes[k][p]) for k, d in configs.items() for p, g in d.items())
    order = sorted(configs, key=lambda k: (-block_err[k], k))
    idle = 0  # blocks in a row without a fitting promotion
    n = 0
    while order and idle < len(order):
        k = order[n % len(order)]
        n += 1
        best = None
        for p, groups in configs[k].items():
            low = groups[-1][0]
            idx = next(m for m, g in enumerate(groups) if g[0] == low)
            nb = groups[idx - 1][0] if idx > 0 else _next_bits(low)
            if nb is None:
                continue
            trial = [list(g) for g in groups]
            trial[idx][0] = nb
            delta = linear_cost(trial, shapes[k][p]) - linear_cost(groups, shapes[k][p])
            if used + delta <= budget and (best is None or delta > best[2]):
                best = (p, trial, delta)
        if best is None:
            idle += 1
            continue
        idle = 0
        configs[k][best[0]] = best[1]
        used += best[2]
    return configs, used


def head_qparams(head_bits: int) -> QParams:
    from .qparams import HEAD_OPTIONS

    if head_bits not in HEAD_OPTIONS:
        raise InvalidArgumentError(f"--head-bits must be one of {sorted(HEAD_OPTIONS)}, got {head_bits}")
    return HEAD_OPTIONS[head_bits]
