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
        assert e["code"] == "invalid_value" and e["param"]
    e = err(
        post(server, "/v1/tokenize", '{"messages": [{"role": "user", "content": "\\ud800"}]}'), 422
    )
    assert e["param"] == "messages[0].content"
    # the same code point sent as raw (CESU-8) bytes rather than an escape
    raw = '{"prompt": "\ud800"}'.encode("utf-8", "surrogatepass")
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(server.url + "/v1/tokenize", content=raw, headers=headers)
    err(r, 422, "surrogate")
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


# ---- grammars: bounded before compiling, compiled off the event loop on a large stack ---------------------------


def ref_chain(n: int, kind: str) -> dict:
    """n definitions, each one referring to the next: nested objects (required or optional), anyOf or allOf."""
    defs = {}
    for i in range(n):
        nxt = {"$ref": f"#/$defs/d{i + 1}"} if i + 1 < n else {"type": "string"}
        if kind in ("object", "optional"):
            d = {"type": "object", "properties": {"next": nxt}}
            if kind == "object":
                d["required"] = ["next"]
        elif kind == "anyOf":
            d = {"anyOf": [nxt, {"type": "null"}]}
        else:
            d = {"allOf": [nxt]}
        defs[f"d{i}"] = d
    return {"$ref": "#/$defs/d0", "$defs": defs}


DEEP = {
    "object-1000": ref_chain(1000, "object"),
    "object-10000": ref_chain(10000, "object"),
    "optional-1000": ref_chain(1000, "optional"),
    "anyOf-5000": ref_chain(5000, "anyOf"),
    "allOf-10000": ref_chain(10000, "allOf"),
}


def schema_body(schema: dict) -> dict:
    return {
        "messages": MSG,
        "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }


def tool_body(schema: dict) -> dict:
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    return {
        "messages": MSG,
        "max_tokens": 4,
        "tools": [tool],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
    }


@pytest.mark.parametrize("name", list(DEEP))
def test_deep_schemas_are_400(server, name):
    """These schemas overflowed the stack of llguidance's compiler (SIGSEGV) on the event loop's thread."""
    e = err(post(server, "/v1/chat/completions", schema_body(DEEP[name])), 400, "max_schema_")
    assert e["param"] == "response_format"
    # as a forced tool's parameters (a Lark grammar embedding the schema); 100 levels keep the prompt, which lists
    # the tools, inside the context
    kind = name.split("-")[0]
    e = err(
        post(server, "/v1/chat/completions", tool_body(ref_chain(100, kind))),
        400,
        "max_schema_depth",
    )
    assert e["param"] == "tools"
    assert_alive(server)


def test_schema_limits_and_compile_stack(server):
    # 60 levels of $ref (under the default limit of 64) compile and decode
    r = post(server, "/v1/chat/completions", schema_body(ref_chain(60, "optional")))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"].startswith("{")
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(12000)}}
    err(post(server, "/v1/chat/completions", schema_body(wide)), 400, "max_schema_nodes")
    # self-recursion is not depth: a recursive optional property is a fine (compact) grammar
    tree = {
        "$ref": "#/$defs/t",
        "$defs": {
            "t": {
                "type": "object",
                "properties": {
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/t"}, "maxItems": 2}
                },
            }
        },
    }
    assert post(server, "/v1/chat/completions", schema_body(tree)).status_code == 200
    assert_alive(server)


def test_undecodable_grammars_are_400(server):
    """Compiled fine but broke down at the first token: a 500 "generation failed" before; the client's error."""
    recursive = {
        "$ref": "#/$defs/a",
        "$defs": {
            "a": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}
        },
    }
    for schema, words in ((recursive, ("too many items",)), ({"const": "a" * 10**6}, ("lexer",))):
        for stream in (False, True) if schema is recursive else (False,):
            body = {**schema_body(schema), "stream": stream}
            e = err(post(server, "/v1/chat/completions", body), 400, "cannot be decoded", *words)
            assert e["param"] == "response_format"
        if (
            schema is recursive
        ):  # (a 10^6-character const in the tool list is beyond the context anyway)
            e = err(
                post(server, "/v1/chat/completions", tool_body(schema)), 400, "cannot be decoded"
            )
            assert e["param"] == "tools"
        prompt = {
            "prompt": "x",
            "max_tokens": 2,
            "response_format": schema_body(schema)["response_format"],
        }
        err(post(server, "/v1/completions", prompt), 400, "cannot be decoded")
    assert_alive(server)


def test_tool_parameters_with_defs(server):
    """A tool's parameters with $defs (as pydantic writes them): their $ref still resolve inside the tool-call
    grammar (they pointed at the wrapper's root before: "Pointer '/$defs/city' does not exist")."""
    params = {
        "type": "object",
        "properties": {"where": {"$ref": "#/$defs/city"}},
        "required": ["where"],
        "additionalProperties": False,
        "$defs": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    }
    r = post(
        server, "/v1/chat/completions", {**tool_body(params), "max_tokens": 40, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "f" and json.loads(call["arguments"])["where"] in ("Paris", "Rome")


def test_grammar_breaking_down_mid_decoding_is_400(server):
    """A free choice first (probing cannot see past it), then a recursive required property: the grammar fails at
    the token after the choice, in the engine. Non-streamed that is a 400; streamed, an error event naming it."""
    schema = {
        "type": "object",
        "properties": {
            "x": {"enum": ["yes", "no"]},
            "a": {"$ref": "#/$defs/a"},
        },
        "required": ["x", "a"],
        "$defs": {
            "a": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}
        },
    }
    body = {**schema_body(schema), "max_tokens": 30}
    e = err(post(server, "/v1/chat/completions", body), 400, "response_format", "too many items")
    assert e["param"] == "response_format"
    r = post(server, "/v1/chat/completions", {**body, "stream": True})
    events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    assert r.status_code == 200 and "error" in events[-1], r.text[-500:]
    assert events[-1]["error"]["type"] == "invalid_request_error"
    assert "[DONE]" not in r.text
    assert_alive(server)


# ---- units -----------------------------------------------------------------------------------------------------


def test_schema_depth_and_limits_config(tmp_path):
    from exl2cpp.server.config import load_config
    from exl2cpp.server.grammar import GrammarLimits, check_schema, schema_depth

    assert schema_depth({"type": "string"}, 10) == 1
    nested = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string"}}}}
    assert schema_depth(nested, 10) == 3
    assert [schema_depth(ref_chain(n, "object"), 10**6) for n in (1, 60, 1000)] == [2, 61, 1001]
    assert schema_depth(ref_chain(10**5, "allOf"), 64) == 65  # stops counting past the limit
    # a DAG of 40 levels with two edges each (2^40 paths) is counted once per node
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}] * 2} for i in range(40)}
    defs["d40"] = {"type": "null"}
    assert schema_depth({"$ref": "#/$defs/d0", "$defs": defs}, 100) == 41
    with pytest.raises(ValueError, match="max_schema_depth"):
        check_schema(ref_chain(9, "anyOf"), GrammarLimits(max_depth=8), "s", "response_format")
    with pytest.raises(ValueError, match="max_schema_nodes"):
        check_schema(
            {"enum": list(range(100))}, GrammarLimits(max_nodes=50), "s", "response_format"
        )
    y = tmp_path / "serve.yml"
    y.write_text("max_schema_depth: 16\nmax_schema_nodes: 500\n")
    cfg = load_config(y)
    assert (cfg.max_schema_depth, cfg.max_schema_nodes) == (16, 500)
    for bad in ("max_schema_depth: 0", "max_schema_depth: 5000", "max_schema_nodes: '10'"):
        y.write_text(bad + "\n")
        with pytest.raises(ValueError, match=bad.split(":")[0]):
            load_config(y)


# ---- a hostile chat template: rendered off the event loop, bounded in time and size ------------------------------

HOSTILE_TEMPLATE = (
    "{% if messages[-1]['content'] == 'loop' %}"
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{% elif messages[-1]['content'] == 'big' %}{{ 'a' * 10**9 }}"
    "{% elif messages[-1]['content'] == 'grow' %}{% set ns = namespace(s='ab') %}"
    "{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"
    "{% endif %}"
)


@pytest.fixture(scope="module")
def hostile(smollm2_dir, tmp_path_factory):
    """SmolLM2 whose chat template loops 10^10 times or builds a gigabyte on cue (the last message 'loop', 'big' or
    'grow'), with a 3 s render limit; other messages render with SmolLM2's own template."""
    d = tmp_path_factory.mktemp("hostile-smollm2")
    for f in smollm2_dir.iterdir():
        (d / f.name).symlink_to(f)
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = HOSTILE_TEMPLATE + cfg["chat_template"]
    cfg_path.unlink()
    cfg_path.write_text(json.dumps(cfg))
    yml = d.parent / "hostile-serve.yml"
    yml.write_text("template_timeout_s: 3\n")
    srv = ServerProc(
        d,
        "--api-key",
        KEY,
        "--cache-tokens",
        "4096",
        "--model-name",
        "smollm2",
        "--config",
        str(yml),
    )
    yield srv
    srv.stop()


def test_hostile_template_is_400_and_health_stays_quick(hostile):
    import threading
    import time

    psutil = pytest.importorskip("psutil")
    rss0 = psutil.Process(hostile.proc.pid).memory_info().rss
    result: dict = {}

    def chat():
        t0 = time.perf_counter()
        body = {"messages": [{"role": "user", "content": "loop"}], "max_tokens": 2}
        result["r"], result["s"] = (
            post(hostile, "/v1/chat/completions", body),
            time.perf_counter() - t0,
        )

    th = threading.Thread(target=chat)
    th.start()
    time.sleep(0.3)  # the render is running now
    slowest = 0.0
    while th.is_alive():
        t0 = time.perf_counter()
        assert httpx.get(hostile.url + "/health", timeout=5).status_code == 200
        slowest = max(slowest, time.perf_counter() - t0)
        time.sleep(0.1)
    th.join()
    assert slowest < 1.0, (
        f"/health took {slowest:.2f} s during a render (the event loop was blocked)"
    )
    e = err(result["r"], 400, "template_timeout_s", "tokenizer_config.json")
    assert e["param"] == "messages" and result["s"] < 8
    for cue, limit in (("big", "template_max_chars"), ("grow", "template_max_chars")):
        for path in ("/v1/chat/completions", "/v1/tokenize"):
            body = {"messages": [{"role": "user", "content": cue}], "max_tokens": 2}
            err(post(hostile, path, body), 400, limit)
    assert psutil.Process(hostile.proc.pid).memory_info().rss - rss0 < 300 << 20
    # the same template renders other conversations normally
    r = post(hostile, "/v1/chat/completions", {"messages": MSG, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text


def test_sigterm_during_a_hostile_render(hostile):
    """A template loop used to hold the event loop: SIGTERM went unanswered. Now the server shuts down while the
    render runs (the render stops itself at its limit)."""
    import signal
    import threading
    import time

    body = {"messages": [{"role": "user", "content": "loop"}], "max_tokens": 2}
    th = threading.Thread(target=lambda: post(hostile, "/v1/chat/completions", body, timeout=30))
    th.start()
    time.sleep(0.5)
    t0 = time.perf_counter()
    hostile.proc.send_signal(signal.SIGTERM)
    hostile.proc.wait(20)
    assert time.perf_counter() - t0 < 10
    th.join(30)


# ---- JSON output never repeats a key ------------------------------------------------------------------------------


def duplicate_keys(text: str) -> list[str]:
    """Keys that appear twice in one object of the JSON ``text`` (which must parse)."""
    dups: list[str] = []

    def pairs(items):
        keys = [k for k, _ in items]
        dups.extend(k for k in dict.fromkeys(keys) if keys.count(k) > 1)
        return dict(items)

    json.loads(text, object_pairs_hook=pairs)
    return dups


def test_json_output_never_repeats_a_key(server):
    """Additional properties (allowed unless the schema forbids them) and json_object: SmolLM2 wrote
    '"description":"A Statue of Liberty.","description":"The Statue of Liberty,"' here."""
    city = {"type": "object", "properties": {"city": {"type": "string"}}}
    msgs = [{"role": "user", "content": "Where is the Statue of Liberty? Reply in JSON."}]
    for rf in (
        {"type": "json_schema", "json_schema": {"name": "c", "schema": city}},
        {"type": "json_object"},
    ):
        body = {
            "messages": msgs,
            "max_tokens": 60,
            "temperature": 0.7,
            "seed": 1,
            "response_format": rf,
        }
        c = post(server, "/v1/chat/completions", body).json()["choices"][0]
        assert c["finish_reason"] == "stop", c  # 40 tokens before the fix
        assert duplicate_keys(c["message"]["content"]) == [], c["message"]["content"]


def test_key_guard_masks_repeated_keys(smollm2_dir):
    """The guard on a bare object: after {"a":1,"  the tokens that close the key "a" are masked (also through an
    escape, and in a nested object after it is closed); other keys stay allowed."""
    from exl2cpp.server.grammar import GrammarFactory
    from exl2cpp.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_dir)
    g = GrammarFactory(tok._json, tok.vocab_size, tok.eos_ids).json_schema({"type": "object"})

    def allowed(c, text: str) -> bool:
        bits = c.mask()
        ids = tok.encode(text, add_bos=False)
        return all(bits[i >> 5] >> (i & 31) & 1 for i in ids[:1])

    def after(prefix: str):
        c = g.constraint()
        c.mask()
        for t in tok.encode(prefix, add_bos=False):
            c.advance(t)
        return c

    c = after('{"a":1,"a')
    assert not allowed(c, '"') and not allowed(c, '":')
    assert allowed(after('{"a":1,"b'), '"')
    assert allowed(after('{"ab":1,"a'), '"')
    assert not allowed(after('{"a":{"b":1,"b'), '"')
    assert allowed(after('{"a":{"b":1},"b'), '"')  # "b" belongs to the inner object
    assert not allowed(after('{"a":{"b":1},"a'), '"')
    assert not allowed(after('{"x\\n":1,"x\\u000a'), '"')  # the same key, escaped otherwise
    assert not allowed(after('{"a":[{"x":1}],"a'), '"')
