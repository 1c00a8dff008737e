"""Log-probabilities in the coordinator, on the ledger and the relay alone: a request asking
for them goes only to engines that announce them (503 when none does), and a stream's delivered
logprobs are kept beside its tokens for a migration."""

from __future__ import annotations

from service.coordinator.relay import ReplyRelay
from service.coordinator.requests import InflightRequest
from service.protocol.logprobs import StreamedLogprobs
from tests.unit.coordinator.conftest import Later
from tests.unit.coordinator.wiring import Floor, build, reply


def asking(floor: Floor, stream: bool = False) -> InflightRequest:
    entry = floor.request(stream=stream)
    entry.logprobs = True
    return entry


def admit(floor: Floor, entry: InflightRequest) -> None:
    floor.ledger.admit(entry, None, floor.ledger.engine_for(floor.pool.everyone, None, None, entry.logprobs))


async def test_a_request_asking_goes_only_to_an_engine_that_computes_them_and_waits_for_one() -> None:
    floor = build(routing_policy="round_robin")
    floor.pool.add("old", 4)
    floor.pool.add("new", 1, logprobs=True)
    first, second, plain = asking(floor), asking(floor), floor.request()
    for entry in (first, second, plain):
        admit(floor, entry)
    assert first.engine_id == "new" and second.engine_id is None  # waits while the one that computes them is full
    assert plain.engine_id is None  # behind it in the queue of its model (an upgrade under way is short)
    await ReplyRelay(floor.core, floor.ledger, floor.answers, floor.peers, floor.kept, floor.replies).relay_finals(
        "new", [reply(first)]
    )
    assert second.engine_id == "new" and plain.engine_id == "old"


async def test_without_an_engine_that_computes_them_a_queued_request_fails_with_503(later: Later) -> None:
    floor = build()
    floor.pool.add("old", 4)
    entry = asking(floor)
    admit(floor, entry)  # before the fleet is known, it waits
    assert entry.return_path.request_id in floor.ledger
    later.advance(floor.settings.heartbeat_timeout_s)
    floor.ledger.release()
    await floor.spawned.settle()
    [error] = floor.bus.to(entry.return_path.reply_to)
    assert error.json()["error"]["code"] == 503 and "computes log-probabilities" in error.json()["error"]["message"]


async def test_a_streams_logprobs_are_kept_with_its_tokens_until_a_partial_comes_without() -> None:
    floor = build()
    floor.pool.add("e1", 4, logprobs=True)
    job = ReplyRelay(floor.core, floor.ledger, floor.answers, floor.peers, floor.kept, floor.replies)
    entry = asking(floor, stream=True)
    admit(floor, entry)
    first = StreamedLogprobs([-0.5, -1.0], [[(1, -0.5)], [(2, -1.0)]])
    await job.relay_partials(
        "e1",
        [
            reply(entry, b"{}", seq=0, tokens=[1, 2], logprobs=first),
            reply(entry, b"{}", seq=1, tokens=[3], logprobs=StreamedLogprobs([-2.0], [[(3, -2.0)]])),
        ],
    )
    assert entry.streamed_tokens == [1, 2, 3] and entry.resumable
    assert entry.streamed_logprobs == StreamedLogprobs([-0.5, -1.0, -2.0], [[(1, -0.5)], [(2, -1.0)], [(3, -2.0)]])
    await job.relay_partials("e1", [reply(entry, b"{}", seq=2, tokens=[4])])  # its logprobs missing
    assert not entry.resumable and entry.streamed_tokens is None and entry.streamed_logprobs is None
