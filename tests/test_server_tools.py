"""Tool calling in `exl2cpp serve`: the three call formats (Hermes/Qwen `<tool_call>`, Llama 3 JSON and
`<|python_tag|>`, Mistral `[TOOL_CALLS]`), picked from the chat template or the server's tool_format; the streaming
parser (deltas that reassemble to the non-streamed reply, for any cut of the text); forced calls through the
grammar in each format; the history (assistant calls, tool results) given to templates that render tools; errors
for malformed tools. The server runs SmolLM2 on CPU through FastAPI's TestClient."""

from __future__ import annotations

import json
import random
from pathlib import Path

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


# Llama 3.1's built-in tools after <|python_tag|>, as Meta's prompt format documents them (and llama-models decodes
# them): brave_search / wolfram_alpha as name.call(query="..."), code_interpreter as plain Python code.
BUILTIN = ["brave_search", "wolfram_alpha", "code_interpreter"]
BUILTIN_REPLIES = [
    # (reply, built-in tools, content, [(name, arguments)])
    ('<|python_tag|>brave_search.call(query="current weather in Menlo Park, California")', BUILTIN, None,
     [("brave_search", '{"query": "current weather in Menlo Park, California"}')]),
    ('<|python_tag|>wolfram_alpha.call(query="solve x^3 - 4x^2 + 6x - 24 = 0")', BUILTIN[:2], None,
     [("wolfram_alpha", '{"query": "solve x^3 - 4x^2 + 6x - 24 = 0"}')]),
    ("Let me look. <|python_tag|>brave_search.call(query='it\\'s \"x\" (y)', count=3)\n", BUILTIN[:1], "Let me look.",
     [("brave_search", '{"query": "it\'s \\"x\\" (y)", "count": 3}')]),
    ("<|python_tag|>import math\nprint(math.sqrt(2) * {'a': 1}['a'])\n", BUILTIN, None,
     [("code_interpreter", json.dumps({"code": "import math\nprint(math.sqrt(2) * {'a': 1}['a'])"}))]),
    ('<|python_tag|>brave_search.call(query=x)', BUILTIN, None,  # not literal arguments: code, as Meta decodes it
     [("code_interpreter", json.dumps({"code": "brave_search.call(query=x)"}))]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}', BUILTIN, None,  # JSON still JSON
     [("get_weather", '{"city": "Rome"}')]),
    # not calls: stay text
    ('<|python_tag|>brave_search.call(query=x)', BUILTIN[:2], '<|python_tag|>brave_search.call(query=x)', []),
    ('<|python_tag|>photogen.call(query="a cat")', BUILTIN[:2], '<|python_tag|>photogen.call(query="a cat")', []),
    ("<|python_tag|>print(1)", BUILTIN[:2], "<|python_tag|>print(1)", []),
    ('brave_search.call(query="x")', BUILTIN, 'brave_search.call(query="x")', []),  # only after the tag
]  # fmt: skip


@pytest.mark.parametrize("reply, builtin, content, calls", BUILTIN_REPLIES)
def test_parse_llama31_builtin_tools(reply, builtin, content, calls):
    """Built-in tool calls, whole and cut into streamed pieces every way, give the same content and calls."""
    got_content, got = T.parse_tool_calls(reply, [WEATHER], "llama3", builtin=builtin)
    assert (got_content, _calls(got)) == (content, calls)
    names = T.tool_names([WEATHER], builtin)
    rng = random.Random(1)
    for _ in range(100):
        cuts = sorted(rng.sample(range(len(reply) + 1), k=min(len(reply) + 1, rng.randint(1, 15))))
        p = T.ToolCallParser("llama3", names)
        events = [e for a, b in zip([0, *cuts], [*cuts, len(reply)]) for e in p.push(reply[a:b])] + p.finish()
        assert (lambda c, cs: (c, _calls(cs)))(*T.assemble(events)) == (content, calls), cuts
    # a tool of a built-in's name in the request's tools is a built-in too
    tool = {"type": "function", "function": {"name": builtin[0], "parameters": {"type": "object"}}}
    if calls and calls[0][0] == builtin[0]:
        assert _calls(T.parse_tool_calls(reply, [WEATHER, tool], "llama3")[1]) == calls


def test_code_interpreter_streams_while_generated():
    """The code streams as the call's arguments while it is written; whitespace at its end is held back."""
    code = "import math\nfor i in range(3):\n    print(math.sqrt(i))\n"
    p = T.ToolCallParser("llama3", {"code_interpreter"})
    pieces = [p.push(x) for x in ["<|python_tag|>", *[code[k : k + 4] for k in range(0, len(code), 4)]]]
    args = [e.text for es in pieces for e in es if isinstance(e, T.CallArgs)]
    assert len(args) > 5 and not any(a.endswith("\\n") for a in args)
    args += [e.text for e in p.finish() if isinstance(e, T.CallArgs)]
    assert json.loads("".join(args)) == {"code": code.rstrip()}


def test_builtin_tools_checked():
    assert T.check_builtin_tools(["brave_search", "brave_search"]) == ["brave_search"]
    for bad in ("brave_search", [1], ["has space"]):
        with pytest.raises(ValueError, match="builtin_tools"):
            T.check_builtin_tools(bad)


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

# Llama 3.1's structure: "Environment: ipython" and the built-in tools in the system header, built-in calls in the
# history as name.call(...) after <|python_tag|>, JSON calls for the rest, results in the ipython role.
LLAMA31_T = """<|begin_of_text|>{%- if builtin_tools is defined or tools %}<|start_header_id|>system<|end_header_id|>

Environment: ipython
{% if builtin_tools is defined %}Tools: {{ builtin_tools | reject('equalto', 'code_interpreter') | join(', ') }}
{% endif %}<|eot_id|>{% endif %}{%- for m in messages %}{%- if m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ m.content }}<|eot_id|>{% elif m.tool_calls %}{% set c = m.tool_calls[0].function %}<|start_header_id|>assistant<|end_header_id|>

{% if builtin_tools is defined and c.name in builtin_tools %}<|python_tag|>{{ c.name }}.call({% for k, v in c.arguments | items %}{{ k }}="{{ v }}"{% if not loop.last %}, {% endif %}{% endfor %})<|eom_id|>{% else %}{"name": "{{ c.name }}", "parameters": {{ c.arguments | tojson }}}<|eot_id|>{% endif %}{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content }}<|eot_id|>{% endif %}{%- endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""  # noqa: E501

TEMPLATES = {"hermes": HERMES_T, "llama3": LLAMA3_T, "mistral": MISTRAL_T, "llama31": LLAMA31_T}


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


def forced_calls(http) -> list[tuple[dict, list[dict]]]:
    """A call forced by name and by "required" under the template in use: each parses to a valid call (the named
    one get_weather with a string city), and the stream reassembles to the same message. Returns (request body,
    message) of each."""
    out = []
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        body = dict(tools=[WEATHER, TIME], tool_choice=choice, max_tokens=48, temperature=0,
                    messages=[{"role": "user", "content": "What is the weather in Paris?"}])  # fmt: skip
        r = http.post("/v1/chat/completions", json=body, headers=U)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert c["finish_reason"] == "tool_calls", c
        call = c["message"]["tool_calls"][0]
        args = json.loads(call["function"]["arguments"])
        if choice != "required":
            assert call["function"]["name"] == "get_weather" and isinstance(args["city"], str)
        content, calls, finish = stream_message(
            http.post("/v1/chat/completions", json={**body, "stream": True}, headers=U)
        )
        assert finish == "tool_calls" and content == c["message"]["content"]
        assert _calls(calls) == _calls(c["message"]["tool_calls"])
        out.append((body, c["message"]))
    return out


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral"])
def test_forced_call_in_each_format(http, fmt):
    """A template writing each format (auto picks the format from it): the forced call parses to a valid call,
    and the stream reassembles to the same message."""
    assert http.post("/v1/template/switch", json={"prompt_template_name": fmt}, headers=A).status_code == 200
    try:
        forced_calls(http)
    finally:
        http.post("/v1/template/unload", headers=A)


def _rendered(http, messages, **extra) -> str:
    r = http.post("/v1/tokenize", json={"messages": messages, **extra}, headers=U)
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


def test_llama31_builtin_calls_through_the_server(http):
    """With Llama 3.1's template and chat_template_kwargs.builtin_tools, a reply <|python_tag|>name.call(...) (the
    135M model is held to it by a regex) is a tool call, streamed the same; code_interpreter's code too; the call
    and its result go back into the history in Llama's syntax."""
    assert http.post("/v1/template/switch", json={"prompt_template_name": "llama31"}, headers=A).status_code == 200
    try:
        kw = {"builtin_tools": ["brave_search", "wolfram_alpha", "code_interpreter"]}
        prompt = _rendered(http, [{"role": "user", "content": "x"}], chat_template_kwargs=kw)
        assert "Environment: ipython\nTools: brave_search, wolfram_alpha\n" in prompt
        for regex, name, key in [
            (r'<\|python_tag\|>brave_search\.call\(query="[a-z ]{3,30}"\)', "brave_search", "query"),
            (r"<\|python_tag\|>print\([0-9]{1,4}\)", "code_interpreter", "code"),
        ]:
            body = {"chat_template_kwargs": kw, "regex_pattern": regex, "max_tokens": 40,
                    "messages": [{"role": "user", "content": "What is the weather in Paris?"}]}  # fmt: skip
            r = chat(http, **body)
            assert r.status_code == 200, r.text
            c = r.json()["choices"][0]
            assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None, c
            [call] = c["message"]["tool_calls"]
            args = json.loads(call["function"]["arguments"])
            assert call["function"]["name"] == name and list(args) == [key] and args[key], call
            content, calls, finish = stream_message(
                http.post("/v1/chat/completions", json={**body, "stream": True, "temperature": 0}, headers=U)
            )
            assert (content, _calls(calls), finish) == (None, _calls([call]), "tool_calls")
        history = [
            {"role": "user", "content": "Weather in Menlo Park?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "brave_search", "arguments": '{"query": "weather Menlo Park"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ]  # fmt: skip
        text = _rendered(http, history, chat_template_kwargs=kw)
        assert '<|python_tag|>brave_search.call(query="weather Menlo Park")<|eom_id|>' in text
        assert "<|start_header_id|>ipython<|end_header_id|>\n\nsunny" in text
        # without builtin_tools the same reply is text
        r = chat(http, regex_pattern=body["regex_pattern"], max_tokens=40)
        m = r.json()["choices"][0]["message"]
        assert m["content"].startswith("<|python_tag|>print(") and "tool_calls" not in m
        _err(chat(http, chat_template_kwargs={"builtin_tools": "brave_search"}), 400, None, "builtin_tools")
    finally:
        http.post("/v1/template/unload", headers=A)


OPENWEBUI_REQUEST = Path(__file__).parent / "data" / "openwebui-0.12.4-chat-request.json"


@pytest.mark.parametrize("fmt", T.FORMATS)
def test_openwebui_request_streams_its_answer_as_it_comes(fmt):
    """The chat request Open WebUI 0.12.4 sends for a plain question (captured between it and `exl2cpp serve`:
    its 36 built-in tools, native function calling) is accepted as it is, and a plain answer streams: each piece
    of the reply goes out with the piece that completes it, none is held for a possible call."""
    from exl2cpp.server.schemas import ChatCompletionRequest

    body = json.loads(OPENWEBUI_REQUEST.read_text())
    req = ChatCompletionRequest.model_validate(body)
    tools = T.check_tools([t if isinstance(t, dict) else t.model_dump() for t in req.tools])
    assert len(tools) == 36
    parser = T.ToolCallParser(fmt, T.tool_names(tools))
    answer = ["The", " capital", " of", " France", " is", " Paris", "."]
    out = []
    for piece in answer:
        events = parser.push(piece)
        text = "".join(e.text for e in events if isinstance(e, T.Content))
        assert text == piece, (fmt, piece, events)
        out.append(text)
    assert not parser.finish() and not parser.calls and "".join(out) == "".join(answer)
