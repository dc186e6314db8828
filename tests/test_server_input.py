"""Hostile request content against `exl2cpp serve` (SmolLM2 on CPU, one server process per fixture): text that is not
Unicode, wrongly typed fields, grammars that crash or stall a compiler, chat templates that never end. Every case is
a 4xx naming what was wrong, and the server is still up and answering a normal request afterwards."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
httpx = pytest.importorskip("httpx")

from test_server import KEY, ServerProc

MSG = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(smollm2_dir):
    srv = ServerProc(
        smollm2_dir, "--api-key", KEY, "--cache-tokens", "4096", "--model-name", "smollm2"
    )
    yield srv
    srv.stop()


def post(srv, path: str, body, timeout: float = 120) -> httpx.Response:
    """POST a body given as a dict, or as raw JSON text (to send escapes such as a lone \\ud800)."""
    raw = body if isinstance(body, str) else json.dumps(body)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    return httpx.post(srv.url + path, content=raw.encode(), headers=headers, timeout=timeout)


def err(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:2000])
    e = r.json()["error"]
    assert set(e) >= {"message", "type", "code", "param"}
    for w in words:
        assert w.lower() in e["message"].lower(), (w, e["message"])
    return e


def assert_alive(srv) -> None:
    """The process is up and a normal chat request still works."""
    assert srv.proc.poll() is None, f"server died ({srv.proc.returncode}):\n{srv.logs()[-3000:]}"
    r = post(srv, "/v1/chat/completions", {"messages": MSG, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]


# ---- text that is not Unicode, wrongly typed fields ---------------------------------------------------------------


def test_lone_surrogates_are_4xx(server):
    cases = [
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 2}',
        ),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
        ),
        (
            "/v1/chat/completions",
            '{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}',
        ),
        ("/v1/completions", '{"prompt": "hi \\ud800", "max_tokens": 2}'),
        ("/v1/completions", '{"prompt": ["ok", "x\\ud83d"], "max_tokens": 2}'),
        ("/v1/tokenize", '{"prompt": "hi \\ud800"}'),
        ("/v1/tokenize", '{"messages": [{"role": "user", "content": "\\udfff"}]}'),
        ("/v1/tokenize", '{"model": "\\ud800", "prompt": "x"}'),
        ("/v1/detokenize", '{"model": "\\ud800", "tokens": [1]}'),
    ]
    for path, raw in cases:
        e = err(post(server, path, raw), 422, "surrogate")
        assert e["code"] == "invalid_value"
    # a surrogate pair is one valid character and goes through
    r = post(server, "/v1/tokenize", '{"prompt": "\\ud83d\\ude42"}')
    assert r.status_code == 200 and r.json()["count"] >= 1
    assert_alive(server)


def test_strict_types(server):
    u = "/v1/chat/completions"
    for field, value in [
        ("stream", "yes"),
        ("stream", 1),
        ("logprobs", "true"),
        ("ignore_eos", "no"),
        ("max_tokens", "2"),
        ("max_tokens", 2.0),
        ("max_tokens", True),
        ("n", "1"),
        ("seed", "7"),
        ("temperature", "0.5"),
        ("top_logprobs", "2"),
    ]:
        err(post(server, u, {"messages": MSG, field: value}), 422, field)
    err(post(server, "/v1/completions", {"prompt": "x", "echo": "yes"}), 422, "echo")
    err(
        post(server, "/v1/tokenize", {"prompt": "x", "add_special_tokens": "no"}),
        422,
        "add_special",
    )
    # ints where floats are expected stay fine (JSON has one number type)
    r = post(server, u, {"messages": MSG, "max_tokens": 2, "temperature": 0, "top_p": 1})
    assert r.status_code == 200, r.text
    assert_alive(server)


def test_bad_tool_calls_in_history(server):
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "x", "tool_calls": ["x"]},
    ]
    for path in ("/v1/tokenize", "/v1/chat/completions"):
        e = err(post(server, path, {"messages": history, "max_tokens": 2}), 400, "tool_calls[0]")
        assert e["param"] == "messages"
    for calls in ({"a": 1}, [{"function": "f"}], [{"function": {"name": 3}}]):
        history[1]["tool_calls"] = calls
        err(post(server, "/v1/tokenize", {"messages": history}), 400, "tool_calls")
    assert_alive(server)
