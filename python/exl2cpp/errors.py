"""Exceptions raised by exl2cpp. All are ``ValueError`` subclasses so callers can catch bad input broadly."""

from __future__ import annotations


class Exl2Error(ValueError):
    """Base class of every error exl2cpp raises on purpose."""


class InvalidArgumentError(Exl2Error):
    """A bad argument: a shape, a dtype, a sampling setting, a token id out of range..."""


class ModelFormatError(Exl2Error):
    """A model file is malformed or inconsistent (safetensors, config.json, EXL2 tensors, GGUF)."""


class ModelFileError(ModelFormatError, OSError):
    """A model file is missing, unreadable or truncated."""


class UnsupportedError(Exl2Error):
    """Well-formed input that exl2cpp does not handle (architecture, dtype, bit width...)."""


class CudaError(Exl2Error):
    """A CUDA runtime or cuBLAS call failed."""


class OutOfMemoryError(Exl2Error, MemoryError):
    """Host or device memory ran out; the message carries the numbers."""


def retry_after_collect(make):
    """``make()``, once more after a garbage collection if it ran out of memory: a model or engine that the caller
    dropped can still hold device memory inside a reference cycle until the collector runs (e.g. a notebook that
    loads a second model over the first). No second try when the collection found nothing to free."""
    import gc

    try:
        return make()
    except MemoryError:
        if not gc.collect():
            raise
    return make()


class InternalError(Exl2Error, RuntimeError):
    """A broken invariant inside exl2cpp (a bug: please report it with the message)."""


__all__ = [
    "Exl2Error",
    "InvalidArgumentError",
    "ModelFormatError",
    "ModelFileError",
    "UnsupportedError",
    "CudaError",
    "OutOfMemoryError",
    "InternalError",
]
