"""Bounded fuzzing of the readers: random and mutated safetensors files and JSON text must either parse
(then agree with the `safetensors` package / Python's json) or raise an exl2cpp error; never crash or raise
anything else. Each test runs <= 200 examples without deadline; the whole file takes a few seconds.
"""

from __future__ import annotations

import json
import math
import os
import struct
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

from exl2cpp import _C
from exl2cpp.errors import Exl2Error, ModelFormatError

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=False)

_TMP = tempfile.mkdtemp(prefix="exl2cpp-fuzz-")
_PATH = os.path.join(_TMP, "f.safetensors")


def _read(content: bytes):
    """read_safetensors on `content`; returns the dict or None when an exl2cpp error was raised."""
    with open(_PATH, "wb") as f:
        f.write(content)
    try:
        got = _C.read_safetensors(_PATH)
    except Exl2Error as e:
        assert str(e), "errors carry a message"
        event(f"rejected: {type(e).__name__}")
        return None
    event("accepted")
    return got


def _agree_with_reference(got: dict):
    """When we accept a file, the safetensors package must accept it too and give the same bytes."""
    try:
        ref = load_file(_PATH)
    except TypeError:  # numpy has no bfloat16: read through torch, compare raw bits
        from safetensors.torch import load_file as load_torch

        ref = {k: v.view(-1).view(torch_int16()).numpy().reshape(tuple(v.shape)) if str(v.dtype) == "torch.bfloat16"
               else v.numpy() for k, v in load_torch(_PATH).items()}
    assert sorted(got) == sorted(ref)
    for k, v in ref.items():
        g = got[k]
        assert g.shape == v.shape, k
        assert g.tobytes() == v.tobytes(), k


def torch_int16():
    import torch

    return torch.int16


def _valid_file() -> bytes:
    rng = np.random.default_rng(99)
    tensors = {
        "a.weight": rng.standard_normal((3, 5)).astype(np.float16),
        "b.bias": rng.standard_normal((4,)).astype(np.float32),
        "c.q": rng.integers(-100, 100, size=(2, 3), dtype=np.int32),
        "d.e": np.zeros((0, 2), np.int8),
    }
    p = os.path.join(_TMP, "valid.safetensors")
    save_file(tensors, p, metadata={"format": "np"})
    with open(p, "rb") as f:
        return f.read()


VALID = _valid_file()


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_safetensors(data):
    got = _read(data)
    if got is not None:
        _agree_with_reference(got)


@FUZZ
@given(st.binary(min_size=0, max_size=200))
def test_random_header_bytes(header):
    # A length field that matches, so the fuzz reaches the JSON and validation layers.
    got = _read(struct.pack("<Q", len(header)) + header + bytes(16))
    if got is not None:
        _agree_with_reference(got)


@FUZZ
@given(
    st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), max_size=6),
    st.one_of(st.none(), st.integers(0, len(VALID))),
)
def test_mutated_valid_file(flips, cut):
    b = bytearray(VALID)
    for pos, val in flips:
        b[pos] = val
    if cut is not None:
        b = b[:cut]
    got = _read(bytes(b))
    if got is not None:
        _agree_with_reference(got)


_dtype_sizes = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "F64": 8, "I64": 8, "BOOL": 1}
_entry = st.fixed_dictionaries(
    {
        "dtype": st.one_of(st.sampled_from(sorted(_dtype_sizes)), st.text(max_size=4)),
        "shape": st.lists(st.integers(-2, 6), max_size=3),
        "data_offsets": st.lists(st.integers(-1, 80), min_size=0, max_size=3),
    }
)


@FUZZ
@given(st.dictionaries(st.text(min_size=1, max_size=5), _entry, max_size=4), st.integers(0, 100), st.data())
def test_structured_headers(entries, data_len, data):
    # Half the time make the entries self-consistent and contiguous, so valid files get generated as well.
    if data.draw(st.booleans()):
        pos = 0
        for e in entries.values():
            if e["dtype"] not in _dtype_sizes or e["dtype"] in ("F64", "I64", "BOOL"):
                e["dtype"] = "U8"
            e["shape"] = [abs(s) for s in e["shape"]]
            n = math.prod(e["shape"]) * _dtype_sizes[e["dtype"]]
            e["data_offsets"] = [pos, pos + n]
            pos += n
        data_len = pos
    h = json.dumps(entries).encode()
    content = struct.pack("<Q", len(h)) + h + bytes((i * 37) % 256 for i in range(data_len))
    got = _read(content)
    if got is not None:
        _agree_with_reference(got)


# ---- JSON ----------------------------------------------------------------------------------------


def _same(a, b):
    """Equal values with equal JSON types (1 vs 1.0 differ)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, float) and isinstance(b, int) and not -(2**63) <= b < 2**63:
        return a == float(b)  # integers beyond int64 are kept as doubles (documented)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return type(a) is type(b) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=20,
)


@FUZZ
@given(_json_values, st.booleans(), st.booleans())
def test_json_agrees_with_python_on_valid(value, ascii_only, indent):
    text = json.dumps(value, ensure_ascii=ascii_only, indent=2 if indent else None)
    got = _C.parse_json(text)
    assert _same(got, json.loads(text)), text
    assert _same(json.loads(_C.dump_json(text)), json.loads(text))


def _check_text(text: str):
    try:
        got = _C.parse_json(text)
    except ModelFormatError as e:
        assert "<json>: invalid JSON at byte" in str(e)
        ours = None
    else:
        ours = got
    event("accepted" if ours is not None else "rejected")
    try:
        ref = json.loads(text)
    except (ValueError, RecursionError):
        assert ours is None, f"we accepted what Python's json rejects: {text!r}"
        return
    if ours is not None:
        assert _same(ours, ref), text


@FUZZ
@given(st.text(max_size=60))
def test_json_random_text(text):
    _check_text(text)


@FUZZ
@given(_json_values, st.lists(st.tuples(st.integers(0, 200), st.sampled_from(list('{}[],:"\\ .-+eE0123456789tfnul\x00\u00e9'))), min_size=1, max_size=3))
def test_json_mutated_documents(value, edits):
    text = json.dumps(value)
    for pos, ch in edits:
        pos = pos % (len(text) + 1)
        text = text[:pos] + ch + text[pos + 1 :] if pos < len(text) and ord(ch) % 2 else text[:pos] + ch + text[pos:]
    _check_text(text)


@FUZZ
@given(st.binary(max_size=80))
def test_json_random_bytes(data):
    try:
        _C.parse_json(data)
    except ModelFormatError:
        return
    # Accepted bytes are valid UTF-8 JSON, so Python must agree.
    assert _same(_C.parse_json(data), json.loads(data.decode("utf-8")))


@pytest.fixture(scope="module", autouse=True)
def _cleanup():
    yield
    for name in os.listdir(_TMP):
        os.unlink(os.path.join(_TMP, name))
    os.rmdir(_TMP)
