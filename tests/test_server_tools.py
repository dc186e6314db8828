"""Tool calling in `exl2cpp serve`: the three call formats (Hermes/Qwen `<tool_call>`, Llama 3 JSON and
`<|python_tag|>`, Mistral `[TOOL_CALLS]`), picked from the chat template or the server's tool_format; the streaming
parser (deltas that reassemble to the non-streamed reply, for any cut of the text); forced calls through the
grammar in each format; the history (assistant calls, tool results) given to templates that render tools; errors
for malformed tools. The server runs SmolLM2 on CPU through FastAPI's TestClient."""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
from fastapi.testclient import TestClient

from exl2cpp.server import tools as T

KEY, ADMIN = "sk-tools-user", "sk-tools-admin"
U = {"Authorization": f"Bearer {KEY}"}
A = {"x-admin-key": ADMIN}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
        "properties": {"tz": {"type": "string", "maxLength": 10}}, "required": ["tz"]}}}  # fmt: skip
NAMES = {"get_weather", "get_time"}

# ---- the formats as models write them -------------------------------------------------------------------------

REPLIES = [
    # (format, reply, content, [(name, arguments)])
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     [("get_weather", '{"city": "Paris"}')]),
    ("hermes", 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>', "Let me check.",
     [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}')]),
    ("hermes", '<tool_call>{"arguments": {"tz": "UTC"}, "name": "get_time"}</tool_call>', None,
     [("get_time", '{"tz": "UTC"}')]),  # name after the arguments
    ("hermes", '```json\n{"name": "get_time", "arguments": "{\\"tz\\": \\"X\\"}"}\n```', None,
     [("get_time", '{"tz": "X"}')]),  # a fenced bare call, arguments as a JSON string
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", '{"city": "Paris"}')]),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", "x": [1, {"y": "}"}]}}; '
     '{"name": "get_time", "parameters": {}}', None,
     [("get_weather", '{"city": "Rome", "x": [1, {"y": "}"}]}'), ("get_time", "{}")]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
     '{"name": "get_time", "arguments": {"tz": "CET"}, "id": "a1b2c3d4e"}]', None,
     [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"tz": "CET"}')]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[CALL_ID]x1y2z3w4v[ARGS]{"tz": "UTC"}',
     None, [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"tz": "UTC"}')]),
    # not calls: stay text, exactly
    ("hermes", "The weather is <b>fine</b> and 2 < 3.", "The weather is <b>fine</b> and 2 < 3.", []),
    ("hermes", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', []),
    ("hermes", "<tool_call>{broken</tool_call>", "<tool_call>{broken</tool_call>", []),
    ("hermes", '  {"answer": 42}', '  {"answer": 42}', []),
    ("llama3", '<|python_tag|>brave_search.call(query="x")', '<|python_tag|>brave_search.call(query="x")', []),
    ("mistral", 'Sure. [TOOL_CALLS]delete_all[ARGS]{}', 'Sure. [TOOL_CALLS]delete_all[ARGS]{}', []),
    ("mistral", "[1, 2] are numbers", "[1, 2] are numbers", []),
]  # fmt: skip


def _calls(calls):
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("fmt, reply, content, calls", REPLIES)
def test_parse_each_format(fmt, reply, content, calls):
    """The whole reply, and every way of cutting it into streamed pieces, give the same content and calls."""
    got_content, got = T.parse_tool_calls(reply, [WEATHER, TIME], fmt)
    assert (got_content, _calls(got)) == (content, calls)
    assert all(c["type"] == "function" and c["id"] for c in got)
    if fmt == "mistral":
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in got)  # Mistral's templates need 9 characters
    rng = random.Random(0)
    for _ in range(100):
        cuts = sorted(rng.sample(range(len(reply) + 1), k=min(len(reply) + 1, rng.randint(1, 15))))
        p = T.ToolCallParser(fmt, NAMES)
        events = [e for a, b in zip([0, *cuts], [*cuts, len(reply)]) for e in p.push(reply[a:b])] + p.finish()
        c, cs = T.assemble(events)
        assert (c, _calls(cs)) == (content, calls), cuts


def test_calls_stream_while_generated():
    """Fed a token at a time: the call starts once its name is known, the arguments follow in pieces, and no
    content is held back longer than a marker could be."""
    reply = 'Checking <tool_call>{"name": "get_weather", "arguments": {"city": "San Francisco"}}</tool_call>'
    p = T.ToolCallParser("hermes", NAMES)
    per_piece = [p.push(reply[k : k + 3]) for k in range(0, len(reply), 3)]
    flat = [(k, e) for k, es in enumerate(per_piece) for e in es]
    start = next(k for k, e in flat if isinstance(e, T.CallStart))
    args = [k for k, e in flat if isinstance(e, T.CallArgs)]
    assert len(args) > 5 and min(args) >= start and len(set(args)) == len(args)
    assert "".join(e.text for _, e in flat if isinstance(e, T.Content)) == "Checking"
    assert p.finish() == []
    assert T.stream_deltas([e for _, e in flat])[0] == {
        "index": 0, "id": p.calls[0].id, "type": "function", "function": {"name": "get_weather", "arguments": ""}}


def test_cut_call_keeps_what_it_wrote():
    """A reply cut off inside a call's arguments (max_tokens) keeps them as written, or none: no "{}" is made up;
    a complete call without arguments still gets "{}"."""
    for fmt, reply, args in [
        ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"ci', '{"ci'),
        ("hermes", '<tool_call>{"name": "get_weather", "argu', ""),
        ("llama3", '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "para', ""),
        ("mistral", "[TOOL_CALLS]get_weather[ARGS]", ""),
    ]:
        _, calls = T.parse_tool_calls(reply, [WEATHER, TIME], fmt)
        assert calls and calls[-1]["function"]["arguments"] == args, (fmt, reply, calls)
        if fmt == "llama3":
            assert calls[0]["function"]["arguments"] == "{}"
    _, calls = T.parse_tool_calls('<tool_call>{"name": "get_time"}</tool_call>', [WEATHER, TIME], "hermes")
    assert _calls(calls) == [("get_time", "{}")]


def test_parallel_tool_calls_false_keeps_the_first():
    reply = REPLIES[1][1]
    content, calls = T.parse_tool_calls(reply, [WEATHER, TIME], "hermes", max_calls=1)
    assert (content, _calls(calls)) == ("Let me check.", [("get_weather", '{"city": "Paris"}')])


def test_format_of_the_template():
    assert T.template_format("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}") == "mistral"
    assert T.template_format("<tools>{{ tools }}</tools> <tool_call>") == "hermes"
    assert T.template_format("{{ '<|python_tag|>' }}") == "llama3"
    assert T.template_format("{% if m.role == 'ipython' %}...\"parameters\"...") == "llama3"
    assert T.template_format("<|im_start|>{{ m.content }}") == "hermes"
    assert T.template_format(None) == "hermes"


@pytest.fixture(scope="module")
def factory(smollm2_dir):
    from exl2cpp.server.grammar import GrammarFactory
    from exl2cpp.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_dir)
    return GrammarFactory(tok._json, tok.vocab_size, tok.eos_ids), tok


@pytest.mark.parametrize(
    "fmt, forced",
    [
        ("hermes", '<tool_call>{"name":"get_weather","arguments":{"city'),
        ("llama3", '{"name":"get_weather","parameters":{"city'),
        ("mistral", '[TOOL_CALLS][{"name":"get_weather","arguments":{"city'),
    ],
)
def test_forced_call_grammar_writes_the_format(factory, fmt, forced):
    """A forced call of one tool: the grammar forces the format's text up to the first argument (as far as the
    tokenization is certain)."""
    fac, tok = factory
    lark, _ = T.forced_grammar([WEATHER, TIME], "get_weather", fmt)
    c = fac.lark(lark).constraint()
    assert tok.decode(c._m.compute_ff_tokens()).startswith(forced)


def test_forced_marker_as_a_special_token(factory):
    """A marker that is one special token of the vocabulary is forced as that token, not as its spelling."""
    fac, tok = factory
    im_start = tok.token_to_id("<|im_start|>")
    lark, _ = T.forced_grammar([WEATHER], None, "mistral", {"[TOOL_CALLS]": im_start}.get)
    assert lark.startswith(f"start: <[{im_start}]>")
    assert fac.lark(lark).constraint()._m.compute_ff_tokens()[0] == im_start


# ---- through the server ---------------------------------------------------------------------------------------

HERMES_T = """{%- if tools %}<|im_start|>system
You may call functions. <tools>
{% for t in tools %}{{ t | tojson }}
{% endfor %}</tools>
Reply with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}{%- for m in messages %}{%- if m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.tool_call_id }}: {{ m.content }}</tool_response><|im_end|>
{% elif m.tool_calls %}<|im_start|>assistant
{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA3_T = """{%- if tools %}<|im_start|>system
Call a function by replying with JSON {"name": function name, "parameters": its arguments}. Functions:
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|im_end|>
{% endif %}{%- for m in messages %}{%- if m.role == 'tool' %}<|im_start|>ipython
{{ m.content }}<|im_end|>
{% elif m.tool_calls %}<|im_start|>assistant
{% for c in m.tool_calls %}{{ {"name": c.function.name, "parameters": c.function.arguments} | tojson }}{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

MISTRAL_T = """{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]
{% endif %}{%- for m in messages %}{%- if m.role == 'tool' %}[TOOL_RESULTS]{"call_id": "{{ m.tool_call_id }}", "content": {{ m.content | tojson }}}[/TOOL_RESULTS]
{% elif m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | map(attribute='function') | list | tojson }}</s>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""  # noqa: E501

TEMPLATES = {"hermes": HERMES_T, "llama3": LLAMA3_T, "mistral": MISTRAL_T}


@pytest.fixture(scope="module")
def http(smollm2_dir, tmp_path_factory):
    from exl2cpp.server import create_app
    from exl2cpp.server.config import ServeConfig

    tmp = tmp_path_factory.mktemp("tools")
    (tmp / "templates").mkdir()
    for name, source in TEMPLATES.items():
        (tmp / "templates" / f"{name}.jinja").write_text(source)
    cfg = ServeConfig(model=str(smollm2_dir), model_name="smol", api_keys=[KEY], admin_key=ADMIN, cache_tokens=4096,
                      page_size=16, templates_dir=str(tmp / "templates"))  # fmt: skip
    with TestClient(create_app(cfg)) as c:
        while c.get("/health").json().get("status") != "ready":
            pass
        yield c


def chat(http, **body):
    body.setdefault("messages", [{"role": "user", "content": "What is the weather in Paris?"}])
    body.setdefault("max_tokens", 48)
    body.setdefault("temperature", 0)
    return http.post("/v1/chat/completions", json=body, headers=U)


def stream_message(r) -> tuple[str | None, list, str]:
    """(content, tool calls, finish_reason) reassembled from a streamed reply, as the openai client does."""
    assert r.status_code == 200, r.text
    content, calls, finish = "", {}, None
    for line in r.text.splitlines():
        if not line.startswith("data: {"):
            continue
        for ch in json.loads(line[6:])["choices"]:
            d = ch["delta"]
            content += d.get("content") or ""
            for tc in d.get("tool_calls") or []:
                if "id" in tc:
                    assert tc["index"] not in calls
                    calls[tc["index"]] = {"id": tc["id"], "type": tc["type"], "function": dict(tc["function"])}
                else:
                    calls[tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
            finish = ch["finish_reason"] or finish
    return content or None, [calls[k] for k in sorted(calls)], finish


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral"])
def test_forced_call_in_each_format(http, fmt):
    """A template writing each format (auto picks the format from it): the forced call parses to a valid call,
    and the stream reassembles to the same message."""
    assert http.post("/v1/template/switch", json={"prompt_template_name": fmt}, headers=A).status_code == 200
    try:
        for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
            body = dict(tools=[WEATHER, TIME], tool_choice=choice)
            r = chat(http, **body)
            assert r.status_code == 200, r.text
            c = r.json()["choices"][0]
            assert c["finish_reason"] == "tool_calls", c
            call = c["message"]["tool_calls"][0]
            args = json.loads(call["function"]["arguments"])
            if choice != "required":
                assert call["function"]["name"] == "get_weather" and isinstance(args["city"], str)
            content, calls, finish = stream_message(http.post("/v1/chat/completions", json={**body, "stream": True,
                "messages": [{"role": "user", "content": "What is the weather in Paris?"}], "max_tokens": 48,
                "temperature": 0}, headers=U))  # fmt: skip
            assert finish == "tool_calls" and content == c["message"]["content"]
            assert _calls(calls) == _calls(c["message"]["tool_calls"])
    finally:
        http.post("/v1/template/unload", headers=A)


def _rendered(http, messages) -> str:
    r = http.post("/v1/tokenize", json={"messages": messages}, headers=U)
    assert r.status_code == 200, r.text
    return http.app.state.slot.model.tokenizer.decode(r.json()["tokens"])


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "abc123XYZ", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},  # fmt: skip
    {"role": "tool", "tool_call_id": "abc123XYZ", "content": '{"temp": 21}'},
]


def test_history_rendered_by_templates_with_tools(http):
    """Assistant calls reach a template that renders tools with their arguments as objects (not a JSON string
    encoded twice), tool results with their tool_call_id."""
    want = {
        "hermes": ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                   '<tool_response>abc123XYZ: {"temp": 21}</tool_response>'],
        "llama3": ['{"name": "get_weather", "parameters": {"city": "Paris"}}', 'ipython\n{"temp": 21}'],
        "mistral": ['[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
                    '[TOOL_RESULTS]{"call_id": "abc123XYZ", "content": "{\\"temp\\": 21}"}[/TOOL_RESULTS]'],
    }  # fmt: skip
    for fmt, parts in want.items():
        assert http.post("/v1/template/switch", json={"prompt_template_name": fmt}, headers=A).status_code == 200
        try:
            text = _rendered(http, HISTORY)
            for p in parts:
                assert p in text, (fmt, p, text)
        finally:
            http.post("/v1/template/unload", headers=A)


def test_history_without_template_tools(http):
    """SmolLM2's own template renders no tools: calls and results are written as text in the format."""
    text = _rendered(http, HISTORY)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in text


def test_tool_format_setting(smollm2_dir):
    """tool_format names the format whatever the template: SmolLM2's own template with llama3 gets the Llama
    syntax in its system message and a forced call in it."""
    from exl2cpp.server import create_app
    from exl2cpp.server.config import ServeConfig

    cfg = ServeConfig(model=str(smollm2_dir), api_keys=[KEY], cache_tokens=2048, page_size=16, tool_format="llama3")
    with TestClient(create_app(cfg)) as c:
        while c.get("/health").json().get("status") != "ready":
            pass
        r = chat(c, tools=[WEATHER], tool_choice="required")
        call = r.json()["choices"][0]["message"]["tool_calls"][0]
        assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"])
        r = c.post("/v1/tokenize", json={"messages": HISTORY}, headers=U)
        text = c.app.state.slot.model.tokenizer.decode(r.json()["tokens"])
        assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in text


def _err(r, status: int, param: str | None, *words: str) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    e = r.json()["error"]
    if param is not None:
        assert e["param"] == param, e
    for w in words:
        assert w in e["message"], (w, e["message"])


def test_malformed_tools(http):
    fn = WEATHER["function"]
    cases = [
        ([WEATHER, WEATHER], "listed twice"),
        ([{"type": "function", "function": {**fn, "name": "get weather"}}], "letters, digits"),
        ([{"type": "function", "function": {**fn, "name": "x" * 65}}], "1-64"),
        ([{"type": "function", "function": {**fn, "parameters": {"type": "array"}}}], "object schema"),
        ([{"type": "function", "function": {**fn, "parameters": "x"}}], "JSON schema object"),
        ([{"type": "function", "function": {**fn, "description": 3}}], "description"),
        ([{"type": "code_interpreter"}], "tools[0]"),
    ]
    for tools, word in cases:
        _err(chat(http, tools=tools), 400, None, word)
    _err(chat(http, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), 400, None, "nope")
    _err(chat(http, tools=[WEATHER], tool_choice="sometimes"), 400, "tool_choice")
    _err(chat(http, tools={"a": 1}), 422, None)


def test_tool_choice_none_and_auto(http):
    """none: the tools are not in the prompt and the reply is text; auto: text that is no call stays content."""
    r = chat(http, tools=[WEATHER], tool_choice="none", max_tokens=8)
    m = r.json()["choices"][0]["message"]
    assert m["content"] and "tool_calls" not in m
    r = chat(http, tools=[WEATHER], max_tokens=8, messages=[{"role": "user", "content": "Say hello."}])
    c = r.json()["choices"][0]
    if "tool_calls" not in c["message"]:
        assert c["finish_reason"] in ("stop", "length") and c["message"]["content"]
        content, calls, finish = stream_message(http.post("/v1/chat/completions", json={"tools": [WEATHER],
            "max_tokens": 8, "temperature": 0, "stream": True, "messages": [{"role": "user", "content": "Say hello."}]},
            headers=U))  # fmt: skip
        assert (content, calls, finish) == (c["message"]["content"], [], c["finish_reason"])
