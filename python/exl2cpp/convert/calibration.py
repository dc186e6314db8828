"""Calibration token rows for the converter: the default mix (no download) or the user's .txt / .jsonl / .parquet
files, cut into ``rows`` rows of ``length`` tokens, each starting with BOS when the model has one.

Default ("(default)"): a quarter of the rows is text the model writes itself (sampled from the unquantized model
on our runtime, seeded); the rest is split evenly between the license texts in /usr/share/common-licenses
(leaving out the GPL-3, the perplexity text of the quality bench), the running interpreter's Python documentation
(``pydoc_data/topics.py``: the language reference's English prose) and Python standard library source. A source
gets at most as many rows as its text fills without repeating (``_share``, estimated at 4 characters per token);
the rest goes to the others. Those files are read from the user's own system, never shipped. Without a tokenizer every row is model-generated.
"""

from __future__ import annotations

import ast
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


def python_docs() -> list[str]:
    """The Python documentation topics shipped with the interpreter (pydoc_data/topics.py), in key order."""
    f = Path(sysconfig.get_paths()["stdlib"]) / "pydoc_data" / "topics.py"
    if not f.is_file():
        return []
    try:
        tree = ast.parse(f.read_text(encoding="utf-8", errors="replace"))
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "topics" for t in node.targets):
                topics = ast.literal_eval(node.value)
                return [topics[k] for k in sorted(topics) if isinstance(topics[k], str)]
    except (SyntaxError, ValueError):
        pass
    return []


def default_texts() -> tuple[list[str], list[str], list[str], list[str]]:
    """(license docs, stdlib source docs, Python documentation docs, names used) for the default mix, whatever
    exists on this system."""
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
    docs = python_docs()
    if docs:
        names.append("python-docs/pydoc_data/topics.py")
    return lic, code, docs, names


def _share(n: int, avail: list[int], width: int) -> list[int]:
    """Split n rows over sources with avail[i] tokens: evenly, but a source takes at most the rows its text fills
    without repeating (at least one when it has text); the others take the rest (all of them when every source is
    full: the windows then overlap)."""
    cap = [0 if a == 0 else max(1, -(-a // width)) for a in avail]
    out = [0] * len(avail)
    left = n
    while left > 0:
        has = [i for i in range(len(avail)) if avail[i]]
        open_ = [i for i in has if out[i] < cap[i]] or has
        if not open_:
            break
        each = max(1, left // len(open_))
        for i in open_:
            k = min(each, left, max(cap[i] - out[i], 0) or left)
            out[i] += k
            left -= k
            if left == 0:
                break
    return out


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


def _tokens_for(tokenizer, docs: list[str], need: int) -> list[int]:
    """Tokens of k documents spread evenly over docs (in their order), the smallest k that gives at least `need`
    tokens (all of them when they give fewer): a short calibration does not tokenize every text."""
    m = len(docs)
    cache: dict[int, list[int]] = {}
    pick: list[int] = []
    for k in range(1, m + 1):
        pick = sorted({round(j * (m - 1) / (k - 1)) for j in range(k)}) if k > 1 else [0]
        for i in pick:
            if i not in cache:
                cache[i] = _tokens(tokenizer, [docs[i]])
        if sum(len(cache[i]) for i in pick) >= need:
            break
    return [t for i in pick for t in cache[i]]


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
            n_gen, n_lic, n_doc, n_code = rows, 0, 0, 0
            toks: list[list[int]] = []
            names: list[str] = []
        else:
            lic, code, doc, names = default_texts()
            n_gen = max(1, rows // 4)
            texts = (lic, doc, code)
            # rows per source from ~4 characters per token; then only as many documents are tokenized as fill them
            n_lic, n_doc, n_code = _share(rows - n_gen, [sum(map(len, t)) // 4 for t in texts], width)
            n_gen = rows - n_lic - n_doc - n_code
            toks = [_tokens_for(tokenizer, t, n * width) if n else [] for t, n in zip(texts, (n_lic, n_doc, n_code))]
        rows_list = []
        for n, kind in ((n_lic, 0), (n_doc, 1), (n_code, 2)):
            if n:
                rows_list += [head + b for b in _windows(toks[kind], n, width)]
        rows_list += generate_rows(model_dir, n_gen, length, bos, vocab, seed, progress, device)
        info["sources"] = {"model_generated": n_gen, "licenses": n_lic, "python_docs": n_doc, "python_stdlib": n_code}
        info["files"] = names
    ids = np.asarray(rows_list, dtype=np.int64)
    ids[(ids < 0) | (ids >= vocab)] = 0
    order = np.random.default_rng([seed, 104729]).permutation(rows)
    return ids[order].astype(np.int32), info
