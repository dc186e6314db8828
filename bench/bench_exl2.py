"""EXL2 quantized linear on the GPU: the fused decode kernel vs the copy-bandwidth ceiling, and the prefill path
(dequantize + cuBLAS) vs cuBLAS fp16 on the same shape.

Weights are written by our own packer (_C.exl2_pack) with random codes (values don't change the speed) in a
realistic bit mix per target bpw, groups of 128 rows, for the linears of Llama-2-7B and Llama-3-8B.
Measured in one process on the current GPU, CUDA events, mean over --iters calls after warm-up:
  decode:  m = 1 row; GB/s = layer bytes (q_weight + scales + perm) / time, next to the device-to-device copy
           bandwidth (2 * bytes / time of our 16-byte copy kernel) measured in the same run; VRAM MB = what the
           layer holds on the device (the v4 layout);
  sweep:   m = 1..64 on one shape through both paths (fused / dequant+cuBLAS): where the threshold belongs
           (option gemv_max_rows, default 32);
  prefill: m = 2048 rows; TFLOP/s = 2 m in out / time, next to cuBLAS fp16 (f16 weights) on the same shape;
  group:   q+k+v and gate+up at m = 1, 4, 16 as one launch (forward_group) against one launch per linear.

    PYTHONPATH=python python3 bench/bench_exl2.py [--quick] [--json OUT.json] [--option NAME=VALUE ...]
--option sets a runtime option (docs/options.md) for the whole run, e.g. --option gemv_slices=1.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

MODELS = {
    # name: [(linear, in_features, out_features)] of one decoder layer
    "llama2-7b": [
        ("q", 4096, 4096),
        ("k", 4096, 4096),
        ("v", 4096, 4096),
        ("o", 4096, 4096),
        ("gate", 4096, 11008),
        ("up", 4096, 11008),
        ("down", 11008, 4096),
    ],
    "llama3-8b": [
        ("q", 4096, 4096),
        ("k", 4096, 1024),
        ("v", 4096, 1024),
        ("o", 4096, 4096),
        ("gate", 4096, 14336),
        ("up", 4096, 14336),
        ("down", 14336, 4096),
    ],
}
N_LAYERS = 32

# Share of input rows per bit width (storage order, descending), close to what ExLlamaV2's optimizer picks.
BIT_MIX = {
    2.5: {4: 0.1, 3: 0.3, 2: 0.6},
    4.0: {5: 0.1, 4: 0.8, 3: 0.1},
    6.0: {8: 0.05, 6: 0.85, 5: 0.1},
}
GROUP = 128
# Linears of one layer that read the same x (linear::forward_group in the model graph).
GROUPS = [("q+k+v", ["q", "k", "v"]), ("gate+up", ["gate", "up"])]


def gpu_name() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return out.stdout.strip().splitlines()[0]
    except Exception:  # noqa: BLE001 - no nvidia-smi
        return "unknown GPU"


def pack_random_layer(_C, rng, n_in: int, n_out: int, bpw: float) -> dict:
    """The EXL2 tensors of a random layer with BIT_MIX[bpw], groups of GROUP rows (suffix-keyed)."""
    n_groups = n_in // GROUP
    assert n_groups * GROUP == n_in
    bits = []
    widths = sorted(BIT_MIX[bpw], reverse=True)
    for b in widths[:-1]:
        bits += [b] * round(BIT_MIX[bpw][b] * n_groups)
    bits += [widths[-1]] * (n_groups - len(bits))
    rows = [GROUP] * n_groups
    codes = np.empty((n_in, n_out), np.uint8)
    for g, b in enumerate(bits):
        codes[g * GROUP : (g + 1) * GROUP] = rng.integers(0, 1 << b, (GROUP, n_out), dtype=np.uint8)
    nib = rng.integers(0, 16, (n_groups, n_out), dtype=np.uint8)
    qsm = np.full(n_groups, 0.05, np.float16)
    perm = rng.permutation(n_in).astype(np.int32)
    return _C.exl2_pack(codes, bits, rows, nib, qsm, perm, n_out)


def make_layer(_C, rng, n_in: int, n_out: int, bpw: float, path: Path) -> None:
    """Pack a random EXL2 layer with BIT_MIX[bpw] into `path` as tensors 'layer.*'."""
    t = pack_random_layer(_C, rng, n_in, n_out, bpw)
    write_safetensors(path, {f"layer.{k}": v for k, v in t.items()})


def write_safetensors(path: Path, tensors: dict) -> None:
    import struct

    names = {np.dtype("int32"): "I32", np.dtype("int16"): "I16", np.dtype("float16"): "F16"}
    header, off = {}, 0
    for k, a in tensors.items():
        header[k] = {
            "dtype": names[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [off, off + a.nbytes],
        }
        off += a.nbytes
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for a in tensors.values():
            f.write(np.ascontiguousarray(a).tobytes())


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="4.0 bpw and llama2-7b only")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--prefill", type=int, default=2048, help="rows for the prefill measurement")
    ap.add_argument("--json", help="write all numbers here")
    C.add_option_flag(ap)
    args = ap.parse_args()

    import exl2cpp.options
    from exl2cpp import _C

    options = C.options_of(args)
    exl2cpp.options.set(options)  # process-wide: every launch below reads them

    if not _C.cuda_compiled() or _C.cuda_device_count() == 0:
        print("bench_exl2: no CUDA GPU (or a CPU-only build)", file=sys.stderr)
        return 1
    gpu = gpu_name()
    cb = _C.cuda_bench
    copy_bytes = 512 << 20
    copy_bw = 2 * copy_bytes / cb.copy(copy_bytes, 50, True)
    memcpy_bw = 2 * copy_bytes / cb.copy(copy_bytes, 50, False)
    print(f"GPU: {gpu}")
    if options:
        print("options: " + " ".join(f"{k}={v}" for k, v in options.items()))
    print(
        f"copy bandwidth: {copy_bw / 1e9:.0f} GB/s (copy kernel), {memcpy_bw / 1e9:.0f} GB/s (cudaMemcpy)"
    )
    ceiling = max(copy_bw, memcpy_bw)

    models = ["llama2-7b"] if args.quick else list(MODELS)
    bpws = [4.0] if args.quick else list(BIT_MIX)
    rng = np.random.default_rng(0)
    results = {
        "gpu": gpu,
        "options": options,
        "copy_GBps": copy_bw / 1e9,
        "memcpy_GBps": memcpy_bw / 1e9,
        "decode": [],
        "prefill": [],
        "sweep": [],
    }
    hdr = f"{'GPU':<22} {'model':<10} {'linear':<6} {'shape':>12} {'bpw':>5} {'us':>8} {'GB/s':>7} {'% copy':>7} {'VRAM MB':>8}"
    pre = f"{'GPU':<22} {'model':<10} {'linear':<6} {'shape':>12} {'bpw':>5} {'m':>5} {'ms':>8} {'TFLOP/s':>8} {'cuBLAS f16':>10} {'% cuBLAS':>8}"
    decode_rows, prefill_rows, summary, group_rows = [], [], [], []
    with tempfile.TemporaryDirectory() as td:
        cache: dict = {}
        for bpw in bpws:
            for model in models:
                layer_s = 0.0
                layer_bytes = 0
                layer_dev = 0
                for name, n_in, n_out in MODELS[model]:
                    key = (n_in, n_out, bpw)
                    if key not in cache:
                        p = Path(td) / f"l_{n_in}_{n_out}_{bpw}.safetensors"
                        t0 = time.time()
                        make_layer(_C, rng, n_in, n_out, bpw, p)
                        cache[key] = (str(p), time.time() - t0)
                    path = cache[key][0]
                    r = _C.exl2_linear_bench(path, "layer", 1, args.iters)
                    s, nb = r["seconds"], r["nbytes"]
                    layer_s += s
                    layer_bytes += nb
                    dev_b = r.get("device_bytes", nb)
                    layer_dev += dev_b
                    gbps = nb / s / 1e9
                    row = {
                        "model": model,
                        "linear": name,
                        "in": n_in,
                        "out": n_out,
                        "bpw_target": bpw,
                        "bpw": r["bits_per_weight"],
                        "bits": r["bits_desc"],
                        "us": s * 1e6,
                        "GBps": gbps,
                        "pct_copy": 100 * nb / s / ceiling,
                        "device_bytes": dev_b,
                    }
                    results["decode"].append(row)
                    decode_rows.append(
                        f"{gpu[:22]:<22} {model:<10} {name:<6} {f'{n_in}x{n_out}':>12} "
                        f"{r['bits_per_weight']:>5.2f} {s * 1e6:>8.1f} {gbps:>7.0f} "
                        f"{100 * nb / s / ceiling:>6.1f}% {dev_b / 1e6:>8.2f}"
                    )
                    if name in ("q", "gate", "down"):
                        m = args.prefill
                        rp = _C.exl2_linear_bench(path, "layer", m, max(5, args.iters // 10))
                        sf = cb.matmul_f16(m, n_in, n_out, max(5, args.iters // 10))
                        tf = 2 * m * n_in * n_out / rp["seconds"] / 1e12
                        tb = 2 * m * n_in * n_out / sf / 1e12
                        results["prefill"].append(
                            {
                                "model": model,
                                "linear": name,
                                "in": n_in,
                                "out": n_out,
                                "bpw_target": bpw,
                                "m": m,
                                "ms": rp["seconds"] * 1e3,
                                "TFLOPs": tf,
                                "cublas_f16_TFLOPs": tb,
                                "pct_cublas": 100 * tf / tb,
                            }
                        )
                        prefill_rows.append(
                            f"{gpu[:22]:<22} {model:<10} {name:<6} {f'{n_in}x{n_out}':>12} "
                            f"{rp['bits_per_weight']:>5.2f} {m:>5} {rp['seconds'] * 1e3:>8.3f} "
                            f"{tf:>8.1f} {tb:>10.1f} {100 * tf / tb:>7.1f}%"
                        )
                # The linears that share x as one launch (linear::forward_group) vs one launch each.
                paths = {name: cache[(n_in, n_out, bpw)][0] for name, n_in, n_out in MODELS[model]}
                for gname, members in GROUPS:
                    ps = [paths[n] for n in members]
                    for m in (1, 4, 16):
                        sep = _C.exl2_linear_bench_group(
                            ps, ["layer"] * len(ps), m, args.iters, group=False
                        )
                        grp = _C.exl2_linear_bench_group(ps, ["layer"] * len(ps), m, args.iters)
                        r = {
                            "model": model,
                            "bpw_target": bpw,
                            "group": gname,
                            "m": m,
                            "separate_us": sep["seconds"] * 1e6,
                            "grouped_us": grp["seconds"] * 1e6,
                            "one_launch": grp["grouped"],
                        }
                        results.setdefault("group", []).append(r)
                        group_rows.append(
                            f"  {model:<10} {bpw:>4} bpw {gname:<8} m={m:>2}: separate {r['separate_us']:7.1f} us"
                            f"   one launch {r['grouped_us']:7.1f} us ({r['separate_us'] / r['grouped_us']:.2f}x)"
                            f"{'' if grp['grouped'] else '   (did NOT group)'}"
                        )
                tok_s = 1.0 / (layer_s * N_LAYERS)
                summary.append(
                    f"{model} @ {bpw} bpw: linears of one layer {layer_s * 1e6:.1f} us, "
                    f"{layer_bytes / layer_s / 1e9:.0f} GB/s ({100 * layer_bytes / layer_s / ceiling:.1f}% "
                    f"of copy); {N_LAYERS} layers' linears alone -> {tok_s:.0f} tokens/s; "
                    f"VRAM of one layer's linears {layer_dev / 2**20:.1f} MiB (file {layer_bytes / 2**20:.1f} MiB)"
                )
                results.setdefault("layer", []).append(
                    {
                        "model": model,
                        "bpw_target": bpw,
                        "us": layer_s * 1e6,
                        "GBps": layer_bytes / layer_s / 1e9,
                        "linears_only_tok_s": tok_s,
                        "device_bytes": layer_dev,
                    }
                )
        # Threshold sweep on one shape at 4.0 bpw: fused vs dequant+cuBLAS per row count.
        path = cache.get((4096, 11008, 4.0), (None,))[0]
        sweep_rows = []
        if path:
            for m in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64):
                fused = _C.exl2_linear_bench(path, "layer", m, args.iters, threshold=1 << 20)[
                    "seconds"
                ]
                deq = _C.exl2_linear_bench(path, "layer", m, args.iters, threshold=0)["seconds"]
                results["sweep"].append({"m": m, "fused_us": fused * 1e6, "dequant_us": deq * 1e6})
                sweep_rows.append(
                    f"  m={m:>3}: fused {fused * 1e6:8.1f} us   dequant+cuBLAS {deq * 1e6:8.1f} us"
                    f"   -> {'fused' if fused <= deq else 'dequant'}"
                )

    print("\nDecode (m = 1), fused dequantize+GEMV:")
    print(hdr)
    print("\n".join(decode_rows))
    print(
        "\nLinears that share x, one launch (forward_group, option gemv_group) vs one launch each:"
    )
    print("\n".join(group_rows))
    print("\nPer decoder layer:")
    print("\n".join("  " + s for s in summary))
    print(f"\nPrefill (m = {args.prefill}), dequantize + cuBLAS vs cuBLAS fp16:")
    print(pre)
    print("\n".join(prefill_rows))
    if sweep_rows:
        print(
            "\nThreshold sweep, 4096x11008 @ 4.0 bpw (option gemv_max_rows = largest m where fused wins):"
        )
        print("\n".join(sweep_rows))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
