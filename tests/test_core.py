"""Core readers: safetensors (single, sharded, folder), strict JSON, config.json, NumPy round trips.

Valid files are written by the `safetensors` package and by transformers' save_pretrained; broken files are
built byte by byte here, and each must raise its specific exl2cpp error with a message naming the problem.
"""

from __future__ import annotations

import glob
import json
import math
import os
import struct

import numpy as np
import pytest
from exl2cpp import _C
from exl2cpp.errors import (
    Exl2Error,
    ModelFileError,
    ModelFormatError,
    UnsupportedError,
)
from conftest import fixtures_root
from safetensors.numpy import save_file

# Golden fixtures (real files written by ExLlamaV2 / HF); tests that need them skip when absent.
FIXTURES = str(fixtures_root() / "exl2-smol4")

# ---- helpers -------------------------------------------------------------------------------------


def raw_safetensors(header: dict | bytes, data: bytes = b"", length: int | None = None) -> bytes:
    """A safetensors file from a header (dict -> JSON, or raw bytes) and a data section."""
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(h) if length is None else length
    return struct.pack("<Q", n) + h + data


def write(tmp_path, name: str, content: bytes):
    p = tmp_path / name
    p.write_bytes(content)
    return str(p)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, round to nearest even (numpy reference)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return r


def random_tensors(rng, shapes):
    out = {}
    for i, (dt, shape) in enumerate(shapes):
        if np.issubdtype(dt, np.floating):
            a = rng.standard_normal(shape).astype(dt)
        else:
            info = np.iinfo(dt)
            a = rng.integers(info.min, info.max, size=shape, endpoint=True, dtype=dt)
        out[f"t{i}.{np.dtype(dt).name}"] = a
    return out


LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 96,
    "intermediate_size": 160,
    "num_hidden_layers": 3,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "vocab_size": 123,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "bos_token_id": 1,
    "eos_token_id": [2, 7],
    "tie_word_embeddings": True,
}


def write_config(tmp_path, cfg: dict | bytes | str):
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    p = d / "config.json"
    if isinstance(cfg, dict):
        p.write_text(json.dumps(cfg))
    elif isinstance(cfg, str):
        p.write_text(cfg)
    else:
        p.write_bytes(cfg)
    return str(d)


# ---- valid safetensors ---------------------------------------------------------------------------


def test_roundtrip_all_dtypes_awkward_shapes(tmp_path):
    rng = np.random.default_rng(1234)
    shapes = [
        (np.float32, (19, 111)),
        (np.float16, (3, 5, 7)),
        (np.int32, (1,)),
        (np.int16, (0, 4)),  # empty tensor
        (np.int8, (257,)),
        (np.uint8, (2, 3, 1, 5)),
        (np.float32, ()),  # scalar
    ]
    tensors = random_tensors(rng, shapes)
    path = str(tmp_path / "m.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    got = _C.read_safetensors(path)
    assert sorted(got) == sorted(tensors)
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype, k
        assert got[k].shape == v.shape, k
        np.testing.assert_array_equal(got[k], v)
    assert _C.safetensors_names(path) == sorted(tensors)


def test_bf16_comes_back_as_bits(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file as save_torch

    rng = np.random.default_rng(7)
    x = rng.standard_normal((33, 17)).astype(np.float32)
    t = torch.from_numpy(x).to(torch.bfloat16)
    path = str(tmp_path / "bf.safetensors")
    save_torch({"w": t}, path)
    got = _C.read_safetensors(path)["w"]
    assert got.dtype == np.uint16 and got.shape == (33, 17)
    np.testing.assert_array_equal(got, t.view(torch.int16).numpy().view(np.uint16))
    np.testing.assert_array_equal(got, bf16_bits(x))  # numpy reference of the rounding


def test_sharded_with_index(tmp_path):
    rng = np.random.default_rng(5)
    a = {
        "model.a": rng.standard_normal((4, 6)).astype(np.float16),
        "model.b": np.arange(5, dtype=np.int32),
    }
    b = {"lm_head.weight": rng.standard_normal((7, 3)).astype(np.float32)}
    d = tmp_path / "sharded"
    d.mkdir()
    save_file(a, str(d / "model-00001-of-00002.safetensors"))
    save_file(b, str(d / "model-00002-of-00002.safetensors"))
    wm = {k: "model-00001-of-00002.safetensors" for k in a}
    wm.update({k: "model-00002-of-00002.safetensors" for k in b})
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 1}, "weight_map": wm})
    )
    got = _C.read_safetensors(str(d))
    assert sorted(got) == sorted({**a, **b})
    for k, v in {**a, **b}.items():
        np.testing.assert_array_equal(got[k], v)


def test_folder_without_index_exllamav2_layout(tmp_path):
    d = tmp_path / "exl2"
    d.mkdir()
    save_file({"x": np.ones((2, 2), np.float16)}, str(d / "output-00001-of-00002.safetensors"))
    save_file({"y": np.full((3,), 7, np.int16)}, str(d / "output-00002-of-00002.safetensors"))
    (d / "notes.txt").write_text("not a tensor file")
    got = _C.read_safetensors(str(d))
    assert sorted(got) == ["x", "y"]
    np.testing.assert_array_equal(got["y"], np.full((3,), 7, np.int16))


def test_hand_built_file_matches_bytes(tmp_path):
    # Hand-computed: two f32 values 1.5 and -2.0 then one u8 = 200.
    data = struct.pack("<ff", 1.5, -2.0) + bytes([200])
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "U8", "shape": [1, 1], "data_offsets": [8, 9]},
        "__metadata__": {"k": "v"},
    }
    p = write(tmp_path, "h.safetensors", raw_safetensors(header, data))
    got = _C.read_safetensors(p)
    assert got["a"].tolist() == [1.5, -2.0]
    assert got["b"].tolist() == [[200]]


def test_unaligned_header_length_still_reads(tmp_path):
    # Header length 3 mod 4 puts f32 data at an unaligned address: the reader copies instead of viewing.
    h = json.dumps({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}}).encode()
    while (8 + len(h)) % 4 != 3:
        h += b" "
    p = write(tmp_path, "u.safetensors", raw_safetensors(h, struct.pack("<fff", 1, 2, 3)))
    assert _C.read_safetensors(p)["a"].tolist() == [1.0, 2.0, 3.0]


# ---- broken safetensors --------------------------------------------------------------------------

GOOD_HEADER = {
    "a": {"dtype": "F16", "shape": [2, 2], "data_offsets": [0, 8]},
    "b": {"dtype": "I32", "shape": [2], "data_offsets": [8, 16]},
}
GOOD_DATA = bytes(range(16))


@pytest.mark.parametrize(
    "content, exc, pattern",
    [
        (b"", ModelFileError, r"0 bytes, shorter than the 8-byte"),
        (b"\x10\x00\x00", ModelFileError, r"3 bytes"),
        (
            raw_safetensors(GOOD_HEADER, GOOD_DATA, length=10_000),
            ModelFileError,
            r"header length field says 10000",
        ),
        (
            raw_safetensors(GOOD_HEADER, GOOD_DATA[:12]),
            ModelFileError,
            r"tensor 'b'.*past the end of the data",
        ),
        (
            raw_safetensors(
                {
                    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                    "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
                },
                bytes(12),
            ),
            ModelFormatError,
            r"overlaps tensor",
        ),
        (
            raw_safetensors(
                {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8)
            ),
            ModelFormatError,
            r"tensor 'a' is F32\[3\] = 12 bytes, but its data_offsets \[0, 8\] span 8 bytes",
        ),
        (
            raw_safetensors(
                {"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8)
            ),
            ModelFormatError,
            r"belong to no tensor \(holes",
        ),
        (
            raw_safetensors(
                {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(6)
            ),
            ModelFormatError,
            r"2 trailing bytes",
        ),
        (
            raw_safetensors(
                {"w": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}}, bytes(8)
            ),
            UnsupportedError,
            r"tensor 'w' has dtype F64",
        ),
        (
            raw_safetensors(
                {"w": {"dtype": "Q4K", "shape": [1], "data_offsets": [0, 1]}}, bytes(1)
            ),
            ModelFormatError,
            r"tensor 'w' has unknown dtype \"Q4K\"",
        ),
        (
            raw_safetensors(b'{"a": "\xff\xfe"}'),
            ModelFormatError,
            r"invalid JSON at byte \d+: invalid UTF-8",
        ),
        (
            raw_safetensors(b'{"a": {"dtype": "F32",}}'),
            ModelFormatError,
            r"invalid JSON at byte \d+",
        ),
        (raw_safetensors(b"[1, 2]"), ModelFormatError, r"does not start with a JSON object"),
        (
            raw_safetensors({"a": [1, 2]}),
            ModelFormatError,
            r"tensor 'a' must be an object, got array",
        ),
        (
            raw_safetensors({"a": {"dtype": "F32", "shape": [1]}}),
            ModelFormatError,
            r"needs 'dtype', 'shape'",
        ),
        (
            raw_safetensors(
                {"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, bytes(4)
            ),
            ModelFormatError,
            r"shape entries must be non-negative integers, got -1",
        ),
        (
            raw_safetensors(
                {"a": {"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}}, bytes(4)
            ),
            ModelFormatError,
            r"shape entries must be non-negative integers",
        ),
        (
            raw_safetensors({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, bytes(4)),
            ModelFormatError,
            r"data_offsets must be \[begin, end\]",
        ),
        (
            raw_safetensors(
                {"a": {"dtype": "F32", "shape": [0], "data_offsets": [4, 0]}}, bytes(4)
            ),
            ModelFormatError,
            r"begin > end",
        ),
        (
            raw_safetensors(
                {"a": {"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 4]}}, bytes(4)
            ),
            ModelFormatError,
            r"F32\[4611686018427387904, 4611686018427387904\] = over 2\^64 bytes",
        ),
        (
            raw_safetensors({"__metadata__": {"k": 1}}),
            ModelFormatError,
            r"__metadata__\[\"k\"\] must be a string",
        ),
    ],
    ids=[
        "empty",
        "truncated_3_bytes",
        "header_len_past_end",
        "offsets_past_data",
        "overlap",
        "size_mismatch",
        "hole",
        "trailing",
        "f64_unsupported",
        "unknown_dtype",
        "non_utf8_header",
        "invalid_json_trailing_comma",
        "header_not_object",
        "entry_not_object",
        "missing_fields",
        "negative_dim",
        "float_dim",
        "one_offset",
        "begin_after_end",
        "numel_overflow",
        "metadata_not_string",
    ],
)
def test_bad_safetensors(tmp_path, content, exc, pattern):
    p = write(tmp_path, "bad.safetensors", content)
    with pytest.raises(exc, match=pattern) as ei:
        _C.read_safetensors(p)
    assert "bad.safetensors" in str(ei.value)  # the file is named
    with pytest.raises(exc):
        _C.safetensors_names(p)


def test_missing_file_and_empty_folder(tmp_path):
    with pytest.raises(ModelFileError, match="no such file"):
        _C.read_safetensors(str(tmp_path / "nope.safetensors"))
    with pytest.raises(ModelFormatError, match=r"no \*\.safetensors files"):
        _C.read_safetensors(str(tmp_path))


def _index_folder(tmp_path, weight_map):
    d = tmp_path / "idx"
    d.mkdir()
    save_file({"a": np.zeros(2, np.float32)}, str(d / "s1.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return str(d)


def test_missing_shard(tmp_path):
    d = _index_folder(tmp_path, {"a": "s1.safetensors", "b": "s2.safetensors"})
    with pytest.raises(
        ModelFileError, match=r'shard "s2.safetensors" \(holding tensor b\) is missing'
    ):
        _C.read_safetensors(d)


def test_index_lists_tensor_not_in_shard(tmp_path):
    d = _index_folder(tmp_path, {"a": "s1.safetensors", "zz": "s1.safetensors"})
    with pytest.raises(
        ModelFormatError, match=r'tensor zz is listed in shard "s1.safetensors" but'
    ):
        _C.read_safetensors(d)


def test_index_bad_json_and_escape(tmp_path):
    d = _index_folder(tmp_path, {"a": "../s1.safetensors"})
    with pytest.raises(ModelFormatError, match="not a file name inside the model folder"):
        _C.read_safetensors(d)
    (tmp_path / "idx" / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "s1.safetensors",}}'
    )
    with pytest.raises(
        ModelFormatError, match=r"model.safetensors.index.json: invalid JSON at byte \d+: trailing"
    ):
        _C.read_safetensors(d)


def test_duplicate_names_across_shards(tmp_path):
    d = tmp_path / "dup"
    d.mkdir()
    save_file(
        {"w": np.zeros(2, np.float32), "u": np.zeros(1, np.int8)},
        str(d / "output-00001-of-00002.safetensors"),
    )
    save_file({"w": np.ones(2, np.float32)}, str(d / "output-00002-of-00002.safetensors"))
    with pytest.raises(ModelFormatError, match=r"tensor w is in both .*00001.* and .*00002"):
        _C.read_safetensors(str(d))


def test_duplicate_key_in_header(tmp_path):
    h = b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}'
    p = write(tmp_path, "d.safetensors", raw_safetensors(h, b"x"))
    with pytest.raises(ModelFormatError, match='duplicate key "a"'):
        _C.read_safetensors(p)


# ---- JSON ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, value",
    [
        (
            '{"a": [1, -0, 2.5, 1e3, -1E-2, true, false, null]}',
            {"a": [1, 0, 2.5, 1000.0, -0.01, True, False, None]},
        ),
        ('"\\ud83d\\ude00 \\u00e9 \\n\\t\\"\\\\\\/"', '\U0001f600 \u00e9 \n\t"\\/'),
        ("9223372036854775807", 9223372036854775807),
        ("-9223372036854775808", -9223372036854775808),
        ("  [ ]  ", []),
        ("{}", {}),
        ('"\u00e9\u4e2d\U0001f600"', "\u00e9\u4e2d\U0001f600"),
        ("1e-400", 0.0),
        ('"a\\u0000b"', "a\x00b"),
    ],
)
def test_json_valid(text, value):
    got = _C.parse_json(text)
    assert got == value
    assert type(got) is type(value)


def test_json_int_vs_float_types():
    got = _C.parse_json("[1, 1.0, 1e0, 12345678901234567890]")
    assert [type(x) for x in got] == [int, float, float, float]  # beyond int64 -> double
    assert got[3] == float(12345678901234567890)


@pytest.mark.parametrize(
    "text, pattern",
    [
        ("", r"at byte 0: unexpected end of input"),
        ("[1, 2,]", r"at byte 6: trailing comma in array"),
        ('{"a": 1,}', r"trailing comma in object"),
        ("// c\n1", r"comments are not JSON"),
        ("NaN", r"NaN and Infinity"),
        ("[Infinity]", r"NaN and Infinity"),
        ("01", r"leading zeros"),
        ("1.", r"digit after '.'"),
        ("1e", r"digit in the exponent"),
        ("-", r"truncated number"),
        ('{"a": 1, "a": 2}', r'at byte 9: duplicate key "a"'),
        ('"\\ud800"', r"unpaired high surrogate"),
        ('"\\udc00"', r"unpaired low surrogate"),
        ('"\\ud800\\u0041"', r"not followed by a low surrogate"),
        ('"\\x41"', r"invalid escape"),
        ('"\\u12G4"', r"invalid hex digit"),
        ('"a\nb"', r"unescaped control character"),
        ('"abc', r"unterminated string"),
        ("[1] 2", r"unexpected data after the top-level value"),
        ("tru", r"invalid literal"),
        ("{1: 2}", r"expected a string key"),
        ('{"a" 1}', r"expected ':'"),
        ("[1 2]", r"expected ',' or ']'"),
        ("1e400", r"out of the range of a double"),
        ("[" * 300 + "]" * 300, r"nesting deeper than 256"),
        ("'a'", r"unexpected character"),
    ],
)
def test_json_invalid(text, pattern):
    with pytest.raises(
        ModelFormatError, match=r"<json>: invalid JSON at byte \d+: .*" + pattern.split(": ", 1)[-1]
    ):
        _C.parse_json(text)
    with pytest.raises(ModelFormatError, match=pattern):
        _C.parse_json(text)


@pytest.mark.parametrize(
    "raw, pattern",
    [
        (b'"\xc0\xaf"', "invalid UTF-8 lead byte"),  # overlong '/'
        (b'"\xe0\x80\xaf"', "overlong UTF-8"),
        (b'"\xed\xa0\x80"', "surrogate code point"),
        (b'"\xf4\x90\x80\x80"', "above U\\+10FFFF"),
        (b'"\xe4\xb8"', "truncated UTF-8|continuation"),
        (b'"\x80"', "invalid UTF-8 lead byte"),
        (b'"\xe4\x41\xad"', "continuation byte"),
        (b'"\xff"', "invalid UTF-8 lead byte"),
    ],
)
def test_json_bad_utf8(raw, pattern):
    with pytest.raises(ModelFormatError, match=pattern):
        _C.parse_json(raw)


def test_json_deep_but_allowed_and_dump_roundtrip():
    text = "[" * 256 + "]" * 256
    v = _C.parse_json(text)
    for _ in range(255):
        v = v[0]
    assert v == []
    doc = {"s": 'é\u0001"\\', "n": [0.1, -2.5e-300, 3, 1.0, 1e300], "o": {"x": None, "y": True}}
    dumped = _C.dump_json(json.dumps(doc))
    assert json.loads(dumped) == doc
    assert [type(x) for x in json.loads(dumped)["n"]] == [float, float, int, float, float]


def test_real_tokenizer_json_matches_python():
    path = os.path.join(FIXTURES, "source", "tokenizer.json")
    if not os.path.exists(path):
        pytest.skip("fixture not present")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert _C.parse_json(text) == json.loads(text)


# ---- config.json ---------------------------------------------------------------------------------


def test_config_llama_values(tmp_path):
    c = _C.load_config(write_config(tmp_path, LLAMA_CONFIG))
    assert c["architecture"] == "LlamaForCausalLM"
    assert (
        c["hidden_size"],
        c["num_attention_heads"],
        c["num_key_value_heads"],
        c["head_dim"],
    ) == (96, 6, 2, 16)
    assert (c["vocab_size"], c["intermediate_size"], c["num_hidden_layers"]) == (123, 160, 3)
    assert c["rms_norm_eps"] == 1e-5 and c["rope_theta"] == 500000.0
    assert c["bos_token_ids"] == [1] and c["eos_token_ids"] == [2, 7]
    assert c["tie_word_embeddings"] is True and c["attention_bias"] is False
    assert c["rope_scaling"]["type"] == "default"
    assert c["max_position_embeddings"] == 4096 and c["sliding_window"] == 0


def test_config_defaults(tmp_path):
    cfg = {
        k: LLAMA_CONFIG[k]
        for k in (
            "architectures",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "vocab_size",
            "intermediate_size",
        )
    }
    cfg["eos_token_id"] = None
    c = _C.load_config(write_config(tmp_path, cfg))
    assert c["num_key_value_heads"] == 6 and c["head_dim"] == 16
    assert (
        c["rms_norm_eps"] == 1e-6
        and c["rope_theta"] == 10000.0
        and c["max_position_embeddings"] == 2048
    )
    assert c["tie_word_embeddings"] is False and c["mlp_bias"] is False
    assert c["bos_token_ids"] == [] and c["eos_token_ids"] == []
    assert c["quantization_config"] is None


def test_config_explicit_head_dim_and_null(tmp_path):
    c = _C.load_config(write_config(tmp_path, {**LLAMA_CONFIG, "head_dim": 32}))
    assert c["head_dim"] == 32
    c = _C.load_config(write_config(tmp_path, {**LLAMA_CONFIG, "head_dim": None}))
    assert c["head_dim"] == 16


def test_config_quantization_and_sliding(tmp_path):
    q = {"quant_method": "exl2", "bits": 4.0}
    c = _C.load_config(
        write_config(tmp_path, {**LLAMA_CONFIG, "quantization_config": q, "sliding_window": 4096})
    )
    assert c["quantization_config"] == q and c["sliding_window"] == 4096
    c = _C.load_config(
        write_config(
            tmp_path, {**LLAMA_CONFIG, "sliding_window": 4096, "use_sliding_window": False}
        )
    )
    assert c["sliding_window"] == 0


def _hf_roundtrip(tmp_path, **kw):
    """config.json as the installed transformers writes it (rope_parameters layout in transformers >= 5)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        architectures=["LlamaForCausalLM"],
        **kw,
    )
    d = tmp_path / "hf"
    cfg.save_pretrained(str(d))
    return json.loads((d / "config.json").read_text()), _C.load_config(str(d))


def test_config_transformers_written_default(tmp_path):
    _, c = _hf_roundtrip(tmp_path, rope_theta=123456.0)
    assert c["rope_theta"] == 123456.0 and c["rope_scaling"]["type"] == "default"
    assert c["head_dim"] == 16 and c["num_key_value_heads"] == 2


def test_config_transformers_written_llama3(tmp_path):
    rs = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    }
    _, c = _hf_roundtrip(
        tmp_path, rope_scaling=rs, rope_theta=500000.0, max_position_embeddings=8192
    )
    r = c["rope_scaling"]
    assert c["rope_theta"] == 500000.0
    assert (r["type"], r["factor"], r["low_freq_factor"], r["high_freq_factor"]) == (
        "llama3",
        8.0,
        1.0,
        4.0,
    )
    assert r["original_max_position_embeddings"] == 1024


@pytest.mark.parametrize("layout", ["rope_scaling", "rope_parameters"])
def test_config_rope_types(tmp_path, layout):
    def load(rs):
        return _C.load_config(write_config(tmp_path, {**LLAMA_CONFIG, layout: rs}))["rope_scaling"]

    r = load({"type": "linear", "factor": 2})
    assert r["type"] == "linear" and r["factor"] == 2.0
    r = load({"rope_type": "dynamic", "factor": 3.0})
    assert r["type"] == "dynamic" and r["original_max_position_embeddings"] == 4096
    r = load(
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    )
    assert (
        r["original_max_position_embeddings"] == 4096
    )  # defaults to max_position_embeddings, as transformers
    # yarn: attention_factor derived as transformers does (0.1 ln(factor) + 1); beta defaults 32 / 1.
    r = load({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024})
    assert (
        r["type"] == "yarn"
        and r["beta_fast"] == 32.0
        and r["beta_slow"] == 1.0
        and r["truncate"] is True
    )
    assert math.isclose(r["attention_factor"], 0.1 * math.log(4.0) + 1.0)
    r = load(
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "beta_fast": 16,
            "truncate": False,
        }
    )
    assert (
        math.isclose(r["attention_factor"], 1.0)
        and r["beta_fast"] == 16.0
        and r["truncate"] is False
    )
    r = load({"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 1024})
    assert r["factor"] == 4.0  # max_position_embeddings / original
    r = load({"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.25})
    assert r["attention_factor"] == 1.25 and r["original_max_position_embeddings"] == 4096


def test_config_rope_theta_inside_rope_parameters(tmp_path):
    cfg = {**LLAMA_CONFIG, "rope_parameters": {"rope_type": "default", "rope_theta": 7777.0}}
    del cfg["rope_theta"]
    assert _C.load_config(write_config(tmp_path, cfg))["rope_theta"] == 7777.0


@pytest.mark.parametrize(
    "patch, exc, pattern",
    [
        ({"hidden_size": None}, ModelFormatError, r"missing required key 'hidden_size'"),
        (
            {"vocab_size": "123"},
            ModelFormatError,
            r"key 'vocab_size' must be a positive integer, got \"123\"",
        ),
        (
            {"num_hidden_layers": 0},
            ModelFormatError,
            r"key 'num_hidden_layers' must be a positive integer, got 0",
        ),
        (
            {"intermediate_size": 1.5},
            ModelFormatError,
            r"'intermediate_size' must be a positive integer, got 1.5",
        ),
        ({"hidden_size": 96.0}, ModelFormatError, r"'hidden_size' must be a positive integer"),
        ({"architectures": []}, ModelFormatError, r"'architectures' must be a non-empty list"),
        (
            {"architectures": "LlamaForCausalLM"},
            ModelFormatError,
            r"'architectures' must be a non-empty list",
        ),
        ({"architectures": [3]}, ModelFormatError, r"'architectures' must be a non-empty list"),
        (
            {"num_key_value_heads": 4},
            ModelFormatError,
            r"num_attention_heads \(6\) must be a multiple of num_key_v",
        ),
        (
            {"hidden_size": 100},
            ModelFormatError,
            r"hidden_size \(100\) is not a multiple of num_attention_heads",
        ),
        ({"rms_norm_eps": -1}, ModelFormatError, r"'rms_norm_eps' must be a positive number"),
        (
            {"tie_word_embeddings": "yes"},
            ModelFormatError,
            r"'tie_word_embeddings' must be true or false",
        ),
        ({"eos_token_id": "2"}, ModelFormatError, r"'eos_token_id' must be a token id"),
        ({"eos_token_id": [2, None]}, ModelFormatError, r"'eos_token_id' must be a token id"),
        (
            {"rope_scaling": {"type": "longrope", "factor": 2}},
            ModelFormatError,
            r"missing required key 'rope_scaling.short_factor'",
        ),
        (
            {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0, 2.0]}},
            ModelFormatError,
            r"'rope_scaling.long_factor' must be a list of rotary dims / 2 = 8",
        ),
        ({"rope_scaling": {"rope_type": "mrope"}}, UnsupportedError, r"rope type 'mrope'.*not supp"),
        ({"rope_scaling": "linear"}, ModelFormatError, r"'rope_scaling' must be an object or null"),
        (
            {"rope_scaling": {"type": "linear"}},
            ModelFormatError,
            r"missing required key 'rope_scaling.factor'",
        ),
        ({"rope_scaling": {"type": 3}}, ModelFormatError, r"'rope_scaling.type' must be a string"),
        (
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8,
                    "low_freq_factor": 4,
                    "high_freq_factor": 1,
                }
            },
            ModelFormatError,
            r"high_freq_factor \(1\) must be greater than low_freq_factor \(4\)",
        ),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8}},
            ModelFormatError,
            r"'rope_scaling.low_freq_factor'",
        ),
    ],
)
def test_config_errors(tmp_path, patch, exc, pattern):
    cfg = {**LLAMA_CONFIG, **patch}
    cfg = {k: v for k, v in cfg.items() if v is not None or k not in ("hidden_size",)}
    with pytest.raises(exc, match=pattern) as ei:
        _C.load_config(write_config(tmp_path, cfg))
    assert "config.json" in str(ei.value)


def test_config_missing_keys_each(tmp_path):
    for key in (
        "architectures",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "vocab_size",
        "intermediate_size",
    ):
        cfg = {k: v for k, v in LLAMA_CONFIG.items() if k != key}
        with pytest.raises(ModelFormatError, match=f"missing required key '{key}'"):
            _C.load_config(write_config(tmp_path, cfg))


@pytest.mark.parametrize(
    "content, exc, pattern",
    [
        (
            b'{"architectures": ["\xff"]}',
            ModelFormatError,
            r"config.json: invalid JSON at byte 20: invalid UTF-8",
        ),
        (
            '{"hidden_size": 1,}',
            ModelFormatError,
            r"config.json: invalid JSON at byte \d+: trailing comma",
        ),
        (
            "[1]",
            ModelFormatError,
            r"config.json: expected a JSON object at the top level, got array",
        ),
        ('{"hidden_size": NaN}', ModelFormatError, r"NaN"),
    ],
)
def test_config_bad_files(tmp_path, content, exc, pattern):
    with pytest.raises(exc, match=pattern):
        _C.load_config(write_config(tmp_path, content))


def test_config_missing_file(tmp_path):
    with pytest.raises(ModelFileError, match=r"config.json: not found; is .* a model folder"):
        _C.load_config(str(tmp_path))


def test_real_fixture_config():
    d = os.path.join(FIXTURES, "source")
    if not os.path.exists(d):
        pytest.skip("fixture not present")
    c = _C.load_config(d)
    with open(os.path.join(d, "config.json")) as f:
        raw = json.load(f)
    assert (
        c["hidden_size"] == raw["hidden_size"]
        and c["num_key_value_heads"] == raw["num_key_value_heads"]
    )
    assert c["head_dim"] == raw.get("head_dim", raw["hidden_size"] // raw["num_attention_heads"])


def test_device_query():
    assert isinstance(_C.cuda_compiled(), bool)
    n = _C.cuda_device_count()
    assert isinstance(n, int) and n >= 0
    if not _C.cuda_compiled():
        assert n == 0


def test_all_errors_are_exl2_errors(tmp_path):
    p = write(tmp_path, "x.safetensors", b"garbage!garbage")
    with pytest.raises(Exl2Error):
        _C.read_safetensors(p)


# ---- NumPy <-> Tensor bridge ---------------------------------------------------------------------


@pytest.mark.parametrize("dt", [np.float32, np.float16, np.int32, np.int16, np.int8, np.uint8])
def test_numpy_roundtrip_same_dtype(dt):
    rng = np.random.default_rng(3)
    a = (rng.standard_normal((5, 13, 3)) * 50).astype(dt)
    b = _C.numpy_roundtrip(a)
    assert b.dtype == a.dtype and b.shape == a.shape
    np.testing.assert_array_equal(a, b)
    # non-contiguous input is made contiguous
    np.testing.assert_array_equal(
        _C.numpy_roundtrip(a[:, ::2, :].transpose(2, 0, 1)), a[:, ::2, :].transpose(2, 0, 1)
    )


def test_numpy_roundtrip_conversions():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((7, 9)).astype(np.float32)
    np.testing.assert_array_equal(_C.numpy_roundtrip(x, "f16"), x.astype(np.float16))
    bits = _C.numpy_roundtrip(x, "bf16")
    assert bits.dtype == np.uint16
    np.testing.assert_array_equal(bits, bf16_bits(x))
    np.testing.assert_array_equal(_C.numpy_roundtrip(bits, "bf16"), bits)  # raw bits pass through
    # Hand-computed: 1.0 -> 0x3f80, -2.0 -> 0xc000, 1 + 2^-8 (a tie) rounds to even 0x3f80.
    h = _C.numpy_roundtrip(np.array([1.0, -2.0, 1.0 + 2.0**-8], np.float32), "bf16")
    assert h.tolist() == [0x3F80, 0xC000, 0x3F80]
    assert _C.numpy_roundtrip(np.zeros((0, 3), np.float32)).shape == (0, 3)
    assert _C.numpy_roundtrip(np.array(2.5, np.float32)).tolist() == 2.5


def test_numpy_bad_dtypes():
    from exl2cpp.errors import InvalidArgumentError

    with pytest.raises(
        InvalidArgumentError, match=r"dtype float64 are not accepted.*astype\(np.float32\)"
    ):
        _C.numpy_roundtrip(np.zeros(3))
    with pytest.raises(InvalidArgumentError, match=r"unknown dtype 'f8'"):
        _C.numpy_roundtrip(np.zeros(3, np.float32), "f8")
    with pytest.raises(InvalidArgumentError, match=r"bf16 needs a uint16 array"):
        _C.numpy_roundtrip(np.zeros(3, np.int32), "bf16")


# ---- TensorMap lookups ---------------------------------------------------------------------------


def test_read_tensor_checked(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    w = np.arange(12, dtype=np.float16).reshape(3, 4)
    save_file({"w": w, "i": np.arange(3, dtype=np.int32)}, str(d / "model.safetensors"))
    np.testing.assert_array_equal(_C.read_tensor(str(d), "w"), w)
    np.testing.assert_array_equal(_C.read_tensor(str(d), "w", [3, -1], ["f16", "bf16"]), w)
    with pytest.raises(
        ModelFormatError,
        match=r"tensor w in .*model.safetensors has shape \[3, 4\], expected \[4, 3\]",
    ):
        _C.read_tensor(str(d), "w", [4, 3])
    with pytest.raises(
        ModelFormatError, match=r"tensor w in .* has shape \[3, 4\], expected \[3\]"
    ):
        _C.read_tensor(str(d), "w", [3])
    with pytest.raises(
        ModelFormatError, match=r"tensor i in .* has dtype i32, expected one of f16, bf16"
    ):
        _C.read_tensor(str(d), "i", None, ["f16", "bf16"])
    with pytest.raises(
        ModelFormatError,
        match=r"missing tensor lm_head.weight in .*model.safetensors \(has 2 tensors\)",
    ):
        _C.read_tensor(str(d), "lm_head.weight")
    save_file({"x": np.zeros(1, np.uint8)}, str(d / "extra.safetensors"))
    with pytest.raises(ModelFormatError, match=r"missing tensor nope in .*/m \(has 3 tensors\)"):
        _C.read_tensor(str(d), "nope")


def test_real_exl2_fixture_files_match_safetensors_package():
    from safetensors.numpy import load_file

    files = sorted(glob.glob(os.path.join(FIXTURES, "*.safetensors")))
    files += glob.glob(os.path.join(FIXTURES, "source", "*.safetensors"))
    if not files:
        pytest.skip("fixtures not present")
    for path in files:
        got, ref = _C.read_safetensors(path), load_file(path)
        assert sorted(got) == sorted(ref), path
        for k, v in ref.items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, (path, k)
            assert got[k].tobytes() == v.tobytes(), (path, k)
