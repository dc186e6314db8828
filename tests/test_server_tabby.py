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
    err(chat(http, temperature=11), 422, "temperature")
    err(chat(http, stop=[10**7]), 400, "stop")
    # neutral values of samplers that are off are fine (TabbyAPI's own defaults: dry_base 0, allowed_length 0)
    r = chat(http, dry_multiplier=0, dry_base=0, dry_allowed_length=0, xtc_probability=0, mirostat_mode=0,
             token_healing=False, skew=0, temperature=0)  # fmt: skip
    assert r.status_code == 200, r.text


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
