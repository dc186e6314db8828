"""exl2cpp: fast EXL2 quantized LLM inference, a torch-free C++/CUDA runtime with a small Python API.

    >>> import exl2cpp
    >>> model = exl2cpp.load("smollm2")          # or a folder with config.json + *.safetensors
    >>> print(model.generate("The capital of France is", max_new_tokens=16))
"""

from __future__ import annotations

from .errors import (
    CudaError,
    Exl2Error,
    InternalError,
    InvalidArgumentError,
    ModelFileError,
    ModelFormatError,
    OutOfMemoryError,
    UnsupportedError,
)

__version__ = "0.1.0"

from . import options  # noqa: E402
from .budget import fit  # noqa: E402
from .engine import Engine, Job  # noqa: E402
from .model import Model, load  # noqa: E402
from .quality import compare  # noqa: E402

__all__ = [
    "__version__",
    "Engine",
    "Job",
    "Model",
    "load",
    "compare",
    "fit",
    "options",
    "CudaError",
    "Exl2Error",
    "InternalError",
    "InvalidArgumentError",
    "ModelFileError",
    "ModelFormatError",
    "OutOfMemoryError",
    "UnsupportedError",
]
