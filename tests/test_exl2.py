"""EXL2 loading: bit-exact dequantization against ExLlamaV2 0.3.2's own output (golden fixtures), an independent
NumPy reference and hand-computed fp16 cases (subnormal scales, ties to even), the Linear layer, bits-per-weight
accounting against ExLlamaV2's measurement, and ModelFormatError for every malformed-tensor case."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from conftest_exl2 import (
    TAGS,
    exllama_orientation,
    f16_mul,
    layer,
    linear_prefixes,
    load_quant,
    np_dequantize,
    np_unpack,
    require_fixtures,
    short,
)
from exl2cpp import _C, ModelFormatError

Q = "model.layers.0.self_attn.q_proj"


def f16_bits(a) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint16)


# ---- golden fixtures -----------------------------------------------------------------------------------------


def test_layer0_q40_bit_exact_vs_exllamav2():
    from safetensors.numpy import load_file

    ref = load_file(str(require_fixtures() / "fx_deq_q40_layer0.safetensors"))
    tensors, _ = load_quant("q40")
    assert len(ref) == 7
    for prefix, want in ref.items():
        w = _C.exl2_dequantize(layer(tensors, prefix))
        assert w.dtype == np.float16 and w.shape == tuple(tensors[prefix + ".q_invperm"].shape) + (
            w.shape[1],
        )
        got = exllama_orientation(tensors, prefix, w)
        assert got.shape == want.shape, prefix
        diff = np.count_nonzero(f16_bits(got) != f16_bits(want))
        assert diff == 0, f"{prefix}: {diff} of {want.size} fp16 values differ from ExLlamaV2's"


@pytest.mark.parametrize("tag", TAGS)
def test_all_linears_sha256_vs_exllamav2(tag):
    sha = json.loads((require_fixtures() / "fx_deq_sha256.json").read_text())
    tensors, _ = load_quant(tag)
    prefixes = linear_prefixes(tensors)
    assert len(prefixes) == 29 and "lm_head" in prefixes
    bad = []
    for prefix in prefixes:
        w = exllama_orientation(tensors, prefix, _C.exl2_dequantize(layer(tensors, prefix)))
        want = sha[f"{tag}/{prefix}"]
        if (
            list(w.shape) != want["shape"]
            or hashlib.sha256(w.tobytes()).hexdigest() != want["sha256"]
        ):
            bad.append(prefix)
    assert not bad, f"{tag}: dequantized weights differ from ExLlamaV2's for {bad}"


def test_fixture_subnormal_scales_are_rounded_like_exllamav2():
    # README: 75 groups have q_scale_max < 2^-6, so msc = q_scale_max/256 is an fp16 subnormal and loses bits.
    # Rounding msc to fp16 (as ExLlamaV2 does; the sha test shows we match it) must change weights there:
    # computing s = f16((nib+1)^2 * q_scale_max/256) in one step gives different fp16 weights.
    n_sub = sum(
        int((t[p + ".q_scale_max"].astype(np.float32) < 2.0**-6).sum())
        for t in (load_quant(tag)[0] for tag in TAGS)
        for p in linear_prefixes(t)
    )
    assert n_sub == 75
    tensors, _ = load_quant("q60")
    t = short(layer(tensors, "model.layers.0.self_attn.v_proj"))
    qsm = t["q_scale_max"].astype(np.float32)
    assert (qsm < 2.0**-6).sum() == 17
    got = _C.exl2_dequantize(t)
    assert np.array_equal(f16_bits(got), f16_bits(np_dequantize(t)))
    # The same weights with msc left in fp32 (s rounded once from the exact product).
    u = np_unpack(t)
    s = ((u["nibbles"] + 1) ** 2 * (qsm / 256)[:, None]).astype(np.float16)
    gidx = np.concatenate([np.full(r, g) for g, (_, _, _, r) in enumerate(u["groups"])])
    zero = np.concatenate([np.full(r, 1 << (b - 1)) for b, _, _, r in u["groups"]])
    wp = f16_mul((u["codes"] - zero[:, None]).astype(np.float16), s[gidx])
    fake = np.empty_like(wp)
    fake[u["perm"]] = wp
    assert np.count_nonzero(f16_bits(got) != f16_bits(fake)) > 100


@pytest.mark.parametrize("tag", TAGS)
def test_numpy_reference_agrees_on_fixture(tag):
    # Keeps the in-test reference honest (it is used on random tensors below): layer 0 of every quant.
    tensors, _ = load_quant(tag)
    for prefix in linear_prefixes(tensors):
        if not prefix.startswith("model.layers.0."):
            continue
        t = short(layer(tensors, prefix))
        assert np.array_equal(f16_bits(np_dequantize(t)), f16_bits(_C.exl2_dequantize(t))), prefix


# ---- synthetic layers: NumPy reference, hand-computed fp16 cases, prescale ------------------------------------


def random_layer(rng, n_in, n_out, bits, group_rows, subnormal=False):
    g = len(bits)
    codes = np.concatenate([rng.integers(0, 1 << b, (r, n_out)) for b, r in zip(bits, group_rows)])
    nib = rng.integers(0, 16, (g, n_out))
    lo, hi = (-16, -7) if subnormal else (-9, 0)
    qsm = (2.0 ** rng.uniform(lo, hi, g)).astype(np.float16)
    perm = rng.permutation(n_in).astype(np.int32)
    return _C.exl2_pack(
        codes.astype(np.uint8), list(bits), list(group_rows), nib.astype(np.uint8), qsm, perm, n_out
    )


@pytest.mark.parametrize(
    "n_in,n_out,bits,rows",
    [
        (96, 33, [8, 4], [32, 64]),
        (160, 100, [6, 5, 3], [32, 64, 64]),
        (224, 64, [8, 6, 5, 4, 3, 2], [32, 32, 32, 32, 64, 32]),
        (64, 7, [2, 2], [32, 32]),
    ],
)
@pytest.mark.parametrize("prescale", [1.0, 0.7, 3.0])
@pytest.mark.parametrize("subnormal", [False, True])
def test_dequantize_matches_numpy_reference(n_in, n_out, bits, rows, prescale, subnormal):
    rng = np.random.default_rng(n_in * 7 + n_out + int(prescale * 10) + subnormal)
    t = random_layer(rng, n_in, n_out, bits, rows, subnormal)
    got = _C.exl2_dequantize(t, prescale=prescale, out_features=n_out)
    want = np_dequantize(t, prescale=prescale, out_features=n_out)
    assert got.shape == (n_in, n_out)
    assert np.array_equal(f16_bits(got), f16_bits(want))


def hand_layer(codes_col0: dict[int, int], nib0: int, qsm: float, perm=None, bits=4) -> dict:
    """One 4-bit group, in = out = 32, built by hand (value i of a 4-bit stream sits at bits 4i of word i//8)."""
    assert bits == 4
    qw = np.full((4, 32), 0x88888888, np.uint32)  # every code = zero point 8
    for k, code in codes_col0.items():
        qw[k // 8, 0] = (qw[k // 8, 0] & ~np.uint32(15 << 4 * (k % 8))) | np.uint32(
            code << 4 * (k % 8)
        )
    qs = np.zeros((1, 4), np.uint32)
    qs[0, 0] = nib0
    return {
        "q_weight": qw.view(np.int32),
        "q_scale": qs.view(np.int32),
        "q_scale_max": np.array([qsm], np.float16),
        "q_groups": np.array([4, 0], np.int16),
        "q_invperm": np.argsort(perm).astype(np.int32)
        if perm is not None
        else np.arange(32, dtype=np.int32),
    }


def test_hand_computed_normal_scale():
    # q_scale_max 0.5, nibble 15: s = 16^2 * 0.5/256 = 0.5; code 15 -> (15-8)*0.5 = 3.5; code 0 -> -4.
    w = _C.exl2_dequantize(hand_layer({0: 15, 9: 0}, 15, 0.5))
    assert w[0, 0] == np.float16(3.5) and w[9, 0] == np.float16(-4.0)
    assert (
        np.count_nonzero(w) == 2
    )  # everything else is the zero point; other columns have nibble 0


def test_hand_computed_subnormal_msc_tie_to_even():
    # q_scale_max = 3*2^-17 (an fp16 subnormal): msc = 1.5*2^-24, a tie between 1 and 2 subnormal quanta ->
    # even -> 2^-23. With no single rounding (fp32 msc) the weight would be 1.5*2^-24 * 1; with FTZ it is 0.
    w = _C.exl2_dequantize(hand_layer({0: 9, 1: 7, 2: 12}, 0, 3 * 2.0**-17))
    assert f16_bits(w[0:3, 0]).tolist() == [0x0002, 0x8002, 0x0008]  # +2^-23, -2^-23, 4*2^-23
    # 5*2^-17 -> msc = 2.5 quanta -> tie -> 2 quanta (not 3).
    w = _C.exl2_dequantize(hand_layer({0: 9}, 0, 5 * 2.0**-17))
    assert f16_bits(w[0:1, 0]).tolist() == [0x0002]
    # (1 + 2^-10) * 2^-9 -> msc = 2^-17 + 2^-27, below half a quantum above 2^-17 -> 2^-17 = 128 quanta;
    # nibble 15 -> s = 256 * 2^-17 = 2^-9; code 15 -> 7 * 2^-9.
    w = _C.exl2_dequantize(hand_layer({0: 15}, 15, (1 + 2.0**-10) * 2.0**-9))
    assert w[0, 0] == np.float16(7 * 2.0**-9)


def test_hand_computed_weight_rounding_tie_to_even_and_perm():
    # q_scale_max 128.125 -> msc = 0.5 + 2^-11 (exact), nibble 0 -> s = msc; code 11 -> 3*s = 1.5 + 1.5*2^-10,
    # a tie between 1.5 + 2^-10 (odd mantissa) and 1.5 + 2^-9 (even) -> 1.501953125. Code 5 -> the negative.
    perm = np.roll(np.arange(32), 5)  # packed row k holds input feature perm[k]
    w = _C.exl2_dequantize(hand_layer({0: 11, 1: 5}, 0, 128.125, perm=perm))
    assert w[perm[0], 0] == np.float16(1.501953125) and w[perm[1], 0] == np.float16(-1.501953125)
    assert np.count_nonzero(w) == 2


def test_prescale_rounds_once_like_torch():
    # msc = f16(f32(q_scale_max) * f32(prescale/256)): what torch's in-place fp16 `*= prescale / 256` does.
    # With nibble 0 and code zero+1 the weight is exactly msc.
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    qsms = (2.0 ** rng.uniform(-18, 2, 40)).astype(np.float16)
    for prescale in (1.0, 0.3, 1.7, 1 / 3, 12.5):
        for qsm in qsms:
            msc = torch.tensor([float(qsm)], dtype=torch.float16)
            msc *= prescale / 256
            w = _C.exl2_dequantize(hand_layer({0: 9}, 0, float(qsm)), prescale=prescale)
            assert f16_bits(w[0:1, 0])[0] == msc.numpy().view(np.uint16)[0], (float(qsm), prescale)
    t = random_layer(rng, 64, 32, [4, 4], [32, 32], subnormal=True)
    want = np_dequantize(t, prescale=0.3)
    assert np.array_equal(f16_bits(_C.exl2_dequantize(t, prescale=0.3)), f16_bits(want))


# ---- the Linear layer ----------------------------------------------------------------------------------------


def test_exl2_linear_layer_on_fixture():
    fx = require_fixtures()
    tensors, _ = load_quant("q40")
    prefix = "model.layers.0.mlp.down_proj"
    x = np.random.default_rng(1).standard_normal((5, 1536)).astype(np.float32)
    d = _C.exl2_linear_load(str(fx / "fx_q40.safetensors"), prefix, 1536, 576, x)
    w = _C.exl2_dequantize(layer(tensors, prefix))  # [in, out], original order
    assert d["kind"] == "exl2" and (d["in_features"], d["out_features"]) == (1536, 576)
    assert np.array_equal(
        d["weight_f32"], w.T.astype(np.float32)
    )  # permutation folded into the weight
    assert d["nbytes"] == sum(v.nbytes for v in layer(tensors, prefix).values())
    assert d["bits_desc"] == "8b:6% 4b:94% (g32)"
    want = x.astype(np.float64) @ w.astype(np.float64)
    assert np.linalg.norm(d["y"] - want) / np.linalg.norm(want) < 1e-6


def test_exl2_linear_bias_and_shape_checks(tmp_path):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(2)
    t = random_layer(rng, 96, 40, [6, 4], [32, 64])
    bias = rng.standard_normal(40).astype(np.float16)
    save_file(
        {f"blk.lin.{k}": v for k, v in {**t, "bias": bias}.items()}, str(tmp_path / "m.safetensors")
    )
    x = rng.standard_normal((3, 96)).astype(np.float32)
    d = _C.exl2_linear_load(str(tmp_path / "m.safetensors"), "blk.lin", 96, 40, x)
    w = _C.exl2_dequantize(t, out_features=40).astype(np.float64)
    want = x @ w + bias.astype(np.float64)
    assert np.linalg.norm(d["y"] - want) / np.linalg.norm(want) < 1e-6
    with pytest.raises(ModelFormatError, match=r"blk\.lin\.q_invperm"):
        _C.exl2_linear_load(str(tmp_path / "m.safetensors"), "blk.lin", 128, 40)
    with pytest.raises(ModelFormatError, match=r"blk\.lin\.q_weight"):
        _C.exl2_linear_load(str(tmp_path / "m.safetensors"), "blk.lin", 96, 72)


# ---- bits per weight -----------------------------------------------------------------------------------------


def test_total_bits_match_exllamav2_measurement():
    # ExLlamaV2's optimizer picked one measured candidate per block; our accounting of the written tensors must
    # reproduce that candidate's total_bits (conversion/qparams.py QParams.total_bits) for every block.
    meas = json.loads((require_fixtures() / "fx_measurement.json").read_text())["measurement"]
    blocks = {
        "self_attn": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "mlp": ["gate_proj", "up_proj", "down_proj"],
    }
    for tag in TAGS:
        tensors, _ = load_quant(tag)
        for i in range(4):
            for blk, projs in blocks.items():
                key = f"model.layers.{i}.{blk}"
                total = sum(
                    _C.exl2_validate(layer(tensors, f"{key}.{p}"))["total_bits"] for p in projs
                )
                assert total in {c["total_bits"] for c in meas[key]}, (tag, key, total)


def test_bits_accounting_hand_computed():
    t = random_layer(np.random.default_rng(3), 160, 40, [8, 4, 4], [32, 64, 64])
    info = _C.exl2_validate(t, out_features=40)
    # q_weight 32*40*8 + 128*40*4, q_scale_max 3*16, q_groups 3*32, q_scale 3*40*4, q_invperm 160*32
    want = 32 * 40 * 8 + 128 * 40 * 4 + 48 + 96 + 480 + 5120
    assert info["total_bits"] == want
    assert info["bits_per_weight"] == pytest.approx(want / (160 * 40))
    assert info["bits_desc"] == "8b:20% 4b:80% (g32/g64)"
    assert info["bits_per_group"] == [8, 4, 4] and info["group_rows"] == [32, 64, 64]
    assert info["qrow_start"] == [0, 8, 16] and info["out_pad"] == 64


# ---- malformed tensors ---------------------------------------------------------------------------------------


def with_(t, **kw):
    d = dict(t)
    for k, v in kw.items():
        if v is None:
            d.pop(f"{Q}.{k}")
        else:
            d[f"{Q}.{k}"] = v
    return d


def q40_q():
    tensors, _ = load_quant("q40")
    return layer(tensors, Q)


def qg_of(t):
    return t[f"{Q}.q_groups"].copy()


def _cases():
    # (id, mutate(t) -> t, tensor suffix named in the message, message fragment)
    def set_qg(f):
        def m(t):
            g = qg_of(t)
            f(g)
            return with_(t, q_groups=g)

        return m

    def qw_rows(n):
        return lambda t: with_(t, q_weight=t[f"{Q}.q_weight"][:n])

    return [
        ("qgroups_odd", lambda t: with_(t, q_groups=qg_of(t)[:-1]), "q_groups", "even length"),
        ("qgroups_first_not_0", set_qg(lambda g: g.__setitem__(1, 1)), "q_groups", "row 0"),
        (
            "qgroups_not_increasing",
            set_qg(lambda g: g.__setitem__(3, 0)),
            "q_groups",
            "must increase",
        ),
        ("qgroups_past_rows", set_qg(lambda g: g.__setitem__(-1, 10000)), "q_groups", "only"),
        ("bits_7", set_qg(lambda g: g.__setitem__(0, 7)), "q_groups", "unsupported bit width 7"),
        ("bits_16", set_qg(lambda g: g.__setitem__(0, 16)), "q_groups", "unsupported bit width 16"),
        ("bits_increasing", set_qg(lambda g: g.__setitem__(2, 4)), "q_groups", "never increase"),
        ("qweight_rows_short", qw_rows(-3), "q_weight", "do not match"),
        (
            "qweight_rows_long",
            lambda t: with_(t, q_weight=np.concatenate([t[f"{Q}.q_weight"]] * 2)),
            "q_weight",
            "do not match",
        ),
        (
            "qweight_rows_not_whole",
            set_qg(lambda g: g.__setitem__(3, g[3] - 1)),
            "q_weight",
            "whole number",
        ),
        (
            "invperm_dup",
            lambda t: with_(t, q_invperm=np.zeros(576, np.int32)),
            "q_invperm",
            "not a permutation",
        ),
        (
            "invperm_range",
            lambda t: with_(t, q_invperm=np.arange(1, 577, dtype=np.int32)),
            "q_invperm",
            "out of range",
        ),
        (
            "invperm_len",
            lambda t: with_(t, q_invperm=np.arange(544, dtype=np.int32)),
            "q_weight",
            "entries",
        ),
        (
            "perm_wrong",
            lambda t: with_(t, q_perm=np.arange(576, dtype=np.int32)),
            "q_perm",
            "argsort",
        ),
        (
            "scale_shape",
            lambda t: with_(t, q_scale=t[f"{Q}.q_scale"][:, :-1]),
            "q_scale",
            "expected shape",
        ),
        (
            "scale_rows",
            lambda t: with_(t, q_scale=t[f"{Q}.q_scale"][:-1]),
            "q_scale",
            "expected shape",
        ),
        (
            "scale_max_shape",
            lambda t: with_(t, q_scale_max=t[f"{Q}.q_scale_max"][:-1]),
            "q_scale_max",
            "expected shape",
        ),
        (
            "scale_max_inf",
            lambda t: with_(t, q_scale_max=np.full_like(t[f"{Q}.q_scale_max"], np.inf)),
            "q_scale_max",
            "non-finite",
        ),
        (
            "out_pad_not_32",
            lambda t: with_(
                t,
                q_weight=t[f"{Q}.q_weight"][:, :570],
            ),
            "q_weight",
            "multiple of 32",
        ),
        (
            "qweight_dtype",
            lambda t: with_(t, q_weight=t[f"{Q}.q_weight"].view(np.float32)),
            "q_weight",
            "int32",
        ),
        (
            "qgroups_dtype",
            lambda t: with_(t, q_groups=qg_of(t).astype(np.int32)),
            "q_groups",
            "int16",
        ),
        (
            "scale_max_dtype",
            lambda t: with_(t, q_scale_max=t[f"{Q}.q_scale_max"].astype(np.float32)),
            "q_scale_max",
            "float16",
        ),
        ("missing_invperm", lambda t: with_(t, q_invperm=None), "q_invperm", "missing"),
        (
            "bias_shape",
            lambda t: with_(t, bias=np.zeros(575, np.float16)),
            "bias",
            "expected shape",
        ),
    ]


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c[0])
def test_malformed_tensors_raise_model_format_error(case):
    _, mutate, suffix, fragment = case
    t = mutate(q40_q())
    for fn in (_C.exl2_validate, _C.exl2_dequantize, _C.exl2_unpack):
        with pytest.raises(ModelFormatError) as e:
            fn(t)
        msg = str(e.value)
        assert f"{Q}.{suffix}" in msg and fragment in msg, msg


def test_valid_q_perm_and_feature_checks():
    t = q40_q()
    perm = np.argsort(t[f"{Q}.q_invperm"]).astype(np.int32)
    ok = _C.exl2_dequantize(with_(t, q_perm=perm))
    assert np.array_equal(f16_bits(ok), f16_bits(_C.exl2_dequantize(t)))
    with pytest.raises(ModelFormatError, match="in_features = 512"):
        _C.exl2_validate(t, in_features=512)
    with pytest.raises(ModelFormatError, match="out_features = 600"):
        _C.exl2_validate(t, out_features=600)
    assert (
        _C.exl2_validate(t, in_features=576, out_features=560)["out_pad"] == 576
    )  # 560 pads to 576
