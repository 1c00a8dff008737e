"""The gateway as applications use it: the official ``openai`` package, sync, async and
streaming, completions and chat, against a coordinator with echo engines and with the torch
engine's random default model."""

from __future__ import annotations

import asyncio

import openai
import pytest

from engines.runtime import EngineRuntime
from service.coordinator.coordinator import Coordinator
from service.ops.settings import Settings
from tests.conftest import EngineFactory
from tests.gateway_helpers import Served

ECHO = "dpcoord-echo"


async def test_models_are_the_fleets(start_engines: EngineFactory, aclient: openai.AsyncOpenAI) -> None:
    await start_engines(2)
    models = await aclient.models.list()
    assert [model.id for model in models.data] == [ECHO]
    assert models.data[0].object == "model"


async def test_sync_completion_with_usage(start_engines: EngineFactory, gateway: Served) -> None:
    await start_engines(1)

    def create() -> openai.types.Completion:
        with openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0) as client:
            return client.completions.create(model=ECHO, prompt="Hello", max_tokens=7)

    completion = await asyncio.to_thread(create)
    assert completion.id.startswith("cmpl-") and completion.object == "text_completion" and completion.model == ECHO
    [choice] = completion.choices
    assert (choice.index, choice.text, choice.finish_reason) == (0, "HelloHe", "length")
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens, completion.usage.total_tokens) == (
        5,
        7,
        12,
    )
    # The engines' timings give OpenAI's cached prompt tokens (the echo engine caches nothing).
    assert completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens == 0


async def test_async_completion_of_several_prompts_and_n(
    start_engines: EngineFactory, aclient: openai.AsyncOpenAI
) -> None:
    """Choice ``i * n + j`` is sample ``j`` of prompt ``i``; token-id prompts are used as they are;
    the stop string that ended a choice is left out of its text, as OpenAI does, and each prompt's
    tokens count once however many samples are drawn from it."""
    await start_engines(2)
    completion = await aclient.completions.create(model=ECHO, prompt=["ab", "xyz"], n=2, max_tokens=3, stop=["z"])
    assert [(c.index, c.text, c.finish_reason) for c in completion.choices] == [
        (0, "aba", "length"),
        (1, "aba", "length"),
        (2, "xy", "stop"),
        (3, "xy", "stop"),
    ]
    assert completion.usage is not None and completion.usage.prompt_tokens == 2 + 3
    assert completion.usage.completion_tokens == 3 * 4
    assert completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens == 0
    by_ids = await aclient.completions.create(model=ECHO, prompt=[104, 105], max_tokens=3)
    assert by_ids.choices[0].text == "hih"


async def test_streamed_completion_with_usage(start_engines: EngineFactory, aclient: openai.AsyncOpenAI) -> None:
    await start_engines(1)
    stream = await aclient.completions.create(
        model=ECHO, prompt="Hello", max_tokens=7, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    texts = [chunk.choices[0].text for chunk in chunks if chunk.choices]
    assert "".join(texts) == "HelloHe" and len(texts) >= 7
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (5, 7)
    assert chunks[-1].usage.prompt_tokens_details is not None


async def test_sync_chat_renders_the_plain_fallback(start_engines: EngineFactory, gateway: Served) -> None:
    """The echo engine renders messages with the plain fallback and echoes that prompt."""
    await start_engines(1)
    prompt = "system: Be brief.\nuser: Hi\nassistant:"

    def create() -> openai.types.chat.ChatCompletion:
        with openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0) as client:
            return client.chat.completions.create(
                model=ECHO,
                max_completion_tokens=len(prompt),
                messages=[
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                ],
            )

    chat = await asyncio.to_thread(create)
    assert chat.id.startswith("chatcmpl-") and chat.object == "chat.completion"
    [choice] = chat.choices
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", prompt, "length")
    assert chat.usage is not None and chat.usage.prompt_tokens == len(prompt.encode())


async def test_async_streamed_chat(start_engines: EngineFactory, aclient: openai.AsyncOpenAI) -> None:
    await start_engines(1)
    stream = await aclient.chat.completions.create(
        model=ECHO,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        stream=True,
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == "user:"
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None


async def test_async_chat_with_n(start_engines: EngineFactory, aclient: openai.AsyncOpenAI) -> None:
    await start_engines(2)
    chat = await aclient.chat.completions.create(
        model=ECHO, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, n=3
    )
    assert [(c.index, c.message.content) for c in chat.choices] == [(0, "us"), (1, "us"), (2, "us")]
    assert chat.usage is not None and chat.usage.completion_tokens == 6


async def test_the_torch_engine_through_the_sdk(
    settings: Settings, coordinator: Coordinator, aclient: openai.AsyncOpenAI
) -> None:
    """The torch engine's random default model (tiny, on CPU) behind the gateway: a completion and a chat stream."""
    pytest.importorskip("torch")
    from engines.factory import make_backend

    engine_settings = settings.model_copy(
        update={"backend": "torch", "device": "cpu", "max_context": 128, "kv_cache_gb": 0.005}
    )
    async with EngineRuntime(engine_settings, make_backend(engine_settings)) as engine:
        await engine.registered.wait()
        assert [model.id for model in (await aclient.models.list()).data] == ["dpcoord-random"]
        completion = await aclient.completions.create(
            model="dpcoord-random", prompt="Hello", max_tokens=6, temperature=0
        )
        assert completion.choices[0].finish_reason == "length"
        assert completion.usage is not None and (
            completion.usage.prompt_tokens,
            completion.usage.completion_tokens,
        ) == (5, 6)
        stream = await aclient.chat.completions.create(
            model="dpcoord-random",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
        assert chunks[-1].usage.prompt_tokens == len(b"user: Hi\nassistant:")
        assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "length"
