"""Transport and operations of `exl2cpp serve` (SmolLM2 on CPU, real server processes): request-body limits, slow and
idle connections, connection cap, admin-load bounds and rollback, what /health and the logs reveal, streams the
server ends itself (unload, reload, SIGTERM drain) and a command-line model that cannot load."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from test_server import ADMIN, KEY, PKG_PARENT, H, ServerProc, free_port
from test_server import _err as err

MSG = [{"role": "user", "content": "What is the capital of France?"}]
LONG = {"messages": MSG, "max_tokens": 3000, "ignore_eos": True, "stream": True}
# the fixture server's max_body_size and its header/body/keep-alive timeouts
BODY_LIMIT, TIMEOUT = 65536, 2


def flags(**kw) -> list[str]:
    """--name value pairs from name=value keywords."""
    return [str(x) for k, v in kw.items() for x in ("--" + k.replace("_", "-"), v)]


@pytest.fixture(scope="module")
def server(smollm2_dir):
    srv = ServerProc(
        smollm2_dir,
        *flags(
            api_key=KEY,
            admin_key=ADMIN,
            cache_tokens=8192,
            model_name="smollm2",
            max_body_size=BODY_LIMIT,
            timeout_header=TIMEOUT,
            timeout_body=TIMEOUT,
            timeout_keep_alive=TIMEOUT,
            max_connections=24,
        ),
    )
    yield srv
    srv.stop()


def assert_alive(srv) -> None:
    """The process is up, /health says ready and a normal chat request works."""
    assert srv.proc.poll() is None, f"server died ({srv.proc.returncode}):\n{srv.logs()[-3000:]}"
    assert httpx.get(srv.url + "/health", timeout=10).json() == {"status": "ready"}
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        headers=H(),
        json={"messages": MSG, "max_tokens": 2, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def raw(srv, data: bytes = b"") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    if data:
        s.sendall(data)
    return s


def read_all(s: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when (seconds from now)."""
    t0, out = time.monotonic(), b""
    s.settimeout(timeout)
    try:
        while True:
            d = s.recv(65536)
            if not d:
                break
            out += d
    except ConnectionResetError:
        pass
    return out, time.monotonic() - t0


class Stream:
    """A streaming request read on a thread: its SSE data lines, and a flag once the first content arrived."""

    def __init__(self, srv, body: dict, path: str = "/v1/chat/completions"):
        self.lines: list[str] = []
        self.started = threading.Event()
        self.status = None
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._run, args=(srv, path, body), daemon=True)
        self.thread.start()

    def _run(self, srv, path, body):
        try:
            with httpx.stream("POST", srv.url + path, headers=H(), json=body, timeout=120) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.lines.append(line[6:])
                        if line != "data: [DONE]" and any(
                            (c.get("delta") or {}).get("content") or c.get("text")
                            for c in json.loads(line[6:]).get("choices", [])
                        ):
                            self.started.set()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        self.started.set()

    def join(self, timeout=60) -> list[str]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream did not end"
        assert self.error is None, self.error
        return self.lines

    def wait_started(self, timeout=60) -> None:
        assert self.started.wait(timeout), "no content arrived"
        assert self.error is None, self.error


def assert_cut(lines: list[str], code: str) -> None:
    """The stream ended with finish_reason "abort" and then an error event with `code` (no [DONE])."""
    assert lines and lines[-1] != "[DONE]", lines[-3:]
    last = json.loads(lines[-1])
    assert last["error"]["code"] == code and last["error"]["type"] == "server_error", last
    finishes = [c["finish_reason"] for x in lines[:-1] for c in json.loads(x).get("choices", [])]
    assert "abort" in finishes and "stop" not in finishes and "length" not in finishes, finishes


# ---- bodies ------------------------------------------------------------------------------------------------------


def test_body_over_the_limit_is_413_before_parsing(server):
    big = json.dumps({"messages": [{"role": "user", "content": "a" * BODY_LIMIT}]}).encode()
    e = err(
        httpx.post(server.url + "/v1/chat/completions", headers=H(), content=big, timeout=30),
        413,
        str(BODY_LIMIT),
        "max_body_size",
    )
    assert e["type"] == "invalid_request_error" and e["code"] == "request_too_large"

    def chunks():  # no Content-Length: chunked transfer encoding, counted as it arrives
        for _ in range(8):
            yield b"x" * (BODY_LIMIT // 4)

    r = httpx.post(server.url + "/v1/completions", headers=H(), content=chunks(), timeout=30)
    err(r, 413, "max_body_size")
    # a Content-Length far over the limit is refused from the header, without waiting for the body
    s = raw(
        server,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 40000000\r\n\r\n",
    )
    out, took = read_all(s, 10)
    s.close()
    assert out.startswith(b"HTTP/1.1 413") and b"request_too_large" in out and took < 2, (out, took)
    assert_alive(server)


def test_big_bodies_keep_memory_and_health(server):
    """Bodies of 40 MB do not grow the server or stall /health (they are cut off at the limit)."""
    pid = server.proc.pid
    before = rss_mib(pid)
    slowest = 0.0
    for _ in range(3):
        s = raw(
            server,
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
        )
        piece = b"%x\r\n%s\r\n" % (1 << 20, b"a" * (1 << 20))
        try:
            for _ in range(40):
                s.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered 413 and closed the connection
        t = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        slowest = max(slowest, time.monotonic() - t)
        s.close()
    grown = rss_mib(pid) - before
    assert grown < 64, f"RSS grew by {grown:.0f} MiB"
    assert slowest < 1.0, slowest
    assert_alive(server)


# ---- slow and idle connections -------------------------------------------------------------------------------------


def test_slow_and_idle_connections_are_closed(server):
    socks = {
        "idle": [raw(server) for _ in range(4)],
        "headers": [
            raw(server, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n") for _ in range(4)
        ],
        "body": [
            raw(
                server,
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 1000\r\n\r\n{"messages": ',
            )
            for _ in range(4)
        ],
    }
    # a normal request is answered meanwhile
    r = httpx.post(
        server.url + "/v1/completions",
        headers=H(),
        json={"prompt": "Hi", "max_tokens": 1},
        timeout=30,
    )
    assert r.status_code == 200
    for kind, group in socks.items():
        for s in group:
            out, took = read_all(s, TIMEOUT + 8)
            s.close()
            assert took < TIMEOUT + 6, f"{kind}: still open after {took:.1f} s"
            if kind == "body":  # the request had started: it gets an answer
                assert out.startswith(b"HTTP/1.1 408") and b"timeout_body" in out, out
    # keep-alive: an idle connection after a response is closed after timeout_keep_alive
    s = raw(server, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    out, took = read_all(s, TIMEOUT + 8)
    s.close()
    assert out.startswith(b"HTTP/1.1 200") and took < TIMEOUT + 6
    assert_alive(server)


def test_connection_cap(server):
    held = [raw(server) for _ in range(24)]
    time.sleep(0.3)
    extra = raw(server)
    out, took = read_all(extra, 5)
    extra.close()
    assert out.startswith(b"HTTP/1.1 503") and b"max_connections" in out and took < 2, out
    for s in held:
        s.close()
    time.sleep(0.5)
    assert_alive(server)


# ---- admin load: bounds and rollback -------------------------------------------------------------------------------


def admin_load(srv, **body) -> httpx.Response:
    return httpx.post(srv.url + "/admin/load", headers=H(ADMIN), json=body, timeout=180)


def test_admin_load_bounds(server, smollm2_dir):
    for field, value in (("cache_tokens", 10**15), ("cache_tokens", 2**40), ("max_seq_len", 2**40)):
        t = time.monotonic()
        e = err(admin_load(server, model=str(smollm2_dir), **{field: value}), 400, field)
        assert e["param"] == field and time.monotonic() - t < 5
        assert_alive(server)
    # within the bound but more than this machine has: refused, and the old model still serves
    e = err(admin_load(server, model=str(smollm2_dir), cache_tokens=2**31 - 1), 400, "memory")
    assert e["param"] == "cache_tokens"
    assert_alive(server)


def vm_size_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) // 1024 for ln in f if ln.startswith("VmSize:"))


@pytest.mark.slow
def test_admin_load_when_two_models_do_not_fit(server, smollm2_dir):
    """Address space capped (RLIMIT_AS) so that a second model does not fit beside the first: the old one is freed
    first; when the new one then fails too, the old one is loaded again and serves."""
    import resource

    pid, unlimited = server.proc.pid, (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
    model = str(smollm2_dir)
    # (room in MiB above the process's size now, cache_tokens, 200 expected): 32768 tokens are 1.5 GiB of fp32 KV
    for room, tokens, fits in ((1500, 32768, True), (600, 65536, False)):
        resource.prlimit(pid, resource.RLIMIT_AS, ((vm_size_mib(pid) + room) << 20, unlimited[1]))
        try:
            r = admin_load(server, model=model, model_name="smollm2", cache_tokens=tokens)
        finally:
            resource.prlimit(pid, resource.RLIMIT_AS, unlimited)
        if fits:
            assert r.status_code == 200, r.text
        else:
            e = err(r, 400, "memory", "still serving 'smollm2'")
            assert e["param"] == "cache_tokens"
        assert_alive(server)
    assert (
        server.logs().count("no room to load") == 2
    )  # both went through unloading the old model first
    r = admin_load(server, model=model, model_name="smollm2", cache_tokens=8192)
    assert r.status_code == 200, r.text
    st = httpx.get(server.url + "/admin/stats", headers=H(ADMIN), timeout=10).json()
    assert st["engine"]["pages_total"] * 256 == 8192


def test_failed_load_keeps_the_old_model(server, tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n" * 4)
    for bad in ("/no/such/folder", str(fake), "/etc/passwd"):
        e = err(admin_load(server, model=bad), 400, bad, "still serving 'smollm2'")
        assert e["param"] == "model"
        h = httpx.get(server.url + "/health", timeout=10)
        assert h.status_code == 200 and h.json() == {"status": "ready"}, h.text
        assert_alive(server)
    st = httpx.get(server.url + "/admin/stats", headers=H(ADMIN), timeout=10).json()
    assert "/etc/passwd" in st["last_load_error"]  # details for the admin


def test_health_never_shows_load_errors(server, smollm2_dir, tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n" * 4)
    assert httpx.post(server.url + "/admin/unload", headers=H(ADMIN), timeout=30).status_code == 200
    try:
        err(admin_load(server, model=str(fake)), 400, str(fake))
        h = httpx.get(server.url + "/health", timeout=10)
        assert h.status_code == 503 and h.json() == {"status": "error"}, h.text
        st = httpx.get(server.url + "/admin/stats", headers=H(ADMIN), timeout=10).json()
        assert str(fake) in st["last_load_error"]
    finally:
        r = admin_load(server, model=str(smollm2_dir), model_name="smollm2", cache_tokens=8192)
        assert r.status_code == 200, r.text
    assert_alive(server)


# ---- logs ----------------------------------------------------------------------------------------------------------


def test_access_log_redacts_query_credentials_and_ignores_forwarded_for(server):
    secret = "sk-query-secret-1234"
    r = httpx.get(
        server.url + f"/health?api_key={secret}&x=1&token={secret}",
        headers={"X-Forwarded-For": "203.0.113.9"},
        timeout=10,
    )
    assert r.status_code == 200
    time.sleep(0.3)
    logs = server.logs()
    assert "GET /health?api_key=" in logs and "x=1" in logs  # the request was logged ...
    assert secret not in logs  # ... without the credential
    assert "203.0.113.9" not in logs  # no proxy is trusted by default: the peer address is logged


# ---- streams the server ends itself --------------------------------------------------------------------------------


def test_unload_and_reload_cut_streams_with_an_error(server, smollm2_dir):
    for action, code in (("unload", "model_unloaded"), ("reload", "model_replaced")):
        chat = Stream(server, LONG)
        comp = Stream(server, {"prompt": "Count:", "max_tokens": 3000, "ignore_eos": True, "stream": True},
                      "/v1/completions")  # fmt: skip
        plain: dict = {}

        def post_plain(out=plain):
            out["r"] = httpx.post(
                server.url + "/v1/completions",
                headers=H(),
                json={"prompt": "Count:", "max_tokens": 3000, "ignore_eos": True},
                timeout=120,
            )

        t = threading.Thread(target=post_plain)
        t.start()
        chat.wait_started()
        comp.wait_started()
        time.sleep(0.3)
        if action == "unload":
            r = httpx.post(server.url + "/admin/unload", headers=H(ADMIN), timeout=30)
        else:
            r = admin_load(server, model=str(smollm2_dir), model_name="smollm2", cache_tokens=8192)
        assert r.status_code == 200, r.text
        assert_cut(chat.join(), code)
        assert_cut(comp.join(), code)
        t.join(60)
        err(plain["r"], 503, action)
        assert plain["r"].json()["error"]["code"] == code
        if action == "unload":
            r = admin_load(server, model=str(smollm2_dir), model_name="smollm2", cache_tokens=8192)
            assert r.status_code == 200, r.text
    assert_alive(server)


def test_sigterm_drains(smollm2_dir):
    srv = ServerProc(
        smollm2_dir,
        *flags(
            api_key=KEY,
            cache_tokens=8192,
            timeout_graceful_shutdown=4,
            forwarded_allow_ips="127.0.0.1",
        ),
    )
    try:
        # a trusted proxy's X-Forwarded-For is the logged client
        httpx.get(srv.url + "/health", headers={"X-Forwarded-For": "203.0.113.9"}, timeout=10)
        long = Stream(srv, LONG)
        short = Stream(srv, {"messages": MSG, "max_tokens": 12, "ignore_eos": True, "stream": True})
        long.wait_started()
        short.wait_started()
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        h = httpx.get(srv.url + "/health", timeout=10)
        assert h.status_code == 503 and h.json() == {"status": "draining"}, h.text
        e = err(
            httpx.post(
                srv.url + "/v1/chat/completions", headers=H(), json={"messages": MSG}, timeout=10
            ),
            503,
            "shutting down",
        )
        assert e["code"] == "server_shutting_down"
        assert short.join()[-1] == "[DONE]"  # finished within the grace period
        assert_cut(long.join(), "server_shutting_down")  # ended by the server at the grace period
        rc = srv.proc.wait(30)
        took = time.monotonic() - t0
        assert rc == 0, srv.logs()[-3000:]
        assert 3.5 < took < 15, took
        assert "203.0.113.9" in srv.logs()
    finally:
        srv.stop()


# ---- the command line's model --------------------------------------------------------------------------------------


def test_serve_exits_when_its_model_cannot_load(tmp_path):
    env = dict(os.environ, PYTHONPATH=PKG_PARENT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    bad = tmp_path / "no-such-model"
    proc = subprocess.Popen(
        [sys.executable, "-m", "exl2cpp", "serve", str(bad), "--port", str(free_port())],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the server stayed up with a model that cannot load:\n{out[-2000:]}")
    assert proc.returncode == 1, out[-2000:]
    assert "exl2cpp: error:" in out and str(bad) in out.split("exl2cpp: error:")[-1], out[-2000:]


# ---- units ---------------------------------------------------------------------------------------------------------


def test_redact_query():
    from exl2cpp.server.transport import redact_query

    assert redact_query("/health") == "/health"
    assert redact_query("/v1/models?api_key=sk-1&n=2") == "/v1/models?api_key=***&n=2"
    assert (
        redact_query("/x?ACCESS_TOKEN=a;Password=b&api%5Fkey=c&flag&key=")
        == "/x?ACCESS_TOKEN=***;Password=***&api%5Fkey=***&flag&key=***"
    )


def test_transport_settings_are_checked(tmp_path):
    from exl2cpp.errors import InvalidArgumentError
    from exl2cpp.server.config import load_config

    cfg = load_config(None, forwarded_allow_ips="127.0.0.1, 10.0.0.0/8", max_body_size=1024)
    assert cfg.forwarded_allow_ips == ["127.0.0.1", "10.0.0.0/8"] and cfg.max_body_size == 1024
    assert load_config(None).forwarded_allow_ips == []  # no proxy trusted by default
    for name, bad in (
        ("max_body_size", 0),
        ("timeout_header", -1),
        ("timeout_body", "60"),
        ("max_connections", 2.5),
        ("cache_tokens", 2**40),
        ("max_seq_len", 10**15),
        ("timeout_graceful_shutdown", 10**6),
    ):
        with pytest.raises(InvalidArgumentError, match=name):
            load_config(None, **{name: bad})
    y = tmp_path / "serve.yml"
    y.write_text("forwarded_allow_ips: [127.0.0.1]\ntimeout_keep_alive: 2\n")
    cfg = load_config(y)
    assert cfg.forwarded_allow_ips == ["127.0.0.1"] and cfg.timeout_keep_alive == 2
