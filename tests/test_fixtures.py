"""One way to the shared fixtures: $EXL2CPP_FIXTURES, else ../shared/fixtures beside the checkout, and a skip that
names the variable."""

from __future__ import annotations

from pathlib import Path

import conftest
import conftest_exl2
import pytest


def test_the_variable_names_the_fixtures_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("EXL2CPP_FIXTURES", str(tmp_path))
    assert conftest.fixtures_root() == tmp_path
    assert conftest_exl2.fixture_dir() is None  # no exl2-smol4 there
    (tmp_path / "exl2-smol4").mkdir()
    (tmp_path / "exl2-smol4" / "fx_q40.safetensors").write_bytes(b"")
    assert conftest_exl2.fixture_dir() == tmp_path / "exl2-smol4"
    monkeypatch.delenv("EXL2CPP_FIXTURES")
    assert conftest.fixtures_root() == Path(conftest.__file__).resolve().parent.parent.parent / "shared" / "fixtures"


def test_a_missing_folder_skips_naming_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("EXL2CPP_FIXTURES", str(tmp_path / "nowhere"))
    with pytest.raises(pytest.skip.Exception) as exc:
        conftest_exl2.require_fixtures()
    msg = str(exc.value)
    assert str(tmp_path / "nowhere" / "exl2-smol4") in msg and "EXL2CPP_FIXTURES" in msg
    monkeypatch.delenv("EXL2CPP_FIXTURES")
    assert "../shared/fixtures" in conftest.missing_fixtures(Path("x"))
