"""Runs independent GPTQ jobs (the candidate configs of a layer, or q/k/v and gate/up) in worker processes.

GPTQ itself runs in C++ (``_C.gptq_quantize``, deterministic for any thread count); its NumPy preparation
(Cholesky, inverse) and the job overhead are serial, so processes scale it. Workers are spawned with one BLAS
and one exl2cpp thread each (OPENBLAS/OMP/MKL/EXL2CPP_NUM_THREADS=1 in their environment); every job always runs
in a worker when the pool is on, so a run and its --resume agree bit for bit. Jobs for a CUDA device run in this
process (convert() uses workers=1 there).
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

from . import gptq

_BLAS_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "EXL2CPP_NUM_THREADS")


def default_workers() -> int:
    return max(1, min(os.cpu_count() or 1, 16))


def _run(job):
    weight, prep, groups, *rest = job  # rest: [device[, permuted weight]]
    return gptq.quantize(weight, prep, groups, rest[0] if rest else "cpu", rest[1] if len(rest) > 1 else None)


class GPTQPool:
    """map(jobs) -> [QuantizedLinear] for jobs (weight [out, in] or None, gptq.Prepared, groups[, device[,
    gptq.permuted(weight, prep)]])."""

    def __init__(self, workers: int):
        self.workers = workers
        self._ex: ProcessPoolExecutor | None = None

    def _executor(self) -> ProcessPoolExecutor:
        if self._ex is None:
            saved = {k: os.environ.get(k) for k in _BLAS_ENV}
            os.environ.update({k: "1" for k in _BLAS_ENV})
            try:
                ctx = multiprocessing.get_context("spawn")
                self._ex = ProcessPoolExecutor(max_workers=self.workers, mp_context=ctx)
                # start every worker now, while the environment says one BLAS thread
                list(self._ex.map(_noop, range(self.workers)))
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        return self._ex

    def map(self, jobs: list) -> list:
        if self.workers <= 1:
            return [_run(j) for j in jobs]
        return list(self._executor().map(_run, jobs))

    def close(self) -> None:
        if self._ex is not None:
            self._ex.shutdown(wait=True, cancel_futures=True)
            self._ex = None

    def __enter__(self) -> GPTQPool:  # noqa: PYI034
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _noop(_):
    return os.getpid()
