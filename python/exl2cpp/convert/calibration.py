"""Calibration token rows for the converter: the default mix (no download) or the user's .txt / .jsonl / .parquet
files, cut into ``rows`` rows of ``length`` tokens, each starting with BOS when the model has one.

Default ("(default)"): a quarter of the rows is text the model writes itself (sampled from the unquantized model
on our runtime, seeded), a quarter is Python source from the running interpreter's standard library, the rest
is the license texts in /usr/share/common-licenses, leaving out the GPL-3 (the perplexity text of the quality
bench). Those files are read from the user's own system, never shipped. Without a tokenizer every row is
model-generated.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np

from ..errors import InvalidArgumentError, ModelFileError, UnsupportedError

LICENSES_DIR = Path("/usr/share/common-licenses")
LICENSES_EXCLUDED = {"GPL", "GPL-3"}  # the quality bench measures perplexity on GPL-3
STDLIB_FILES = ("argparse.py", "textwrap.py", "dataclasses.py", "functools.py", "fractions.py",
                "statistics.py", "json/decoder.py", "heapq.py", "shlex.py", "difflib.py", "calendar.py",
                "string.py")  # fmt: skip


def read_calibration_file(path: str | Path) -> list[str]:
    """Documents of a calibration file: .txt (whole file), .jsonl (the "text" field of each line), .parquet
    (the "text" column, else all string columns of a row joined by spaces; needs pyarrow)."""
    p = Path(path)
    if not p.is_file():
        raise ModelFileError(f"calibration file {p} does not exist")
    suffix = p.suffix.lower()
    if suffix in (".txt", ".text", ".md"):
        try:
            return [p.read_text(encoding="utf-8")]
        except UnicodeDecodeError as exc:
            raise InvalidArgumentError(f"calibration file {p} is not UTF-8 text ({exc})") from None
    if suffix in (".jsonl", ".ndjson"):
        docs = []
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidArgumentError(f"calibration file {p}, line {n}: invalid JSON ({exc})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise InvalidArgumentError(
                    f'calibration file {p}, line {n}: expected an object with a string "text" field'
                )
            docs.append(obj["text"])
        return docs
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise UnsupportedError(
                f"reading {p} needs pyarrow (pip install pyarrow), or pass the text as .txt / .jsonl"
            ) from None
        table = pq.read_table(p)
        if "text" in table.column_names:
            return [t for t in table.column("text").to_pylist() if isinstance(t, str)]
        cols = [c for c in table.column_names if str(table.schema.field(c).type) in ("string", "large_string")]
        if not cols:
            raise InvalidArgumentError(f"calibration file {p} has no string column")
        rows = zip(*(table.column(c).to_pylist() for c in cols))
        return [" ".join(v for v in r if isinstance(v, str)) for r in rows]
    raise InvalidArgumentError(
        f"calibration file {p}: unknown type {suffix or '(no suffix)'}; use .txt, .jsonl or .parquet"
    )


def default_texts() -> tuple[list[str], list[str], list[str]]:
    """(license docs, stdlib source docs, names used) for the default mix, whatever exists on this system."""
    names, lic, code, seen = [], [], [], set()
    if LICENSES_DIR.is_dir():
        for f in sorted(LICENSES_DIR.iterdir()):
            if f.name in LICENSES_EXCLUDED or not f.is_file():
                continue
            text = f.read_text(encoding="utf-8", errors="replace")
            if text in seen:
                continue
            seen.add(text)
            lic.append(text)
            names.append(f"licenses/{f.name}")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for rel in STDLIB_FILES:
        f = stdlib / rel
        if f.is_file():
            code.append(f.read_text(encoding="utf-8", errors="replace"))
            names.append(f"python-stdlib/{rel}")
    return lic, code, names


def _windows(tokens: list[int], n_rows: int, width: int) -> list[list[int]]:
    """n_rows windows of `width` tokens spread evenly over tokens (cycling when too short)."""
    if n_rows <= 0:
        return []
    if len(tokens) < width:
        reps = -(-width // max(1, len(tokens))) + 1
        tokens = (tokens * reps)[: max(width, len(tokens))]
    span = len(tokens) - width
    starts = [0] * n_rows if n_rows == 1 else [round(span * i / (n_rows - 1)) for i in range(n_rows)]
    return [tokens[s : s + width] for s in starts]


def _tokens(tokenizer, docs: list[str]) -> list[int]:
    ids: list[int] = []
    for d in docs:
        ids += tokenizer.encode(d, add_bos=False, special=False)
        ids += tokenizer.encode("\n\n", add_bos=False, special=False)
    return ids


def generate_rows(model_dir: Path, n_rows: int, length: int, bos: int | None, vocab: int, seed: int,
                  progress: bool, device: str = "cpu") -> list[list[int]]:  # fmt: skip
    """Text sampled from the unquantized model on our runtime on `device` (temperature 1, min-p 0.02), seeded per
    row."""
    import exl2cpp

    from .progress import bar

    if n_rows <= 0:
        return []
    from ..model import PAGE_SIZE

    model = exl2cpp.load(model_dir, max_seq_len=max(length, 16), device=device)
    per_seq = -(-length // PAGE_SIZE)
    cache = model._core.make_cache(n_rows * per_seq * PAGE_SIZE, PAGE_SIZE)
    pages = cache.pool.alloc(n_rows * per_seq)
    rngs = [np.random.default_rng([seed, 7919, r]) for r in range(n_rows)]
    rows = [[bos if bos is not None else int(g.integers(vocab))] for g in rngs]
    seqs = list(range(n_rows))
    try:
        with bar(total=length - 1, desc="calibration: model text", unit="tok", enable=progress) as pb:
            for pos in range(length - 1):
                logits = model._core.forward(cache, [r[-1] for r in rows], [pos] * n_rows, seqs, pages, per_seq,
                                             None)  # fmt: skip
                for r in range(n_rows):
                    lg = logits[r].astype(np.float64)
                    p = np.exp(lg - lg.max())
                    p[p < 0.02] = 0.0  # min-p relative to the top token
                    p /= p.sum()
                    rows[r].append(int(rngs[r].choice(len(p), p=p)))
                pb.update(1)
    finally:
        for pg in pages:
            cache.pool.release(pg)
    return rows


def build_calibration(model_dir: Path, files: list[str] | None, rows: int, length: int, seed: int, vocab: int,
                      bos: int | None, progress: bool = True, device: str = "cpu") -> tuple[np.ndarray, dict]:  # fmt: skip
    """Calibration ids int32 [rows, length] (rows shuffled with the seed) and the record for
    quantization_config["calibration"]."""
    if rows < 1 or length < 16:
        raise InvalidArgumentError(f"calibration needs rows >= 1 and length >= 16, got rows={rows}, length={length}")
    tokenizer = None
    try:
        from ..tokenizer import Tokenizer

        tokenizer = Tokenizer(model_dir)
    except ModelFileError:
        if files:
            raise ModelFileError(
                f"calibration files need the model's tokenizer, but {model_dir} has no tokenizer.json"
            ) from None
    head = [bos] if bos is not None else []
    width = length - len(head)
    info: dict = {"rows": rows, "length": length}
    if files:
        docs: list[str] = []
        for f in files:
            docs += read_calibration_file(f)
        toks = _tokens(tokenizer, docs)
        if len(toks) < width:
            raise InvalidArgumentError(
                f"calibration text has {len(toks)} tokens; it needs at least --length - 1 = {width}"
            )
        body = _windows(toks, rows, width)
        info["dataset"] = ", ".join(Path(f).name for f in files)
        info["tokens_available"] = len(toks)
        rows_list = [head + b for b in body]
    else:
        info["dataset"] = "(default)"
        if tokenizer is None:
            n_gen, n_code, n_lic = rows, 0, 0
            lic = code = []
            names: list[str] = []
        else:
            lic, code, names = default_texts()
            n_gen = max(1, rows // 4)
            n_code = rows // 4 if code else 0
            n_lic = rows - n_gen - n_code
            if not lic:
                n_gen, n_lic = n_gen + n_lic, 0
        rows_list = [head + b for b in _windows(_tokens(tokenizer, lic), n_lic, width)] if n_lic else []
        rows_list += [head + b for b in _windows(_tokens(tokenizer, code), n_code, width)] if n_code else []
        rows_list += generate_rows(model_dir, n_gen, length, bos, vocab, seed, progress, device)
        info["sources"] = {"model_generated": n_gen, "python_stdlib": n_code, "licenses": n_lic}
        info["files"] = names
    ids = np.asarray(rows_list, dtype=np.int64)
    ids[(ids < 0) | (ids >= vocab)] = 0
    order = np.random.default_rng([seed, 104729]).permutation(rows)
    return ids[order].astype(np.int32), info
