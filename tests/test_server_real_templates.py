"""The real chat templates of Qwen2.5, Llama 3.1, Mistral Nemo and Qwen3 (llama.cpp's copies, from
llama-cpp-python's sdist on PyPI) in `exl2cpp serve`: the tool format picked from each, the tool list and a
conversation with calls and results rendered by each as that model expects, forced calls written in each
template's format with the stream reassembling to the non-streamed reply, and Qwen3's thinking: its
`enable_thinking` switch reaching the template, and its replies (reasoning, then content or calls) split into
reasoning_content / content / tool_calls the same way streamed, for any cut of the text. SmolLM2 on CPU through
FastAPI's TestClient."""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
from fastapi.testclient import TestClient

from exl2cpp.server import tools as T
from exl2cpp.server.reasoning import ReasoningSplitter
from exl2cpp.server.reasoning import split as reasoning_split
from test_server_tools import ADMIN, KEY, TIME, WEATHER, A, U, forced_calls

FORMAT = {"qwen2.5": "hermes", "llama3.1": "llama3", "mistral-nemo": "mistral", "qwen3": "hermes"}
CALL_ID = "abc123XYZ"  # nine letters and digits: Mistral's templates refuse other ids
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": CALL_ID, "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},  # fmt: skip
    {"role": "tool", "tool_call_id": CALL_ID, "content": '{"temp": 21}'},
]
# what each template writes for HISTORY: the call with its arguments as an object, the result
RENDERED = {
    "qwen2.5": ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>'],
    "llama3.1": ['{"name": "get_weather", "parameters": {"city": "Paris"}}',
                 '<|start_header_id|>ipython<|end_header_id|>\n\n"{\\"temp\\": 21}"'],
    "mistral-nemo": [f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {{"city": "Paris"}}, "id": "{CALL_ID}"}}]',
                     f'[TOOL_RESULTS]{{"content": {{"temp": 21}}, "call_id": "{CALL_ID}"}}[/TOOL_RESULTS]'],
    "qwen3": ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
              '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>'],
}  # fmt: skip


@pytest.fixture(scope="module")
def http(smollm2_dir, real_templates, tmp_path_factory):
    from exl2cpp.server import create_app
    from exl2cpp.server.config import ServeConfig

    tmp = tmp_path_factory.mktemp("real-templates")
    for name, source in real_templates.items():
        (tmp / f"{name}.jinja").write_text(source)
    cfg = ServeConfig(model=str(smollm2_dir), model_name="smol", api_keys=[KEY], admin_key=ADMIN, cache_tokens=4096,
                      page_size=16, templates_dir=str(tmp))  # fmt: skip
    with TestClient(create_app(cfg)) as c:
        while c.get("/health").json().get("status") != "ready":
            pass
        yield c


class _Template:
    def __init__(self, http, name):
        self.http, self.name = http, name

    def __enter__(self):
        r = self.http.post("/v1/template/switch", json={"prompt_template_name": self.name}, headers=A)
        assert r.status_code == 200, r.text
        return self

    def __exit__(self, *exc):
        self.http.post("/v1/template/unload", headers=A)


def _rendered(http, messages, **extra) -> str:
    r = http.post("/v1/tokenize", json={"messages": messages, **extra}, headers=U)
    assert r.status_code == 200, r.text
    return http.app.state.slot.model.tokenizer.decode(r.json()["tokens"])


@pytest.mark.parametrize("name", sorted(FORMAT))
def test_format_picked_from_the_real_template(real_templates, name):
    assert T.template_format(real_templates[name]) == FORMAT[name]


@pytest.mark.parametrize("name", sorted(FORMAT))
def test_real_template_renders_tools_and_history(http, name):
    """The tool list reaches the template (its own tool prompt, the function's name and parameters), and a
    conversation with a call and its result is written as the model was trained on."""
    with _Template(http, name):
        text = _rendered(http, HISTORY, tools=[WEATHER])
        for part in RENDERED[name]:
            assert part in text, (name, part, text)
        assert '"get_weather"' in text and '"maxLength": 20' in text, text


@pytest.mark.parametrize("name", sorted(FORMAT))
def test_forced_call_with_the_real_template(http, name):
    """A forced call (named, and "required") is written in the template's own format, parses to a valid call,
    and the stream reassembles to the same message."""
    with _Template(http, name):
        for body, msg in forced_calls(http):
            call = msg["tool_calls"][0]
            if FORMAT[name] == "mistral":
                assert len(call["id"]) == 9 and call["id"].isalnum()
            # the reply goes back into the next turn through the same template
            follow = [body["messages"][0], msg, {"role": "tool", "tool_call_id": call["id"], "content": '{"t": 21}'}]
            assert call["function"]["name"] in _rendered(http, follow, tools=[WEATHER, TIME])


def test_qwen3_enable_thinking_reaches_the_template(http):
    """chat_template_kwargs enable_thinking=false makes Qwen3's template write its empty thinking block; the
    default leaves the reasoning to the model."""
    msgs = [{"role": "user", "content": "Hi"}]
    with _Template(http, "qwen3"):
        off = _rendered(http, msgs, chat_template_kwargs={"enable_thinking": False})
        on = _rendered(http, msgs)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n"), off
    assert on.endswith("<|im_start|>assistant\n"), on


QWEN3_REPLIES = [
    # (reply as Qwen3 writes it after its template's generation prompt, reasoning, content, calls)
    ("<think>\nThe user wants the weather. I should call get_weather.\n</think>\n\n<tool_call>\n"
     '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "\nThe user wants the weather. I should call get_weather.\n", None, [("get_weather", '{"city": "Paris"}')]),
    ("<think>\nSimple greeting.\n</think>\n\nHello! How can I help you today?",
     "\nSimple greeting.\n", "Hello! How can I help you today?", []),
    ("<think>\n\n</think>\n\nParis is the capital of France.", "\n\n", "Paris is the capital of France.", []),
    ("<think>\nTwo lookups.\n</think>\n\nLet me check both.\n<tool_call>\n"
     '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n<tool_call>\n'
     '{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
     "\nTwo lookups.\n", "Let me check both.", [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"tz": "CET"}')]),
]  # fmt: skip


def _split_whole(reply, names):
    thought, text = reasoning_split(reply, "<think>", "</think>")
    content, calls = T.parse_tool_calls(text, [WEATHER, TIME], "hermes", None)
    return thought, content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def _split_streamed(reply, names, cuts):
    """The server's streaming chain: the reasoning splitter, then the tool-call parser on the content."""
    rs, tp = ReasoningSplitter("<think>", "</think>"), T.ToolCallParser("hermes", names)
    thought, content, events = "", "", []
    pieces = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)])]
    for piece in pieces:
        t, c = rs.push(piece)
        thought += t
        events += tp.push(c)
    t, c = rs.flush()
    thought += t
    events += tp.push(c) + tp.finish()
    content = "".join(e.text for e in events if isinstance(e, T.Content))
    args: dict[int, list] = {}
    for e in events:
        if isinstance(e, T.CallStart):
            args[e.index] = [e.name, ""]
        elif isinstance(e, T.CallArgs):
            args[e.index][1] += e.text
    return thought or None, content or None, [(n, a) for n, a in (args[k] for k in sorted(args))]


@pytest.mark.parametrize("i", range(len(QWEN3_REPLIES)))
def test_qwen3_replies_split_the_same_streamed(i):
    """Each Qwen3 reply splits into its reasoning, its content and its calls; the streamed split gives the same
    for one-character pieces and for random cuts."""
    reply, thought, content, calls = QWEN3_REPLIES[i]
    names = {"get_weather", "get_time"}
    got = _split_whole(reply, names)
    assert got[0] == thought and got[1] == content, got
    assert [(n, json.loads(a)) for n, a in got[2]] == [(n, json.loads(a)) for n, a in calls]
    rng = random.Random(i)
    for cuts in [list(range(1, len(reply))), *(sorted(rng.sample(range(1, len(reply)), 7)) for _ in range(20))]:
        streamed = _split_streamed(reply, names, cuts)
        assert streamed[0] == got[0] and streamed[1] == got[1], (cuts, streamed)
        assert [(n, json.loads(a)) for n, a in streamed[2]] == [(n, json.loads(a)) for n, a in got[2]]


def test_tokenize_tools_checked(http):
    """/v1/tokenize renders a chat's tools as a chat request does; tools without messages, or malformed, are a
    400 naming the field."""
    r = http.post("/v1/tokenize", json={"prompt": "hi", "tools": [WEATHER]}, headers=U)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    r = http.post("/v1/tokenize", json={"messages": [{"role": "user", "content": "hi"}], "tools": [{"x": 1}]},
                  headers=U)  # fmt: skip
    assert r.status_code == 400 and "tools[0]" in r.json()["error"]["message"], r.text
