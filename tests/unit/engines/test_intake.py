"""The request intake on the request table alone: routed requests start (or each gets its own
error reply), aborts end them, resends are answered; no NATS server."""

from __future__ import annotations

import msgspec

from engines.backend import GenerationRequest
from engines.echo import EchoBackend
from engines.runtime_intake import RequestIntake
from service.bus.registry import Incoming
from service.protocol.codec import Encoding
from service.protocol.membership import ResendAnswer, ResendReplies
from service.protocol.routed import ReturnPath, RoutedAbort, RoutedRequest, RoutedRequestBatch
from tests.unit.engines.wiring import Floor, build


def intake(floor: Floor) -> RequestIntake:
    return RequestIntake(floor.core, floor.requests, floor.control)


def incoming(header: str, reply: str | None = None) -> Incoming:
    return Incoming(header, reply, Encoding.MSGPACK, b"")


async def test_every_request_of_a_batch_starts_and_wakes_the_step_loop() -> None:
    floor = build()
    batch = [floor.routed(), floor.routed(prompt="xyz")]
    await intake(floor).start_batch(incoming("submit_request"), RoutedRequestBatch(batch))
    assert [routed.return_path.request_id in floor.requests for routed in batch] == [True, True]
    assert floor.core.wake.is_set() and floor.backend.has_work()
    assert floor.bus.published == []  # no answer: the replies follow


async def test_a_request_that_cannot_be_served_gets_its_own_error_and_its_neighbours_start() -> None:
    floor = build(EchoBackend(max_context=8), max_stop_strings=1)
    good = floor.routed()
    over_context = floor.routed(max_tokens=9)
    stops = floor.routed(stop=["a", "b"])
    undecodable = RoutedRequest(floor.routed().return_path, b'{"prompt": 7}')
    resumed_too_far = floor.routed(max_tokens=2, resume_tokens=[97, 98])
    batch = [over_context, good, stops, undecodable, resumed_too_far]
    await intake(floor).start_batch(incoming("submit_request"), RoutedRequestBatch(batch))
    assert floor.requests.ids() == [good.return_path.request_id]
    errors = {reply.return_path.request_id: msgspec.json.decode(reply.body) for reply in floor.replies()}
    assert set(errors) == {routed.return_path.request_id for routed in batch if routed is not good}
    assert all(error["type"] == "error" and error["error"]["code"] == 400 for error in errors.values())


async def test_a_backend_that_fails_to_start_a_request_answers_500() -> None:
    class FailingBackend(EchoBackend):
        """Test double: ``add`` fails as a bug would, not with a refusal."""

        def add(self, request: GenerationRequest) -> int:
            raise RuntimeError("bug")

    floor = build(FailingBackend())
    await intake(floor).start(floor.routed())
    [error] = floor.bodies()
    assert error["error"]["code"] == 500 and len(floor.requests) == 0


async def test_an_unknown_encoding_is_counted_and_dropped_without_a_reply() -> None:
    floor = build()
    path = ReturnPath("r1", "c1", "_INBOX.client.1", "yaml", False, None)
    await intake(floor).start(RoutedRequest(path, b"{}"))
    assert floor.core.counters["malformed"] == 1 and floor.bus.published == [] and len(floor.requests) == 0


async def test_a_migrated_run_continues_after_the_tokens_streamed() -> None:
    floor = build()
    routed = floor.routed(max_tokens=3, resume_tokens=[97, 98], attempt=2)
    floor.control.set_epoch(5)
    await intake(floor).start(routed)
    await floor.requests.record_step(await floor.backend.step(), 6, None)
    [final] = floor.bodies()
    assert final["generated_tokens"] == [97, 98, 99] and final["generated_text"] == "abc"
    assert final["epochs"] == [{"epoch": 5, "start": 0, "end": 2}, {"epoch": 6, "start": 2, "end": 3}]


async def test_an_abort_ends_the_request_with_an_abort_final() -> None:
    floor = build()
    routed = floor.routed()
    job = intake(floor)
    await job.start(routed)
    await job.abort(incoming("abort_request"), RoutedAbort(routed.return_path.request_id))
    await job.abort(incoming("abort_request"), RoutedAbort("unknown"))
    assert [body["finish_reason"] for body in floor.bodies()] == ["abort"]


async def test_a_resend_is_answered_with_the_requests_never_received() -> None:
    floor = build()
    routed = floor.routed()
    job = intake(floor)
    await job.start(routed)
    await job.resend(incoming("resend_replies", "_INBOX.coordinator.7"), ResendReplies(["lost", "r-held"]))
    [answer] = floor.bus.on("_INBOX.coordinator.7")
    assert answer.decode(ResendAnswer).unknown == ["lost", "r-held"]
    await job.resend(incoming("resend_replies", "_INBOX.coordinator.8"), ResendReplies([routed.return_path.request_id]))
    assert floor.bus.on("_INBOX.coordinator.8")[0].decode(ResendAnswer).unknown == []
