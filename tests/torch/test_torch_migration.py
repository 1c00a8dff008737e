"""Migration with the torch backend on CPU: a request resumed on another engine from the tokens
an earlier run streamed (``resume_tokens``) continues exactly as an uninterrupted run, greedy
and sampled (the sampling stream is derived from the seed, or the request id, and the token's
position, not held in one process); and the same through the coordinator, with an engine
leaving mid-stream, every token's logprob in the final within 1e-4 of an uninterrupted run's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from engines.backend import GenerationRequest, TokenOutput
from engines.factory import torch_options
from engines.runtime import EngineRuntime
from engines.torch_backend.backend import TorchBackend
from service.client import DpcoordClient
from service.coordinator.coordinator import Coordinator
from service.ops.settings import Settings
from service.protocol.codec import encode_msgpack
from service.protocol.membership import EngineDisconnect
from service.protocol.messages import Final, Partial
from tests.torch.reference import engine_options

PROMPT = "Once upon a time"
TOKENS = 16
CUT = 6  # tokens the first run streamed before its engine was lost


@pytest.fixture(scope="module")
def first() -> TorchBackend:
    return TorchBackend(engine_options(model_seed=1))


@pytest.fixture(scope="module")
def second() -> TorchBackend:
    """Another engine with the same weights: nothing of the first run's state is in it."""
    return TorchBackend(engine_options(model_seed=1))


def run(backend: TorchBackend, request: GenerationRequest) -> list[TokenOutput]:
    backend.add(request)
    return drain(backend, request)


def drain(backend: TorchBackend, request: GenerationRequest) -> list[TokenOutput]:
    outputs: list[TokenOutput] = []
    while backend.has_work():
        outputs += [output for output in backend._step() if output.request_id == request.request_id]
    return outputs


def tokens_of(outputs: list[TokenOutput]) -> list[int]:
    return [token for output in outputs for token in output.new_tokens]


PARAMS = [
    pytest.param({"temperature": 0.0}, id="greedy"),
    pytest.param({"temperature": 1.0, "seed": 1234}, id="seeded"),
    pytest.param({"temperature": 0.8, "seed": -7, "top_k": 40, "top_p": 0.9}, id="seeded-top-k-top-p"),
    pytest.param({"temperature": 1.0}, id="unseeded"),
]


@pytest.mark.parametrize("params", PARAMS)
def test_a_resumed_run_continues_exactly_as_an_uninterrupted_one(
    first: TorchBackend, second: TorchBackend, params: dict[str, object]
) -> None:
    whole = run(first, GenerationRequest("r-whole", PROMPT, max_tokens=TOKENS, **params))  # type: ignore[arg-type]
    expected = tokens_of(whole)
    assert len(expected) == TOKENS
    resumed = GenerationRequest("r-whole", PROMPT, max_tokens=TOKENS, resume_tokens=tuple(expected[:CUT]), **params)  # type: ignore[arg-type]
    second.add(resumed)
    streamed_text = "".join(output.text for output in whole[:CUT])
    assert second.resumed_text("r-whole") == streamed_text
    outputs = drain(second, resumed)
    assert tokens_of(outputs) == expected[CUT:]
    assert outputs[-1].finish_reason == whole[-1].finish_reason == "length"
    assert streamed_text + "".join(output.text for output in outputs) == "".join(output.text for output in whole)


class StallingTorchBackend(TorchBackend):
    """A test double of an engine that stalls mid-stream: once armed, after ``CUT`` tokens it
    steps no more until unstalled, as an engine that hangs before it is declared gone. (A pause
    could not hold it there: the engine may generate every token before the pause lands.)"""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.armed = False
        self.generated = 0
        self.unstalled = asyncio.Event()  # not "release": that is Backend.release (backpressure)

    async def step(self) -> list[TokenOutput]:
        if self.armed and self.generated >= CUT:
            await self.unstalled.wait()
        outputs = await super().step()
        if self.armed:
            self.generated += sum(len(output.new_tokens) for output in outputs)
        return outputs


@pytest.fixture
async def torch_engines(settings: Settings, coordinator: Coordinator) -> AsyncIterator[list[EngineRuntime]]:
    engine_settings = settings.model_copy(
        update={"backend": "torch", "device": "cpu", "max_context": 128, "kv_cache_gb": 0.005, "stream_interval": 1}
    )
    stalling = StallingTorchBackend(torch_options(engine_settings))
    engines = [
        EngineRuntime(engine_settings, backend) for backend in (stalling, TorchBackend(torch_options(engine_settings)))
    ]
    yield engines
    stalling.unstalled.set()
    for engine in engines:
        await engine.stop()


@pytest.mark.parametrize("params", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 99}], ids=["greedy", "seeded"])
async def test_an_engine_leaving_mid_stream_changes_no_token(
    torch_engines: list[EngineRuntime], coordinator: Coordinator, settings: Settings, params: dict[str, Any]
) -> None:
    lost, survivor = torch_engines
    stalling = lost.backend
    assert isinstance(stalling, StallingTorchBackend)
    await lost.start()
    await coordinator.wait_for_engines(1)
    await lost.registered.wait()
    async with await DpcoordClient.connect(settings) as client:
        uninterrupted = await client.submit(PROMPT, max_tokens=TOKENS, timeout=60, logprobs=2, **params)
        stalling.armed = True
        partials: list[Partial] = []
        async for reply in client.stream(PROMPT, max_tokens=TOKENS, timeout=60, logprobs=2, **params):
            if isinstance(reply, Final):
                final = reply
                break
            partials.append(reply)
            if sum(len(partial.new_tokens) for partial in partials) == CUT:
                await survivor.start()
                await survivor.registered.wait()
                await coordinator.nc.publish(
                    coordinator.subjects.sent_by("disconnect", lost.engine_id),
                    encode_msgpack(EngineDisconnect(lost.engine_id, "test")),
                )
    assert final.engine_id == survivor.engine_id and partials[-1].attempt == 1
    assert final.generated_tokens == uninterrupted.generated_tokens
    assert final.generated_text == uninterrupted.generated_text == "".join(partial.text for partial in partials)
    assert [token for partial in partials for token in partial.new_tokens] == final.generated_tokens
    # Every token's logprob: those the lost engine delivered, then the survivor's (after a
    # prefill of the prompt and the delivered tokens instead of decode steps): within 1e-4.
    assert final.token_logprobs is not None and uninterrupted.token_logprobs is not None
    assert len(final.token_logprobs) == TOKENS
    assert max(abs(a - b) for a, b in zip(final.token_logprobs, uninterrupted.token_logprobs, strict=True)) <= 1e-4
    delivered = [value for partial in partials[:CUT] for value in partial.token_logprobs or ()]
    assert delivered and final.token_logprobs[: len(delivered)] == delivered  # the lost engine's, exactly
