"""Runs independent GPTQ jobs (the candidate configs of a layer, or q/k/v and gate/up) in worker processes.

GPTQ itself runs in C++ (``_C.gptq_quantize``, deterministic for any thread count); its NumPy preparation
(Cholesky, inverse) and the job overhead are serial, so processes scale it. Workers are spawned with one BLAS
and one exl2cpp thread each (OPENBLAS/OMP/MKL/EXL2CPP_NUM_THREADS=1 in their environment); every job always runs
in a worker when the pool is on, so a run and its --resume agree bit for bit. Jobs for a CUDA device run in this
process (convert() uses workers=1 there).

Each worker has a pipe of its own and this process hands it one job at a time; there is no helper thread here, so
a pool left by an exception (KeyboardInterrupt, the CLI's SIGTERM) kills its workers, closes the pipes and returns
at once, whatever the workers were doing (a worker killed halfway through sending a result cannot leave anything
here waiting for the rest of it).

Workers end with this process whatever ends it: on Linux the kernel kills them when it dies (PR_SET_PDEATHSIG,
set first thing in each worker), and everywhere a thread in each worker waits on the pipe that multiprocessing
keeps from the parent and exits when it closes (which also covers a parent that died before prctl ran).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import traceback
from multiprocessing.connection import Connection, wait

from . import gptq

_BLAS_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "EXL2CPP_NUM_THREADS")


def default_workers() -> int:
    return max(1, min(os.cpu_count() or 1, 16))


def _run(job):
    weight, prep, groups, *rest = job  # rest: [device[, permuted weight]]
    return gptq.quantize(weight, prep, groups, rest[0] if rest else "cpu", rest[1] if len(rest) > 1 else None)


class WorkerError(RuntimeError):
    """A GPTQ worker process died, or raised an exception that could not be sent back as itself."""


class GPTQPool:
    """map(jobs) -> [QuantizedLinear] for jobs (weight [out, in] or None, gptq.Prepared, groups[, device[,
    gptq.permuted(weight, prep)]])."""

    def __init__(self, workers: int):
        self.workers = workers
        self._procs: list[tuple[multiprocessing.process.BaseProcess, Connection]] = []

    def _start(self) -> None:
        if self._procs:
            return
        saved = {k: os.environ.get(k) for k in _BLAS_ENV}
        os.environ.update({k: "1" for k in _BLAS_ENV})  # the spawned workers inherit one BLAS thread
        try:
            ctx = multiprocessing.get_context("spawn")
            for _ in range(self.workers):
                here, there = ctx.Pipe(duplex=True)
                proc = ctx.Process(target=_worker_main, args=(there, os.getpid()), daemon=True,
                                   name="exl2cpp-gptq")  # fmt: skip
                self._procs.append((proc, here))
                proc.start()
                there.close()
        except BaseException:
            self.close(kill=True)
            raise
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def map(self, jobs: list) -> list:
        if self.workers <= 1:
            return [_run(j) for j in jobs]
        self._start()
        try:
            return self._map(jobs)
        except BaseException:
            self.close(kill=True)  # answers to the jobs still out must not reach a later map
            raise

    def _map(self, jobs: list) -> list:
        results: list = [None] * len(jobs)
        todo = iter(enumerate(jobs))
        busy: dict[Connection, tuple[int, multiprocessing.process.BaseProcess]] = {}

        def hand_out(proc, conn) -> None:
            nxt = next(todo, None)
            if nxt is not None:
                try:
                    conn.send(nxt[1])
                except OSError:
                    raise WorkerError(f"a GPTQ worker (pid {proc.pid}) died with exit code {proc.exitcode}") from None
                busy[conn] = (nxt[0], proc)

        for proc, conn in self._procs:
            hand_out(proc, conn)
        while busy:
            ready = set(wait([*busy, *(proc.sentinel for _, proc in busy.values())]))
            for conn in [c for c in busy if c in ready]:
                index, proc = busy.pop(conn)
                try:
                    ok, value = conn.recv()
                except EOFError:
                    raise WorkerError(f"a GPTQ worker (pid {proc.pid}) ended without an answer") from None
                if not ok:
                    raise value
                results[index] = value
                hand_out(proc, conn)
            for conn, (_, proc) in busy.items():
                if proc.sentinel in ready and not conn.poll():  # dead, and no answer left in its pipe
                    raise WorkerError(f"a GPTQ worker (pid {proc.pid}) died with exit code {proc.exitcode}"
                                      " (out of memory?)")  # fmt: skip
        return results

    def close(self, kill: bool = False) -> None:
        """Stop the workers: once idle (they end when their pipe closes), or at once with kill=True (their results
        are not wanted). Never waits on a worker that does not end by itself."""
        procs, self._procs = self._procs, []
        if kill:
            for proc, _ in procs:
                if proc.is_alive():
                    proc.kill()
        for _, conn in procs:
            conn.close()
        for proc, _ in procs:
            proc.join(timeout=None if kill else 10)
            if proc.is_alive():
                proc.kill()
                proc.join()

    def __enter__(self) -> GPTQPool:  # noqa: PYI034
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(kill=exc_type is not None)


def _worker_main(conn: Connection, parent_pid: int) -> None:
    """A worker: one job at a time from its pipe, answered (True, result) or (False, exception); ends when the pipe
    closes."""
    _worker_init(parent_pid)
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        try:
            answer = (True, _run(job))
        except Exception as exc:  # noqa: BLE001 - handed to the parent, which raises it
            answer = (False, exc)
        try:
            conn.send(answer)
        except (EOFError, OSError):
            return
        except Exception:  # noqa: BLE001 - an exception that does not pickle goes back as text
            conn.send((False, WorkerError(traceback.format_exc())))


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
