"""Speculative decoding in the engine: batch-1 decode tokens/s with a draft that always agrees (K = 1..8) and one that
never does (adaptive K), n-gram drafts on a repetitive prompt, and 8 / 32 concurrent jobs with drafts on and off.

The models are synthetic (bench/synth_exl2.py, random EXL2 codes): a Llama-2-7B-shaped target at --bpw whose
o_proj and down_proj scales are zeroed, so its layers add nothing to the residual stream while the target still
reads all its weight bytes; a 2-layer draft cut from that target (same embedding, layers, norm and head) that
therefore predicts it exactly (up to rounding ties between a verify row batch and a draft row); and a 2-layer draft
synthesized with another seed, whose greedy tokens (almost) never agree. Greedy jobs, 128-token random prompts,
--new tokens each, prefix cache off.

    PYTHONPATH=python python3 bench/bench_spec.py --work /tmp/spec --device cuda [--json out.jsonl]
    PYTHONPATH=python python3 bench/bench_spec.py --work /tmp/spec-tiny --preset tiny --device cpu --quick  # smoke
    PYTHONPATH=python python3 bench/bench_spec.py --work /tmp/spec --real MODEL_DIR [--real-draft 4 --real-draft DIR]

--real: the realistic case instead. A real model (e.g. SmolLM2-135M-Instruct imported to fp16) is the target; each
--real-draft is a number N (its first N layers with the same embedding, final norm and head: a small draft of the
same vocabulary) or a model folder (e.g. a 2.5 bpw quant of the target); on real text (a Python stdlib source file,
--real-text), greedy: plain vs each draft at K = 2 and 4 with the measured acceptance, and n-gram drafts on the same
text, at 1 and 8 jobs.

Targets (issue: speculative decoding): >= 2x batch-1 tok/s with the agreeing draft at K = 4, <= 5 % loss with the
disagreeing one, no loss at 32 jobs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def synth(out: Path, preset: str, bpw: float, seed: int, layers: int = 0) -> Path:
    if not (out / "config.json").is_file():
        cmd = [sys.executable, str(HERE / "synth_exl2.py"), "--preset", preset, "--bpw", str(bpw), "--out", str(out),
               "--seed", str(seed), "--distinct-layers", "0" if layers else "4"]
        if layers:
            cmd += ["--layers", str(layers)]
        subprocess.run(cmd, check=True)
    return out


def _tensors(folder: Path) -> dict:
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _write(folder: Path, src: Path, tensors: dict, layers: int) -> None:
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():  # config, tokenizer, ...
        if f.suffix != ".safetensors" and f.is_file() and f.name != "synth.json":
            (folder / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(tensors, str(folder / "output.safetensors"))


def derive(base: Path, work: Path) -> tuple[Path, Path]:
    """The zero-residual target and its 2-layer cut (the agreeing draft)."""
    target, draft = work / "target-zero", work / "draft-agree"
    if (target / "output.safetensors").is_file() and (draft / "output.safetensors").is_file():
        return target, draft
    t = _tensors(base)
    for name in list(t):
        if name.endswith(("o_proj.q_scale_max", "down_proj.q_scale_max")):
            t[name] = np.zeros_like(t[name])  # EXL2 weights are scale_max-relative: these linears output 0
    n_layers = json.loads((base / "config.json").read_text())["num_hidden_layers"]
    _write(target, base, t, n_layers)
    keep = {k: v for k, v in t.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < 2}
    _write(draft, base, keep, 2)
    return target, draft


def cut(src: Path, work: Path, layers: int) -> Path:
    """The first `layers` decoder layers of the model in `src`, with its embedding, final norm and head."""
    out = work / f"{src.name}-first{layers}"
    if not (out / "output.safetensors").is_file():
        t = _tensors(src)
        keep = {k: v for k, v in t.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
        _write(out, src, keep, layers)
    return out


def real_case(args, record) -> None:
    """--real: a real target, drafts cut from its first layers, on real text (see the module docstring)."""
    import textwrap

    import exl2cpp

    src = Path(args.real)
    target = exl2cpp.load(src, device=args.device)
    text = Path(args.real_text or textwrap.__file__).read_text()
    ids = target.tokenizer.encode(text)
    prompt_len = 256
    prompts = [ids[i * prompt_len:(i + 1) * prompt_len] for i in range(8)]
    if len(prompts[-1]) < prompt_len:
        raise SystemExit(f"--real-text has {len(ids)} tokens; 8 prompts of {prompt_len} need more")
    run_jobs(engine(target), prompts[:1], 16)  # warm-up
    for jobs in (1, 8):
        ps = prompts[:jobs]
        core = engine(target, jobs=jobs)
        base, total, want = run_jobs(core, ps, args.new)
        record("real: plain", "-", jobs, base, total, core)
        for d in args.real_draft or ["4"]:
            if d.isdigit():
                folder, name = cut(src, Path(args.work), int(d)), f"first {d} layers"
            else:
                folder, name = Path(d), Path(d).name
            draft = exl2cpp.load(folder, device=args.device, max_seq_len=target.max_seq_len)
            for k in (2, 4):
                core = engine(target, draft, k, jobs=jobs)
                decode, total, got = run_jobs(core, ps, args.new)
                assert got == want, "speculative greedy output differs from plain decoding"
                record(f"real: {name}", k, jobs, decode, total, core, base)
        core = engine(target, ngram=True, jobs=jobs)
        decode, total, got = run_jobs(core, ps, args.new)
        assert got == want
        record("real: ngram", 4, jobs, decode, total, core, base)


def run_jobs(core, prompts, new_tokens):
    """Submit all prompts (greedy) and step until idle: (decode tok/s after each job's first token, total tok/s,
    tokens per job)."""
    from exl2cpp import _C

    ids = {core.submit(p, max_new_tokens=new_tokens, sampler=_C.SamplerSettings(temperature=0.0)): i
           for i, p in enumerate(prompts)}
    toks = {i: [] for i in range(len(prompts))}
    t0 = time.perf_counter()
    t_first = None
    while not core.idle:
        for jid, token, _lp, _top, _fin, _reason, err in core.step():
            if err:
                raise RuntimeError(err)
            if token >= 0:
                toks[ids[jid]].append(token)
                if t_first is None:
                    t_first = time.perf_counter()
    t1 = time.perf_counter()
    n = sum(len(v) for v in toks.values())
    decode = (n - len(prompts)) / max(t1 - (t_first or t0), 1e-9)
    return decode, n / (t1 - t0), toks


def engine(model, draft=None, k=4, ngram=False, jobs=1):
    from exl2cpp import _C

    kw = {"cache_tokens": 1024 * max(jobs, 4), "page_size": 256, "max_batch_tokens": 2048, "prefix_cache": False}
    if draft is not None:
        kw.update(draft_model=draft._core, draft_tokens=k)
    if ngram:
        kw.update(ngram_draft=True, draft_tokens=k)
    return _C.Engine(model._core, **kw)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, help="folder for the synthetic models (reused)")
    ap.add_argument("--preset", default="llama2-7b")
    ap.add_argument("--bpw", type=float, default=4.0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--new", type=int, default=256, help="new tokens per job")
    ap.add_argument("--quick", action="store_true", help="K in {1, 4}, 8 jobs only (smoke run)")
    ap.add_argument("--json", help="append one JSON line per measurement")
    ap.add_argument("--real", help="a real model folder: the realistic case only (see above)")
    ap.add_argument("--real-draft", action="append", help="--real: a draft, N (first N layers) or a folder (repeatable; default 4)")
    ap.add_argument("--real-text", help="--real: the text file (default: Python's textwrap.py)")
    args = ap.parse_args(argv)

    import exl2cpp

    rows = []

    def record(case, k, jobs, decode, total, core, base=None):
        s = core.stats()
        acc = s["spec_accepted"] / s["spec_proposed"] if s["spec_proposed"] else None
        row = {"case": case, "k": k, "jobs": jobs, "decode_tok_s": round(decode, 1), "total_tok_s": round(total, 1),
               "spec_proposed": s["spec_proposed"], "spec_accepted": s["spec_accepted"],
               "acceptance": None if acc is None else round(acc, 3), "steps": s["steps"],
               "device": args.device, "preset": Path(args.real).name if args.real else args.preset,
               "bpw": None if args.real else args.bpw}
        rows.append(row)
        vs = f"  {decode / base:.2f}x plain" if base else ""
        print(f"{case:24s} K={k!s:>2} jobs={jobs:3d}  decode {decode:8.1f} tok/s  total {total:8.1f} tok/s  "
              f"acceptance {'-' if acc is None else f'{acc:.2f}'}  steps {s['steps']}{vs}", flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")

    if args.real:
        real_case(args, record)
        return 0
    work = Path(args.work)
    base = synth(work / "base", args.preset, args.bpw, seed=0)
    target_dir, agree_dir = derive(base, work)
    other_dir = synth(work / "draft-other", args.preset, args.bpw, seed=1, layers=2)
    target = exl2cpp.load(target_dir, device=args.device)
    agree = exl2cpp.load(agree_dir, device=args.device, max_seq_len=target.max_seq_len)
    other = exl2cpp.load(other_dir, device=args.device, max_seq_len=target.max_seq_len)
    rng = np.random.default_rng(0)
    vocab = target.vocab_size
    prompt = rng.integers(0, vocab, 128).tolist()
    run_jobs(engine(target), [prompt], 16)  # warm-up (kernels, graphs)
    core = engine(target)
    base_decode, total, want = run_jobs(core, [prompt], args.new)
    record("plain", "-", 1, base_decode, total, core)
    for k in (1, 4) if args.quick else range(1, 9):
        core = engine(target, agree, k)
        decode, total, got = run_jobs(core, [prompt], args.new)
        assert got == want, "speculative greedy output differs from plain decoding"
        record("draft agrees", k, 1, decode, total, core)
    core = engine(target, other, 4)
    decode, total, got = run_jobs(core, [prompt], args.new)
    assert got == want
    record("draft never agrees", 4, 1, decode, total, core)
    code = (rng.integers(0, vocab, 24).tolist() * 6)[:128]  # a repetitive "code edit": n-grams recur
    core = engine(target)
    plain_code, total, want = run_jobs(core, [code], args.new)
    record("plain (repetitive)", "-", 1, plain_code, total, core)
    core = engine(target, ngram=True)
    decode, total, got = run_jobs(core, [code], args.new)
    assert got == want
    record("ngram (repetitive)", 4, 1, decode, total, core)
    for jobs in (8,) if args.quick else (8, 32):
        prompts = [rng.integers(0, vocab, 128).tolist() for _ in range(jobs)]
        for case, kw in (("plain", {}), ("draft agrees", {"draft": agree}), ("draft never agrees", {"draft": other}),
                         ("ngram", {"ngram": True})):
            core = engine(target, jobs=jobs, **kw)
            decode, total, _ = run_jobs(core, prompts, args.new)
            record(case, 4 if kw else "-", jobs, decode, total, core)
    by = {(r["case"], r["k"], r["jobs"]): r for r in rows}
    k4 = by.get(("draft agrees", 4, 1))
    never = by.get(("draft never agrees", 4, 1))
    print(f"\nbatch 1: agreeing K=4 {k4['decode_tok_s'] / base_decode:.2f}x plain (target >= 2x); never agreeing "
          f"{never['decode_tok_s'] / base_decode:.2f}x (target >= 0.95x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
