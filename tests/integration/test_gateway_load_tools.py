"""What load tools (guidellm, aiperf) and the OpenAI SDK rely on: vLLM's ``ignore_eos``,
``min_tokens`` and ``stream_options.continuous_usage_stats``, ``/health``, ``GET /v1/models/{id}``,
OpenAI's error JSON on unknown routes and methods, stop strings left out of the text, and
``prompt_tokens`` counted once per prompt with ``n > 1``; and the stop rules in the torch
engine's request state."""

from __future__ import annotations

import json

import openai
import pytest

from engines.backend import GenerationRequest
from engines.torch_backend.request_state import RequestState
from engines.torch_backend.sequence import Sequence
from engines.torch_backend.tokenizer import ByteTokenizer, IncrementalDetokenizer
from tests.conftest import EngineFactory
from tests.gateway_helpers import Served, http, sse_data

ECHO = "dpcoord-echo"
EOS = 0


def _state(**overrides: object) -> RequestState:
    request = GenerationRequest("r", [104, 105], **overrides)  # type: ignore[arg-type]
    return RequestState(request, Sequence.from_prompt("r", [104, 105]), 0, IncrementalDetokenizer(ByteTokenizer(), []))


def _run(state: RequestState, tokens: list[int]) -> tuple[int, str | None]:
    """Feed ``tokens`` as the engine would; how many were taken and why it finished."""
    for count, token in enumerate(tokens, 1):
        state.sequence.token_ids.append(token)
        finish = state.token_finish(token, (EOS,), max_context=1000)
        _, stopped = state.text(token)
        if finish is not None or stopped:
            return count, finish or "stop"
    return len(tokens), None


def test_eos_ends_a_request_unless_ignored_or_before_min_tokens() -> None:
    tokens = [97, EOS, 98, 99, EOS, 100]
    assert _run(_state(max_tokens=100), tokens) == (2, "stop")
    assert _run(_state(max_tokens=100, ignore_eos=True), tokens) == (6, None)
    assert _run(_state(max_tokens=100, min_tokens=3), tokens) == (5, "stop")


def test_stop_strings_count_from_min_tokens() -> None:
    """A stop string completed before ``min_tokens`` is passed over; the next one ends the request."""
    tokens = [ord(c) for c in "xaxbxc"]
    assert _run(_state(max_tokens=100, stop=("x",)), tokens) == (1, "stop")
    assert _run(_state(max_tokens=100, stop=("x",), min_tokens=2), tokens) == (3, "stop")


async def test_min_tokens_and_ignore_eos_through_the_gateway(
    start_engines: EngineFactory, aclient: openai.AsyncOpenAI
) -> None:
    """The echo engine honours ``min_tokens`` for stop strings; ``ignore_eos`` is accepted (it has no EOS)."""
    await start_engines(1)
    plain = await aclient.completions.create(model=ECHO, prompt="abc", max_tokens=8, stop=["a"])
    assert (plain.choices[0].text, plain.choices[0].finish_reason) == ("", "stop")
    later = await aclient.completions.create(
        model=ECHO, prompt="abc", max_tokens=8, stop=["a"], extra_body={"min_tokens": 3, "ignore_eos": True}
    )
    assert (later.choices[0].text, later.choices[0].finish_reason) == ("abc", "stop")
    assert later.usage is not None and later.usage.completion_tokens == 4


async def test_min_tokens_above_max_tokens_is_400_by_name(
    start_engines: EngineFactory, aclient: openai.AsyncOpenAI
) -> None:
    await start_engines(1)
    with pytest.raises(openai.BadRequestError) as raised:
        await aclient.completions.create(model=ECHO, prompt="abc", max_tokens=2, extra_body={"min_tokens": 3})
    assert raised.value.body["param"] == "min_tokens"  # type: ignore[index]


async def test_guidellms_streaming_request_is_served_with_usage_in_every_chunk(
    start_engines: EngineFactory, gateway: Served
) -> None:
    """The body guidellm 0.8 sends when it streams; usage is in every chunk and counts up."""
    await start_engines(1)
    body = {
        "model": ECHO,
        "prompt": [104, 105, 33],
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "ignore_eos": True,
    }
    response = await http(gateway.port, "POST", "/v1/completions", body)
    assert response.status == 200
    events = sse_data(response.body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(data) for data in events[:-1]]
    assert all(chunk["usage"]["prompt_tokens"] == 3 for chunk in chunks)
    counted = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert counted == sorted(counted) and counted[-1] == 6
    assert "".join(choice["text"] for chunk in chunks for choice in chunk["choices"]) == "hi!hi!"


async def test_a_streamed_stop_string_is_left_out(start_engines: EngineFactory, aclient: openai.AsyncOpenAI) -> None:
    """Held back while it may be the start of a stop string, dropped once it is one."""
    await start_engines(1)
    stream = await aclient.completions.create(
        model=ECHO, prompt="Hello world", max_tokens=20, stop=["wor", "xyz"], stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == "Hello "
    assert chunks[-1].choices[0].finish_reason == "stop"
    chat = await aclient.chat.completions.create(
        model=ECHO, messages=[{"role": "user", "content": "Hi"}], max_tokens=20, stop=[":"], stream=True
    )
    assert "".join([chunk.choices[0].delta.content or "" async for chunk in chat]) == "user"


async def test_streamed_usage_counts_each_prompt_once(
    start_engines: EngineFactory, aclient: openai.AsyncOpenAI
) -> None:
    await start_engines(1)
    stream = await aclient.completions.create(
        model=ECHO, prompt="Hello", max_tokens=3, n=2, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    usage = chunks[-1].usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (5, 6)


async def test_health_and_one_model(start_engines: EngineFactory, gateway: Served, aclient: openai.AsyncOpenAI) -> None:
    assert (await http(gateway.port, "GET", "/health")).status == 503  # no engine yet
    await start_engines(1)
    assert (await http(gateway.port, "GET", "/health")).status == 200
    model = await aclient.models.retrieve(ECHO)
    assert (model.id, model.object) == (ECHO, "model")
    with pytest.raises(openai.NotFoundError) as raised:
        await aclient.models.retrieve("no-such/model")
    assert raised.value.body["code"] == "model_not_found"  # type: ignore[index]


@pytest.mark.parametrize(
    ("method", "path", "status", "allow"),
    [
        ("GET", "/v1/nothing", 404, None),
        ("POST", "/", 404, None),
        ("GET", "/v1/completions", 405, "POST"),
        ("DELETE", "/v1/models", 405, "GET"),
        ("POST", "/healthz", 405, "GET, HEAD"),
    ],
)
async def test_unknown_routes_and_methods_answer_openai_errors(
    gateway: Served, method: str, path: str, status: int, allow: str | None
) -> None:
    response = await http(gateway.port, method, path)
    assert response.status == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert response.headers.get("allow") == allow
