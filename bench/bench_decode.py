"""Hardware ceilings and backend kernel timings on the GPU (skeleton of the decode/prefill benchmark).

Measures, in one process on the current GPU:
  - device-to-device copy bandwidth with our own copy kernel and cudaMemcpyAsync (the decode ceiling),
    next to torch's copy as a reference when torch with CUDA is importable;
  - fp16 GEMM TFLOP/s through our cuda::matmul_nt (cuBLAS) on Llama-2-7B and Llama-3-8B linear shapes, for a
    2048-token prefill (vs the fp16 dense peak and torch.matmul) and for batch-1 decode (as % of copy bandwidth);
  - our paged attention for decode at context 2048 and a 2048-token causal prefill.
Full-model decode/prefill tokens/s come later (issue 4).

    PYTHONPATH=python python3 bench/bench_decode.py [--quick]
"""

from __future__ import annotations

import argparse
import subprocess
import sys

# Dense fp16/bf16 tensor-core peaks (TFLOP/s, no sparsity) from NVIDIA's data sheets, keyed by name fragment.
PEAK_TFLOPS = {"H200": 989.0, "H100 SXM": 989.0, "H100": 756.0, "A100": 312.0, "RTX 4090": 165.0, "L40S": 362.0}

SHAPES = {
    # name: (hidden, intermediate, n_heads, n_heads_kv, head_dim, vocab)
    "llama2-7b": (4096, 11008, 32, 32, 128, 32000),
    "llama3-8b": (4096, 14336, 32, 8, 128, 128256),
}


def linear_shapes(hidden, inter, n_heads, n_kv, head_dim, vocab):
    """(name, in_features, out_features) of one decoder layer's linears (fused as exl2cpp runs them) + lm_head."""
    qkv = (n_heads + 2 * n_kv) * head_dim
    return [
        ("qkv", hidden, qkv),
        ("o", n_heads * head_dim, hidden),
        ("gate_up", hidden, 2 * inter),
        ("down", inter, hidden),
        ("lm_head", hidden, vocab),
    ]


def gpu_name():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
        return out.stdout.strip().splitlines()[0]
    except Exception:  # noqa: BLE001 - no nvidia-smi: report unknown
        return "unknown GPU"


def peak_for(name):
    for key, val in PEAK_TFLOPS.items():
        if key in name:
            return val
    return None


def torch_ref():
    try:
        import torch  # reference only; the exl2cpp package itself never imports torch

        return torch if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001
        return None


def torch_time(torch, fn, iters):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e-3 / iters


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    args = ap.parse_args()
    iters = 5 if args.quick else 20

    from exl2cpp import _C

    if not hasattr(_C, "cuda_bench"):
        print("exl2cpp._C has no cuda_bench: this build has no CUDA backend")
        return 1
    cb = _C.cuda_bench
    torch = torch_ref()
    name = gpu_name()
    peak = peak_for(name)
    print(f"GPU: {name}   fp16 dense peak: {peak or '?'} TFLOP/s (data sheet)   torch reference: "
          f"{'yes ' + torch.__version__ if torch else 'no'}")

    # ---- copy bandwidth (decode ceiling) ----
    nbytes = 1 << 30
    bw = {}
    for label, kernel in (("exl2cpp copy kernel", True), ("cudaMemcpyAsync D2D", False)):
        s = cb.copy(nbytes, iters, kernel)
        bw[label] = 2 * nbytes / s / 1e9
    if torch:
        a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        b = torch.empty_like(a)
        s = torch_time(torch, lambda: b.copy_(a), iters)
        bw["torch copy_"] = 2 * nbytes / s / 1e9
    ceiling_bw = max(bw.values())
    print(f"\nDevice-to-device copy, {nbytes >> 20} MiB (read + write counted):")
    for label, gbs in bw.items():
        print(f"  {label:24s} {gbs:8.0f} GB/s  ({100 * gbs / ceiling_bw:5.1f}% of best)")

    # ---- GEMM (prefill ceiling) and GEMV (decode) ----
    for model, dims in SHAPES.items():
        print(f"\n{model}: fp16 linears via cuda::matmul_nt (cuBLAS, fp32 accumulate)")
        print(f"  {'linear':8s} {'in':>6s} {'out':>7s} | {'prefill n=2048':>15s} {'%peak':>6s} {'torch':>7s} |"
              f" {'decode n=1 us':>13s} {'GB/s':>7s} {'%copy':>6s}")
        tot_pre = tot_dec = tot_bytes = tot_flops = 0.0
        for lname, fin, fout in linear_shapes(*dims):
            n = 2048
            s = cb.matmul_f16(n, fin, fout, iters)
            tflops = 2 * n * fin * fout / s / 1e12
            tref = ""
            if torch:
                x = torch.randn(n, fin, dtype=torch.float16, device="cuda")
                w = torch.randn(fout, fin, dtype=torch.float16, device="cuda")
                st = torch_time(torch, lambda: x @ w.t(), iters)
                tref = f"{2 * n * fin * fout / st / 1e12:7.0f}"
                del x, w
            s1 = cb.matmul_f16(1, fin, fout, iters)
            gbs = 2 * fin * fout / s1 / 1e9
            pct_peak = f"{100 * tflops / peak:5.1f}%" if peak else "    ?"
            print(f"  {lname:8s} {fin:6d} {fout:7d} | {tflops:9.0f} TF/s {pct_peak:>6s} {tref:>7s} |"
                  f" {s1 * 1e6:13.1f} {gbs:7.0f} {100 * gbs / ceiling_bw:5.1f}%")
            if lname != "lm_head":
                tot_pre += s
                tot_dec += s1
                tot_bytes += 2 * fin * fout
                tot_flops += 2 * n * fin * fout
        print(f"  per layer: prefill {tot_flops / tot_pre / 1e12:.0f} TF/s, decode {tot_bytes / tot_dec / 1e9:.0f} GB/s "
              f"({100 * tot_bytes / tot_dec / 1e9 / ceiling_bw:.1f}% of copy)")

        hidden, inter, nh, nkv, hd, vocab = dims
        sd = cb.attention(1, 2048, nh, nkv, hd, iters)
        kv_bytes = 2 * 2048 * nkv * hd * 2
        sp = cb.attention(2048, 2048, nh, nkv, hd, max(2, iters // 4))
        flops = 4 * nh * hd * 2048 * 2048 / 2  # causal: half of QK^T and PV
        print(f"  attention decode ctx 2048: {sd * 1e6:8.1f} us/layer ({kv_bytes / sd / 1e9:.0f} GB/s of KV, "
              f"{100 * kv_bytes / sd / 1e9 / ceiling_bw:.1f}% of copy)")
        print(f"  attention prefill 2048:    {sp * 1e3:8.2f} ms/layer ({flops / sp / 1e12:.1f} TF/s causal)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
