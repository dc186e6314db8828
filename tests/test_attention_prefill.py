"""The CUDA prefill attention tiles (cuda/attention.cu) against the float64 reference.

rm2 (two m-tiles of Q per warp, 128-row blocks; head_dim 256 stays on rm1, the variant rm2 beat on the H200) runs
awkward layouts: row counts that are not a multiple of any tile, a chunk starting at an
unaligned position after earlier cache content, a sequence prefilled in three chained chunks, several sequences
(long and short runs) in one batch, a 2048-key context, GQA groups 1 / 4 / 8, head_dim 64 and 128. All cases run in one
child process (inputs and outputs through .npz files); tolerance and reference are test_backend_ops's (3e-3 of
max |ref| for f16).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest
from test_backend_ops import TOL, _cuda_count, assert_close, make_paged, ref_attention

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(_cuda_count() == 0, reason="no CUDA device"),
]

MODES = ["rm2"]


def _layout(name):
    """(seq_lens, seq, pos, calls): calls = [(row_begin, row_end, n_decode or None)], one op call each."""
    if (
        name == "from0"
    ):  # 300 rows of one sequence from position 0 (2.3 blocks of 128 rows, 4.7 of 64)
        return [300], [0] * 300, list(range(300)), [(0, 300, 0)]
    if (
        name == "after"
    ):  # a 333-row chunk at 1167 after 1167 cached keys: m-tiles straddle the key tiles
        return [1500], [0] * 333, list(range(1167, 1500)), [(0, 333, 0)]
    if name == "chained":  # one 700-key sequence prefilled in chunks of 256, 256, 188: three calls
        return [700], [0] * 700, list(range(700)), [(0, 256, 0), (256, 512, 0), (512, 700, 0)]
    if name == "long":  # 130 rows at the end of a 2048-key context
        return [2048], [0] * 130, list(range(1918, 2048)), [(0, 130, 0)]
    if (
        name == "multi"
    ):  # several sequences in one batch, long and short runs, one block holding several
        lens = [70, 450, 25, 200, 100]
        seq = [0] * 70 + [1] * 50 + [2] * 5 + [3] * 200 + [4]
        pos = (
            list(range(70)) + list(range(400, 450)) + list(range(20, 25)) + list(range(200)) + [99]
        )
        n = len(seq)
        return (
            lens,
            seq,
            pos,
            [(0, n, 0), (0, n, None)],
        )  # all rows through prefill; as a model step plans it
    raise AssertionError(name)


CASES = []
for hd in (64, 128):
    for ratio in (1, 4, 8):
        for layout in ("from0", "after", "chained", "multi"):
            CASES.append((hd, ratio, layout, 16))
CASES += [
    (128, 8, "long", 64),
    (64, 4, "long", 32),
    (256, 2, "multi", 16),
]  # 256: rm1 under either value


def _cid(case):
    hd, ratio, layout, page = case
    return f"hd{hd}-g{ratio}-{layout}-p{page}"


def _build(case):
    hd, ratio, layout, page = case
    rng = np.random.default_rng(zlib.crc32(_cid(case).encode()))
    kv = 1 if ratio == 8 else 2
    seq_lens, seq, pos, calls = _layout(layout)
    k_pages, v_pages, table, k_seq, v_seq = make_paged(rng, seq_lens, page, kv, hd, "f16")
    seq = np.array(seq, dtype=np.int32)
    pos = np.array(pos, dtype=np.int32)
    q = rng.standard_normal((len(seq), kv * ratio, hd)).astype(np.float16)
    scale = 1.0 / math.sqrt(hd) * 2.0  # sharper than usual so the softmax is not flat
    ref = ref_attention(q.astype(np.float64), k_seq, v_seq, pos, seq, scale)
    arrays = {"q": q, "k": k_pages, "v": v_pages, "pos": pos, "seq": seq, "table": table}
    return arrays, calls, scale, ref


_CHILD = r"""
import json, sys
import numpy as np
from exl2cpp import _C
spec = json.load(open(sys.argv[1]))
inp = np.load(sys.argv[2])
out = {}
for cid, c in spec.items():
    a = {k: inp[cid + "/" + k] for k in ("q", "k", "v", "pos", "seq", "table")}
    for i, (b, e, nd) in enumerate(c["calls"]):
        o = _C.op_attention_paged(a["q"][b:e], a["k"], a["v"], a["pos"][b:e], a["seq"][b:e], a["table"],
                                  c["scale"], device="cuda:0", n_decode=nd)
        out[f"{cid}/{i}"] = o
np.savez(sys.argv[3], **out)
print("ok")
"""


def _env(value):
    return dict(os.environ)


@pytest.fixture(scope="module")
def built():
    return {_cid(c): _build(c) for c in CASES}


@pytest.fixture(scope="module")
def outputs(built, tmp_path_factory):
    """{mode: {case id / call index: output}}, one child process."""
    d = tmp_path_factory.mktemp("attn_prefill")
    spec = {cid: {"calls": calls, "scale": scale} for cid, (_, calls, scale, _) in built.items()}
    (d / "spec.json").write_text(json.dumps(spec))
    np.savez(
        d / "in.npz", **{f"{cid}/{k}": v for cid, (a, *_) in built.items() for k, v in a.items()}
    )
    res = {}
    for mode in MODES:
        r = subprocess.run(
            [
                sys.executable,
                "-c",
                _CHILD,
                str(d / "spec.json"),
                str(d / "in.npz"),
                str(d / f"{mode}.npz"),
            ],
            env=_env(mode),
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert r.returncode == 0 and r.stdout.strip() == "ok", f"{mode}: {r.stderr[-3000:]}"
        with np.load(d / f"{mode}.npz") as z:
            res[mode] = {k: z[k] for k in z.files}
    return res


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES, ids=_cid)
def test_prefill_variant_matches_reference(outputs, built, mode, case):
    cid = _cid(case)
    _, calls, _, ref = built[cid]
    for i, (b, e, nd) in enumerate(calls):
        out = outputs[mode][f"{cid}/{i}"]
        assert out.dtype == np.float16
        assert_close(out, ref[b:e], TOL["f16"], f"{mode} {cid} rows {b}..{e} n_decode {nd}")
