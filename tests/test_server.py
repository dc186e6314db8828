"""Tests of `exl2cpp serve`: a real server process (SmolLM2 on CPU) on 127.0.0.1 driven by the official openai client
and raw httpx (errors, auth, admin, metrics), plus unit tests of tool-call parsing, auth and the engine token mask."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

REPO = Path(__file__).resolve().parents[1]
import exl2cpp

# The exl2cpp this test process imported (installed, or the source tree with a dev build): servers use the same.
PKG_PARENT = str(Path(exl2cpp.__file__).resolve().parent.parent)
KEY, ADMIN = "sk-test-user-key", "sk-test-admin-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProc:
    """`python -m exl2cpp serve` in a child process; killed (by its pid) on stop()."""

    def __init__(self, model_dir: Path, *extra: str, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        e = dict(os.environ)
        e["PYTHONPATH"] = PKG_PARENT + os.pathsep + e.get("PYTHONPATH", "")
        e.update(env or {})
        cmd = [
            sys.executable,
            "-m",
            "exl2cpp",
            "serve",
            str(model_dir),
            "--port",
            str(self.port),
            *extra,
        ]
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"exl2cpp-serve-{self.port}.log"
        self.log = open(self.log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, env=e, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited ({self.proc.returncode}): {self.log_path.read_text()}"
                )
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                if r.status_code == 200 and r.json()["status"] == "ready":
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError("server did not become ready in 120 s")

    def logs(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def server(smollm2_dir):
    srv = ServerProc(
        smollm2_dir,
        "--api-key",
        KEY,
        "--admin-key",
        ADMIN,
        "--cache-tokens",
        "8192",
        "--model-name",
        "smollm2",
        "--log-level",
        "info",
    )
    yield srv
    srv.stop()
    logs = srv.logs()
    assert "POST /v1/chat/completions" in logs  # the access log was on ...
    assert KEY not in logs and ADMIN not in logs, (
        "a key leaked into the server log"
    )  # ... and shows no key


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def H(key=KEY):
    return {"Authorization": f"Bearer {key}"}


def stats(server) -> dict:
    return httpx.get(server.url + "/admin/stats", headers=H(ADMIN), timeout=10).json()["engine"]


def wait_idle(server, timeout=20.0) -> dict:
    deadline = time.time() + timeout
    while True:
        s = stats(server)
        if (s["jobs_active"] == 0 and s["jobs_queued"] == 0) or time.time() > deadline:
            return s
        time.sleep(0.1)


# ---- the openai client -----------------------------------------------------------------------------------------

MSG = [{"role": "user", "content": "What is the capital of France?"}]


def test_models(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["smollm2"]


def test_chat_greedy_deterministic(client, smollm2_dir):
    r = client.chat.completions.create(model="smollm2", messages=MSG, max_tokens=12, temperature=0)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content
    assert c.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # the same as the Python engine with the same prompt, greedy
    import exl2cpp

    m = exl2cpp.load(str(smollm2_dir))
    tok = m.tokenizer
    ids = tok.encode(tok.apply_chat_template(MSG, add_generation_prompt=True))
    assert r.usage.prompt_tokens == len(ids)
    want = m.generate(ids, max_new_tokens=12, temperature=0.0)
    assert c.message.content == want
    r2 = client.chat.completions.create(model="smollm2", messages=MSG, max_tokens=12, temperature=0)
    assert r2.choices[0].message.content == c.message.content


def test_completion_and_n_seed(client):
    r = client.completions.create(
        model="smollm2", prompt="The sky is", max_tokens=8, temperature=0.9, seed=7, n=3
    )
    assert len(r.choices) == 3 and [c.index for c in r.choices] == [0, 1, 2]
    r2 = client.completions.create(
        model="smollm2", prompt="The sky is", max_tokens=8, temperature=0.9, seed=7, n=3
    )
    assert [c.text for c in r.choices] == [c.text for c in r2.choices]  # seeded: reproducible
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)


def test_stop_and_logit_bias(client):
    r = client.completions.create(
        model="smollm2", prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[" 7"]
    )
    assert " 7" not in r.choices[0].text and r.choices[0].finish_reason == "stop"
    # ban the greedy first token with logit_bias -100: the first token changes
    base = client.completions.create(
        model="smollm2", prompt="1, 2, 3, 4,", max_tokens=1, temperature=0, logprobs=1
    )
    tid = httpx.post(
        client.base_url.__str__().rstrip("/") + "/tokenize",
        headers=H(),
        json={"prompt": base.choices[0].text, "add_special_tokens": False},
    ).json()["tokens"][0]
    biased = client.completions.create(
        model="smollm2",
        prompt="1, 2, 3, 4,",
        max_tokens=1,
        temperature=0,
        logit_bias={str(tid): -100},
    )
    assert biased.choices[0].text != base.choices[0].text


def test_banned_strings_extension(client, server):
    # extension field through the openai client's extra_body, on chat (also streamed) and completions
    base = client.chat.completions.create(model="smollm2", messages=MSG, max_tokens=16, temperature=0)
    assert "Paris" in base.choices[0].message.content
    r = client.chat.completions.create(
        model="smollm2", messages=MSG, max_tokens=16, temperature=0, extra_body={"banned_strings": ["Paris"]}
    )
    text = r.choices[0].message.content
    assert text and "Paris" not in text
    stream = client.chat.completions.create(
        model="smollm2", messages=MSG, max_tokens=16, temperature=0, stream=True,
        extra_body={"banned_strings": ["Paris"]},
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == text
    c = client.completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0,
        extra_body={"banned_strings": ["Paris"]},
    )
    assert "Paris" not in c.choices[0].text
    with pytest.raises(openai.BadRequestError, match="banned_strings"):
        client.completions.create(
            model="smollm2", prompt="x", max_tokens=2, extra_body={"banned_strings": [""]}
        )
    s = wait_idle(server)
    assert s["pages_reserved"] == 0


def test_streaming_chat_with_usage(client):
    stream = client.chat.completions.create(
        model="smollm2",
        messages=MSG,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals in (["stop"], ["length"])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    full = client.chat.completions.create(
        model="smollm2", messages=MSG, max_tokens=10, temperature=0
    )
    assert text == full.choices[0].message.content


def test_streaming_completion(client):
    stream = client.completions.create(
        model="smollm2", prompt="Once upon a time", max_tokens=8, temperature=0, stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    full = client.completions.create(
        model="smollm2", prompt="Once upon a time", max_tokens=8, temperature=0
    )
    assert text == full.choices[0].text and len(chunks) >= 3


def test_logprobs(client):
    r = client.chat.completions.create(
        model="smollm2", messages=MSG, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens or len(lp) == r.usage.completion_tokens - 1
    assert "".join(x.token for x in lp) == r.choices[0].message.content
    for x in lp:
        assert len(x.top_logprobs) == 3 and x.logprob <= 0
        # greedy: the chosen token is the most likely one, and the alternatives are sorted
        assert (
            x.top_logprobs[0].token == x.token and abs(x.top_logprobs[0].logprob - x.logprob) < 1e-5
        )
        assert x.top_logprobs[0].logprob >= x.top_logprobs[1].logprob >= x.top_logprobs[2].logprob
        assert sum(2.718281828**t.logprob for t in x.top_logprobs) <= 1.0 + 1e-4
    c = client.completions.create(
        model="smollm2", prompt="Hello", max_tokens=4, temperature=0, logprobs=2
    )
    L = c.choices[0].logprobs
    assert len(L.tokens) == len(L.token_logprobs) == len(L.top_logprobs) == len(L.text_offset) >= 1
    assert all(len(d) == 2 for d in L.top_logprobs)


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}


def test_json_schema_output(client):
    msgs = [{"role": "user", "content": "Describe a fictional programmer as JSON."}]
    for temp in (0.0, 0.8):
        r = client.chat.completions.create(
            model="smollm2",
            messages=msgs,
            max_tokens=120,
            temperature=temp,
            seed=3,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON},
            },
        )
        obj = json.loads(r.choices[0].message.content)
        jsonschema.validate(obj, PERSON)
        assert r.choices[0].finish_reason == "stop"


def test_json_object_output(client):
    r = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "A cat, in JSON"}],
        max_tokens=80,
        temperature=0,
        response_format={"type": "json_object"},
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # ran out of tokens inside the object: still a JSON prefix starting with "{"
        assert r.choices[0].message.content.startswith("{")


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "maxLength": 30}},
            "required": ["tz"],
        },
    },
}


def test_tool_call_forced(client):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(
        model="smollm2",
        messages=msgs,
        tools=[WEATHER, TIME],
        max_tokens=60,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    # round trip: the tool result goes back and the model answers in text (tool_choice none)
    msgs2 = msgs + [
        c.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    r2 = client.chat.completions.create(
        model="smollm2",
        messages=msgs2,
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=8,
        temperature=0,
    )
    assert r2.choices[0].message.content and not r2.choices[0].message.tool_calls


def test_tool_call_required_streaming(client):
    stream = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Time in Tokyo?"}],
        tools=[WEATHER, TIME],
        tool_choice="required",
        max_tokens=60,
        temperature=0,
        stream=True,
    )
    deltas = [tc for ch in stream if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    # the first delta of a call has its id and name, the arguments follow in pieces as they are generated
    assert deltas[0].id and deltas[0].function.name in ("get_weather", "get_time")
    assert len(deltas) > 2 and all(d.index == 0 and d.id is None for d in deltas[1:])
    json.loads("".join(d.function.arguments for d in deltas))


def test_tokenize_detokenize(server):
    r = httpx.post(server.url + "/v1/tokenize", headers=H(), json={"prompt": "Hello world"})
    ids = r.json()["tokens"]
    assert r.status_code == 200 and r.json()["count"] == len(ids) >= 2
    d = httpx.post(server.url + "/v1/detokenize", headers=H(), json={"tokens": ids})
    assert d.json()["prompt"].endswith("Hello world")
    m = httpx.post(server.url + "/v1/tokenize", headers=H(), json={"messages": MSG}).json()
    assert m["count"] > len(ids)


# ---- negative tests --------------------------------------------------------------------------------------------


def _err(r, status, *words):
    assert r.status_code == status, (r.status_code, r.text)
    e = r.json()["error"]
    assert set(e) >= {"message", "type", "code", "param"}
    for w in words:
        assert w.lower() in e["message"].lower(), (w, e["message"])
    return e


def test_auth(server, client):
    u = server.url + "/v1/chat/completions"
    body = {"messages": MSG, "max_tokens": 1}
    _err(httpx.post(u, json=body), 401, "missing api key")
    _err(httpx.post(u, json=body, headers=H("sk-wrong")), 401, "invalid api key")
    _err(httpx.post(u, json=body, headers={"Authorization": "Basic abc"}), 401, "bearer")
    _err(httpx.get(server.url + "/v1/models", headers=H(KEY[:-1])), 401, "invalid")
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    # admin: a user key is forbidden, the admin key works; health and metrics are open
    _err(httpx.post(server.url + "/admin/unload", headers=H()), 403, "admin key")
    _err(httpx.get(server.url + "/admin/stats", headers=H()), 403, "admin key")
    _err(httpx.post(server.url + "/admin/load", headers=H(), json={"model": "x"}), 403, "admin key")
    _err(httpx.get(server.url + "/admin/stats"), 401, "missing")
    assert httpx.get(server.url + "/admin/stats", headers=H(ADMIN)).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200


def test_malformed_requests(server):
    u = server.url + "/v1/chat/completions"
    hdr = {**H(), "Content-Type": "application/json"}
    _err(httpx.post(u, content=b'{"messages": [', headers=hdr), 400, "malformed json")
    _err(httpx.post(u, content=b"not json", headers=hdr), 400, "malformed json")
    _err(httpx.post(u, json={"messages": "hi"}, headers=H()), 422, "messages")
    _err(httpx.post(u, json={}, headers=H()), 422, "messages")
    _err(httpx.post(u, json=[1, 2], headers=H()), 422)
    _err(
        httpx.post(u, json={"messages": MSG, "max_tokens": "many"}, headers=H()), 422, "max_tokens"
    )
    _err(httpx.post(u, json={"messages": MSG, "temperature": 11}, headers=H()), 422, "temperature")
    _err(httpx.post(u, json={"messages": MSG, "top_p": 0}, headers=H()), 422, "top_p")
    _err(
        httpx.post(u, json={"messages": [{"role": "wizard", "content": "x"}]}, headers=H()),
        400,
        "role",
    )
    _err(
        httpx.post(
            u,
            json={"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            headers=H(),
        ),
        400,
        "image_url",
    )
    _err(
        httpx.post(u, json={"messages": MSG, "logit_bias": {"abc": 1}}, headers=H()),
        400,
        "logit_bias",
    )
    _err(
        httpx.post(u, json={"messages": MSG, "logit_bias": {"999999": 1}}, headers=H()),
        400,
        "vocabulary",
    )
    _err(httpx.post(u, json={"messages": MSG, "n": 100}, headers=H()), 400, "n=100")
    _err(httpx.post(u, json={"messages": MSG, "top_k": 10**12}, headers=H()), 422, "top_k")
    _err(
        httpx.post(u, json={"messages": MSG, "chat_template_kwargs": {"messages": 1}}, headers=H()),
        400,
        "chat_template_kwargs",
    )
    _err(
        httpx.post(u, json={"messages": MSG, "tool_choice": "required"}, headers=H()), 400, "tools"
    )
    _err(
        httpx.post(u, json={"messages": MSG, "tools": [{"type": "function"}]}, headers=H()),
        400,
        "tools[0]",
    )
    _err(
        httpx.post(
            u,
            json={
                "messages": MSG,
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
            headers=H(),
        ),
        400,
        "nope",
    )
    _err(
        httpx.post(u, json={"messages": MSG, "response_format": {"type": "xml"}}, headers=H()),
        422,
        "response_format",
    )
    _err(
        httpx.post(
            u,
            json={
                "messages": MSG,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}},
                    },
                },
            },
            headers=H(),
        ),
        400,
    )
    _err(httpx.post(u, json={"model": "gpt-4o", "messages": MSG}, headers=H()), 404, "gpt-4o")
    _err(
        httpx.post(server.url + "/v1/completions", json={"prompt": [999999]}, headers=H()),
        400,
        "token ids",
    )
    _err(
        httpx.post(server.url + "/v1/detokenize", json={"tokens": [-1]}, headers=H()),
        400,
        "out of range",
    )
    _err(httpx.get(server.url + "/v1/nothing", headers=H()), 404, "unknown endpoint")
    _err(httpx.get(u, headers=H()), 405)
    assert httpx.get(server.url + "/health").status_code == 200  # still alive


def test_over_context(server):
    u = server.url + "/v1/chat/completions"
    long = "word " * 9000  # > 8192 tokens
    e = _err(
        httpx.post(
            u,
            json={"messages": [{"role": "user", "content": long}], "max_tokens": 4},
            headers=H(),
            timeout=60,
        ),
        400,
        "maximum context length is 8192 tokens",
    )
    assert e["code"] == "context_length_exceeded"
    _err(
        httpx.post(u, json={"messages": MSG, "max_tokens": 8190}, headers=H()),
        400,
        "maximum context length",
    )
    _err(
        httpx.post(
            server.url + "/v1/completions",
            json={"prompt": long, "max_tokens": 4},
            headers=H(),
            timeout=60,
        ),
        400,
        "maximum context length",
    )
    _err(httpx.post(u, json={"messages": MSG, "max_tokens": 20000}, headers=H()), 400, "limit")


def test_disconnect_cancels(server):
    before = stats(server)
    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        headers=H(),
        timeout=60,
        json={
            "messages": MSG,
            "max_tokens": 2000,
            "temperature": 1.0,
            "stream": True,
            "ignore_eos": True,
        },
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line and '""' not in line:
                break  # first real token: hang up
    s = wait_idle(server)
    assert s["jobs_active"] == 0 and s["pages_used"] - s["pages_evictable"] == 0
    assert s["tokens_out"] - before["tokens_out"] < 1500  # stopped long before max_tokens
    # a non-streaming request whose client gives up is cancelled too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.url + "/v1/completions",
            headers=H(),
            timeout=1.5,
            json={"prompt": "Count:", "max_tokens": 2000, "ignore_eos": True},
        )
    s2 = wait_idle(server)
    assert s2["jobs_active"] == 0 and s2["pages_used"] - s2["pages_evictable"] == 0
    assert s2["tokens_out"] - s["tokens_out"] < 1500
    m = httpx.get(server.url + "/metrics").text
    assert "exl2cpp_requests_cancelled_total" in m


def test_metrics_and_health(server):
    m = httpx.get(server.url + "/metrics").text
    for name in (
        "exl2cpp_requests_total",
        "exl2cpp_prompt_tokens_total",
        "exl2cpp_generation_tokens_total",
        "exl2cpp_queue_depth",
        "exl2cpp_time_to_first_token_seconds_bucket",
        "exl2cpp_tokens_per_second",
        "exl2cpp_cache_pages_in_use",
        "exl2cpp_cache_pages_shared",
        "process_resident_memory_bytes",
    ):
        assert name in m, name
    assert 'exl2cpp_requests_total{endpoint="/v1/chat/completions",status="200"}' in m
    h = httpx.get(server.url + "/health").json()
    assert h == {"status": "ready"}  # the state only: details are for the admin (/admin/stats)


def test_admin_unload_load(server, smollm2_dir):
    r = httpx.post(server.url + "/admin/unload", headers=H(ADMIN))
    assert r.json()["status"] == "unloaded"
    assert httpx.get(server.url + "/health").status_code == 503
    _err(
        httpx.post(server.url + "/v1/chat/completions", json={"messages": MSG}, headers=H()),
        503,
        "no model",
    )
    _err(
        httpx.post(
            server.url + "/admin/load",
            json={"model": "/no/such/folder"},
            headers=H(ADMIN),
            timeout=60,
        ),
        400,
        "/no/such/folder",
    )
    r = httpx.post(
        server.url + "/admin/load",
        headers=H(ADMIN),
        timeout=120,
        json={"model": str(smollm2_dir), "model_name": "smollm2", "cache_tokens": 8192},
    )
    assert r.status_code == 200 and r.json() == {"status": "ready", "model": "smollm2"}
    assert httpx.get(server.url + "/health").status_code == 200


# ---- units -----------------------------------------------------------------------------------------------------


def test_parse_tool_calls():
    from exl2cpp.server.tools import parse_tool_calls

    tools = [WEATHER, TIME]
    content, calls = parse_tool_calls(
        '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>', tools
    )
    assert content is None and calls[0]["function"]["name"] == "get_time"
    assert json.loads(calls[0]["function"]["arguments"]) == {"tz": "UTC"}
    text = (
        'ok <tool_call>{"name": "get_time", "arguments": {"tz": "A"}}</tool_call>\n'
        '<tool_call>{"name": "get_weather", "parameters": {"city": "B"}}</tool_call>'
    )
    content, calls = parse_tool_calls(text, tools)
    assert content == "ok" and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    content, calls = parse_tool_calls(
        '```json\n{"name": "get_time", "arguments": "{\\"tz\\": \\"X\\"}"}\n```', tools
    )
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"tz": "X"}
    assert parse_tool_calls('{"name": "rm_rf", "arguments": {}}', tools) == (
        '{"name": "rm_rf", "arguments": {}}',
        [],
    )
    assert parse_tool_calls("just text", tools) == ("just text", [])
    assert parse_tool_calls("<tool_call>{broken</tool_call>", tools)[1] == []


def test_key_checker_and_config(tmp_path, monkeypatch):
    from exl2cpp.server.auth import KeyChecker
    from exl2cpp.server.config import load_config

    k = KeyChecker(["a1", "b2"], "adm")
    assert k.check_user("Bearer a1") is None and k.check_user("Bearer b2") is None
    assert k.check_user("Bearer adm") is None
    assert k.check_user("Bearer a") and k.check_user(None) and k.check_user("a1")
    assert k.check_admin("Bearer adm") is None and k.check_admin("Bearer a1")[0] == 403
    assert k.check_admin("Bearer zz")[0] == 401
    assert KeyChecker([], None).check_user(None) is None
    f = tmp_path / "keys.txt"
    f.write_text("# comment\nk-file-1\n\nk-file-2\n")
    y = tmp_path / "serve.yml"
    y.write_text(
        f"host: 0.0.0.0\nport: 9001\napi_keys: [k-yml]\napi_key_file: {f}\ncache_tokens: 4096\n"
    )
    monkeypatch.setenv("EXL2CPP_API_KEYS", "k-env1, k-env2")
    cfg = load_config(y, port=9002, api_keys=["k-flag"])
    assert cfg.host == "0.0.0.0" and cfg.port == 9002 and cfg.cache_tokens == 4096
    assert set(cfg.api_keys) == {"k-yml", "k-file-1", "k-file-2", "k-flag", "k-env1", "k-env2"}
    assert "k-yml" not in repr(cfg)
    y.write_text("bogus_setting: 1\n")
    with pytest.raises(ValueError, match="bogus_setting"):
        load_config(y)


def test_engine_token_mask(smollm2_dir):
    """The engine's per-job mask: only allowed ids are sampled, whatever the temperature; None/empty lifts it."""
    import exl2cpp
    import numpy as np

    m = exl2cpp.load(str(smollm2_dir))
    allowed = [17, 260, 1001, 30000]

    def words(ids):
        w = np.zeros((m.vocab_size + 31) // 32, dtype=np.uint32)
        for i in ids:
            w[i >> 5] |= np.uint32(1 << (i & 31))
        return w.tolist()

    class Fixed:
        def __init__(self):
            self.seen = []

        def mask(self):
            return words(allowed)

        def advance(self, t):
            self.seen.append(t)
            return words(allowed[len(self.seen) % 2 :])  # the mask changes every step

    with exl2cpp.Engine(m, cache_tokens=2048) as e:
        fx = Fixed()
        job = e.submit(
            "Hello there",
            max_new_tokens=12,
            temperature=1.5,
            seed=1,
            ignore_eos=True,
            constraint=fx,
        )
        job.result()
        assert len(job.token_ids) == 12 and all(t in allowed for t in job.token_ids)
        assert job.token_ids[1:] and all(
            t in allowed[(k + 1) % 2 :] for k, t in enumerate(job.token_ids[1:])
        )
        assert fx.seen == job.token_ids[:-1]  # advanced on every token but the last
        free = e.submit("Hello there", max_new_tokens=6, temperature=0, ignore_eos=True)
        free.result()
        assert any(t not in allowed for t in free.token_ids)


def test_server_stack_without_torch(smollm2_dir):
    """The server, its grammar engine (llguidance) and the app import no torch/transformers."""
    code = (
        "import sys, exl2cpp\n"
        "from exl2cpp.server.app import create_app\n"
        "from exl2cpp.server.config import ServeConfig\n"
        "from exl2cpp.server.grammar import GrammarFactory\n"
        f"m = exl2cpp.load({str(smollm2_dir)!r}, max_seq_len=256)\n"
        "g = GrammarFactory(m.tokenizer._json, m.vocab_size, m.tokenizer.eos_ids)\n"
        "assert len(g.json_schema({'type': 'object'}).constraint().mask()) == (m.vocab_size + 31) // 32\n"
        "create_app(ServeConfig())\n"
        "bad = sorted(k for k in sys.modules if k.split('.')[0] in ('torch', 'transformers'))\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=PKG_PARENT)
    r = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("ok")


def test_config_tensor_parallel(tmp_path):
    from exl2cpp.server.config import load_config
    from exl2cpp.tensor_parallel import tensor_parallel_kwargs

    y = tmp_path / "serve.yml"
    y.write_text("tensor_parallel: [0, 1]\n")
    cfg = load_config(y)
    assert tensor_parallel_kwargs(cfg.tensor_parallel) == {"tensor_parallel": True, "devices": [0, 1]}
    assert load_config(y, tensor_parallel="2").tensor_parallel == "2"
    assert tensor_parallel_kwargs(load_config(None).tensor_parallel) == {}
