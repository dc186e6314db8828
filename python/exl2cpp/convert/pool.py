"""Runs independent GPTQ jobs (the candidate configs of a layer, or q/k/v and gate/up) in worker processes.

GPTQ itself runs in C++ (``_C.gptq_quantize``, deterministic for any thread count); its NumPy preparation
(Cholesky, inverse) and the job overhead are serial, so processes scale it. Workers are spawned with one BLAS
and one exl2cpp thread each (OPENBLAS/OMP/MKL/EXL2CPP_NUM_THREADS=1 in their environment); every job always runs
in a worker when the pool is on, so a run and its --resume agree bit for bit. Jobs for a CUDA device run in this
process (convert() uses workers=1 there).

Workers end with this process whatever ends it: on Linux the kernel kills them when it dies (PR_SET_PDEATHSIG,
set in the worker initializer), and everywhere a thread in each worker waits on the pipe that multiprocessing
keeps from the parent and exits when it closes (which also covers a parent that died before prctl ran). A pool
left by an exception (KeyboardInterrupt, the CLI's SIGTERM) kills its workers instead of waiting for their jobs.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
from concurrent.futures import ProcessPoolExecutor
from multiprocessing.connection import wait

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
                self._ex = ProcessPoolExecutor(max_workers=self.workers, mp_context=ctx,
                                               initializer=_worker_init, initargs=(os.getpid(),))
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

    def close(self, kill: bool = False) -> None:
        """Stop the workers: after their current jobs, or at once with kill=True (their results are not wanted)."""
        if self._ex is None:
            return
        if kill:
            # Every worker, or none: one killed while it holds the job queue's lock leaves the others blocked on it
            # and the executor waiting for them (Python < 3.12 does not terminate them itself). The executor's own
            # table is the only complete list of its workers. Jobs still queued for the dead workers would keep the
            # queue's feeder thread writing into a full pipe, and the executor joining it: that join is dropped.
            for proc in list(getattr(self._ex, "_processes", {}).values()):
                if proc.is_alive():
                    proc.kill()
            call_queue = getattr(self._ex, "_call_queue", None)
            if call_queue is not None:
                call_queue.cancel_join_thread()
        self._ex.shutdown(wait=True, cancel_futures=True)
        self._ex = None

    def __enter__(self) -> GPTQPool:  # noqa: PYI034
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(kill=exc_type is not None)


def _noop(_):
    return os.getpid()


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _worker_init(parent_pid: int) -> None:
    """Runs first in every worker: tie its life to the parent's (see the module docstring)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent ends the workers
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the pipe watch below still ends the worker
    if os.getppid() != parent_pid:  # the parent died before prctl: nobody will send the signal
        os._exit(1)
    parent = multiprocessing.parent_process()
    if parent is not None and parent.sentinel is not None:
        threading.Thread(target=_exit_when_closed, args=(parent.sentinel,), daemon=True,
                         name="exl2cpp-parent-watch").start()  # fmt: skip


def _exit_when_closed(sentinel: int) -> None:
    wait([sentinel])  # readable (end of file) once the parent is gone; it never writes to it
    os._exit(1)
