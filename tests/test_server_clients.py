"""The agent frameworks users point at `exl2cpp serve`, driving a real server process (SmolLM2 on CPU):
langchain-openai's ChatOpenAI (invoke, stream, bind_tools, with_structured_output) and the openai-agents SDK (an
Agent with a function tool run by Runner, on the chat-completions model). Greedy decoding throughout, so a streamed
reply must equal the non-streamed one. A 135M model does not call tools by itself, so calls are forced with
tool_choice (a named tool or "required"): what is tested is that the frameworks read the server's calls, run the
tool with the parsed arguments and carry the result back."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

from test_server import KEY, ServerProc  # noqa: E402

INSTALL = "pip install -e '.[test]'"
QUESTION = "What is the capital of France?"
WEATHER_Q = "What is the weather in Paris?"


def _need(module: str, package: str):
    return pytest.importorskip(module, reason=f"{package} is not installed ({INSTALL} installs it)")


@pytest.fixture(scope="module")
def server(smollm2_dir):
    srv = ServerProc(smollm2_dir, "--api-key", KEY, "--cache-tokens", "8192", "--model-name", "smollm2")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    age: int = pydantic.Field(ge=0, le=150)


# ---- langchain-openai ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lc(server):
    lco = _need("langchain_openai", "langchain-openai")

    def make(**kw):
        kw.setdefault("max_tokens", 24)
        return lco.ChatOpenAI(
            base_url=server.url + "/v1", api_key=KEY, model="smollm2", temperature=0, max_retries=0,
            timeout=120, **kw,
        )  # fmt: skip

    return make


def _joined(chunks):
    acc = chunks[0]
    for c in chunks[1:]:
        acc = acc + c
    return acc


def test_langchain_invoke_and_stream(lc, client):
    """invoke answers what the openai client gets; stream's chunks (sync and async) join to it, with usage."""
    llm = lc(stream_usage=True)
    r = llm.invoke(QUESTION)
    want = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": QUESTION}], max_tokens=24, temperature=0
    )
    assert r.content == want.choices[0].message.content and "Paris" in r.content
    assert r.response_metadata["finish_reason"] == want.choices[0].finish_reason
    assert r.usage_metadata["output_tokens"] == want.usage.completion_tokens
    chunks = list(llm.stream(QUESTION))
    assert len(chunks) > 3  # streamed in pieces, not one block
    acc = _joined(chunks)
    assert acc.content == r.content
    assert acc.usage_metadata["output_tokens"] == r.usage_metadata["output_tokens"]
    assert acc.usage_metadata["input_tokens"] == r.usage_metadata["input_tokens"]

    async def both():
        a = await llm.ainvoke(QUESTION)
        pieces = [c.content async for c in llm.astream(QUESTION)]
        return a.content, "".join(pieces)

    assert asyncio.run(both()) == (r.content, r.content)


def _weather_tool(seen: list):
    tools = _need("langchain_core.tools", "langchain-openai")

    @tools.tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        seen.append(city)
        return f"Sunny, 21 C in {city}."

    return get_weather


def test_langchain_bind_tools(lc):
    """A forced call reaches langchain as a parsed tool call (streamed the same), the tool runs with its arguments,
    and the ToolMessage goes back for a text answer."""
    msgs = _need("langchain_core.messages", "langchain-openai")
    seen: list = []
    get_weather = _weather_tool(seen)
    llm = lc(max_tokens=60)
    bound = llm.bind_tools([get_weather], tool_choice="get_weather", strict=True)
    ai = bound.invoke(WEATHER_Q)
    assert ai.invalid_tool_calls == [] and len(ai.tool_calls) == 1, ai
    call = ai.tool_calls[0]
    assert call["name"] == "get_weather" and call["id"]
    jsonschema.validate(call["args"], get_weather.tool_call_schema.model_json_schema())
    assert "paris" in call["args"]["city"].lower()
    assert ai.response_metadata["finish_reason"] == "tool_calls"

    chunks = list(bound.stream(WEATHER_Q))
    streamed = _joined(chunks)
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(call["name"], call["args"])]
    arg_pieces = [tc["args"] for ch in chunks for tc in ch.tool_call_chunks if tc["args"]]
    assert len(arg_pieces) > 1  # the arguments arrived as deltas while they were generated

    result = get_weather.invoke(call)  # a ToolCall in, a ToolMessage out
    assert isinstance(result, msgs.ToolMessage) and result.tool_call_id == call["id"]
    assert seen == [call["args"]["city"]]
    history = [msgs.HumanMessage(WEATHER_Q), ai, result]
    answer = llm.bind_tools([get_weather], tool_choice="none").invoke(history)
    assert answer.content and not answer.tool_calls
    assert answer.response_metadata["finish_reason"] in ("stop", "length")


def test_langchain_bind_tools_required(lc):
    """tool_choice "any" ("required" on the wire) over two tools: one call of one of them, arguments valid."""
    tools = _need("langchain_core.tools", "langchain-openai")

    @tools.tool
    def get_time(tz: str) -> str:
        """Current time in a time zone."""
        return "12:00"

    get_weather = _weather_tool([])
    ai = lc(max_tokens=60).bind_tools([get_weather, get_time], tool_choice="any", strict=True).invoke(
        "What time is it in Tokyo?"
    )
    assert len(ai.tool_calls) == 1 and not ai.invalid_tool_calls, ai
    call = ai.tool_calls[0]
    chosen = {"get_weather": get_weather, "get_time": get_time}[call["name"]]
    jsonschema.validate(call["args"], chosen.tool_call_schema.model_json_schema())


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_structured_output(lc, method):
    """with_structured_output in each of langchain's methods returns a Person that satisfies the schema; json_schema
    and function_calling are constrained by the server, json_mode only to JSON (the prompt names the keys)."""
    prompt = "Alice is 30 years old. Extract the person."
    if method == "json_mode":
        prompt += ' Reply with a JSON object with keys "name" and "age".'
    kw = {"strict": True} if method != "json_mode" else {}
    so = lc(max_tokens=60).with_structured_output(Person, method=method, include_raw=True, **kw)
    out = so.invoke(prompt)
    assert out["parsing_error"] is None, out
    p = out["parsed"]
    assert isinstance(p, Person)
    jsonschema.validate(p.model_dump(), Person.model_json_schema())
    assert p.name == "Alice"  # the model copies the name; the age it picks within the bounds is its own
    if method == "json_schema":
        assert json.loads(out["raw"].content) == p.model_dump()
        streamed = [s for s in so.stream(prompt) if "parsed" in s]
        assert streamed[-1]["parsed"] == p


def test_langchain_cut_tool_call_is_length(lc, client):
    """A forced call cut off by max_tokens inside its arguments is finish_reason "length" (streamed and not) with
    the arguments as far as they were written, so langchain reports an invalid (truncated) call, not a finished
    one with made-up arguments."""
    get_weather = _weather_tool([])
    ai = lc(max_tokens=16).bind_tools([get_weather], tool_choice="get_weather").invoke(WEATHER_Q)
    assert ai.response_metadata["finish_reason"] == "length"
    assert ai.tool_calls == [] and [c["name"] for c in ai.invalid_tool_calls] == ["get_weather"], ai
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
    kw = dict(
        model="smollm2", messages=[{"role": "user", "content": WEATHER_Q}], max_tokens=16, temperature=0,
        tools=[tool], tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "length" and r.usage.completion_tokens == 16
    args = c.message.tool_calls[0].function.arguments
    assert args == ai.invalid_tool_calls[0]["args"] and args.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(args)
    chunks = [ch for ch in client.chat.completions.create(stream=True, **kw) if ch.choices]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices[0].finish_reason] == ["length"]
    deltas = [tc for ch in chunks for tc in ch.choices[0].delta.tool_calls or []]
    assert "".join(d.function.arguments or "" for d in deltas) == args


# ---- openai-agents ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def agents_sdk(server):
    sdk = _need("agents", "openai-agents")
    sdk.set_tracing_disabled(True)

    def model():  # a client of its own: its connections belong to the event loop that first uses them
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        return sdk.OpenAIChatCompletionsModel(model="smollm2", openai_client=aclient)

    return sdk, model


def test_agents_tool_loop(agents_sdk):
    """Runner.run: the forced first turn calls the function tool with parsed arguments, its output goes back (tool
    choice reset to auto), the second turn answers in text; run_streamed does the same, token for token."""
    sdk, model = agents_sdk
    seen: list = []

    @sdk.function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        seen.append(city)
        return f"Sunny, 21 C in {city}."

    agent = sdk.Agent(
        name="weather",
        instructions="You answer weather questions with the get_weather tool.",
        tools=[get_weather],
        model=model(),
        model_settings=sdk.ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=40),
    )

    async def both():
        r = await sdk.Runner.run(agent, WEATHER_Q, max_turns=4)
        rs = sdk.Runner.run_streamed(agent, WEATHER_Q, max_turns=4)
        return r, rs, [e async for e in rs.stream_events()]

    r, rs, events = asyncio.run(both())
    kinds = [type(i).__name__ for i in r.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"], kinds
    assert len(seen) == 2 and seen[0] == seen[1] and "paris" in seen[0].lower()  # once in each run
    call = r.new_items[0].raw_item
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": seen[0]}
    assert r.new_items[1].output == f"Sunny, 21 C in {seen[0]}."
    assert isinstance(r.final_output, str) and r.final_output
    assert len(r.raw_responses) == 2 and r.context_wrapper.usage.requests == 2
    assert r.context_wrapper.usage.output_tokens > 0
    assert rs.final_output == r.final_output
    names = [e.name for e in events if e.type == "run_item_stream_event"]
    assert names[:2] == ["tool_called", "tool_output"] and "message_output_created" in names
    text_deltas = [e for e in events if e.type == "raw_response_event" and e.data.type == "response.output_text.delta"]
    assert len(text_deltas) > 1  # the answer streamed in pieces


def test_agents_output_type(agents_sdk):
    """An agent with output_type gets a Person from the server's JSON-schema constrained reply."""
    sdk, model = agents_sdk
    agent = sdk.Agent(
        name="extract",
        instructions="Extract the person.",
        output_type=Person,
        model=model(),
        model_settings=sdk.ModelSettings(temperature=0, max_tokens=40),
    )
    r = asyncio.run(sdk.Runner.run(agent, "Alice is 30 years old."))
    assert isinstance(r.final_output, Person) and (r.final_output.name, r.final_output.age) == ("Alice", 30)
