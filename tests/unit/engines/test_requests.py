"""The request table alone, on the echo backend and a recording bus: every transition, and
exactly one terminal reply per request whatever path ends it."""

from __future__ import annotations

import asyncio

import pytest

from engines.backend import GenerationRequest, TokenOutput
from engines.echo import EchoBackend
from service.protocol.codec import Encoding
from service.protocol.errors import ErrorCode, WireError
from service.protocol.routed import RoutedRequest
from service.protocol.subjects import Header
from tests.unit.engines.wiring import Floor, build


def start(floor: Floor, routed: RoutedRequest, epoch: int | None = None) -> None:
    """As the intake starts a routed request: "abc" for 3 tokens, after its resume tokens."""
    request = GenerationRequest(
        routed.return_path.request_id, "abc", max_tokens=3, resume_tokens=tuple(routed.resume_tokens or ())
    )
    floor.requests.start(routed, Encoding.JSON, request, epoch)


async def run_steps(floor: Floor, count: int, epoch: int | None = None) -> None:
    for _ in range(count):
        await floor.requests.record_step(await floor.backend.step(), epoch, None)


async def test_a_started_request_is_held_until_its_final_which_holds_every_token() -> None:
    floor = build()
    routed = floor.routed()
    start(floor, routed)
    assert routed.return_path.request_id in floor.requests and len(floor.requests) == 1
    await run_steps(floor, 3, epoch=4)
    [final] = floor.bodies()
    assert final["type"] == "final" and final["generated_text"] == "abc" and final["finish_reason"] == "length"
    assert final["generated_tokens"] == [97, 98, 99] and final["prompt_tokens"] == 3
    assert final["epochs"] == [{"epoch": 4, "start": 0, "end": 3}]
    assert len(floor.requests) == 0 and not floor.backend.has_work()
    assert floor.replies(Header.ENGINE_REPLY_PARTIAL) == []  # not streamed


async def test_a_stream_sends_a_partial_every_stream_interval_tokens_and_the_rest_before_its_final() -> None:
    floor = build(stream_interval=2)
    start(floor, floor.routed(stream=True))
    await run_steps(floor, 3)
    partials = floor.replies(Header.ENGINE_REPLY_PARTIAL)
    assert [reply.tokens for reply in partials] == [[97, 98], [99]]
    assert [reply.seq for reply in partials] == [0, 1]
    assert [body["offset"] for body in floor.bodies(Header.ENGINE_REPLY_PARTIAL)] == [0, 2]
    [final] = floor.replies()
    assert final.seq == 2  # after both partials


async def test_a_request_routed_twice_is_ignored_and_a_newer_run_replaces_the_older_silently() -> None:
    floor = build()
    first = floor.routed(request_id="r")
    start(floor, first)
    assert not floor.requests.supersede(floor.routed(request_id="r"))
    newer = floor.routed(request_id="r", attempt=1, resume_tokens=[97])
    assert floor.requests.supersede(newer)
    assert "r" not in floor.requests and not floor.backend.has_work()
    start(floor, newer)
    await run_steps(floor, 2)
    [final] = floor.replies()
    assert final.attempt == 1 and floor.bodies()[0]["generated_text"] == "abc"
    assert floor.core.counters["runs_superseded"] == 1


async def test_a_refused_request_is_not_held_and_gets_one_error_reply() -> None:
    class RefusingBackend(EchoBackend):
        """Test double: refuses every request, as a backend refuses a prompt it cannot take."""

        def add(self, request: GenerationRequest) -> int:
            raise WireError(ErrorCode.TOO_LARGE, "prompt too long")

    floor = build(RefusingBackend())
    routed = floor.routed()
    with pytest.raises(WireError):
        start(floor, routed)
    assert len(floor.requests) == 0
    await floor.requests.refuse(routed, Encoding.JSON, WireError(ErrorCode.TOO_LARGE, "prompt too long"))
    [error] = floor.bodies()
    assert error["type"] == "error" and error["error"]["code"] == 413


async def test_abort_ends_a_request_with_its_tokens_once_and_later_outputs_are_dropped() -> None:
    floor = build()
    routed = floor.routed()
    start(floor, routed)
    await run_steps(floor, 1)
    outputs = await floor.backend.step()  # generated before the abort arrived
    assert await floor.requests.abort(routed.return_path.request_id)
    await floor.requests.record_step(outputs, None, None)
    assert not await floor.requests.abort(routed.return_path.request_id)
    assert await floor.requests.fail([routed.return_path.request_id], WireError(ErrorCode.INTERNAL, "late")) == 0
    [final] = floor.bodies()
    assert final["finish_reason"] == "abort" and final["generated_text"] == "a"
    assert not floor.backend.has_work()


async def test_failing_ends_each_held_request_with_an_error_and_frees_the_backend() -> None:
    floor = build()
    held = [floor.routed() for _ in range(3)]
    for routed in held:
        start(floor, routed)
    err = WireError(ErrorCode.NO_ENGINE, "stopped")
    assert await floor.requests.fail([held[0].return_path.request_id, "unknown"], err) == 1
    assert await floor.requests.fail_all(err) == 2
    assert [body["error"]["code"] for body in floor.bodies()] == [503, 503, 503]
    assert len(floor.requests) == 0 and not floor.backend.has_work()


async def test_abort_all_sends_abort_finals_and_drop_all_sends_nothing() -> None:
    floor = build()
    for _ in range(2):
        start(floor, floor.routed())
    assert await floor.requests.abort_all() == 2
    assert [body["finish_reason"] for body in floor.bodies()] == ["abort", "abort"]
    for _ in range(2):
        start(floor, floor.routed())
    published = len(floor.bus.published)
    assert floor.requests.drop_all() == 2
    assert len(floor.bus.published) == published and len(floor.requests) == 0 and not floor.backend.has_work()


async def test_hand_over_names_the_adopter_in_the_dead_coordinators_requests_only() -> None:
    floor = build(stream_interval=1)
    dead = floor.routed(coordinator_id="c-dead", stream=True)
    alive = floor.routed(coordinator_id="c-alive")
    start(floor, dead)
    start(floor, alive)
    await run_steps(floor, 1)
    [adopted] = floor.requests.hand_over("c-dead", "c-adopter")
    assert adopted.return_path.coordinator_id == "c-adopter" and adopted.tokens == [97]
    assert adopted.partials_sent == 1 and adopted.body == dead.body
    await run_steps(floor, 2)
    paths = {reply.return_path.request_id: reply.return_path.coordinator_id for reply in floor.replies()}
    assert paths == {dead.return_path.request_id: "c-adopter", alive.return_path.request_id: "c-alive"}


async def test_resend_sends_remembered_finals_again_and_names_what_never_arrived() -> None:
    floor = build()
    done, held = floor.routed(), floor.routed()
    start(floor, done)
    await run_steps(floor, 3)
    start(floor, held)
    ids = [done.return_path.request_id, held.return_path.request_id, "never"]
    assert await floor.requests.resend(ids) == ["never"]
    assert [reply.return_path.request_id for reply in floor.replies()] == [done.return_path.request_id] * 2


async def test_emptied_returns_once_the_last_request_left() -> None:
    floor = build()
    first, second = floor.routed(), floor.routed()
    start(floor, first)
    start(floor, second)
    emptied = asyncio.ensure_future(floor.requests.emptied())
    await floor.requests.abort(first.return_path.request_id)
    await asyncio.sleep(0)
    assert not emptied.done()
    await floor.requests.abort(second.return_path.request_id)
    await asyncio.wait_for(emptied, 1)


async def test_a_final_carries_the_timings_of_its_steps_read_from_the_steps_it_came_from() -> None:
    """Timings come from the step loop's readings: arrival to the first token's step (queued),
    to that step's end (ttft), then to the last step's end (decode); cached prompt tokens from
    the first output. An abort before any token waited all along."""
    floor = build()
    routed, waiting = floor.routed(request_id="r"), floor.routed(request_id="w")
    start(floor, routed)
    arrived = floor.requests.records["r"].arrived
    outputs = [TokenOutput("r", [97], "a", cached_tokens=2)]
    await floor.requests.record_step(outputs, None, None, arrived + 1.0, arrived + 1.5)
    outputs = [TokenOutput("r", [98], "b"), TokenOutput("r", [99], "c", "length")]
    await floor.requests.record_step(outputs, None, None, arrived + 2.0, arrived + 4.0)
    start(floor, waiting)
    await floor.requests.abort("w")
    final, aborted = floor.bodies()
    assert final["timings"] == {
        "queued_s": pytest.approx(1.0),
        "ttft_s": pytest.approx(1.5),
        "decode_s": pytest.approx(2.5),
        "cached_prompt_tokens": 2,
    }
    assert aborted["timings"]["ttft_s"] is None and aborted["timings"]["queued_s"] >= 0
    assert aborted["timings"]["decode_s"] == 0 and aborted["timings"]["cached_prompt_tokens"] == 0
