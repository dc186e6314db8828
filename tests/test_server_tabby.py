"""TabbyAPI compatibility of `exl2cpp serve` (SmolLM2 on CPU through FastAPI's TestClient): its sampler fields and
aliases, sampler override presets, its model / token / template / auth endpoints and key headers, inline loading,
idle unload and the reasoning split."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
from fastapi.testclient import TestClient

KEY, ADMIN = "sk-tabby-user", "sk-tabby-admin"
U = {"Authorization": f"Bearer {KEY}"}
A = {"x-admin-key": ADMIN}
MSG = [{"role": "user", "content": "Write a short poem about the sea."}]


def wait_ready(http: TestClient, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while http.get("/health").json().get("status") != "ready":
        assert time.time() < deadline, http.get("/health").json()
        time.sleep(0.1)


@pytest.fixture(scope="module")
def models_dir(smollm2_dir, tmp_path_factory) -> Path:
    """A models folder as TabbyAPI has: one sub-folder per model (here two names for SmolLM2)."""
    d = tmp_path_factory.mktemp("models")
    (d / "smol").symlink_to(smollm2_dir, target_is_directory=True)
    (d / "smol-b").symlink_to(smollm2_dir, target_is_directory=True)
    (d / "not-a-model.txt").write_text("x")
    return d


def make_app(models_dir: Path, tmp: Path, **kw):
    from exl2cpp.server import create_app
    from exl2cpp.server.config import ServeConfig

    cfg = dict(
        model=str(models_dir / "smol"),
        model_name="smol",
        api_keys=[KEY],
        admin_key=ADMIN,
        cache_tokens=4096,
        page_size=16,
        model_dir=str(models_dir),
        sampler_override_dir=str(tmp / "sampler_overrides"),
        templates_dir=str(tmp / "templates"),
    )
    cfg.update(kw)
    return create_app(ServeConfig(**cfg))


@pytest.fixture(scope="module")
def http(models_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tabby")
    (tmp / "sampler_overrides").mkdir()
    (tmp / "templates").mkdir()
    with TestClient(make_app(models_dir, tmp)) as c:
        wait_ready(c)
        c.tmp = tmp
        yield c


def err(r, status: int, param: str | None = None, *words: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"}
    if param is not None:
        assert e["param"] == param, e
    for w in words:
        assert w in e["message"], (w, e["message"])
    return e


def chat(http, headers=U, **body):
    body.setdefault("messages", MSG)
    body.setdefault("max_tokens", 12)
    return http.post("/v1/chat/completions", json=body, headers=headers)


def comp(http, headers=U, **body):
    body.setdefault("max_tokens", 12)
    return http.post("/v1/completions", json=body, headers=headers)


def text_of(r) -> str:
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return c["message"]["content"] if "message" in c else c["text"]


# ---- samplers -------------------------------------------------------------------------------------------------

ALL_SAMPLERS = {
    "temperature": 1.3,
    "top_k": 40,
    "top_p": 0.95,
    "min_p": 0.02,
    "top_a": 0.1,
    "tfs": 0.97,
    "typical_p": 0.98,
    "rep_pen": 1.1,
    "rep_pen_range": 64,
    "frequency_penalty": 0.1,
    "presence_penalty": 0.1,
    "smoothing_factor": 0.3,
    "smoothing_curve": 1.5,
    "dynatemp_low": 0.5,
    "dynatemp_high": 1.5,
    "dynatemp_exponent": 1.0,
    "dry_multiplier": 0.8,
    "dry_base": 1.75,
    "dry_allowed_length": 2,
    "dry_range": 256,
    "dry_sequence_breakers": '"\\n", ":", "\\""',
    "xtc_probability": 0.5,
    "xtc_threshold": 0.1,
    "mirostat_mode": 2,
    "mirostat_tau": 3.0,
    "mirostat_eta": 0.2,
    "min_tokens": 4,
    "banned_tokens": "28, 30",
    "temperature_last": True,
}


def test_tabby_samplers_are_accepted_and_seeded(http):
    """Every TabbyAPI sampler at once, by its aliases: the same seed gives the same text twice (and on both
    endpoints), another seed another text."""
    for call, extra in ((chat, {}), (comp, {"prompt": "Once upon a time"})):
        a = text_of(call(http, seed=1234, max_tokens=24, **extra, **ALL_SAMPLERS))
        b = text_of(call(http, seed=1234, max_tokens=24, **extra, **ALL_SAMPLERS))
        assert a == b and a
        others = {text_of(call(http, seed=s, max_tokens=24, **extra, **ALL_SAMPLERS)) for s in (1, 2, 3)}
        assert others - {a}, "three other seeds all gave the seed-1234 text"


def test_seed_holds_with_a_second_request_alongside(http):
    """The same seeded request alone and with another one running at once (n=2: two jobs in one batch)."""
    body = dict(ALL_SAMPLERS, seed=99, max_tokens=20, prompt="The weather today")
    alone = text_of(comp(http, **body))
    r = comp(http, **dict(body, n=2))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == alone


def test_min_tokens_holds_back_eos(http):
    base = dict(messages=[{"role": "user", "content": "Say hi."}], temperature=0, max_tokens=60)
    r = chat(http, **base)
    short = r.json()["usage"]["completion_tokens"]
    assert r.json()["choices"][0]["finish_reason"] == "stop" and short < 40
    r = chat(http, **base, min_length=short + 10)  # TabbyAPI's alias
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= short + 10


def test_banned_and_allowed_tokens(http):
    prompt = "The capital of France is"
    r = comp(http, prompt=prompt, temperature=0, max_tokens=1, logprobs=1)
    first = r.json()["choices"][0]["logprobs"]["tokens"][0]
    slot = http.app.state.slot
    ids = slot.model.tokenizer.encode(first, add_bos=False)
    assert len(ids) == 1
    banned = text_of(comp(http, prompt=prompt, temperature=0, max_tokens=1, banned_tokens=f"{ids[0]}"))
    assert banned and banned != first
    banned_list = text_of(comp(http, prompt=prompt, temperature=0, max_tokens=1, custom_token_bans=ids))
    assert banned_list == banned
    only = slot.model.tokenizer.encode(" Paris", add_bos=False) + slot.model.tokenizer.encode(" London", add_bos=False)
    out = comp(http, prompt=prompt, temperature=1.0, seed=5, max_tokens=6, allowed_tokens=only, ignore_eos=True)
    assert out.status_code == 200, out.text
    assert set(out.json()["choices"][0]["text"].split()) <= {"Paris", "London"}


def test_xtc_takes_the_second_choice(http):
    """With two survivors (top_k 2), threshold 0 and probability 1, XTC removes the more likely one: every token
    is the second of the greedy top-2 at its position."""
    prompt = "Here is a list of fruits: apple,"
    r = comp(
        http, prompt=prompt, max_tokens=6, temperature=1.0, top_k=2, xtc_probability=1.0, xtc_threshold=0.0,
        seed=3, logprobs=2, ignore_eos=True,
    )  # fmt: skip
    lp = r.json()["choices"][0]["logprobs"]
    for t, tops in zip(lp["tokens"], lp["top_logprobs"]):
        ranked = sorted(tops.items(), key=lambda kv: -kv[1])
        assert t == ranked[1][0], (t, ranked)


def test_dry_ends_a_repetition(http):
    """Greedy SmolLM2 continues "1, 2, 3," for ever; with DRY the repeated sequence is penalised away."""
    prompt = "1, 2, 3, 1, 2, 3, 1, 2, 3,"
    plain = text_of(comp(http, prompt=prompt, temperature=0, max_tokens=12))
    assert plain.startswith(" 1, 2, 3"), plain
    dry = text_of(
        comp(http, prompt=prompt, temperature=0, max_tokens=12, dry_multiplier=3.0, dry_base=1.75, dry_allowed_length=2,
             dry_sequence_breakers=["\n"])
    )  # fmt: skip
    assert not dry.startswith(" 1, 2"), dry


def test_ban_eos_and_stop_token_ids(http):
    r = chat(http, messages=[{"role": "user", "content": "Say hi."}], temperature=0, max_tokens=40, ban_eos_token=True)
    assert r.json()["usage"]["completion_tokens"] == 40
    slot = http.app.state.slot
    ids = slot.model.tokenizer.encode(" Paris", add_bos=False)
    r = comp(http, prompt="The capital of France is", temperature=0, max_tokens=8, stop_sequence=[ids[0]])
    assert r.json()["choices"][0]["finish_reason"] == "stop", r.text
    assert r.json()["choices"][0]["text"] == ""


def test_sampler_field_errors(http):
    err(chat(http, mirostat_mode=1), 400, "mirostat_mode", "mirostat v1")
    err(chat(http, mirostat=3), 400, "mirostat_mode")
    err(chat(http, dry_multiplier=1.0, dry_base=0.5), 400, "dry_base", ">= 1")
    err(chat(http, dry_multiplier=1.0, dry_allowed_length=0), 400, "dry_allowed_length")
    err(chat(http, min_temp=2.0, max_temp=1.0), 400, "min_temp")
    err(chat(http, min_tokens=50, max_tokens=10), 400, "min_tokens")
    err(chat(http, banned_tokens=[10**7]), 400, "banned_tokens", "vocabulary")
    err(chat(http, banned_tokens="1,x"), 422, "banned_tokens")
    err(chat(http, allowed_tokens=["a"]), 422, "allowed_tokens.0")
    err(chat(http, dry_sequence_breakers="[\"a\""), 422, "dry_sequence_breakers")
    err(chat(http, tfs=0), 422, "tfs")
    err(chat(http, smoothing_curve=4), 422, "smoothing_curve")
    err(chat(http, xtc_probability=1.5), 422, "xtc_probability")
    err(chat(http, typical_p=0), 422, "typical_p")
    err(chat(http, rep_pen="1.1"), 422, "rep_pen")
    err(chat(http, token_healing=True), 400, "token_healing", "not supported")
    err(chat(http, skew=0.5), 400, "skew")
    err(chat(http, adaptive_target=0.5, adaptive_decay=0.9), 400, "adaptive_target", "adaptive-P")
    err(chat(http, loop_detect_window=8, ban_eos_token=True), 400, "loop_detect_window", "ignore_eos")
    err(chat(http, loop_detect_window=8, banned_strings=["x"]), 400, "loop_detect_window", "banned_strings")
    err(chat(http, loop_detect_window=-1), 422, "loop_detect_window")
    err(chat(http, temperature=11), 422, "temperature")
    err(chat(http, stop=[10**7]), 400, "stop")
    # neutral values of samplers that are off are fine (TabbyAPI's own defaults: dry_base 0, allowed_length 0)
    r = chat(http, dry_multiplier=0, dry_base=0, dry_allowed_length=0, xtc_probability=0, mirostat_mode=0,
             token_healing=False, skew=0, temperature=0, adaptive_target=1.0, adaptive_decay=0.9,
             loop_detect_window=0)  # fmt: skip
    assert r.status_code == 200, r.text


def test_loop_detection(http):
    """loop_detect_window: the job ends (EOS) right after the first token at which its last `window` tokens repeat
    one pattern; the tokens before are the plain run's."""
    from exl2cpp.server.loop_stop import LoopStop, loops

    engine, tok = http.app.state.slot.engine, http.app.state.slot.model.tokenizer
    prompt = tok.encode("1, 2, 3, 1, 2, 3, 1, 2, 3,")
    job = engine.submit(prompt, max_new_tokens=40, temperature=0.0)
    job.result()
    plain = job.token_ids
    for window in (18, 20, 27):  # the pattern " 1, 2, 3," is 9 tokens
        k = next(k for k in range(1, len(plain) + 1) if loops(plain[:k], window))
        job = engine.submit(prompt, max_new_tokens=40, temperature=0.0,
                            constraint=LoopStop(window, tok.eos_id, tok.vocab_size))  # fmt: skip
        job.result()
        assert k == window and job.token_ids == plain[:k] + [tok.eos_id] and job.finish_reason == "stop_token"
    assert not loops([1, 2, 3, 1, 2, 4], 6) and loops([5, 1, 2, 1, 2], 4) and loops([7] * 4, 4)
    # through the server: the same stop, "stop" as the reason, streamed or not
    r = comp(http, prompt="1, 2, 3, 1, 2, 3, 1, 2, 3,", temperature=0, max_tokens=40, loop_detect_window=20)
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "stop" and r.json()["usage"]["completion_tokens"] < 40, r.text
    assert c["text"] == tok.decode(plain[:20])


def test_tabby_constrained_output_fields(http):
    """TabbyAPI's json_schema, regex_pattern and grammar_string (Lark or GBNF) constrain the output as
    response_format does; one at a time; a bad one is a 400 naming it."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
    out = json.loads(text_of(chat(http, json_schema=schema, max_tokens=20, temperature=0)))
    assert set(out) == {"n"} and isinstance(out["n"], int)
    import re

    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text_of(comp(http, prompt="Code:", regex_pattern="[0-9]{3}-[a-z]{2}",
                                                            max_tokens=20)))  # fmt: skip
    for grammar in ('start: "yes" | "no"', 'root ::= "red" | "blue"'):
        got = text_of(chat(http, grammar_string=grammar, max_tokens=10))
        assert got in ({"yes", "no"} if "start" in grammar else {"red", "blue"}), (grammar, got)
    err(chat(http, json_schema=schema, regex_pattern="a"), 400, "regex_pattern", "one of")
    err(chat(http, response_format={"type": "json_object"}, grammar_string='start: "a"'), 400, "grammar_string")
    err(chat(http, regex_pattern="(unclosed"), 400, "regex_pattern")
    err(chat(http, grammar_string="root ::= ( \"x\""), 400, "grammar_string")
    err(chat(http, json_schema={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}), 400, "json_schema")


def test_add_bos_token(http):
    """add_bos_token: a BOS before a completion prompt or not; in a chat, false drops the one the template wrote."""
    tok = http.app.state.slot.model.tokenizer
    n = {b: comp(http, prompt="Hello", max_tokens=1, add_bos_token=b).json()["usage"]["prompt_tokens"]
         for b in (True, False)}  # fmt: skip
    assert n[True] == n[False] + 1 == len(tok.encode("Hello", add_bos=False)) + 1
    with_bos = chat(http, max_tokens=1).json()["usage"]["prompt_tokens"]
    assert chat(http, max_tokens=1, add_bos_token=False).json()["usage"]["prompt_tokens"] == with_bos - 1


# ---- sampler override presets ---------------------------------------------------------------------------------


def test_sampler_presets(http):
    folder = http.tmp / "sampler_overrides"
    (folder / "greedy.yml").write_text("temperature:\n  override: 0\n  force: true\nmax_tokens:\n  override: 5\n")
    (folder / "banned.yml").write_text(
        "banned_strings:\n  override: [' Paris']\n  additive: true\nadaptive_target:\n  override: 1.0\n"
    )
    (folder / "broken.yml").write_text("rep_pen:\n  override: fast\n")
    (folder / "unknown.yml").write_text("warp_drive:\n  override: 1\n")
    r = http.get("/v1/sampling/override/list", headers=A)
    assert r.json() == {"selected_preset": None, "overrides": {}, "presets": ["banned", "broken", "greedy", "unknown"]}
    assert http.get("/v1/sampling/overrides", headers=U).json()["presets"] == []  # presets: admin only
    prompt = {"prompt": "The capital of France is", "max_tokens": 8}
    greedy = text_of(comp(http, temperature=0, **prompt))
    err(http.post("/v1/sampling/override/switch", json={"preset": "greedy"}, headers=U), 403)
    r = http.post("/v1/sampling/override/switch", json={"preset": "greedy"}, headers=A)
    assert r.status_code == 200, r.text
    assert http.get("/v1/sampling/override/list", headers=U).json()["selected_preset"] == "greedy"
    # forced temperature 0: a hot seeded request gives the greedy text; default max_tokens 5 when none is sent
    assert text_of(comp(http, temperature=2.0, seed=7, **prompt)) == greedy
    r = comp(http, prompt="The capital of France is", temperature=0, max_tokens=None)
    assert r.json()["usage"]["completion_tokens"] == 5
    r = chat(http, temperature=0, max_tokens=None, min_p=0.0)
    assert r.json()["usage"]["completion_tokens"] == 5
    r = chat(http, temperature=0, max_completion_tokens=7)
    assert r.json()["usage"]["completion_tokens"] == 7  # a default: what the request sent wins
    (folder / "short.yml").write_text("max_tokens:\n  override: 3\n  force: true\n")
    assert http.post("/v1/sampling/override/switch", json={"preset": "short"}, headers=A).status_code == 200
    r = chat(http, temperature=0, max_completion_tokens=7, ignore_eos=True)
    assert r.json()["usage"]["completion_tokens"] == 3  # forced: whichever name the request used
    # additive list: the preset's banned string goes with the request's own
    assert http.post("/v1/sampling/override/switch", json={"preset": "banned"}, headers=A).status_code == 200
    assert "adaptive_target" not in http.get("/v1/sampling/override/list", headers=A).json()["overrides"]
    out = text_of(comp(http, temperature=0, banned_strings=["zzz"], **prompt))
    assert " Paris" not in out and out != greedy
    # overrides given inline, then unload
    r = http.post("/v1/sampling/override/switch", json={"overrides": {"top_k": {"override": 1, "force": True}}},
                  headers=A)  # fmt: skip
    assert r.status_code == 200 and r.json()["selected_preset"] is None
    assert text_of(comp(http, temperature=1.5, seed=3, **prompt)) == greedy
    assert http.post("/v1/sampling/override/unload", headers=A).status_code == 200
    assert http.get("/v1/sampling/override/list", headers=A).json()["overrides"] == {}
    # errors
    err(http.post("/v1/sampling/override/switch", json={"preset": "nope"}, headers=A), 400, "preset", "does not exist")
    err(http.post("/v1/sampling/override/switch", json={"preset": "../greedy"}, headers=A), 400, "preset")
    err(http.post("/v1/sampling/override/switch", json={"preset": "broken"}, headers=A), 400, "preset", "rep_pen")
    err(http.post("/v1/sampling/override/switch", json={"preset": "unknown"}, headers=A), 400, "preset", "warp_drive")
    err(http.post("/v1/sampling/override/switch", json={}, headers=A), 400, "preset")
    err(http.post("/v1/sampling/override/switch", json={"overrides": {"top_k": 3}}, headers=A), 400, "overrides")
    err(http.post("/v1/sampling/override/switch", json={"preset": 3}, headers=A), 422, "preset")
    assert http.get("/v1/sampling/override/list", headers=A).json()["overrides"] == {}  # failures changed nothing


def test_sampler_preset_at_start(models_dir, tmp_path):
    from exl2cpp.errors import InvalidArgumentError

    (tmp_path / "sampler_overrides").mkdir()
    (tmp_path / "sampler_overrides" / "cold.yml").write_text("temperature:\n  override: 0.1\n")
    app = make_app(models_dir, tmp_path, sampler_preset="cold", model=None)
    assert app.state.overrides.selected_preset == "cold"
    with pytest.raises(InvalidArgumentError, match="hot"):
        make_app(models_dir, tmp_path, sampler_preset="hot", model=None)


# ---- TabbyAPI endpoints ---------------------------------------------------------------------------------------


def sse_events(r) -> list:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]


def test_auth_headers_and_permission(http):
    assert http.get("/v1/auth/permission", headers={"x-api-key": KEY}).json() == {"permission": "api"}
    assert http.get("/v1/auth/permission", headers={"x-admin-key": ADMIN}).json() == {"permission": "admin"}
    assert http.get("/v1/auth/permission", headers={"x-api-key": ADMIN}).json() == {"permission": "admin"}
    assert http.get("/v1/auth/permission", headers={"Authorization": f"Bearer {ADMIN}"}).json()["permission"] == "admin"
    err(http.get("/v1/auth/permission"), 401, None, "x-api-key")
    err(http.get("/v1/auth/permission", headers={"x-api-key": "wrong"}), 401)
    # x-admin-key is looked at first (TabbyAPI's order): a wrong one is not rescued by a good Authorization
    err(http.get("/v1/auth/permission", headers={"x-admin-key": "wrong", **U}), 401)
    assert chat(http, headers={"x-api-key": KEY}).status_code == 200
    err(http.post("/v1/model/unload", headers={"x-api-key": KEY}), 403)
    err(http.post("/v1/template/switch", json={"prompt_template_name": "x"}, headers=U), 403)
    err(http.post("/v1/model/load", json={"model_name": "smol"}, headers=U), 403)
    valid = {"model_name": "smol-b", "prompt_template_name": "x", "preset": "x"}  # each route reads its field
    for path in ("/v1/model/load", "/v1/model/unload", "/v1/template/switch", "/v1/template/unload",
                 "/v1/sampling/override/switch", "/v1/sampling/override/unload"):  # fmt: skip
        e = err(http.post(path, json=valid, headers={"x-api-key": KEY}), 403)
        assert e["code"] == "insufficient_permissions"
        err(http.post(path, json=valid), 401)
    for path in ("/v1/model", "/v1/model/list", "/v1/template/list", "/v1/sampling/override/list"):
        err(http.get(path), 401)
    for path in ("/v1/token/encode", "/v1/token/decode"):
        err(http.post(path, json={"text": "a", "tokens": [1]}), 401)


def test_model_card_and_list(http):
    card = http.get("/v1/model", headers=U).json()
    assert card["id"] == "smol" and card["object"] == "model"
    p = card["parameters"]
    slot = http.app.state.slot
    assert p["max_seq_len"] == slot.model.max_seq_len and p["cache_size"] >= 4096
    assert p["cache_mode"] == slot.engine.cache_type.upper() and p["chunk_size"] == 2048
    assert p["prompt_template"] == "tokenizer_config" and "im_start" in p["prompt_template_content"]
    assert [m["id"] for m in http.get("/v1/model/list", headers=A).json()["data"]] == ["smol", "smol-b"]
    assert [m["id"] for m in http.get("/v1/model/list", headers=U).json()["data"]] == ["smol"]


def test_token_encode_decode(http):
    tok = http.app.state.slot.model.tokenizer
    r = http.post("/v1/token/encode", json={"text": "Hello world"}, headers=U).json()
    assert r == {"tokens": tok.encode("Hello world", add_bos=True), "length": len(r["tokens"])}
    assert r["tokens"][0] == tok.bos_id
    r = http.post("/v1/token/encode", json={"text": "Hello world", "add_bos_token": False}, headers=U).json()
    assert r["tokens"] == tok.encode("Hello world", add_bos=False)
    special = http.post("/v1/token/encode", json={"text": "<|im_start|>", "add_bos_token": False}, headers=U).json()
    plain = http.post("/v1/token/encode", json={"text": "<|im_start|>", "add_bos_token": False,
                                                "encode_special_tokens": False}, headers=U).json()  # fmt: skip
    assert special["length"] == 1 and plain["length"] > 1
    msgs = [{"role": "user", "content": "Hi"}]
    # a chat: rendered without the generation prompt; add_bos_token alone says whether the BOS is there (SmolLM2's
    # BOS is <|im_start|>, which its template writes first)
    rendered = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert rendered.startswith(tok.bos_token)
    r = http.post("/v1/token/encode", json={"text": msgs}, headers=U).json()
    assert r["tokens"] == tok.encode(rendered, add_bos=True)
    r = http.post("/v1/token/encode", json={"text": msgs, "add_bos_token": False}, headers=U).json()
    assert r["tokens"] == tok.encode(rendered[len(tok.bos_token):], add_bos=False)
    ids = tok.encode("<|im_start|>user Hi", add_bos=False)
    assert http.post("/v1/token/decode", json={"tokens": ids}, headers=U).json() == {"text": tok.decode(ids)}
    r = http.post("/v1/token/decode", json={"tokens": ids, "decode_special_tokens": False}, headers=U).json()
    assert r["text"] == tok.decode(ids, skip_special=True) and "im_start" not in r["text"]
    err(http.post("/v1/token/decode", json={"tokens": [10**8]}, headers=U), 400, "tokens")
    err(http.post("/v1/token/decode", json={"tokens": "1,2"}, headers=U), 422, "tokens")
    err(http.post("/v1/token/encode", json={"text": 5}, headers=U), 422)
    err(http.post("/v1/token/encode", json={"text": msgs, "template_vars": {"messages": []}}, headers=U), 400,
        "template_vars")  # fmt: skip


def test_templates(http):
    folder = http.tmp / "templates"
    (folder / "plain.jinja").write_text(
        "{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
    )
    (folder / "broken.jinja").write_text("{% for m in messages %}")
    assert http.get("/v1/template/list", headers=A).json() == {"object": "list", "data": ["broken", "plain"]}
    assert http.get("/v1/templates", headers=U).json()["data"] == ["tokenizer_config"]
    r = http.post("/v1/template/switch", json={"prompt_template_name": "plain"}, headers=A)
    assert r.status_code == 200, r.text
    msgs = [{"role": "user", "content": "Hi"}]
    tok = http.app.state.slot.model.tokenizer
    r = http.post("/v1/token/encode", json={"text": msgs, "add_bos_token": False}, headers=U).json()
    assert tok.decode(r["tokens"]) == "USER: Hi\n"
    assert http.get("/v1/model", headers=U).json()["parameters"]["prompt_template"] == "plain"
    assert chat(http, messages=msgs, temperature=0).status_code == 200
    err(http.post("/v1/template/switch", json={"prompt_template_name": "broken"}, headers=A), 400,
        "prompt_template_name")  # fmt: skip
    err(http.post("/v1/template/switch", json={"prompt_template_name": "nope"}, headers=A), 400,
        "prompt_template_name", "doesn't exist")  # fmt: skip
    err(http.post("/v1/template/switch", json={"prompt_template_name": "../templates/plain"}, headers=A), 400,
        "prompt_template_name")  # fmt: skip
    assert http.post("/v1/template/unload", headers=A).status_code == 200
    r = http.post("/v1/token/encode", json={"text": msgs, "add_bos_token": False}, headers=U).json()
    assert "im_start" in tok.decode(r["tokens"])


def test_model_load_errors(http):
    def load(**body):
        return http.post("/v1/model/load", json=body, headers=A)

    err(load(model_name="nope"), 400, "model_name", "Could not find")
    err(load(model_name="../smol"), 400, "model_name")
    err(load(model_name="/etc"), 400, "model_name")
    err(load(model_name="not-a-model.txt"), 400, "model_name")
    err(load(model_name="smol", cache_mode="Q3"), 400, "cache_mode")
    err(load(model_name="smol", tensor_parallel=True), 400, "tensor_parallel", "CUDA")
    err(load(model_name="smol", gpu_split=[10, 10]), 400, "gpu_split", "CUDA")
    err(load(model_name="smol", rope_scale=2.0), 400, "rope_scale")
    err(load(model_name="smol", rope_alpha="auto"), 400, "rope_alpha")
    err(load(model_name="smol", vision=True), 400, "vision")
    for draft, field in (({"draft_model_name": "../smol"}, "draft_model_name"), ({"draft_mode": "mtp"}, "draft_mode"),
                         ({"draft_model_name": "smol-b", "draft_rope_scale": 2.0}, "draft_rope_scale"),
                         ({"draft_model_name": "smol-b", "draft_gpu_split": [4.0]}, "draft_gpu_split"),
                         ({"draft_model_name": "smol-b", "draft_cache_mode": "Q4"}, "draft_cache_mode"),
                         ({"draft_model_name": "smol-b", "draft_num_tokens": 0}, "draft_num_tokens"),
                         ({"draft_model_name": "smol-b", "dynamic_draft": False}, "dynamic_draft"),
                         ({"draft_mode": "ngram", "ngram_match_min": 0}, "ngram_match_min")):  # fmt: skip
        err(load(model_name="smol", draft_model=draft), 400, "draft_model." + field)
    err(load(model_name="smol", draft_model={"draft_model_name": "smol-b", "draft_model_dir": "/"}), 422)
    err(load(model_name="smol", draft_model={"draft_model_name": 3}), 422)
    err(load(model_name="smol", backend="exllamav3"), 400, "backend")
    err(load(model_name="smol", max_seq_len=2**40), 400, "max_seq_len")
    err(load(model_name="smol", cache_size=0), 422, "cache_size")
    err(load(model_name=7), 422, "model_name")
    assert http.get("/v1/model", headers=U).json()["id"] == "smol"  # still serving


def test_model_load_and_unload(models_dir, tmp_path):
    with TestClient(make_app(models_dir, tmp_path)) as c:
        wait_ready(c)
        r = c.post("/v1/model/load", headers=A, json={
            "model_name": "smol-b", "max_seq_len": 1024, "cache_mode": "Q8", "cache_size": 2048, "chunk_size": 256,
            "gpu_split_auto": True, "rope_scale": 1.0, "max_batch_size": 4,
        })  # fmt: skip
        events = sse_events(r)
        # TabbyAPI's sequence: "processing" after each module (embedding, 30 layers, head), then "finished"
        n = c.app.state.slot.model.config["num_hidden_layers"] + 2
        assert [(e["module"], e["modules"], e["status"]) for e in events] == [
            *((k, n, "processing") for k in range(1, n + 1)), (n, n, "finished")]
        assert all(set(e) == {"model_type", "module", "modules", "status"} and e["model_type"] == "model"
                   for e in events)  # fmt: skip
        card = c.get("/v1/model", headers=U).json()
        assert card["id"] == "smol-b"
        p = card["parameters"]
        assert (p["max_seq_len"], p["cache_mode"], p["chunk_size"], p["max_batch_size"]) == (1024, "Q8", 256, 4)
        assert p["cache_size"] >= 2048
        assert text_of(chat(c, model="smol-b", temperature=0))
        err(chat(c, model="smol"), 404, "model")  # inline loading is off
        r = c.post("/v1/model/unload", headers=A)
        assert r.status_code == 200 and c.get("/health").json()["status"] == "unloaded"
        err(c.get("/v1/model", headers=U), 503)
        err(c.post("/v1/model/unload", headers=A), 503)
        r = c.post("/v1/model/load", headers=A, json={"model_name": "smol", "cache_mode": "FP16"})
        assert sse_events(r)[-1]["status"] == "finished"
        assert c.get("/v1/model", headers=U).json()["parameters"]["cache_mode"] == "FP16"


def test_load_progress_callback(smollm2_dir):
    """exl2cpp.load's progress: after the embedding, each layer and the head; a tensor-parallel load once, at the
    end; an exception raised in it ends the load with that exception."""
    import exl2cpp

    seen = []
    m = exl2cpp.load(smollm2_dir, progress=lambda done, total: seen.append((done, total)))
    n = m.config["num_hidden_layers"] + 2
    assert seen == [(k, n) for k in range(1, n + 1)]
    seen.clear()
    exl2cpp.load(smollm2_dir, tensor_parallel=3, progress=lambda done, total: seen.append((done, total)))
    assert seen == [(n, n)]

    def stop(done, total):
        if done == 3:
            raise KeyError("stop here")

    with pytest.raises(KeyError, match="stop here"):
        exl2cpp.load(smollm2_dir, progress=stop)


def test_model_load_with_draft(models_dir, tmp_path):
    """TabbyAPI's draft_model: the draft loads first (its own progress events), the engine decodes speculatively
    with it (greedy output as without), and /v1/model shows its card; ngram and disabled modes."""
    with TestClient(make_app(models_dir, tmp_path)) as c:
        wait_ready(c)
        want = text_of(chat(c, temperature=0, max_tokens=24))
        assert c.get("/v1/model", headers=U).json()["parameters"]["draft"] is None
        r = c.post("/v1/model/load", headers=A, json={"model_name": "smol", "draft_model": {
            "draft_model_name": "smol-b", "draft_num_tokens": 3, "draft_cache_mode": "FP32", "dynamic_draft": True}})
        events = sse_events(r)
        n = c.app.state.slot.model.config["num_hidden_layers"] + 2
        assert [(e["model_type"], e["module"], e["status"]) for e in events] == [
            *(("draft", k, "processing") for k in range(1, n + 1)), ("draft", n, "finished"),
            *(("model", k, "processing") for k in range(1, n + 1)), ("model", n, "finished")]  # fmt: skip
        draft = c.get("/v1/model", headers=U).json()["parameters"]["draft"]
        assert draft["id"] == "smol-b" and draft["object"] == "model"
        assert (draft["parameters"]["draft_num_tokens"], draft["parameters"]["cache_mode"]) == (3, "FP32")
        assert text_of(chat(c, temperature=0, max_tokens=24))
        st = c.get("/admin/stats", headers=A).json()["engine"]
        assert st["spec_proposed"] > 0 and st["spec_accepted"] > st["spec_proposed"] // 2, st
        r = c.post("/v1/model/load", headers=A, json={"model_name": "smol", "draft_model": {"draft_mode": "ngram",
                                                                                          "ngram_match_min": 3}})
        assert [e["model_type"] for e in sse_events(r)] == ["model"] * (n + 1)
        assert c.get("/v1/model", headers=U).json()["parameters"]["draft"] is None
        assert c.app.state.slot.spec.draft == {"draft_model": None, "draft_tokens": 4, "ngram_draft": True,
                                               "ngram_sizes": [4, 3]}  # fmt: skip
        assert text_of(chat(c, temperature=0, max_tokens=24)) == want
        r = c.post("/v1/model/load", headers=A, json={"model_name": "smol", "draft_model": {"draft_mode": "disabled"}})
        assert sse_events(r)[-1]["status"] == "finished"
        assert c.get("/admin/stats", headers=A).json()["engine"]["spec_proposed"] == 0


# ---- inline loading, idle unload, --cache-type ----------------------------------------------------------------


def test_inline_model_loading(models_dir, tmp_path):
    with TestClient(make_app(models_dir, tmp_path, inline_model_loading=True)) as c:
        wait_ready(c)
        err(chat(c, model="smol-b"), 403, "model", "admin key")  # a user key cannot switch the model
        assert c.get("/v1/model", headers=U).json()["id"] == "smol"
        err(chat(c, model="missing", headers=A), 404, "model")
        err(chat(c, model="../smol", headers=A), 404, "model")
        r = chat(c, model="smol-b", headers=A, temperature=0)
        assert r.status_code == 200 and r.json()["model"] == "smol-b", r.text
        assert c.get("/v1/model", headers=U).json()["id"] == "smol-b"
        r = comp(c, model="smol-b", prompt="Hi", headers=U)  # the model serving: any key
        assert r.status_code == 200, r.text


def test_idle_unload_and_reload(models_dir, tmp_path):
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "plain.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with TestClient(make_app(models_dir, tmp_path, idle_unload_s=0.5)) as c:
        wait_ready(c)
        assert c.post("/v1/template/switch", json={"prompt_template_name": "plain"}, headers=A).status_code == 200
        want = text_of(chat(c, temperature=0))
        deadline = time.time() + 20
        while c.get("/health").json()["status"] != "idle":
            assert time.time() < deadline, c.get("/health").json()
            time.sleep(0.1)
        assert c.get("/health").status_code == 200
        assert c.app.state.slot.engine is None  # the model's memory is free
        assert text_of(chat(c, temperature=0)) == want  # loaded again, with the template it had
        assert c.get("/health").json()["status"] == "ready"
        assert c.get("/v1/model", headers=U).json()["parameters"]["prompt_template"] == "plain"
        # an admin unload is not idleness: nothing comes back by itself
        assert c.post("/v1/model/unload", headers=A).status_code == 200
        assert c.get("/health").json()["status"] == "unloaded"
        err(chat(c), 503)


def test_serve_cli_cache_type_and_presets(models_dir, tmp_path):
    """A real `exl2cpp serve` process with the TabbyAPI options on its command line, driven with TabbyAPI's headers."""
    httpx = pytest.importorskip("httpx")
    from test_server import ServerProc

    (tmp_path / "presets").mkdir()
    (tmp_path / "presets" / "cold.yml").write_text("temperature:\n  override: 0\n  force: true\n")
    srv = ServerProc(
        models_dir / "smol", "--api-key", KEY, "--admin-key", ADMIN, "--model-name", "smol", "--cache-type", "q4",
        "--cache-tokens", "2048", "--model-dir", str(models_dir), "--sampler-override-dir", str(tmp_path / "presets"),
        "--sampler-preset", "cold", "--inline-model-loading",
    )  # fmt: skip
    try:
        card = httpx.get(srv.url + "/v1/model", headers={"x-api-key": KEY}, timeout=30).json()
        assert card["parameters"]["cache_mode"] == "Q4"
        lst = httpx.get(srv.url + "/v1/sampling/override/list", headers={"x-admin-key": ADMIN}, timeout=30).json()
        assert lst["selected_preset"] == "cold" and lst["presets"] == ["cold"]
        body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.8, "rep_pen": 1.05}
        a = httpx.post(srv.url + "/v1/completions", json={**body, "seed": 1}, headers={"x-api-key": KEY}, timeout=60)
        b = httpx.post(srv.url + "/v1/completions", json={**body, "seed": 2}, headers={"x-api-key": KEY}, timeout=60)
        assert a.status_code == 200 and a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]  # forced 0
        r = httpx.post(srv.url + "/v1/chat/completions", headers={"x-admin-key": ADMIN}, timeout=120,
                       json={"model": "smol-b", "messages": MSG, "max_tokens": 4})  # fmt: skip
        assert r.status_code == 200 and r.json()["model"] == "smol-b", r.text
        # a TabbyAPI-style request set: token encode/decode, DRY / XTC fields, a model load with cache_mode
        user = {"x-api-key": KEY}
        enc = httpx.post(srv.url + "/v1/token/encode", json={"text": "Hello there"}, headers=user, timeout=30).json()
        assert set(enc) == {"tokens", "length"} and enc["length"] == len(enc["tokens"])
        dec = httpx.post(srv.url + "/v1/token/decode", json={"tokens": enc["tokens"], "decode_special_tokens": False},
                         headers=user, timeout=30).json()  # fmt: skip
        assert dec == {"text": "Hello there"}
        r = httpx.post(srv.url + "/v1/chat/completions", headers=user, timeout=120, json={
            "model": "smol-b", "messages": MSG, "max_tokens": 8, "dry_multiplier": 0.8, "dry_base": 1.75,
            "dry_allowed_length": 2, "dry_sequence_breakers": '"\\n", ":"', "xtc_probability": 0.5,
            "xtc_threshold": 0.1, "min_p": 0.05, "top_k": -1, "stream": True,
        })  # fmt: skip
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
        with httpx.stream("POST", srv.url + "/v1/model/load", headers={"x-admin-key": ADMIN}, timeout=120,
                          json={"model_name": "smol", "cache_mode": "Q6", "max_seq_len": 2048}) as r:  # fmt: skip
            events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ")]
        assert events[-1]["status"] == "finished", events
        card = httpx.get(srv.url + "/v1/model", headers=user, timeout=30).json()
        assert (card["id"], card["parameters"]["cache_mode"], card["parameters"]["max_seq_len"]) == ("smol", "Q6", 2048)
    finally:
        srv.stop()


# ---- reasoning ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, inside, want",
    [
        ("<think>a</think>b", False, ("a", "b")),
        ("  <think>\nstep 1\nstep 2\n</think>\n\nThe answer.", False, ("\nstep 1\nstep 2\n", "The answer.")),
        ("no thoughts</think> here", False, (None, "no thoughts</think> here")),
        ("text <think>x</think>", False, (None, "text <think>x</think>")),
        ("<think>unfinished", False, ("unfinished", "")),
        ("opened by the prompt</think>answer <think>y</think>", True, ("opened by the prompt", "answer <think>y</think>")),  # noqa: E501
        ("", True, ("", "")),
        ("<thi", False, (None, "<thi")),
        ("<think>a</thin", False, ("a</thin", "")),
    ],
)
def test_reasoning_split(text, inside, want):
    """The whole-reply split, and the same from every way of cutting the reply into streamed pieces."""
    import random

    from exl2cpp.server.reasoning import ReasoningSplitter, split

    assert split(text, "<think>", "</think>", inside) == want
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        s = ReasoningSplitter("<think>", "</think>", inside)
        r, c = "", ""
        for piece in pieces:
            dr, dc = s.push(piece)
            r, c = r + dr, c + dc
        dr, dc = s.flush()
        assert (r + dr, c + dc) == ((want[0] or ""), want[1]), pieces


def test_reasoning_markers_of_the_model(http):
    from exl2cpp.server.reasoning import model_markers, opens_reasoning

    tok = http.app.state.slot.model.tokenizer
    assert model_markers(tok) is None  # SmolLM2 names none
    assert model_markers(tok, "{{ '[THINK]' }}...{{ '[/THINK]' }}") == ("[THINK]", "[/THINK]")
    assert opens_reasoning("<|im_start|>assistant\n<think>\n", "<think>")
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n", "<think>")


FEW_SHOT = (
    "Q: 2+2?\nA: <think>two plus two is four</think>4\nQ: 3+3?\nA: <think>three plus three is six</think>6\n"
    "{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:{% if enable_thinking %} <think>{% endif %}"
)


def test_reasoning_content_streamed_and_not(http):
    """A template that opens the reasoning (and names <think>, so "auto" turns the split on): SmolLM2 follows the
    few-shot pattern, "five plus five is ...</think>8"."""
    (http.tmp / "templates" / "thinker.jinja").write_text(FEW_SHOT)
    assert http.post("/v1/template/switch", json={"prompt_template_name": "thinker"}, headers=A).status_code == 200
    try:
        body = dict(messages=[{"role": "user", "content": "5+5?"}], temperature=0, max_tokens=30, stop=["\nQ:"],
                    chat_template_kwargs={"enable_thinking": True})  # fmt: skip
        r = chat(http, **body)
        msg = r.json()["choices"][0]["message"]
        assert msg["reasoning_content"].startswith("five plus five is"), msg
        assert "</think>" not in msg["reasoning_content"] and msg["content"] and "think" not in msg["content"]
        # the raw text is the two joined by the marker
        raw = text_of(comp(http, prompt=_render(http, body), temperature=0, max_tokens=30, stop=["\nQ:"]))
        assert raw == msg["reasoning_content"] + "</think>" + msg["content"]
        r = http.post("/v1/chat/completions", json={**body, "stream": True}, headers=U)
        deltas = [json.loads(x[6:])["choices"] for x in r.text.splitlines() if x.startswith("data: {")]
        got_r = "".join(c[0]["delta"].get("reasoning_content", "") for c in deltas if c)
        got_c = "".join(c[0]["delta"].get("content", "") or "" for c in deltas if c)
        assert (got_r, got_c) == (msg["reasoning_content"], msg["content"])
        assert any("reasoning_content" in c[0]["delta"] and len(c[0]["delta"]["reasoning_content"]) < len(got_r)
                   for c in deltas if c)  # streamed in pieces, not at the end  # fmt: skip
        # chat_template_kwargs reach the template
        text = _render(http, dict(body, chat_template_kwargs={"enable_thinking": False}))
        assert text.endswith("A:") and _render(http, body).endswith("A: <think>")
    finally:
        http.post("/v1/template/unload", headers=A)
    r = chat(http, temperature=0)
    assert "reasoning_content" not in r.json()["choices"][0]["message"]  # SmolLM2's own template: no split


def _render(http, body) -> str:
    tok = http.app.state.slot.model.tokenizer
    slot = http.app.state.slot
    return tok.apply_chat_template(body["messages"], add_generation_prompt=True, chat_template=slot.template[1],
                                   **body.get("chat_template_kwargs", {}))  # fmt: skip


def test_reasoning_budget(http):
    """After budget tokens of reasoning the end marker is forced: the reasoning is the unbudgeted run's first
    tokens, then the model answers."""
    (http.tmp / "templates" / "thinker.jinja").write_text(FEW_SHOT)
    assert http.post("/v1/template/switch", json={"prompt_template_name": "thinker"}, headers=A).status_code == 200
    tok = http.app.state.slot.model.tokenizer
    try:
        body = dict(messages=[{"role": "user", "content": "5+5?"}], temperature=0, max_tokens=30, stop=["\nQ:"],
                    template_vars={"enable_thinking": True})  # fmt: skip
        free = chat(http, **body).json()["choices"][0]["message"]
        free_ids = tok.encode(free["reasoning_content"], add_bos=False)
        assert len(free_ids) > 4
        for budget, message in ((3, ""), (2, " (out of time)")):
            r = chat(http, **body, thinking_budget=budget, reasoning_budget_message=message)
            msg = r.json()["choices"][0]["message"]
            assert msg["reasoning_content"] == tok.decode(free_ids[:budget]) + message, msg
            assert msg["content"] and "</think>" not in msg["content"]
            s = http.post("/v1/chat/completions", json={**body, "stream": True, "reasoning_budget_tokens": budget,
                                                        "reasoning_budget_message": message}, headers=U)  # fmt: skip
            deltas = [json.loads(x[6:])["choices"] for x in s.text.splitlines() if x.startswith("data: {")]
            got = "".join(c[0]["delta"].get("reasoning_content", "") for c in deltas if c)
            assert got == msg["reasoning_content"]
        r = chat(http, **body, reasoning_budget=0)
        msg = r.json()["choices"][0]["message"]
        assert msg["reasoning_content"] == "" and msg["content"]
        r = chat(http, **body, reasoning_budget=-1)  # negative: no budget
        assert r.json()["choices"][0]["message"] == free
        err(chat(http, **body, reasoning_budget_tokens=3, response_format={"type": "json_object"}), 400,
            "reasoning_budget_tokens")  # fmt: skip
        err(chat(http, **body, reasoning_budget_tokens="3"), 422, "reasoning_budget_tokens")
    finally:
        http.post("/v1/template/unload", headers=A)
    err(chat(http, reasoning_budget_tokens=3), 400, "reasoning_budget_tokens", "reasoning format")


def test_tabby_config_settings(tmp_path):
    from exl2cpp.errors import InvalidArgumentError
    from exl2cpp.server.config import load_config

    y = tmp_path / "serve.yml"
    y.write_text("cache_type: Q8\nmodel_dir: /models\ninline_model_loading: true\nidle_unload_s: 30\n"
                 "reasoning: true\nreasoning_start_token: '[THINK]'\nreasoning_budget_tokens: 512\n")  # fmt: skip
    cfg = load_config(y)
    assert (cfg.cache_type, cfg.model_dir, cfg.inline_model_loading, cfg.idle_unload_s) == ("q8", "/models", True, 30)
    assert (cfg.reasoning, cfg.reasoning_start_token, cfg.reasoning_budget_tokens) == (True, "[THINK]", 512)
    for bad, word in (("cache_type: q3", "cache_type"), ("idle_unload_s: 0", "idle_unload_s"),
                      ("inline_model_loading: 1", "inline_model_loading"), ("reasoning: maybe", "reasoning"),
                      ("reasoning_budget_tokens: many", "reasoning_budget_tokens"),
                      ("reasoning_end_token: ''", "reasoning_end_token")):  # fmt: skip
        y.write_text(bad + "\n")
        with pytest.raises(InvalidArgumentError, match=word):
            load_config(y)


def _cuda_count() -> int:
    from exl2cpp import _C

    return _C.cuda_device_count() if _C.cuda_compiled() else 0


@pytest.mark.cuda
@pytest.mark.skipif(_cuda_count() == 0, reason="needs a CUDA GPU")
def test_model_load_on_cuda(models_dir, tmp_path):
    """TabbyAPI's GPU fields on a CUDA server: gpu_split_auto and a Q4 cache, then an explicit split over the
    GPUs there are (and tensor_parallel with two or more)."""
    with TestClient(make_app(models_dir, tmp_path, device="cuda")) as c:
        wait_ready(c)
        r = c.post("/v1/model/load", headers=A, json={"model_name": "smol-b", "cache_mode": "Q4",
                                                      "gpu_split_auto": True, "cache_size": 4096})  # fmt: skip
        assert sse_events(r)[-1]["status"] == "finished", r.text
        card = c.get("/v1/model", headers=U).json()
        assert card["parameters"]["cache_mode"] == "Q4" and str(c.app.state.slot.model.device).startswith("cuda")
        assert text_of(chat(c, model="smol-b", temperature=0, seed=1))
        n = _cuda_count()
        r = c.post("/v1/model/load", headers=A, json={"model_name": "smol", "gpu_split": [4.0] * n})
        assert sse_events(r)[-1]["status"] == "finished", r.text
        assert text_of(chat(c, model="smol", temperature=0, seed=1))
        if n >= 2:
            r = c.post("/v1/model/load", headers=A, json={"model_name": "smol-b", "tensor_parallel": True})
            assert sse_events(r)[-1]["status"] == "finished", r.text
            assert c.app.state.slot.model.tensor_parallel


@pytest.mark.cuda
@pytest.mark.skipif(_cuda_count() == 0, reason="needs a CUDA GPU")
def test_model_load_with_draft_on_cuda(models_dir, tmp_path):
    """On a CUDA server: the draft model loads on the model's GPU (progress for both), a Q8 cache for both, and it
    drafts (the same weights: most drafts are accepted)."""
    with TestClient(make_app(models_dir, tmp_path, device="cuda")) as c:
        wait_ready(c)
        r = c.post("/v1/model/load", headers=A, json={"model_name": "smol", "cache_mode": "Q8", "draft_model": {
            "draft_model_name": "smol-b", "draft_cache_mode": "Q8", "draft_num_tokens": 4}})  # fmt: skip
        events = sse_events(r)
        assert [e["model_type"] for e in events if e["status"] == "finished"] == ["draft", "model"], events
        draft = c.get("/v1/model", headers=U).json()["parameters"]["draft"]
        assert (draft["id"], draft["parameters"]["cache_mode"]) == ("smol-b", "Q8")
        assert str(c.app.state.slot.engine.draft_model.device).startswith("cuda")
        assert text_of(chat(c, temperature=0, max_tokens=24))
        st = c.get("/admin/stats", headers=A).json()["engine"]
        assert st["spec_proposed"] > 0 and st["spec_accepted"] > st["spec_proposed"] // 2, st
