"""Processes end cleanly whatever ends them: the engine's stepping thread stops and joins at interpreter exit (a
closed stdout pipe, Ctrl-C while `run` or `chat` streams, a script leaving with a job running) instead of aborting
with "terminate called without an active exception", and an abandoned stream cancels its job. Each case runs in a
child process on the real SmolLM2, several times, since the abort was a race with the thread's step."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import exl2cpp
import pytest

PKG_PARENT = str(Path(exl2cpp.__file__).resolve().parent.parent)  # children import this same exl2cpp
PROMPT = "Tell me a very long story about a dragon who learns to read."
REPEATS = 4
ABORT_SIGNS = ("terminate called", "Fatal Python error", "Traceback", "Exception ignored")


def child_env() -> dict:
    return dict(os.environ, PYTHONPATH=PKG_PARENT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def cli(*args: str, **popen) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "exl2cpp", *args]
    return subprocess.Popen(cmd, env=child_env(), stderr=subprocess.PIPE, **popen)


def read_some(stream, n: int, timeout: float = 120) -> bytes:
    """Read n bytes from a child's stdout (the generation is running once they came)."""
    deadline = time.monotonic() + timeout
    got = b""
    while len(got) < n and time.monotonic() < deadline:
        chunk = os.read(stream.fileno(), n - len(got))
        if not chunk:
            break
        got += chunk
    return got


def finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"{proc.args} did not exit within {timeout} s")
    return proc.returncode, err.decode(errors="replace")


def assert_clean(rc: int, err: str, want_rc: int) -> None:
    assert rc != -signal.SIGABRT and rc != 134, err
    assert rc == want_rc, err
    assert not any(s in err for s in ABORT_SIGNS), err


@pytest.mark.parametrize("attempt", range(REPEATS))
def test_run_into_closed_pipe(smollm2_dir, attempt):
    """`exl2cpp run ... | head -c 80`: stdout closes mid-generation; the process exits 0 quietly."""
    proc = cli("run", str(smollm2_dir), PROMPT, "-n", "2000", stdout=subprocess.PIPE)
    assert len(read_some(proc.stdout, 80)) == 80
    proc.stdout.close()  # what `head` does once it has its bytes
    assert_clean(*finish(proc), want_rc=0)


@pytest.mark.parametrize("attempt", range(REPEATS))
def test_ctrl_c_while_run_streams(smollm2_dir, attempt):
    proc = cli("run", str(smollm2_dir), PROMPT, "-n", "2000", stdout=subprocess.PIPE)
    assert read_some(proc.stdout, 20)
    proc.send_signal(signal.SIGINT)
    assert_clean(*finish(proc), want_rc=130)


@pytest.mark.parametrize("attempt", range(REPEATS))
def test_ctrl_c_while_chat_streams(smollm2_dir, attempt):
    proc = cli("chat", str(smollm2_dir), "-n", "2000", stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    proc.stdin.write(PROMPT.encode() + b"\n")
    proc.stdin.flush()  # stdin stays open: chat would read the next turn after this reply
    assert read_some(proc.stdout, 20)
    proc.send_signal(signal.SIGINT)
    assert_clean(*finish(proc), want_rc=130)


SCRIPTS = {
    # leave a stream early, then let the interpreter exit (the job is cancelled but its step still runs)
    "break_out_of_stream": """
        for i, chunk in enumerate(model.stream(PROMPT, max_new_tokens=2000, ignore_eos=True)):
            if i == 5:
                break
    """,
    # exit with a job running that nobody cancelled
    "exit_with_job_running": """
        job = model.engine().submit(PROMPT, max_new_tokens=2000, ignore_eos=True)
        next(iter(job))
    """,
    # a stream left suspended in a global: the interpreter exits with its job running
    "exit_with_stream_suspended": """
        stream = model.stream(PROMPT, max_new_tokens=2000, ignore_eos=True)
        next(stream)
    """,
    # two engines on one model, both busy
    "exit_with_two_engines_busy": """
        jobs = [exl2cpp.Engine(model, cache_tokens=4096).submit(PROMPT, max_new_tokens=2000, ignore_eos=True)
                for _ in range(2)]
        for job in jobs:
            next(iter(job))
    """,
}


@pytest.mark.parametrize("attempt", range(REPEATS))
@pytest.mark.parametrize("case", sorted(SCRIPTS))
def test_python_exits_cleanly_with_generation_running(smollm2_dir, case, attempt):
    code = f"import exl2cpp\nPROMPT = {PROMPT!r}\nmodel = exl2cpp.load({str(smollm2_dir)!r})\n"
    code += textwrap.dedent(SCRIPTS[case]) + "print('leaving', flush=True)\n"
    r = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=120,
                       check=False)  # fmt: skip
    assert r.stdout.strip() == "leaving", r.stderr
    assert_clean(r.returncode, r.stderr, want_rc=0)


def test_abandoned_stream_cancels_its_job(smollm2_dir):
    model = exl2cpp.load(smollm2_dir, max_seq_len=4096)
    engine = model.engine(cache_tokens=4096)
    stream = model.stream(PROMPT, max_new_tokens=2000, ignore_eos=True)
    next(stream)
    (job,) = engine._jobs.values()
    del stream  # garbage-collected mid-stream: nobody will read the rest
    gc.collect()
    assert job.wait(30), "the abandoned stream's job kept running"
    assert job.finish_reason == "cancelled" and len(job.token_ids) < 2000
    assert engine.stats()["jobs_active"] == 0
    engine.close()
