"""What the installed build contains: in CI (CI=true) with nvcc on the PATH, the CUDA backend must have compiled."""

from __future__ import annotations

import os
import shutil

import pytest

from exl2cpp import _C


@pytest.mark.skipif(not (os.environ.get("CI") and shutil.which("nvcc")), reason="only checked in CI with nvcc")
def test_cuda_backend_compiled_in_ci():
    assert _C.cuda_compiled(), "nvcc is on the PATH but the CUDA backend was not built (see .ci/run, EXL2_CUBLAS_ROOT)"


def test_cuda_queries_never_raise_without_gpu():
    n = _C.cuda_device_count()
    assert isinstance(n, int) and n >= 0
