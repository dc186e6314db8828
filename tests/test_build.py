"""What the installed build contains: in CI (CI=true) with nvcc on the PATH, the CUDA backend must have compiled."""

from __future__ import annotations

import os
import shutil

import pytest

from exl2cpp import _C


@pytest.mark.skipif(not (os.environ.get("CI") and shutil.which("nvcc")), reason="only checked in CI with nvcc")
def test_cuda_backend_compiled_in_ci():
    assert _C.cuda_compiled(), "nvcc is on the PATH but the CUDA backend was not built (see .ci/run, EXL2_CUBLAS_ROOT)"


@pytest.mark.cuda
@pytest.mark.skipif(not _C.cuda_compiled(), reason="this build has no CUDA backend")
def test_a_cuda_build_has_no_missing_reason():
    assert _C.cuda_missing_reason() == ""
    _C.require_cuda_backend("anything")  # a no-op here


def test_cuda_queries_never_raise_without_gpu():
    n = _C.cuda_device_count()
    assert isinstance(n, int) and n >= 0


needs_cpu_build = pytest.mark.skipif(_C.cuda_compiled(), reason="this build has the CUDA backend")
KNOWN_REASONS = ("it was configured with EXL2_CUDA=OFF", "no CUDA compiler (nvcc) was found when it was built",
                 "nvcc was found but cuBLAS was not when it was built")  # fmt: skip


def assert_names_the_build(message: str) -> None:
    assert "this build of exl2cpp has no CUDA backend" in message, message
    assert _C.cuda_missing_reason() in message and "EXL2_CUBLAS_ROOT" in message and "nvidia-cublas" in message
    assert "visible" not in message, message  # not blamed on the GPUs


@needs_cpu_build
def test_a_cpu_build_says_why_it_has_no_cuda(smollm2_dir):
    """Asking a build without the CUDA backend for a GPU names the reason recorded at build time and how to
    rebuild, for every way of asking (not "0 CUDA device(s) are visible")."""
    import exl2cpp
    from exl2cpp.convert import _resolve_device

    assert _C.cuda_missing_reason() in KNOWN_REASONS
    for kw in ({"device": "cuda"}, {"device": "cuda:1"}, {"device": "cuda", "gpu_split": "auto"},
               {"device": "cuda", "tensor_parallel": True}):  # fmt: skip
        with pytest.raises(exl2cpp.UnsupportedError) as exc:
            exl2cpp.load(smollm2_dir, **kw)
        assert_names_the_build(str(exc.value))
    with pytest.raises(exl2cpp.UnsupportedError) as exc:
        _resolve_device("cuda")
    assert_names_the_build(str(exc.value))


@needs_cpu_build
def test_the_cli_says_it_too(smollm2_dir, capsys):
    from exl2cpp import cli

    assert cli.main(["run", "--device", "cuda", str(smollm2_dir), "hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("exl2cpp: error: device cuda:0: this build") and err.count("\n") == 1
    assert_names_the_build(err)


@pytest.mark.skipif(not shutil.which("cmake"), reason="cmake is not on the PATH")
def test_cmake_records_the_reason_for_the_stub(tmp_path):
    """The configure step passes its reason to device_stub.cpp only (a changed reason rebuilds one file)."""
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    r = subprocess.run(["cmake", "-S", str(repo), "-B", str(tmp_path), "-G", "Ninja", "-DEXL2_CUDA=OFF",
                        "-DEXL2_BUILD_EXAMPLES=OFF", "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON"],
                       capture_output=True, text=True, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr
    import json

    commands = json.loads((tmp_path / "compile_commands.json").read_text())
    with_reason = [c["file"] for c in commands if "EXL2_NO_CUDA_REASON" in c["command"]]
    assert [Path(f).name for f in with_reason] == ["device_stub.cpp"]
    (cmd,) = [c["command"] for c in commands if c["file"].endswith("device_stub.cpp")]
    assert "EXL2_CUDA=OFF" in cmd
