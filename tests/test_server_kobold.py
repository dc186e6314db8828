"""The KoboldAI API of `exl2cpp serve`, as TabbyAPI offers it for the front-ends set to it: /api/v1/generate and
/api/extra/generate/stream give the text /v1/completions gives for the same settings (under their Kobold names),
tokencount counts as /v1/token/encode does, genkey names a run for /api/extra/generate/check and /api/extra/abort,
dynatemp_range and use_default_badwordsids act; wrong input is a 4xx with an OpenAI-style error body. SmolLM2 on
CPU through FastAPI's TestClient."""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

KEY = "sk-kobold"
U = {"x-api-key": KEY}
PROMPT = "Once upon a time, in a small village by the sea,"


@pytest.fixture(scope="module")
def http(smollm2_dir):
    from exl2cpp.server import create_app
    from exl2cpp.server.config import ServeConfig

    cfg = ServeConfig(model=str(smollm2_dir), model_name="smol", api_keys=[KEY], cache_tokens=2048, page_size=16)
    with TestClient(create_app(cfg)) as c:
        while c.get("/health").json().get("status") != "ready":
            pass
        yield c


def _events(r) -> list[dict]:
    assert r.status_code == 200, r.text
    out, event = [], None
    for line in r.text.splitlines():
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            out.append({"event": event, **json.loads(line[6:])})
    return out


def test_generate_matches_completions(http):
    """Kobold's names (max_length, rep_pen, rep_pen_range, stop_sequence) give what the OpenAI route gives."""
    kobold = {"prompt": PROMPT, "max_length": 24, "temperature": 0, "rep_pen": 1.1, "rep_pen_range": 64,
              "stop_sequence": ["\n\n"]}  # fmt: skip
    r = http.post("/api/v1/generate", json=kobold, headers=U)
    assert r.status_code == 200, r.text
    text = r.json()["results"][0]["text"]
    want = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                     "repetition_penalty": 1.1, "penalty_range": 64, "stop": ["\n\n"]}, headers=U)  # fmt: skip
    assert text and text == want.json()["choices"][0]["text"]
    assert http.post("/api/latest/generate", json=kobold, headers=U).json() == r.json()
    events = _events(http.post("/api/extra/generate/stream", json=kobold, headers=U))
    assert len(events) > 3 and all(e["event"] == "message" for e in events)
    assert "".join(e["token"] for e in events) == text


def test_tokencount_and_info(http):
    r = http.post("/api/extra/tokencount", json={"prompt": PROMPT}, headers=U)
    assert r.status_code == 200, r.text
    enc = http.post("/v1/token/encode", json={"text": PROMPT, "add_bos_token": False}, headers=U).json()
    tok = http.app.state.slot.model.tokenizer
    assert r.json()["ids"] == tok.encode(PROMPT) and r.json()["value"] == len(r.json()["ids"])
    assert r.json()["ids"][-len(enc["tokens"]) :] == enc["tokens"]
    assert http.get("/api/v1/model", headers=U).json() == {"result": "exl2cpp/smol"}
    assert http.get("/api/extra/version").json()["result"] == "KoboldCpp"
    assert http.get("/api/v1/info/version").json() == {"result": "1.2.5"}


def test_genkey_check_and_abort(http):
    """A running generation's text so far under its genkey; abort ends it early; afterwards the key is free."""
    body = {"prompt": PROMPT, "max_length": 400, "temperature": 0, "genkey": "KCPP1234", "ban_eos_token": True}
    got: dict = {}

    def run():
        got["r"] = http.post("/api/v1/generate", json=body, headers=U)

    t = threading.Thread(target=run)
    t.start()
    seen = ""
    for _ in range(600):
        r = http.post("/api/extra/generate/check", json={"genkey": "KCPP1234"}, headers=U)
        assert r.status_code == 200, r.text
        if r.json()["results"] and r.json()["results"][0]["text"]:
            seen = r.json()["results"][0]["text"]
            break
        time.sleep(0.02)
    assert seen
    dup = http.post("/api/v1/generate", json=body, headers=U)  # the key is taken while it runs
    assert dup.status_code == 409 and dup.json()["error"]["param"] == "genkey", dup.text
    assert http.post("/api/extra/abort", json={"genkey": "KCPP1234"}, headers=U).json() == {"success": True}
    t.join(120)
    text = got["r"].json()["results"][0]["text"]
    assert text.startswith(seen) and len(http.app.state.slot.model.tokenizer.encode(text)) < 400
    assert http.post("/api/extra/generate/check", json={"genkey": "KCPP1234"}, headers=U).json() == {"results": []}
    assert http.post("/api/extra/abort", json={"genkey": "KCPP1234"}, headers=U).json() == {"success": False}
    # a stream whose client leaves at once frees its genkey too
    with http.stream("POST", "/api/extra/generate/stream", json={**body, "genkey": "KCPP5678"}, headers=U) as r:
        assert r.status_code == 200
    again = http.post("/api/v1/generate", json={**body, "genkey": "KCPP5678", "max_length": 2}, headers=U)
    assert again.status_code == 200, again.text


def test_dynatemp_range_and_badwordsids(http):
    """dynatemp_range is min_temp / max_temp at temperature -+ range (the same seeded text as those fields give
    on the OpenAI route); use_default_badwordsids bans EOS: the reply runs to max_length."""
    tok = http.app.state.slot.model.tokenizer
    body = {"prompt": "Hi", "max_length": 40, "temperature": 0.8, "dynatemp_range": 0.5, "seed": 7}
    a = http.post("/api/v1/generate", json=body, headers=U).json()["results"][0]["text"]
    b = http.post("/api/v1/generate", json=body, headers=U).json()["results"][0]["text"]
    want = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 40, "temperature": 0.8, "min_temp": 0.3,
                     "max_temp": 1.3, "seed": 7}, headers=U).json()["choices"][0]["text"]  # fmt: skip
    assert a == b == want
    r = http.post("/api/v1/generate", json={"prompt": "The end.", "max_length": 30, "temperature": 0,
                  "use_default_badwordsids": True}, headers=U)  # fmt: skip
    assert len(tok.encode(r.json()["results"][0]["text"])) >= 29


@pytest.mark.parametrize(
    "path, body, status, field",
    [
        ("/api/v1/generate", {"max_length": 5}, 422, "prompt"),
        ("/api/v1/generate", {"prompt": "x", "max_length": -1}, 422, "max_length"),
        ("/api/v1/generate", {"prompt": "x", "rep_pen": "high"}, 422, "rep_pen"),
        ("/api/v1/generate", {"prompt": "x", "dynatemp_range": -1}, 422, "dynatemp_range"),
        ("/api/extra/generate/stream", {"prompt": 5}, 422, "prompt"),
        ("/api/extra/tokencount", {}, 422, "prompt"),
        ("/api/extra/abort", {}, 422, "genkey"),
        ("/api/v1/generate", {"prompt": "x", "n": 2}, 400, "n"),
    ],
)
def test_kobold_errors(http, path, body, status, field):
    r = http.post(path, json=body, headers=U)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert field in json.dumps(err) and err["type"], err


def test_kobold_needs_the_key(http):
    r = http.post("/api/v1/generate", json={"prompt": "x"}, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and "error" in r.json()
    assert http.post("/api/extra/tokencount", json={"prompt": "x"}).status_code == 401


def test_usage_counts_cached_prompt_tokens(http):
    """usage.prompt_tokens_details.cached_tokens: none for a new prompt, the shared prefix's whole pages for a
    prompt that repeats one (page size 16), streamed and not, chat and completions (n=2: counted once)."""
    long = " ".join(f"word{i}" for i in range(120))
    first = http.post("/v1/completions", json={"prompt": long + " A", "max_tokens": 2}, headers=U).json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    again = http.post("/v1/completions", json={"prompt": long + " B", "max_tokens": 2}, headers=U).json()["usage"]
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % 16 == 0 and cached <= again["prompt_tokens"] - 1, again
    r = http.post("/v1/completions", json={"prompt": long + " C", "max_tokens": 2, "stream": True,
                  "stream_options": {"include_usage": True}}, headers=U)  # fmt: skip
    usage = [json.loads(x[6:])["usage"] for x in r.text.splitlines() if x.startswith("data: {") and '"usage"' in x]
    assert usage[-1]["prompt_tokens_details"]["cached_tokens"] == cached
    msgs = [{"role": "user", "content": long}]
    c1 = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2}, headers=U).json()["usage"]
    c2 = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "n": 2}, headers=U).json()
    assert c2["usage"]["prompt_tokens_details"]["cached_tokens"] >= c2["usage"]["prompt_tokens"] - 16
    assert c1["prompt_tokens_details"]["cached_tokens"] <= c2["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_timings_as_llama_cpp_gives_them(http):
    """llama.cpp's `timings` on a reply and on a stream's last chunk: the computed prompt tokens (cached ones not
    counted), the generated tokens, both times positive."""
    body = {"prompt": "The weather today is", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = http.post("/v1/completions", json=body, headers=U).json()
    t, u = r["timings"], r["usage"]
    assert t["predicted_n"] == u["completion_tokens"] == 6
    assert t["prompt_n"] == u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"]
    assert t["prompt_ms"] > 0 and t["predicted_ms"] > 0 and t["predicted_per_second"] > 0
    s = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                  "stream": True}, headers=U)  # fmt: skip
    last = [json.loads(x[6:]) for x in s.text.splitlines() if x.startswith("data: {")][-1]
    assert last["timings"]["predicted_n"] == last["usage"]["completion_tokens"]
