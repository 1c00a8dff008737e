"""The step loop on the request table and the echo backend: it steps only while it may, each
step's replies are sent while the next step runs (or at once), and a failed step or a step
whose replies fail ends its requests with an error."""

from __future__ import annotations

from engines.backend import GenerationRequest, TokenOutput
from engines.echo import EchoBackend
from engines.runtime_steps import StepLoop
from service.protocol.codec import Encoding
from service.protocol.subjects import Header
from tests.unit.engines.wiring import Floor, build


def hold(floor: Floor, max_tokens: int = 3) -> str:
    routed = floor.routed(max_tokens=max_tokens, stream=True)
    request_id = routed.return_path.request_id
    floor.requests.start(routed, Encoding.JSON, GenerationRequest(request_id, "abc", max_tokens=max_tokens), None)
    floor.core.wake.set()
    return request_id


def loop(floor: Floor) -> StepLoop:
    return StepLoop(floor.core, floor.requests, floor.control, floor.weights)


async def test_replies_of_a_step_are_sent_during_the_next_and_at_once_after_the_last() -> None:
    floor = build()
    hold(floor)
    steps = loop(floor)
    await steps.step_once()
    assert floor.bus.published == [] and steps.steps == 1  # held until the next step runs
    await steps.step_once()
    assert [reply.tokens for reply in floor.replies(Header.ENGINE_REPLY_PARTIAL)] == [[97]]
    await steps.step_once()  # the last: no step follows, so its replies leave at once
    assert [reply.tokens for reply in floor.replies(Header.ENGINE_REPLY_PARTIAL)] == [[97], [98], [99]]
    assert floor.bodies()[0]["generated_text"] == "abc" and steps.steps == 3
    await steps.step_once()  # no work: nothing stepped, the loop sleeps until woken
    assert steps.steps == 3 and not floor.core.wake.is_set()


async def test_a_backend_that_launches_ahead_has_each_steps_replies_sent_at_once() -> None:
    class LaunchesAhead(EchoBackend):
        """Test double: says its next step is on the device when ``step`` returns."""

        @property
        def launches_ahead(self) -> bool:
            return True

    floor = build(LaunchesAhead())
    hold(floor)
    await loop(floor).step_once()
    assert [reply.tokens for reply in floor.replies(Header.ENGINE_REPLY_PARTIAL)] == [[97]]


async def test_no_step_while_paused_or_disconnected() -> None:
    floor = build()
    hold(floor)
    steps = loop(floor)
    floor.control.pause()
    await steps.step_once()
    floor.control.unpause()
    floor.core.wake.set()
    floor.core.connected.clear()
    await steps.step_once()
    assert steps.steps == 0 and len(floor.requests) == 1 and not floor.core.wake.is_set()


async def test_a_failed_step_fails_every_request_held() -> None:
    class StepFails(EchoBackend):
        """Test double: its step raises, as a device error would."""

        async def step(self) -> list[TokenOutput]:
            raise RuntimeError("device lost")

    floor = build(StepFails())
    hold(floor)
    hold(floor)
    steps = loop(floor)
    await steps.step_once()
    assert [body["error"]["code"] for body in floor.bodies()] == [500, 500]
    assert len(floor.requests) == 0 and steps.steps == 0


async def test_a_step_whose_replies_fail_ends_its_requests_with_an_error() -> None:
    floor = build()
    request_id = hold(floor)
    steps = loop(floor)
    await steps.step_once()

    async def broken(*_: object) -> None:
        raise RuntimeError("encoding failed")

    floor.requests.record_step = broken  # type: ignore[method-assign,assignment]
    await steps.publish_unsent()
    [error] = floor.replies()
    assert error.return_path.request_id == request_id and floor.bodies()[0]["error"]["code"] == 500
    assert len(floor.requests) == 0


async def test_tokens_carry_the_weight_version_served_when_they_were_generated() -> None:
    floor = build()
    hold(floor, max_tokens=1)
    floor.weights.version = 3
    await loop(floor).step_once()
    assert floor.bodies()[0]["weight_versions"] == [{"version": 3, "start": 0, "end": 1}]
