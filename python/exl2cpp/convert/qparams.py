"""Quantization configs of one linear (ExLlamaV2's QParams: bit widths, row shares, group sizes), the candidate
tables per attention / MLP block and for the head, the group layout a config gives, and bits accounting.

The tables are ExLlamaV2 0.3.2's (``exllamav2/conversion/qparams.py``; numbers read off
``shared/fixtures/exl2-smol4/fx_measurement.json``, ExLlamaV2's own measurement, spec §2.4). Notation:
``"0.1:4b_128g/0.9:3b_128g"`` = 10 % of the input rows (the most important, act-order first) at 4 bits in groups
of 128 rows, the rest at 3 bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import InvalidArgumentError

VALID_BITS = (2, 3, 4, 5, 6, 8)
ATTN_PROJS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJS = ("gate_proj", "up_proj", "down_proj")
EXPERT_PROJS = ("w1", "w3", "w2")  # every expert's gate, up, down: ExLlamaV2's block_sparse_moe roles


@dataclass(frozen=True)
class QParams:
    """One linear's config: ``bits`` descending, ``bits_prop`` (shares of the input rows, sum 1), ``group_size``
    per bit width (multiples of 32)."""

    bits: tuple[int, ...]
    bits_prop: tuple[float, ...]
    group_size: tuple[int, ...]

    @staticmethod
    def parse(text: str) -> QParams:
        bits, prop, gs = [], [], []
        for part in text.split("/"):
            p, rest = part.split(":")
            b, g = rest.split("_")
            prop.append(float(p))
            bits.append(int(b.rstrip("b")))
            gs.append(int(g.rstrip("g")))
        return QParams(tuple(bits), tuple(prop), tuple(gs))

    def to_json(self) -> dict:
        """ExLlamaV2's measurement.json form."""
        return {
            "group_size": {str(b): g for b, g in zip(self.bits, self.group_size)},
            "bits": list(self.bits),
            "bits_prop": list(self.bits_prop),
            "scale_bits": 4,
        }

    @staticmethod
    def from_json(d: dict) -> QParams:
        try:
            bits = tuple(int(b) for b in d["bits"])
            prop = tuple(float(p) for p in d["bits_prop"])
            gs = tuple(int(d["group_size"][str(b)]) for b in bits)
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"measurement: bad per-linear config {d!r} ({exc})") from None
        qp = QParams(bits, prop, gs)
        qp.check()
        return qp

    def check(self) -> None:
        ok = (
            self.bits
            and len(self.bits) == len(self.bits_prop) == len(self.group_size)
            and all(b in VALID_BITS for b in self.bits)
            and all(a > b for a, b in zip(self.bits, self.bits[1:]))
            and all(g > 0 and g % 32 == 0 for g in self.group_size)
            and abs(sum(self.bits_prop) - 1.0) < 1e-6
        )
        if not ok:
            raise InvalidArgumentError(
                f"bad quantization config {self}: bits must be descending in {VALID_BITS}, shares sum to 1, "
                "group sizes multiples of 32"
            )

    def groups(self, in_features: int) -> list[tuple[int, int]]:
        """(bits, rows) per group in storage order, as ExLlamaV2's AdaptiveGPTQ.configure lays them out: for
        each width n = ceil(min(in*p, remaining) / gs) groups of gs rows; the last group is clipped to in."""
        out: list[tuple[int, int]] = []
        remaining = in_features
        for i, (b, p, gs) in enumerate(zip(self.bits, self.bits_prop, self.group_size)):
            want = remaining if i == len(self.bits) - 1 else min(in_features * p, remaining)
            n = max(0, math.ceil(want / gs - 1e-9))
            for _ in range(n):
                rows = min(gs, remaining)
                if rows <= 0:
                    break
                out.append((b, rows))
                remaining -= rows
        return out


def total_bits(groups: list[tuple[int, int]], out_features: int, bias: bool = False) -> int:
    """Bits of a linear as ExLlamaV2 (QParams.total_bits) and exl2cpp's info() count them: codes + 16 per group
    (q_scale_max) + 32 per group (q_groups) + 4*out per group (q_scale) + 32*in (q_invperm) (+ 16*out bias)."""
    n_in = sum(r for _, r in groups)
    g = len(groups)
    bits = sum(b * r for b, r in groups) * out_features
    bits += g * 16 + g * 32 + g * out_features * 4 + 32 * n_in
    if bias:
        bits += 16 * out_features
    return bits


def _rows(*specs: str) -> tuple[QParams, ...]:
    return tuple(QParams.parse(s) for s in specs)


_A32 = "0.05:3b_64g/0.95:2b_64g"
_A1 = "0.1:3b_64g/0.9:2b_64g"
_A43 = "0.1:4b_128g/0.9:3b_128g"
# (q, k, v, o) per option, ExLlamaV2 qparams_attn
ATTN_OPTIONS: tuple[tuple[QParams, ...], ...] = (
    _rows(_A32, _A32, _A32, _A32),
    _rows(_A1, _A1, "0.25:3b_64g/0.75:2b_64g", _A1),
    _rows(_A1, _A1, _A43, _A1),
    _rows(_A1, _A1, _A43, _A43),
    _rows(_A43, _A43, _A43, _A43),
    _rows(_A43, _A43, "0.1:4b_64g/0.9:3b_64g", _A43),
    _rows("1:4b_128g", "1:4b_128g", "1:4b_128g", "1:4b_128g"),
    _rows("1:4b_128g", "1:4b_128g", "1:4b_64g", "1:4b_128g"),
    _rows("1:4b_64g", "1:4b_64g", "1:4b_32g", "1:4b_64g"),
    _rows("1:4b_32g", "1:4b_32g", "1:4b_32g", "1:4b_32g"),
    _rows("0.1:5b_128g/0.9:4b_128g", "0.1:5b_128g/0.9:4b_128g", "0.1:5b_64g/0.9:4b_64g", "0.1:5b_128g/0.9:4b_128g"),
    _rows("0.1:5b_64g/0.9:4b_64g", "0.1:5b_64g/0.9:4b_64g", "0.1:5b_32g/0.9:4b_32g", "0.1:5b_64g/0.9:4b_64g"),
    _rows("0.1:5b_64g/0.9:4b_64g", "0.1:5b_64g/0.9:4b_64g", "1:5b_64g", "0.1:5b_64g/0.9:4b_64g"),
    _rows("0.1:5b_32g/0.9:4b_32g", "0.1:5b_32g/0.9:4b_32g", "1:5b_32g", "0.1:5b_32g/0.9:4b_32g"),
    _rows("0.1:6b_128g/0.9:5b_128g", "0.1:6b_128g/0.9:5b_128g", "1:6b_128g", "0.1:6b_128g/0.9:5b_128g"),
    _rows("0.1:6b_32g/0.9:5b_32g", "0.1:6b_32g/0.9:5b_32g", "1:6b_32g", "0.1:6b_32g/0.9:5b_32g"),
    _rows("1:6b_128g", "1:6b_128g", "1:6b_128g", "1:6b_128g"),
    _rows("1:6b_32g", "1:6b_32g", "1:8b_32g", "1:6b_32g"),
    _rows("1:8b_128g", "1:8b_128g", "1:8b_128g", "1:8b_128g"),
)

_D0 = "0.05:6b_32g/0.2:3b_64g/0.75:2b_64g"
# (gate, up, down) per option, ExLlamaV2 qparams_mlp
MLP_OPTIONS: tuple[tuple[QParams, ...], ...] = (
    _rows(_A32, _A32, _D0),
    _rows(_A1, "0.25:3b_64g/0.75:2b_64g", _D0),
    _rows(_A1, "0.3:3b_64g/0.7:2b_64g", "0.05:5b_32g/0.95:3b_32g"),
    _rows(_A1, "0.3:3b_64g/0.7:2b_64g", "0.05:5b_32g/0.95:4b_32g"),
    _rows(_A43, "0.25:4b_128g/0.75:3b_128g", "0.05:8b_32g/0.1:4b_128g/0.85:3b_128g"),
    _rows("0.1:4b_32g/0.9:3b_32g", "0.25:4b_32g/0.75:3b_32g", "0.05:8b_32g/0.1:4b_32g/0.85:3b_32g"),
    _rows("0.1:4b_32g/0.9:3b_32g", "0.25:4b_32g/0.75:3b_32g", "0.05:8b_32g/0.95:4b_128g"),
    _rows("1:4b_128g", "1:4b_32g", "0.05:8b_32g/0.95:4b_128g"),
    _rows("1:4b_32g", "1:4b_32g", "0.05:8b_32g/0.95:4b_32g"),
    _rows("0.1:5b_128g/0.9:4b_128g", "0.25:5b_128g/0.75:4b_128g", "0.05:8b_32g/0.1:5b_128g/0.85:4b_128g"),
    _rows("0.1:5b_32g/0.9:4b_32g", "0.25:5b_32g/0.75:4b_32g", "0.05:8b_32g/0.1:5b_32g/0.85:4b_32g"),
    _rows("0.1:6b_128g/0.9:5b_128g", "0.25:6b_128g/0.75:5b_128g", "0.05:8b_32g/0.1:6b_128g/0.85:5b_128g"),
    _rows("0.1:6b_32g/0.9:5b_32g", "0.25:6b_32g/0.75:5b_32g", "0.05:8b_32g/0.1:6b_32g/0.85:5b_32g"),
    _rows("1:6b_128g", "1:6b_128g", "0.05:8b_32g/0.95:6b_128g"),
    _rows("0.1:8b_128g/0.9:6b_128g", "0.1:8b_128g/0.9:6b_128g", "0.15:8b_128g/0.85:6b_128g"),
    _rows("0.1:8b_128g/0.9:6b_128g", "0.1:8b_128g/0.9:6b_128g", "1:8b_128g"),
    _rows("1:8b_128g", "1:8b_128g", "1:8b_128g"),
)

# lm_head by --head-bits, ExLlamaV2 qparams_headoptions
HEAD_OPTIONS: dict[int, QParams] = {
    2: QParams.parse("0.3:4b_32g/0.7:2b_32g"),
    3: QParams.parse("0.15:4b_32g/0.85:3b_32g"),
    4: QParams.parse("0.15:6b_32g/0.85:4b_32g"),
    5: QParams.parse("0.15:6b_128g/0.85:5b_128g"),
    6: QParams.parse("0.15:8b_128g/0.85:6b_128g"),
    8: QParams.parse("1:8b_128g"),
}


def block_options(mode: str) -> tuple[tuple[str, ...], tuple[tuple[QParams, ...], ...]]:
    """(projection names, option rows) of a block mode ("self_attn", "mlp" or "block_sparse_moe": the experts of
    a MoE layer, one option row for all of them, from the MLP table as ExLlamaV2 measures them)."""
    if mode == "self_attn":
        return ATTN_PROJS, ATTN_OPTIONS
    if mode == "mlp":
        return MLP_PROJS, MLP_OPTIONS
    if mode == "block_sparse_moe":
        return EXPERT_PROJS, MLP_OPTIONS
    raise InvalidArgumentError(f"unknown block mode {mode!r} (expected 'self_attn', 'mlp' or 'block_sparse_moe')")
