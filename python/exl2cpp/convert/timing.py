"""Wall-clock timers per converter phase (calibration, forward, Hessians, prepare = Cholesky/inverse, GPTQ, candidate
evaluation, host<->device transfers, state I/O): ``with timer("gptq.op"):`` adds to one process-wide table that
convert() resets, prints with ``verbose=True`` (CLI: ``--verbose``) and writes as JSON to
``timing_file``. Device work is synchronized before a timed section ends where the
caller passes ``sync`` (the layer evaluator's), so GPU time lands in the phase that queued it. Timers nest; a
phase's time includes its inner phases (names are dotted: "measure.eval.attention" is inside "measure")."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager


class Timers:
    def __init__(self) -> None:
        self.total: dict[str, float] = {}
        self.count: dict[str, int] = {}

    def reset(self) -> None:
        self.total.clear()
        self.count.clear()

    @contextmanager
    def __call__(self, key: str, sync: Callable[[], None] | None = None):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if sync is not None:
                sync()
            self.total[key] = self.total.get(key, 0.0) + time.perf_counter() - t0
            self.count[key] = self.count.get(key, 0) + 1

    def add(self, key: str, seconds: float, n: int = 1) -> None:
        self.total[key] = self.total.get(key, 0.0) + seconds
        self.count[key] = self.count.get(key, 0) + n

    def report(self) -> dict:
        """{phase: {"s": seconds, "n": calls}}, sorted by phase name."""
        return {k: {"s": round(self.total[k], 4), "n": self.count[k]} for k in sorted(self.total)}

    def table(self) -> str:
        lines = [f"{'phase':<34} {'seconds':>10} {'calls':>8} {'ms/call':>9}"]
        for k in sorted(self.total):
            s, n = self.total[k], self.count[k]
            lines.append(f"{k:<34} {s:>10.2f} {n:>8d} {1e3 * s / max(n, 1):>9.2f}")
        return "\n".join(lines)


timer = Timers()
