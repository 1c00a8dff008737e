"""One run per request id across replicas (issue 34, 1; docs/reliability.md, *One run per id*).

Three in-process replicas share a prefix and queue group on the session's nats-server, with two
echo engines (the documented test double). Raw NATS clients send concurrent same-id pairs
(tests/same_id_pairs.py), which the queue group spreads over the replicas: every pair runs
once, every inbox gets its own prompt's stream or a clear 409, none stays silent. Before
arbitration two replicas each ran 13 of 20 such pairs, with no 409 for another body, and one
replica re-pointed the first inbox's replies to the second, leaving it silent. Then the client
library: its named submission goes straight to the arbiter.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.client import Client as NATS

from engines.echo import EchoBackend
from engines.runtime import EngineRuntime
from handlers import HANDLERS
from service.client import ClientError, DpcoordClient
from service.coordinator.coordinator import Coordinator
from service.ops.settings import Settings
from service.protocol.arbiter import ArbiterTable
from service.protocol.subjects import Header, Subjects
from tests.helpers import until
from tests.same_id_pairs import VARIANTS, PairTally, send_pair

pytestmark = pytest.mark.timeout(90)
IDS = ("c1", "c2", "c3")
PAIRS = 20  # per variant
MAX_TOKENS = 12  # 120 ms at 10 ms a token: the second copy arrives while the first runs


@pytest.fixture
async def trio(settings: Settings) -> AsyncIterator[list[Coordinator]]:
    replicas = [Coordinator(settings.model_copy(update={"coordinator_id": rid}), HANDLERS) for rid in IDS]
    for replica in replicas:
        await replica.start()
    try:
        await until(
            lambda: all(replica.arbiters.settled and len(replica.arbiters.view) == 3 for replica in replicas), 10
        )
        yield replicas
    finally:
        for replica in replicas:
            await replica.stop()


@pytest.fixture
async def engines(settings: Settings, trio: list[Coordinator]) -> AsyncIterator[list[EngineRuntime]]:
    started = [EngineRuntime(settings, EchoBackend(token_delay_ms=10.0)) for _ in range(2)]
    for engine in started:
        await engine.start()
    await until(lambda: all(len(replica.engines) == 2 for replica in trio), 10)
    yield started
    for engine in started:
        await engine.stop()


@pytest.mark.parametrize("variant", VARIANTS)
async def test_concurrent_same_id_pairs_run_once_and_no_inbox_is_silent(
    variant: str, settings: Settings, trio: list[Coordinator], engines: list[EngineRuntime], nc: NATS
) -> None:
    subject = Subjects(settings.subject_prefix).coordinator(Header.SUBMIT_REQUEST)
    other = await nats.connect(settings.nats_url)
    tally = PairTally()
    submitted = sum(replica.counters["submitted"] for replica in trio)
    try:
        outcomes = await asyncio.gather(
            *(send_pair(nc, other, subject, variant, index, MAX_TOKENS, wait_s=10.0) for index in range(PAIRS))
        )
    finally:
        await other.close()
    for runs, inboxes in outcomes:
        tally.pairs += 1
        tally.runs[runs] += 1
        tally.outcomes.update(inboxes)
    line = tally.line(f"{variant}, 3 replicas")
    print(f"\n[same-id pairs] {line}; handed {sum(replica.counters['submissions_handed'] for replica in trio)}")
    assert tally.twice == 0 and sum(replica.counters["submitted"] for replica in trio) - submitted == PAIRS, line
    assert tally.outcomes["silent"] == 0 and tally.outcomes["wrong"] == 0, line
    if variant.endswith("one inbox"):
        assert tally.outcomes == {"final": PAIRS}, line
    else:  # one inbox runs it; the other gets 409 (in progress, another body) or the result again
        assert tally.outcomes["final"] >= PAIRS and tally.outcomes["409"] + tally.outcomes["final"] == 2 * PAIRS, line
        if variant.startswith("other"):
            assert tally.outcomes["409"] == PAIRS, line


async def test_the_client_library_sends_a_named_submission_to_its_arbiter(
    settings: Settings, trio: list[Coordinator], engines: list[EngineRuntime]
) -> None:
    """Once it has heard the replicas' heartbeats, nothing needs handing over; a copy of the same
    id from another client library (another inbox) gets 409 while the first runs."""
    async with await DpcoordClient.connect(settings, client_id="lib") as first:
        async with await DpcoordClient.connect(settings, client_id="lib") as second:
            table = ArbiterTable(IDS)
            await until(lambda: [first.arbiter_of(n) for n in range(12)] == [table.of("lib", n) for n in range(12)], 10)
            handed = sum(replica.counters["submissions_handed"] for replica in trio)
            finals = await asyncio.gather(
                *(first.submit("named", max_tokens=4, client_request_id=n) for n in range(12))
            )
            assert [final.generated_text for final in finals] == ["name"] * 12
            assert sum(replica.counters["submissions_handed"] for replica in trio) == handed
            assert [final.request_id.rpartition("-")[0] for final in finals] == [table.of("lib", n) for n in range(12)]
            running = asyncio.ensure_future(first.submit("again", max_tokens=30, client_request_id="both"))
            await until(lambda: any(replica.requests.find_client(("lib", "both")) for replica in trio), 5)
            with pytest.raises(ClientError) as refusal:
                await second.submit("again", max_tokens=30, client_request_id="both")
            assert refusal.value.code == 409 and "in progress" in refusal.value.message
            final = await running
            assert final.generated_text == "again" * 6
            again = await second.submit("again", max_tokens=30, client_request_id="both")  # it ended: its result
            assert again.request_id == final.request_id
