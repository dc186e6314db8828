"""Shared helpers of the model benchmarks (bench_model, bench_exllamav2, bench_engine, report): model shapes from
config.json, the hardware ceilings from exl2cpp._C.cuda_bench, result records (JSON lines), table printing and the
``--option NAME=VALUE`` flag that sets runtime options."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path


def add_option_flag(ap) -> None:
    """The drivers' ``--option NAME=VALUE`` flag (repeatable): runtime options for the run (docs/options.md)."""
    ap.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                    help="runtime option for this run (docs/options.md; repeatable), e.g. --option gemv_group=false")


def options_of(args) -> dict:
    """{name: value text} of the ``--option`` flags, checked against the registry (InvalidArgumentError)."""
    from exl2cpp.options import parse_assignments

    return parse_assignments(args.option)


def gpu_name():
    """Name of GPU 0 from nvidia-smi, or a placeholder."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
        return out.stdout.strip().splitlines()[0]
    except Exception:  # noqa: BLE001 - no nvidia-smi (CPU runs)
        return "no GPU"


def model_shape(folder):
    """Shape numbers of a Llama-style model folder's config.json."""
    c = json.loads((Path(folder) / "config.json").read_text())
    heads = c["num_attention_heads"]
    hd = c.get("head_dim") or c["hidden_size"] // heads
    q = c.get("quantization_config") or {}
    return {
        "hidden": c["hidden_size"],
        "inter": c["intermediate_size"],
        "layers": c["num_hidden_layers"],
        "heads": heads,
        "kv_heads": c.get("num_key_value_heads") or heads,
        "head_dim": hd,
        "vocab": c["vocab_size"],
        "bits": q.get("bits"),
        "max_pos": c.get("max_position_embeddings", 4096),
    }


def model_label(folder):
    """Short name of a bench folder: its directory name (the device script names them e.g. llama2-7b-4.0)."""
    return Path(folder).name


def kv_bytes_per_token(shape, elem_bytes=2):
    return 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * elem_bytes


def linear_shapes(shape):
    """(name, in, out) of one layer's linears, fused as a runtime runs them (the strictest cuBLAS ceiling)."""
    h, hd = shape["hidden"], shape["head_dim"]
    return [
        ("qkv", h, (shape["heads"] + 2 * shape["kv_heads"]) * hd),
        ("o", shape["heads"] * hd, h),
        ("gate_up", h, 2 * shape["inter"]),
        ("down", shape["inter"], h),
    ]


class Ceilings:
    """Hardware limits measured in this process through exl2cpp._C.cuda_bench (None on a CPU-only build)."""

    def __init__(self, iters=10, enabled=True):
        self.iters = iters
        self.cb = None
        try:
            from exl2cpp import _C

            if enabled and hasattr(_C, "cuda_bench") and _C.cuda_device_count() > 0:
                self.cb = _C.cuda_bench
        except Exception:  # noqa: BLE001
            self.cb = None
        self._bw = None
        self._gemm = {}

    @property
    def available(self):
        return self.cb is not None

    def bandwidth(self):
        """Device-to-device copy bandwidth in bytes/s (read + write counted), best of our kernel and memcpy."""
        if self.cb is None:
            return None
        if self._bw is None:
            nbytes = 1 << 30
            best = min(
                self.cb.copy(nbytes, self.iters, True), self.cb.copy(nbytes, self.iters, False)
            )
            self._bw = 2 * nbytes / best
        return self._bw

    def decode_tok_s(self, bytes_per_token):
        bw = self.bandwidth()
        return bw / bytes_per_token if bw else None

    def prefill_seconds(self, shape, n):
        """cuBLAS fp16 GEMM seconds for n tokens through every layer's linears (lm_head on the last row only), and
        our attention kernel's seconds for the causal n x n prefill (reported apart, not part of the ceiling)."""
        if self.cb is None:
            return None, None
        key = (tuple(sorted(shape.items())), n)
        if key not in self._gemm:
            per_layer = sum(
                self.cb.matmul_f16(n, fin, fout, self.iters)
                for _, fin, fout in linear_shapes(shape)
            )
            head = self.cb.matmul_f16(1, shape["hidden"], shape["vocab"], self.iters)
            attn = self.cb.attention(
                n, n, shape["heads"], shape["kv_heads"], shape["head_dim"], max(2, self.iters // 4)
            )
            self._gemm[key] = (shape["layers"] * per_layer + head, shape["layers"] * attn)
        return self._gemm[key]


def write_record(path, record):
    """Append one JSON line to path (if given)."""
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def read_records(*paths):
    out = []
    for p in paths:
        if p and os.path.exists(p):
            with open(p) as f:
                out += [json.loads(line) for line in f if line.strip()]
    return out


def fmt(x, spec=".0f", none="-"):
    return none if x is None else format(x, spec)


def pct(x, ceiling):
    return None if not x or not ceiling else 100.0 * x / ceiling


def table(rows, headers):
    """Plain fixed-width table (first column left-aligned, the rest right-aligned)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for k, r in enumerate(cells):
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
            )
        )
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


class Stopwatch:
    def __init__(self):
        self.t = time.perf_counter()

    def __call__(self):
        now = time.perf_counter()
        dt, self.t = now - self.t, now
        return dt


def random_prompt(rng_seed, n, vocab, low=3):
    """n token ids in [low, vocab) (skips <unk> <s> </s>), deterministic for the seed."""
    import random

    r = random.Random(rng_seed)
    return [r.randrange(low, vocab) for _ in range(n)]
