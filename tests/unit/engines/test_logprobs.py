"""Log-probabilities through the intake and the request table, on the echo backend (whose
values are a documented function of token and position) and a recording bus: partials and
the final carry them aligned with their tokens, a request without them pays no field, and a
backend that computes none refuses a request that asks."""

from __future__ import annotations

from typing import Any

import msgspec

from engines.echo import EchoBackend, echo_logprob, echo_top_logprobs
from engines.runtime_intake import RequestIntake
from service.bus.registry import Incoming
from service.protocol.codec import Encoding
from service.protocol.logprobs import StreamedLogprobs
from service.protocol.messages import Final, Partial
from service.protocol.routed import RoutedRequestBatch
from service.protocol.subjects import Header
from tests.unit.engines.wiring import Floor, build

PROMPT = "abc"  # echo: the n-th generated token is the prompt's byte n mod 3


async def run(floor: Floor, *routed: Any, steps: int = 3) -> None:
    intake = RequestIntake(floor.core, floor.requests, floor.control)
    await intake.start_batch(Incoming("submit_request", None, Encoding.MSGPACK, b""), RoutedRequestBatch(list(routed)))
    for _ in range(steps):
        await floor.requests.record_step(await floor.backend.step(), None, None)


def expected(tokens: list[int], start: int, k: int) -> tuple[list[float], list[list[list[float]]]]:
    """The echo backend's logprobs and alternatives of ``tokens`` at positions from ``start``, as JSON."""
    positions = range(start, start + len(tokens))
    logprobs = [echo_logprob(token, p) for token, p in zip(tokens, positions, strict=True)]
    top = [[list(pair) for pair in echo_top_logprobs(token, p, k)] for token, p in zip(tokens, positions, strict=True)]
    return logprobs, top


async def test_each_partial_carries_its_tokens_logprobs_and_the_final_all_of_them() -> None:
    floor = build(stream_interval=2)
    await run(floor, floor.routed(PROMPT, max_tokens=3, stream=True, logprobs=2))
    first, second = floor.bodies(Header.ENGINE_REPLY_PARTIAL)
    [final] = floor.bodies()
    tokens = final["generated_tokens"]
    assert tokens == [97, 98, 99]
    logprobs, top = expected(tokens, len(PROMPT), 2)
    assert (first["token_logprobs"], first["top_logprobs"]) == (logprobs[:2], top[:2])
    assert (second["token_logprobs"], second["top_logprobs"]) == (logprobs[2:], top[2:])
    assert (final["token_logprobs"], final["top_logprobs"]) == (logprobs, top)
    assert top[0][0][1] == logprobs[0]  # the sampled token is echo's most likely: the same float
    # token_bytes names every id those fields carry, each its single byte (JSON: base64, keys as strings)
    decoded = msgspec.json.decode(floor.replies()[0].body, type=Final)
    assert decoded.token_bytes == {token: bytes((token,)) for token in (97, 98, 99, 100)}
    assert sorted(int(key) for key in second["token_bytes"]) == [99, 100]
    assert "prompt_logprobs" not in final and "prompt_token_ids" not in final


async def test_prompt_logprobs_come_with_the_final_the_first_token_null() -> None:
    floor = build()
    await run(floor, floor.routed(PROMPT, max_tokens=1, prompt_logprobs=1))
    [final] = floor.bodies()
    assert final["prompt_token_ids"] == [97, 98, 99]
    assert final["prompt_logprobs"] == [None, echo_logprob(98, 1), echo_logprob(99, 2)]
    assert final["prompt_top_logprobs"] == [None, [[98, echo_logprob(98, 1)]], [[99, echo_logprob(99, 2)]]]
    assert "token_logprobs" not in final and "top_logprobs" not in final  # not asked for the generated ones
    assert sorted(int(key) for key in final["token_bytes"]) == [97, 98, 99]


async def test_zero_alternatives_gives_logprobs_without_top_ones() -> None:
    floor = build()
    await run(floor, floor.routed(PROMPT, max_tokens=2, stream=True, logprobs=0, prompt_logprobs=0), steps=2)
    [final] = floor.bodies()
    assert final["token_logprobs"] == expected([97, 98], 3, 0)[0]
    assert "top_logprobs" not in final and "prompt_top_logprobs" not in final
    assert final["prompt_logprobs"][0] is None


async def test_a_request_without_logprobs_pays_no_field_on_the_wire() -> None:
    floor = build(stream_interval=1)
    await run(floor, floor.routed(PROMPT, max_tokens=2, stream=True), steps=2)
    assert {"token_logprobs", "top_logprobs", "token_bytes"} <= set(Partial.__struct_fields__)
    for body in floor.bodies(Header.ENGINE_REPLY_PARTIAL):
        assert set(body) == {"type", "request_id", "client_request_id", "new_tokens", "text", "offset", "attempt"}
    [final] = floor.bodies()
    assert not {key for key in final if "logprob" in key or key in ("token_bytes", "prompt_token_ids")}


async def test_a_backend_that_computes_no_logprobs_refuses_a_request_asking_for_them() -> None:
    class NoLogprobs(EchoBackend):
        """Test double: a backend without log-probabilities."""

        computes_logprobs = False

    floor = build(NoLogprobs())
    await run(floor, floor.routed(PROMPT, prompt_logprobs=0), floor.routed(PROMPT), steps=3)
    error, final = floor.bodies()
    assert (
        error["type"] == "error" and error["error"]["code"] == 400 and "log-probabilities" in error["error"]["message"]
    )
    assert final["type"] == "final"


async def test_a_resumed_run_puts_the_delivered_logprobs_first_and_refuses_resume_tokens_without_them() -> None:
    floor = build()
    delivered = StreamedLogprobs([-9.0], [[(97, -9.0)]])  # what the coordinator kept of the first run
    resumed = floor.routed(PROMPT, max_tokens=3, attempt=1, resume_tokens=[97], logprobs=1)
    resumed.resume_logprobs = delivered
    without = floor.routed(PROMPT, max_tokens=3, attempt=1, resume_tokens=[97], logprobs=1)
    await run(floor, resumed, without)
    error, final = floor.bodies()
    assert error["error"]["code"] == 400 and "resume_logprobs" in error["error"]["message"]
    assert final["token_logprobs"] == [-9.0, *expected([98, 99], 4, 1)[0]]
    assert final["top_logprobs"] == [[[97, -9.0]], *expected([98, 99], 4, 1)[1]]
