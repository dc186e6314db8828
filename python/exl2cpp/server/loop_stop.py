"""Loop detection (TabbyAPI's ``loop_detect_window``): a job whose last ``window`` generated tokens are one pattern
repeated (at least twice) ends there, by a token constraint that then allows only EOS. The check is exact and per
job, so the output up to the stop is the unconstrained one and the seed guarantee holds.

The last ``window`` tokens repeat a pattern of length p (p <= window / 2) when each of them, from the (p+1)-th on,
equals the token p before it: per lag p the constraint keeps how many consecutive tokens matched the one p back, and
the window is a loop when that run reaches ``window - p`` for some p.
"""

from __future__ import annotations

import numpy as np


class LoopStop:
    """A constraint (``Engine.submit(constraint=...)``) that ends the job with ``eos`` once its last ``window``
    tokens loop; ``inner``: another constraint (a grammar) that it wraps, whose masks apply until then."""

    def __init__(self, window: int, eos: int, vocab: int, inner=None):
        self.window, self.eos, self.inner = window, eos, inner
        self.lags = np.arange(1, window // 2 + 1)
        self.need = window - self.lags  # run length per lag that makes a loop
        self.runs = np.zeros(len(self.lags), dtype=np.int64)
        self.recent = np.full(len(self.lags), -1, dtype=np.int64)  # recent[k]: the token k + 1 back
        self.words = (vocab + 31) // 32
        self.looped = False

    def mask(self) -> list[int]:
        return self.inner.mask() if self.inner is not None else []

    def advance(self, token: int) -> list[int]:
        inner = self.inner.advance(token) if self.inner is not None else []
        if self.looped:
            return self._only_eos()
        self.runs = np.where(self.recent == token, self.runs + 1, 0)
        self.recent = np.roll(self.recent, 1)
        self.recent[0] = token
        if np.any(self.runs >= self.need):
            self.looped = True
            return self._only_eos()
        return inner

    def _only_eos(self) -> list[int]:
        words = [0] * self.words
        words[self.eos // 32] = 1 << (self.eos % 32)
        return words


def loops(tokens: list[int], window: int) -> bool:
    """Whether ``tokens`` end with ``window`` tokens that repeat one pattern (the reference for tests)."""
    if len(tokens) < window:
        return False
    tail = tokens[-window:]
    return any(all(tail[i] == tail[i - p] for i in range(p, window)) for p in range(1, window // 2 + 1))
