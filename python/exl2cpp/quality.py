"""Quality of quants against a reference on the same tokens: perplexity, mean KL divergence, top-1 agreement and the
worst windows, scored window by window with bounded memory; plus the sizes, memory and speed ``exl2cpp compare``
prints beside them.

    >>> import exl2cpp
    >>> table = exl2cpp.compare(["q25/", "q40/", "q60/"], reference="fp16/", text=open("text.txt").read())
    >>> [(m["bpw"], m["kl"], m["top1"]) for m in table["models"]]

The text is cut into windows of ``ctx`` tokens (one after the other, no overlap, as ``Model.perplexity`` does); each
window runs through the model in steps of at most ``STEP_ROWS`` tokens with the KV cache carrying the window's past,
and every step's float32 logits rows are scored at once (log-softmax in float64 over those rows only), so memory is
``STEP_ROWS x vocab`` per model whatever the text's length. All models advance in lockstep on the same step, so the
reference runs once. KL is KL(reference || model) in nats per token; top-1 agreement is the share of positions where
both put their highest logit on the same token.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import InvalidArgumentError, UnsupportedError

STEP_ROWS = 256  # rows per forward step while scoring: 256 x vocab f32 (+ an f64 copy) per model
WORST = 5  # worst windows listed per model
DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"  # the GPL-3 text of Debian's base-files (what the CLI tests use)


def token_windows(n_tokens: int, ctx: int) -> list[tuple[int, int]]:
    """(start, end) of each scored window: ``ctx`` tokens after one another, the last one shorter, none under 2."""
    if ctx < 2:
        raise InvalidArgumentError(f"ctx must be >= 2, got {ctx}")
    out = [(s, min(s + ctx, n_tokens)) for s in range(0, n_tokens - 1, ctx)]
    return [(s, e) for s, e in out if e - s >= 2]


def window_logits(model, ids: Sequence[int], ctx: int,
                  step_rows: int = STEP_ROWS) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Yield ``(window index, logits f32 [rows, vocab], targets int64 [rows])`` for every step of every window of
    ``ids``: the logits of each position that has a next token in its window, ``step_rows`` positions at a time."""
    ids = list(ids)
    for w, (s, e) in enumerate(token_windows(len(ids), ctx)):
        window = ids[s:e]
        cache = model._cache_for(len(window))
        pages = cache.pool.alloc(-(-len(window) // cache.page_size))
        try:
            for a in range(0, len(window) - 1, step_rows):
                step = window[a : a + step_rows]
                targets = np.asarray(window[a + 1 : a + 1 + len(step)], np.int64)  # the window's last token: none
                rows = list(range(len(targets)))
                logits = model._step(cache, pages, step, a, rows)
                yield w, logits, targets
        finally:
            for p in pages:
                cache.pool.release(p)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax of each row (the rows of one step, never a whole text)."""
    x = logits.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=1, keepdims=True))
    return x


@dataclass
class Score:
    """Running sums of one model's scores over the text, and per window."""

    nll: float = 0.0
    kl: float = 0.0
    agree: int = 0
    count: int = 0
    windows: dict = field(default_factory=dict)  # window -> [nll, kl, agree, count]

    def add(self, w: int, nll: float, kl: float, agree: int, count: int) -> None:
        self.nll += nll
        self.kl += kl
        self.agree += agree
        self.count += count
        acc = self.windows.setdefault(w, [0.0, 0.0, 0, 0])
        acc[0] += nll
        acc[1] += kl
        acc[2] += agree
        acc[3] += count

    def result(self, spans: list[tuple[int, int]], worst: int = WORST) -> dict:
        rows = [{"window": w, "start": spans[w][0], "tokens": c, "ppl": math.exp(n / c), "kl": k / c, "top1": a / c}
                for w, (n, k, a, c) in sorted(self.windows.items())]
        rows.sort(key=lambda r: (-r["kl"], -r["ppl"], r["window"]))
        return {"ppl": math.exp(self.nll / self.count), "kl": self.kl / self.count, "top1": self.agree / self.count,
                "tokens": self.count, "worst_windows": rows[:worst]}


def score(models: Sequence, ids: Sequence[int], ctx: int, reference=None, progress: bool = False) -> list[dict]:
    """Score ``models`` on ``ids`` against ``reference`` (default: the first model); one result dict per model with
    ``ppl``, ``kl``, ``top1``, ``tokens`` and ``worst_windows`` (the windows of highest KL, then perplexity)."""
    models = list(models)
    if not models:
        raise InvalidArgumentError("compare needs at least one model")
    ref = reference if reference is not None else models[0]
    runners = ([ref] if reference is not None else []) + models
    vocab = {m.vocab_size for m in runners}
    if len(vocab) != 1:
        names = ", ".join(f"{m.path} ({m.vocab_size})" for m in runners)
        raise InvalidArgumentError(f"the models do not share a vocabulary: {names}; compare quants of one model")
    ctx = min([ctx] + [m.max_seq_len for m in runners])
    spans = token_windows(len(ids), ctx)
    if not spans:
        raise InvalidArgumentError("the text is too short to score: it needs at least 2 tokens")
    total = sum(e - s - 1 for s, e in spans)
    scores = [Score() for _ in models]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="tok", desc="scoring", leave=False, dynamic_ncols=True)
    try:
        iters = [window_logits(m, ids, ctx) for m in runners]
        for steps in zip(*iters):
            w, ref_logits, targets = steps[0]
            ref_lp = log_softmax(ref_logits)
            ref_p = np.exp(ref_lp)
            ref_top = ref_lp.argmax(axis=1)
            rows = np.arange(len(targets))
            own = steps[1:] if reference is not None else steps
            for sc, (_, logits, _) in zip(scores, own):
                lp = ref_lp if logits is ref_logits else log_softmax(logits)
                kl = float((ref_p * (ref_lp - lp)).sum()) if lp is not ref_lp else 0.0
                sc.add(w, -float(lp[rows, targets].sum()), max(kl, 0.0), int((lp.argmax(axis=1) == ref_top).sum()),
                       len(targets))
            if bar is not None:
                bar.update(len(targets))
    finally:
        if bar is not None:
            bar.close()
    return [sc.result(spans) for sc in scores]


# ---- what compare prints beside the scores ---------------------------------------------------------------------


def _rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 where it cannot be read)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _used_bytes(device: str) -> int:
    """Memory in use where ``device`` keeps weights: host RSS for the CPU, used VRAM (total - free) for CUDA."""
    from . import _C

    if str(device).startswith("cuda"):
        index = int(str(device).split(":")[1]) if ":" in str(device) else 0
        free, total = _C.cuda_mem_info(index)
        return int(total - free)
    return _rss_bytes()


def bits_of(model) -> dict:
    """bpw with and without the head, file size and weight bytes, as ``Model.info()`` counts them (EXL2: the average
    over the decoder's linears, format overhead included; dense models: the stored width of their linears)."""
    info = model.info()
    out = {"file_bytes": int(info.get("file_bytes") or 0), "weight_bytes": int(info.get("weight_bytes") or 0),
           "quantization": info.get("quantization")}
    if info.get("quantization") == "exl2":
        out["bpw"] = info["bpw_layers"]
        out["bpw_with_head"] = info["bpw_with_head"]
    else:
        rows = info.get("linears") or []
        numel = sum(r["in_features"] * r["out_features"] for r in rows)
        body = [r for r in rows if r["name"] != "lm_head"]
        nb = sum(r["in_features"] * r["out_features"] for r in body)
        out["bpw"] = sum(r["bits_per_weight"] * r["in_features"] * r["out_features"] for r in body) / nb if nb else None
        out["bpw_with_head"] = (sum(r["bits_per_weight"] * r["in_features"] * r["out_features"] for r in rows) / numel
                                if numel else None)
    return out


def speed(model, prompt_tokens: int = 2048, new_tokens: int = 128) -> dict:
    """Prefill tok/s (one prompt of ``prompt_tokens`` through the model, the last row's logits only) and decode tok/s
    (greedy, ``new_tokens`` after a 16-token prompt, the engine's decode path)."""
    n = max(16, min(prompt_tokens, model.max_seq_len - 1))
    ids = [(7 * i + 3) % model.vocab_size for i in range(n)]
    cache = model._cache_for(n)
    pages = cache.pool.alloc(-(-n // cache.page_size))
    try:
        model._step(cache, pages, ids[:16], 0, [15])  # warm-up
        t0 = time.perf_counter()
        for a in range(0, n, 2048):
            step = ids[a : a + 2048]
            model._step(cache, pages, step, a, [len(step) - 1])
        prefill = n / (time.perf_counter() - t0)
    finally:
        for p in pages:
            cache.pool.release(p)
    new = max(1, min(new_tokens, model.max_seq_len - 17))
    model.generate_ids(ids[:16], max_new_tokens=4, temperature=0.0)  # warm-up (graphs, engine)
    t0 = time.perf_counter()
    model.generate_ids(ids[:16], max_new_tokens=new, temperature=0.0)
    decode = new / (time.perf_counter() - t0)
    return {"prefill_tok_s": prefill, "decode_tok_s": decode}


def read_texts(paths: Sequence[str | os.PathLike] | None) -> str:
    """The texts to score, joined by blank lines (default: ``DEFAULT_TEXT``)."""
    if not paths:
        if not os.path.isfile(DEFAULT_TEXT):
            raise InvalidArgumentError(f"no text given and the default {DEFAULT_TEXT} is not here: pass --text FILE")
        paths = [DEFAULT_TEXT]
    parts = []
    for p in paths:
        try:
            parts.append(Path(p).read_bytes().decode("utf-8"))
        except OSError as exc:
            raise InvalidArgumentError(f"cannot read {p}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise InvalidArgumentError(f"{p} is not UTF-8 text ({exc})") from None
    return "\n\n".join(parts)


def compare(models: Sequence, reference=None, text: str | None = None, texts: Sequence[str] | None = None,
            ctx: int = 2048, device: str = "cpu", max_tokens: int | None = None, speed_test: bool | None = None,
            progress: bool = False) -> dict:
    """Compare quants of one model on the same tokens.

    Parameters
    ----------
    models
        Model folders (or loaded :class:`~exl2cpp.Model` objects), in the order the table lists them.
    reference
        The model KL and top-1 agreement are measured against (usually the fp16 source); default: the first model.
    text, texts
        The text to score, or files to read it from (default: ``DEFAULT_TEXT``).
    ctx
        Tokens per window (capped at every model's ``max_seq_len``).
    device
        Where to load folders: ``"cpu"``, ``"cuda"``, ``"cuda:N"``.
    max_tokens
        Score only the first N tokens of the text.
    speed_test
        Time prefill and decode (default: on CUDA only).

    Returns
    -------
    ``{"reference", "ctx", "tokens", "device", "models": [{"path", "bpw", "bpw_with_head", "ppl", "kl", "top1",
    "file_bytes", "memory_bytes", "worst_windows", ["prefill_tok_s", "decode_tok_s"]}, ...]}`` in the order given.
    """
    from .model import Model, load

    if not isinstance(ctx, int) or ctx < 2:
        raise InvalidArgumentError(f"ctx must be an integer >= 2, got {ctx!r}")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 2):
        raise InvalidArgumentError(f"max_tokens must be an integer >= 2, got {max_tokens!r}")
    if isinstance(models, (str, os.PathLike, Model)):
        models = [models]
    if not models:
        raise InvalidArgumentError("compare needs at least one model")
    if text is None:
        text = read_texts(texts)
    on_gpu = str(device).startswith("cuda")
    speed_test = on_gpu if speed_test is None else bool(speed_test)

    def open_model(m):
        if isinstance(m, Model):
            return m, None
        before = _used_bytes(device)
        loaded = load(m, device=device, max_seq_len=None)
        return loaded, max(0, _used_bytes(device) - before)

    ref_model, ref_mem = open_model(reference) if reference is not None else (None, None)
    loaded = [open_model(m) for m in models]
    first = ref_model if ref_model is not None else loaded[0][0]
    ids = first.tokenizer.encode(text)
    for m, _ in loaded:
        if m is not first and m.tokenizer.encode(text[:4096]) != first.tokenizer.encode(text[:4096]):
            raise InvalidArgumentError(f"{m.path} tokenizes the text differently from {first.path}: "
                                       "compare quants of one model (same tokenizer)")
    if max_tokens is not None:
        ids = ids[:max_tokens]
    results = score([m for m, _ in loaded], ids, ctx, reference=ref_model, progress=progress)
    rows = []
    for (m, mem), res in zip(loaded, results):
        row = {"path": str(m.path), **bits_of(m), **res, "memory_bytes": mem}
        if speed_test:
            row.update(speed(m, prompt_tokens=ctx))
        rows.append(row)
    return {"reference": str(ref_model.path) if ref_model is not None else str(loaded[0][0].path),
            "ctx": min([ctx] + [m.max_seq_len for m, _ in loaded]), "tokens": results[0]["tokens"],
            "device": str(device), "models": rows}


# ---- output ----------------------------------------------------------------------------------------------------


def _fmt_bytes(n) -> str:
    if n is None:
        return "-"
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def format_table(result: dict) -> str:
    """The side-by-side table ``exl2cpp compare`` prints: one column per model."""
    models = result["models"]
    names = [Path(m["path"]).name or m["path"] for m in models]

    def f(v, spec):
        return "-" if v is None else format(v, spec)

    lines = [
        ("bpw (layers)", [f(m["bpw"], ".3f") for m in models]),
        ("bpw (with head)", [f(m["bpw_with_head"], ".3f") for m in models]),
        ("perplexity", [f(m["ppl"], ".4f") for m in models]),
        ("KL to reference", [f(m["kl"], ".5f") for m in models]),
        ("top-1 agreement", [f(m["top1"] * 100, ".2f") + " %" for m in models]),
        ("file size", [_fmt_bytes(m["file_bytes"]) for m in models]),
        ("memory after load", [_fmt_bytes(m["memory_bytes"]) for m in models]),
    ]
    if any("prefill_tok_s" in m for m in models):
        lines.append(("prefill tok/s", [f(m.get("prefill_tok_s"), ".0f") for m in models]))
        lines.append(("decode tok/s", [f(m.get("decode_tok_s"), ".1f") for m in models]))
    lines.append(("worst window (KL)", [
        f"#{m['worst_windows'][0]['window']} {m['worst_windows'][0]['kl']:.4f}" if m["worst_windows"] else "-"
        for m in models]))
    width = max(len(k) for k, _ in lines)
    cols = [max(len(n), *(len(v[i]) for _, v in lines)) for i, n in enumerate(names)]
    out = [" " * width + "  " + "  ".join(n.rjust(c) for n, c in zip(names, cols))]
    out += [k.ljust(width) + "  " + "  ".join(x.rjust(c) for x, c in zip(v, cols)) for k, v in lines]
    mem = "host RSS" if not str(result.get("device", "cpu")).startswith("cuda") else "VRAM"
    out.append(f"({result['tokens']} tokens in windows of {result['ctx']}; reference {result['reference']}; "
               f"memory: {mem} growth at load)")
    return "\n".join(out)


def plot(result: dict, path: str | os.PathLike) -> None:
    """KL (and perplexity) against bpw, one point per model, into ``path`` (PNG). Needs matplotlib (the ``plot``
    extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UnsupportedError("--plot needs matplotlib: pip install 'exl2cpp[plot]'") from None
    pts = [m for m in result["models"] if m.get("bpw") is not None]
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    bpw = [m["bpw"] for m in pts]
    ax.plot(bpw, [m["kl"] for m in pts], "o-", color="tab:blue", label="KL to reference")
    ax.set_xlabel("bits per weight (decoder layers)")
    ax.set_ylabel("mean KL (nats/token)", color="tab:blue")
    ax.set_yscale("log" if all(m["kl"] > 0 for m in pts) else "linear")
    ax2 = ax.twinx()
    ax2.plot(bpw, [m["ppl"] for m in pts], "s--", color="tab:red", label="perplexity")
    ax2.set_ylabel("perplexity", color="tab:red")
    for m in pts:
        ax.annotate(Path(m["path"]).name, (m["bpw"], m["kl"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(str(path))
    plt.close(fig)
