"""``gpulock serve`` speaks what agent frameworks speak: OpenAI's Responses API, Anthropic's
Messages API, and tool calls through every chat API, driven by the official clients.

One real server for the module, on the tiny llama.cpp model in the server's own process:

* ``chat``: the model on a simulated GPU (its template is not ChatML: it cannot call tools);
* ``agent``: the same model on the CPU first (``tiny-plain``, no tools), then a candidate that
  names llama-cpp-python's ``chatml-function-calling`` handler (``tiny-tools``): a request
  with tools skips the first and reaches the handler;
* ``plain``: ``tiny-plain`` only: a request with tools is refused, saying why;
* ``remote``: ``tiny-plain``, then a real ``python -m llama_cpp.server`` (its
  ``chatml-function-calling`` chat format) as an OpenAI-compatible candidate: the tools are
  passed to the endpoint, and its tool calls come back through every API.

The model's words are nonsense, so the tests check shapes, the candidate that answered
(``X-Gpulock-Model``), and what the accounting recorded; a tool schema with an ``enum``
keeps the handler's grammar-bound arguments short and valid.
"""

from __future__ import annotations

import asyncio
import json
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import anthropic
import openai
import pytest
from router_servers import LlamaServer
from serve_server import GatewayProc

from gpulock.router.tiny_model import ensure_tiny_llama

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMS}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}}
UPSTREAM_KEY = "upstream-test-key"
ANTHROPIC_TOOL = {"name": "get_weather", "description": "weather", "input_schema": WEATHER_PARAMS}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProc]:
    root = tmp_path_factory.mktemp("agent-apis")
    tiny = ensure_tiny_llama(root)
    upstream = LlamaServer(
        tiny, root / "llama-server.log", api_key=UPSTREAM_KEY, n_ctx=2048,
        chat_format="chatml-function-calling",
    ).start()  # fmt: skip
    config = root / "gpulock.yaml"
    config.write_text(
        textwrap.dedent(
            f"""\
            simulate: 24GiB
            routes:
              chat:
                - {{tier: gpu, backend: llama_cpp, model: {tiny}, n_ctx: 256, max_tokens: 8,
                   name: tiny-gpu}}
              agent:
                - {{tier: cpu, backend: llama_cpp, model: {tiny}, n_ctx: 2048, max_tokens: 48,
                   name: tiny-plain}}
                - {{tier: cpu, backend: llama_cpp, model: {tiny}, n_ctx: 2048, max_tokens: 48,
                   name: tiny-tools, tools: chatml-function-calling}}
              plain:
                - {{tier: cpu, backend: llama_cpp, model: {tiny}, n_ctx: 2048, max_tokens: 8,
                   name: tiny-plain}}
              remote:
                - {{tier: cpu, backend: llama_cpp, model: {tiny}, n_ctx: 2048, max_tokens: 8,
                   name: tiny-plain}}
                - {{tier: cloud, backend: openai, model: tiny, base_url: {upstream.base_url},
                   api_key_env: UPSTREAM_KEY, max_tokens: 48, name: llama-server}}
            """
        )
    )
    env = {
        "GPULOCK_CONFIG": str(config),
        "GPULOCK_STATE_DIR": str(root / "state"),
        "UPSTREAM_KEY": UPSTREAM_KEY,
    }
    g = GatewayProc(root / "serve.log", env=env)
    g.root = root  # type: ignore[attr-defined]
    try:
        yield g.start()
    finally:
        g.stop()
        upstream.stop()


def oa(g: GatewayProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{g.url}/v1", api_key="unused", max_retries=0)


def an(g: GatewayProc, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=g.url, api_key=key, max_retries=0)


def calls(g: GatewayProc) -> list[dict[str, Any]]:
    """The accounting's ``call`` events so far (the router's one path: budgets, usage)."""
    log = g.root / "state" / "events.jsonl"  # type: ignore[attr-defined]
    lines = log.read_text().splitlines() if log.exists() else []
    return [e for e in map(json.loads, lines) if e.get("event") == "call"]


# --- the Responses API -------------------------------------------------------------------------


def test_openai_client_responses_create_plain_and_streamed(gateway: GatewayProc) -> None:
    c = oa(gateway)
    before = len(calls(gateway))
    raw = c.responses.with_raw_response.create(
        model="chat", input="hello", instructions="be brief", max_output_tokens=5
    )
    assert raw.headers["x-gpulock-tier"] == "gpu" and raw.headers["x-gpulock-model"] == "tiny-gpu"
    r = raw.parse()
    assert r.object == "response" and r.model == "chat" and r.output_text
    # The tiny model never ends by itself: it runs into max_output_tokens, as the API says so.
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 5 and r.usage.input_tokens > 0

    kinds: list[str] = []
    deltas: list[str] = []
    with c.responses.create(model="chat", input="hello", stream=True) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            last = event
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"  # the route's max_tokens (8) ran out
    assert "response.output_item.added" in kinds and "response.output_text.done" in kinds
    assert len(deltas) == 8
    final = last.response  # type: ignore[attr-defined]
    assert final.output_text == "".join(deltas) and final.usage.output_tokens == 8
    # Both were counted through the router's accounting, as chat completions are.
    assert len(calls(gateway)) == before + 2


def test_responses_is_stateless_and_says_so(gateway: GatewayProc) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        oa(gateway).responses.create(model="chat", input="hi", previous_response_id="resp_1")
    err = e.value.body
    assert isinstance(err, dict) and err["param"] == "previous_response_id"
    assert "stateless" in err["message"] and "input" in err["message"]
    r = gateway.request(
        "POST",
        "/v1/responses",
        {"model": "chat", "input": [{"type": "item_reference", "id": "msg_1"}]},
    )
    assert r.status == 400 and "stateless" in r.json()["error"]["message"]
    r = gateway.request(
        "POST",
        "/v1/responses",
        {"model": "chat", "input": [{"role": "user", "content": [{"type": "input_image"}]}]},
    )
    assert r.status == 400 and "input_image" in r.json()["error"]["message"]


def test_responses_function_call_loop_reaches_the_handler(gateway: GatewayProc) -> None:
    c = oa(gateway)
    raw = c.responses.with_raw_response.create(
        model="agent",
        input="weather in Paris?",
        tools=[RESPONSES_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
    )
    # tiny-plain cannot call tools: the route fell back to the candidate that can.
    assert raw.headers["x-gpulock-model"] == "tiny-tools"
    r = raw.parse()
    assert r.status == "completed"
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.arguments)["city"] in ("Paris", "Oslo")  # type: ignore[union-attr]

    # The next turn: the call and its output as input items (stateless: all of it is sent).
    follow = c.responses.create(
        model="agent",
        input=[
            {"role": "user", "content": "weather in Paris?"},
            {
                "type": "function_call",
                "call_id": call.call_id,  # type: ignore[union-attr]
                "name": "get_weather",
                "arguments": call.arguments,  # type: ignore[union-attr]
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},  # type: ignore[union-attr]
        ],
        tools=[RESPONSES_TOOL],  # type: ignore[list-item]
        tool_choice="required",
        stream=True,
    )
    kinds = [event.type for event in follow]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds


def test_tools_on_a_route_that_cannot_call_them_are_refused_with_the_reason(
    gateway: GatewayProc,
) -> None:
    with pytest.raises(openai.APIStatusError) as e:
        oa(gateway).responses.create(model="plain", input="hi", tools=[RESPONSES_TOOL])  # type: ignore[list-item]
    assert e.value.status_code == 503
    assert "tiny-plain: cannot call tools" in str(e.value.body)
    # tool_choice "none": the tools are not sent, so any candidate answers.
    r = oa(gateway).responses.create(
        model="plain",
        input="hi",
        tools=[RESPONSES_TOOL],
        tool_choice="none",  # type: ignore[list-item]
    )
    assert r.output_text


def test_chat_completions_pass_tools_to_the_handler(gateway: GatewayProc) -> None:
    c = oa(gateway)
    raw = c.chat.completions.with_raw_response.create(
        model="agent",
        messages=[{"role": "user", "content": "weather?"}],
        tools=[CHAT_TOOL],  # type: ignore[list-item]
        tool_choice="required",
    )
    assert raw.headers["x-gpulock-model"] == "tiny-tools"
    r = raw.parse()
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (tc,) = choice.message.tool_calls or []
    assert tc.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(tc.function.arguments)["city"] in ("Paris", "Oslo")  # type: ignore[union-attr]
    # Streamed, the calls arrive whole (one delta), then finish_reason tool_calls.
    chunks = list(
        c.chat.completions.create(
            model="agent",
            messages=[{"role": "user", "content": "weather?"}],
            tools=[CHAT_TOOL],  # type: ignore[list-item]
            tool_choice="required",
            stream=True,
        )
    )
    deltas = [ch.choices[0].delta.tool_calls for ch in chunks if ch.choices]
    assert [d[0].function.name for d in deltas if d] == ["get_weather"]  # type: ignore[union-attr]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tools_are_passed_to_an_openai_compatible_endpoint(gateway: GatewayProc) -> None:
    """A real OpenAI-compatible server that calls tools (llama-cpp-python's server, its
    chatml-function-calling format): serve passes the tools on, and its calls come back in
    each API's shape."""
    raw = oa(gateway).chat.completions.with_raw_response.create(
        model="remote",
        messages=[{"role": "user", "content": "weather?"}],
        tools=[CHAT_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert raw.headers["x-gpulock-tier"] == "cloud"
    assert raw.headers["x-gpulock-model"] == "llama-server"  # tiny-plain was passed over
    (tc,) = raw.parse().choices[0].message.tool_calls or []
    assert json.loads(tc.function.arguments)["city"] in ("Paris", "Oslo")  # type: ignore[union-attr]
    m = an(gateway).messages.create(
        model="remote",
        max_tokens=48,
        messages=[{"role": "user", "content": "weather?"}],
        tools=[ANTHROPIC_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert m.stop_reason == "tool_use" and m.content[-1].type == "tool_use"
    r = oa(gateway).responses.create(
        model="remote",
        input="weather?",
        tools=[RESPONSES_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
    )
    assert [o.type for o in r.output] == ["function_call"]


# --- the Messages API --------------------------------------------------------------------------


def test_anthropic_client_messages_create_and_stream(gateway: GatewayProc) -> None:
    c = an(gateway)
    before = len(calls(gateway))
    raw = c.messages.with_raw_response.create(
        model="chat",
        max_tokens=6,
        system="be brief",
        messages=[{"role": "user", "content": "hello"}],
        stop_sequences=["\x00"],
    )
    assert raw.headers["x-gpulock-model"] == "tiny-gpu"
    m = raw.parse()
    assert m.type == "message" and m.role == "assistant" and m.model == "chat"
    assert m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 6

    with c.messages.stream(
        model="chat", max_tokens=5, messages=[{"role": "user", "content": "hello"}]
    ) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) == 5 and final.content[0].text == "".join(pieces)  # type: ignore[union-attr]
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 5
    assert len(calls(gateway)) == before + 2


def test_anthropic_event_sequence_and_error_shape(gateway: GatewayProc) -> None:
    body = {
        "model": "chat",
        "max_tokens": 3,
        "stream": True,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    }
    r = gateway.request("POST", "/v1/messages", body, {"anthropic-version": "2023-06-01"})
    assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
    kinds = [line[7:] for line in r.body.decode().splitlines() if line.startswith("event: ")]
    assert kinds == [
        "message_start", "content_block_start", "ping", "content_block_delta",
        "content_block_delta", "content_block_delta", "content_block_stop", "message_delta",
        "message_stop",
    ]  # fmt: skip
    # max_tokens is required, as Anthropic requires it; errors are in Anthropic's shape.
    with pytest.raises(anthropic.BadRequestError) as e:
        gateway_missing = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
        an(gateway).post("/v1/messages", body=gateway_missing, cast_to=object)
    assert e.value.body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "max_tokens: Field required, a whole number >= 1",
        },
    }
    with pytest.raises(anthropic.NotFoundError) as nf:
        an(gateway).messages.create(
            model="nope", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
        )
    err = nf.value.body
    assert isinstance(err, dict) and err["error"]["type"] == "not_found_error"
    assert "known models: chat, agent, plain, remote" in err["error"]["message"]


def test_anthropic_tool_use_and_tool_result(gateway: GatewayProc) -> None:
    c = an(gateway)
    m = c.messages.create(
        model="agent",
        max_tokens=64,
        messages=[{"role": "user", "content": "weather?"}],
        tools=[ANTHROPIC_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert m.stop_reason == "tool_use"
    (use,) = m.content
    assert use.type == "tool_use" and use.name == "get_weather"
    assert use.input["city"] in ("Paris", "Oslo")  # type: ignore[index]
    with c.messages.stream(
        model="agent",
        max_tokens=64,
        tools=[ANTHROPIC_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "any"},
        messages=[
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [use]},  # type: ignore[list-item]
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}],
            },
        ],
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use"


def test_x_api_key_is_accepted_where_keys_are_configured(tmp_path: Path) -> None:
    config = tmp_path / "gpulock.yaml"
    tiny = ensure_tiny_llama(tmp_path)
    config.write_text(
        "serve: {api_keys_env: SERVE_KEYS}\nroutes:\n  chat:\n"
        f"    - {{tier: cpu, backend: llama_cpp, model: {tiny}, n_ctx: 256, max_tokens: 4}}\n"
    )
    env = {
        "GPULOCK_CONFIG": str(config),
        "GPULOCK_STATE_DIR": str(tmp_path / "state"),
        "SERVE_KEYS": "k1",
    }
    g = GatewayProc(tmp_path / "serve.log", env=env).start()
    try:
        msg = [{"role": "user", "content": "hi"}]
        m = an(g, key="k1").messages.create(model="chat", max_tokens=2, messages=msg)  # type: ignore[arg-type]
        assert m.usage.output_tokens == 2
        with pytest.raises(anthropic.AuthenticationError) as e:
            an(g, key="wrong").messages.create(model="chat", max_tokens=2, messages=msg)  # type: ignore[arg-type]
        assert e.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        assert "k1" not in g.output()
    finally:
        g.stop()


# --- the OpenAI Agents SDK ---------------------------------------------------------------------


def test_openai_agents_sdk_runner_on_its_default_path(gateway: GatewayProc) -> None:
    """``Runner.run`` on the SDK's default model (the Responses API), as a new user would:
    a structured answer (``output_type``, a JSON schema: llama.cpp's grammar makes the tiny
    model finish), and a function tool the model must call, whose result ends the run."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_default_openai_client,
        set_tracing_disabled,
    )
    from pydantic import BaseModel

    class Verdict(BaseModel):
        ok: bool

    called: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        called.append(city)
        return f"sunny in {city}"

    async def run() -> tuple[Any, Any]:
        client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
        set_tracing_disabled(True)
        set_default_openai_client(client, use_for_tracing=False)
        judge = Agent(name="judge", instructions="Answer.", model="agent", output_type=Verdict)
        first = await Runner.run(judge, "is it ok?")
        weather = Agent(
            name="weather",
            instructions="Use the tool.",
            model="agent",
            tools=[get_weather],
            model_settings=ModelSettings(tool_choice="get_weather"),
            tool_use_behavior="stop_on_first_tool",
        )
        second = await Runner.run(weather, "weather in Paris?")
        await client.close()
        return first, second

    first, second = asyncio.run(run())
    assert isinstance(first.final_output, Verdict)
    assert called and second.final_output == f"sunny in {called[0]}"
    # The default path, not chat completions: the SDK resolved its Responses model.
    from agents.models.multi_provider import MultiProvider

    assert isinstance(MultiProvider().get_model("agent"), OpenAIResponsesModel)


def test_ollama_chat_takes_tools_in_its_own_shape(gateway: GatewayProc) -> None:
    """Ollama's ``/api/chat`` with ``tools``, through the official ``ollama`` client: the tools
    reach a candidate that can call them (never silently dropped), a call comes back with its
    arguments as an object, a conversation carrying Ollama-shaped calls and results is taken,
    and a route that cannot call tools refuses, saying why."""
    import ollama

    c = ollama.Client(host=gateway.url)
    r = c.chat(model="agent", messages=[{"role": "user", "content": "weather?"}], tools=[CHAT_TOOL])
    calls = r.message.tool_calls or []
    assert calls or r.message.content is not None, r
    for call in calls:  # "auto": the model may answer in words; a call must be well formed
        assert call.function.name == "get_weather"
        assert call.function.arguments.get("city") in ("Paris", "Oslo"), call
    loop = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}],
        },
        {"role": "tool", "content": '{"temp": 3}', "tool_name": "get_weather"},
    ]
    r = c.chat(model="agent", messages=loop, tools=[CHAT_TOOL])
    assert r.done and (r.message.content is not None or r.message.tool_calls), r
    parts = list(
        c.chat(model="agent", messages=loop, tools=[CHAT_TOOL], stream=True)  # whole, one line
    )
    assert parts and parts[-1].done, parts
    with pytest.raises(ollama.ResponseError) as refused:
        c.chat(model="plain", messages=[{"role": "user", "content": "x"}], tools=[CHAT_TOOL])
    assert "tool" in str(refused.value).lower(), refused.value
