"""The worst case of speculative decoding on the CPU: what a job whose drafts are never accepted costs with the
adaptive draft length (it drafts K tokens, halves K at each rejection down to off, then probes one draft token after
waits of 8, 16, ... 256 generated tokens, each draft model probe first catching the draft's KV up on the tokens it
has not seen).

Models are synthetic (bench/synth_exl2.py `tiny` shape, random EXL2 codes, run on the CPU backend): a 12-layer
target and a 1-layer draft of another seed, whose greedy tokens never agree with the target's. Cases, one greedy
batch-1 job each (256 new tokens after a 64-token prompt): plain; the disagreeing draft model; n-gram drafts on a
prompt that repeats a random 16-token phrase (the lookup always finds a continuation, which the random target
follows only at times). Each case runs --reps times interleaved with plain; the medians of the wall-clock tok/s ratio
and of the CPU-time-per-token ratio (the measure a shared CPU disturbs least) are reported, with the draft rows per
generated token and draft forwards per step.

    PYTHONPATH=python python3 bench/bench_spec_cost.py --work /tmp/spec-cost [--reps 5] [--json out.jsonl]

Target (issue: speculative decoding): a never-accepting job costs at most 5 % more per token than plain decoding.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def synth(out: Path, layers: int, seed: int) -> Path:
    sys.path.insert(0, str(HERE))
    from synth_exl2 import synthesize

    synthesize(out, "tiny", 4.0, seed, distinct=0, shape_overrides={"layers": layers}, log=lambda *_: None,
               skip_existing=True)
    return out


def decode_rate(core, prompt, new_tokens):
    """Greedy job, stepped until idle: (decode tok/s after its first token, process CPU seconds per decoded token,
    tokens). CPU time (all threads of this process) is the cost measure that other processes on a shared machine
    disturb least."""
    from exl2cpp import _C

    core.submit(prompt, max_new_tokens=new_tokens, sampler=_C.SamplerSettings(temperature=0.0))
    toks, t_first, c_first = [], None, None
    while not core.idle:
        for _jid, token, _lp, _top, _fin, _reason, err in core.step():
            if err:
                raise RuntimeError(err)
            if token >= 0:
                toks.append(token)
                if t_first is None:
                    t_first, c_first = time.perf_counter(), time.process_time()
    n = max(len(toks) - 1, 1)
    return n / max(time.perf_counter() - t_first, 1e-9), (time.process_time() - c_first) / n, toks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, help="folder for the synthetic models (reused)")
    ap.add_argument("--new", type=int, default=256, help="new tokens per job")
    ap.add_argument("--draft-tokens", type=int, default=4, help="K: the adaptive length starts here")
    ap.add_argument("--reps", type=int, default=3, help="interleaved runs of each case and plain")
    ap.add_argument("--json", help="append one JSON line per case")
    args = ap.parse_args(argv)

    import exl2cpp
    from exl2cpp import _C

    work = Path(args.work)
    target = exl2cpp.load(synth(work / "target-12", 12, seed=0), device="cpu")
    other = exl2cpp.load(synth(work / "draft-other-1", 1, seed=1), device="cpu", max_seq_len=target.max_seq_len)
    rng = np.random.default_rng(0)
    vocab = target.vocab_size
    prompts = {"random": rng.integers(0, vocab, 64).tolist(), "repetitive": rng.integers(0, vocab, 16).tolist() * 4}
    base = {"cache_tokens": 4096, "page_size": 64, "prefix_cache": False}
    cases = [
        ("draft never agrees", "random", {"draft_model": other._core, "draft_tokens": args.draft_tokens}),
        ("ngram, repetitive", "repetitive", {"ngram_draft": True, "draft_tokens": args.draft_tokens}),
    ]
    decode_rate(_C.Engine(target._core, **base), prompts["random"], 16)  # warm-up
    print(f"CPU, tiny-shaped 12-layer target, 1-layer draft; batch 1, {args.new} new tokens, K={args.draft_tokens}, "
          f"median of {args.reps}")
    worst = None
    for case, prompt_kind, opts in cases:
        prompt = prompts[prompt_kind]
        ratios, cost_ratios, plain_rates, spec_rates = [], [], [], []
        for _ in range(args.reps):
            plain_rate, plain_cpu, want = decode_rate(_C.Engine(target._core, **base), prompt, args.new)
            core = _C.Engine(target._core, **base, **opts)
            rate, cpu, got = decode_rate(core, prompt, args.new)
            if got != want:
                raise AssertionError(f"{case}: speculative greedy output differs from plain decoding")
            ratios.append(rate / plain_rate)
            cost_ratios.append(plain_cpu / cpu)
            plain_rates.append(plain_rate)
            spec_rates.append(rate)
        s = core.stats()
        ratio, cost_ratio = statistics.median(ratios), statistics.median(cost_ratios)
        if s["spec_accepted"] == 0:
            worst = cost_ratio if worst is None else min(worst, cost_ratio)
        row = {"case": case, "k": args.draft_tokens, "new": args.new,
               "plain_tok_s": round(statistics.median(plain_rates), 1),
               "spec_tok_s": round(statistics.median(spec_rates), 1), "ratio": round(ratio, 3),
               "cpu_ratio": round(cost_ratio, 3), "spec_proposed": s["spec_proposed"],
               "spec_accepted": s["spec_accepted"], "draft_rows_per_token": round(s["spec_proposed"] / s["tokens_out"], 3),
               "draft_steps_per_step": round(s["draft_steps"] / s["steps"], 3), "device": "cpu"}
        print(f"{case:20s} plain {row['plain_tok_s']:7.1f} tok/s  speculative {row['spec_tok_s']:7.1f} tok/s  "
              f"wall ratio {ratio:.3f}  CPU-time ratio {cost_ratio:.3f}  proposed {s['spec_proposed']} accepted "
              f"{s['spec_accepted']}  draft rows/token {row['draft_rows_per_token']:.3f}  draft forwards/step "
              f"{row['draft_steps_per_step']:.3f}", flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    if worst is not None:
        print(f"\nworst never-accepting case: plain CPU time / speculative CPU time per token {worst:.3f} "
              "(target >= 0.95)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
