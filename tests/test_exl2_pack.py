"""The EXL2 packer: pack(unpack(t)) reproduces ExLlamaV2's files byte for byte; unpack(pack(x)) == x on random
codes of every bit width, mixed widths and awkward sizes; the packed bit streams match an independent NumPy
packer; padding follows ExLlamaV2 (zero-point codes, scale nibbles 15); bad packer input is rejected."""

from __future__ import annotations

import numpy as np
import pytest
from conftest_exl2 import TAGS, layer, linear_prefixes, load_quant, np_dequantize, np_pack_stream
from exl2cpp import _C, InvalidArgumentError

KEYS = ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm")


@pytest.mark.parametrize("tag", TAGS)
def test_pack_unpack_reproduces_fixture_bytes(tag):
    tensors, _ = load_quant(tag)
    for prefix in linear_prefixes(tensors):
        u = _C.exl2_unpack(layer(tensors, prefix))
        assert u["codes"].dtype == np.uint8 and u["codes"].shape == (
            u["in_features"],
            u["out_features"],
        )
        r = _C.exl2_pack(
            u["codes"],
            u["bits_per_group"],
            u["group_rows"],
            u["scales"],
            u["q_scale_max"],
            u["perm"],
            u["out_features"],
        )
        assert sorted(r) == sorted(KEYS)
        for k in KEYS:
            want = tensors[f"{prefix}.{k}"]
            got = r[k]
            assert got.dtype == want.dtype and got.shape == want.shape, (prefix, k)
            assert got.tobytes() == want.tobytes(), (
                f"{tag} {prefix}.{k} differs from ExLlamaV2's bytes"
            )


def random_input(rng, n_in, n_out, bits, rows):
    codes = np.concatenate(
        [rng.integers(0, 1 << b, (r, n_out)) for b, r in zip(bits, rows)]
    ).astype(np.uint8)
    nib = rng.integers(0, 16, (len(bits), n_out)).astype(np.uint8)
    qsm = (2.0 ** rng.uniform(-16, 1, len(bits))).astype(np.float16)
    perm = rng.permutation(n_in).astype(np.int32)
    return codes, list(bits), list(rows), nib, qsm, perm, n_out


CASES = [
    # (in, out, bits per group, rows per group)
    *[(96, 33, [b] * 3, [32] * 3) for b in (2, 3, 4, 5, 6, 8)],
    *[(160, 100, [b], [160]) for b in (2, 3, 4, 5, 6, 8)],
    (224, 7, [8, 6, 5, 4, 3, 2], [32, 32, 32, 32, 64, 32]),
    (160, 64, [8, 8, 4, 4, 4], [32, 32, 32, 32, 32]),
    (96, 257, [6, 3, 2], [32, 32, 32]),
    (64, 1, [5, 2], [32, 32]),
    (48, 40, [4, 2], [32, 16]),  # a 16-row 2-bit group (allowed by the format, 16*2 = 32 bits)
    (
        100,
        31,
        [4, 4, 4, 4],
        [32, 32, 32, 4],
    ),  # ragged last group (ExLlamaV2's pack rounds it up with ceil)
    (70, 50, [3, 3], [64, 6]),  # ragged 3-bit tail: 18 bits in one word
]


@pytest.mark.parametrize("n_in,n_out,bits,rows", CASES)
def test_unpack_pack_roundtrip_random(n_in, n_out, bits, rows):
    rng = np.random.default_rng(n_in * 1000 + n_out + sum(bits))
    args = random_input(rng, n_in, n_out, bits, rows)
    codes, _, _, nib, qsm, perm, _ = args
    t = _C.exl2_pack(*args)
    out_pad = -(-n_out // 32) * 32
    assert t["q_weight"].shape == (sum(-(-r * b // 32) for b, r in zip(bits, rows)), out_pad)
    assert t["q_scale"].shape == (len(bits), out_pad // 8)
    assert t["q_groups"].dtype == np.int16 and t["q_invperm"].dtype == np.int32
    u = _C.exl2_unpack(t, in_features=n_in, out_features=n_out)
    assert np.array_equal(u["codes"], codes)
    assert np.array_equal(u["scales"], nib)
    assert np.array_equal(u["perm"], perm)
    assert u["q_scale_max"].tobytes() == qsm.tobytes()
    assert u["bits_per_group"] == bits and u["group_rows"] == rows
    assert np.array_equal(u["groups"], np.array([bits, rows]).T)
    # and the packed form dequantizes like the independent reference
    w = _C.exl2_dequantize(t, out_features=n_out)
    assert np.array_equal(w.view(np.uint16), np_dequantize(t, out_features=n_out).view(np.uint16))


@pytest.mark.parametrize("n_in,n_out,bits,rows", CASES[::3])
def test_pack_matches_numpy_packer(n_in, n_out, bits, rows):
    rng = np.random.default_rng(7 + n_in + n_out)
    codes, _, _, nib, _qsm, perm, _ = args = random_input(rng, n_in, n_out, bits, rows)
    t = _C.exl2_pack(*args)
    out_pad = -(-n_out // 32) * 32
    words, starts, row = [], [], 0
    for b, r in zip(bits, rows):
        c = np.full((r, out_pad), 1 << (b - 1), np.int64)  # padding columns: the zero point
        c[:, :n_out] = codes[row : row + r]
        starts.append(sum(w.shape[0] for w in words))
        words.append(np_pack_stream(c, b))
        row += r
    assert np.array_equal(t["q_weight"].view(np.uint32), np.concatenate(words))
    assert t["q_groups"].tolist() == [v for b, s in zip(bits, starts) for v in (b, s)]
    assert np.array_equal(t["q_invperm"], np.argsort(perm))
    nibp = np.full((len(bits), out_pad), 15, np.uint32)
    nibp[:, :n_out] = nib
    want_qs = (
        (nibp.reshape(len(bits), -1, 8) << (4 * np.arange(8, dtype=np.uint32)))
        .sum(-1)
        .astype(np.uint32)
    )
    assert np.array_equal(t["q_scale"].view(np.uint32), want_qs)


def test_padding_hand_computed():
    # out = 33: one real column in the last word group. 4-bit zero point 8 -> padded q_weight words 0x88888888;
    # ExLlamaV2 pads qscale with 0, and (uint16)(0 - 1) = 0xffff ORed at nibble 1 sets every higher nibble.
    codes = np.zeros((32, 33), np.uint8)
    nib = np.full((1, 33), 3, np.uint8)
    t = _C.exl2_pack(codes, [4], [32], nib, np.array([1.0], np.float16), np.arange(32), 33)
    qw = t["q_weight"].view(np.uint32)
    assert qw.shape == (4, 64) and (qw[:, :33] == 0).all() and (qw[:, 33:] == 0x88888888).all()
    qs = t["q_scale"].view(np.uint32)
    assert qs.shape == (1, 8)
    assert qs[0, :4].tolist() == [0x33333333] * 4
    assert qs[0, 4] == 0xFFFFFFF3 and (qs[0, 5:] == 0xFFFFFFFF).all()
    assert t["q_groups"].tolist() == [4, 0]
    # code 0 -> -8 * (4^2 * 1/256) = -0.5 in real columns; padding columns dequantize to exactly 0
    w = _C.exl2_dequantize(t)  # out_features defaults to out_pad: padding included
    assert w.shape == (32, 64) and (w[:, :33] == -0.5).all() and (w[:, 33:] == 0).all()


def test_hand_packed_3bit_straddle():
    # 3-bit stream: value 10 occupies bits 30-32 (word 0 bits 30,31 + word 1 bit 0); value 21 bits 63-65.
    codes = np.zeros((32, 1), np.uint8)
    codes[10, 0] = 0b111
    codes[21, 0] = 0b101
    t = _C.exl2_pack(
        codes, [3], [32], np.zeros((1, 1), np.uint8), np.array([1.0], np.float16), np.arange(32), 1
    )
    w = t["q_weight"].view(np.uint32)[:, 0]
    assert w.tolist() == [0xC0000000, 0x80000001, 0x00000002]


BAD = [
    ("bits_increase", {"bits": [4, 8], "rows": [32, 32]}, "never increase"),
    ("bits_7", {"bits": [7], "rows": [64]}, "not one of"),
    ("rows_sum", {"bits": [4], "rows": [32]}, "sum to 32"),
    ("rows_not_words", {"bits": [3, 3], "rows": [16, 48]}, "whole number"),
    ("code_too_big", {"bits": [2, 2], "rows": [32, 32], "code": 4}, "does not fit"),
    ("nibble_too_big", {"bits": [4], "rows": [64], "nib": 16}, "exceeds 15"),
    ("perm_dup", {"bits": [4], "rows": [64], "perm": np.zeros(64, np.int32)}, "not a permutation"),
]


@pytest.mark.parametrize("case", BAD, ids=lambda c: c[0])
def test_pack_rejects_bad_input(case):
    _, kw, fragment = case
    bits, rows = kw["bits"], kw["rows"]
    codes = np.zeros((64, 40), np.uint8)
    codes[5, 3] = kw.get("code", 0)
    nib = np.zeros((len(bits), 40), np.uint8)
    nib[0, 7] = kw.get("nib", 0)
    perm = kw.get("perm", np.arange(64, dtype=np.int32))
    with pytest.raises(InvalidArgumentError, match=fragment):
        _C.exl2_pack(codes, bits, rows, nib, np.ones(len(bits), np.float16), perm, 40)
