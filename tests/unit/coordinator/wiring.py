"""The coordinator's first floor (core, pool, peers, control state, answers, ledger, …) wired
as coordinator.py wires it, on a :class:`~tests.unit.coordinator.bus_double.RecordingBus`, so
each job is built on it alone and tested without a NATS server."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from service.coordinator.answers import Answers
from service.coordinator.block_index import BlockIndex
from service.coordinator.control_state import ControlState
from service.coordinator.core import Core
from service.coordinator.deliveries import ClientDeliveries
from service.coordinator.ledger import RequestLedger
from service.coordinator.peer_replies import PeerReplies
from service.coordinator.peers import CoordinatorPeers
from service.coordinator.pool import EnginePool, EngineRecord
from service.coordinator.requests import InflightRequest
from service.coordinator.results import ResultCache
from service.coordinator.routing import make_policy
from service.ops.settings import Settings
from service.protocol.codec import Encoding
from service.protocol.routed import ReturnPath, RoutedReply
from service.protocol.subjects import InboxPrefixes, ReplySubjects, Subjects
from tests.unit.coordinator.bus_double import RecordingBus

COORDINATOR_ID = "c1"


class Spawned:
    """The core's task spawner: tests await what the jobs started in the background."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Future[object]] = []

    def __call__(self, coro: Coroutine[Any, Any, object]) -> None:
        self.tasks.append(asyncio.ensure_future(coro))

    async def settle(self) -> None:
        """Until every task spawned so far, and those they spawned, has finished."""
        while self.tasks:
            await self.tasks.pop(0)


@dataclass
class Floor:
    settings: Settings
    bus: RecordingBus
    core: Core
    spawned: Spawned
    pool: EnginePool
    peers: CoordinatorPeers
    control: ControlState
    results: ResultCache
    answers: Answers
    ledger: RequestLedger
    replies: ReplySubjects
    kept: PeerReplies
    blocks: BlockIndex  # the block index a cache_aware ledger routes by
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    def engine(self, engine_id: str = "e1", capacity: int = 4, model: str | None = None) -> EngineRecord:
        return self.pool.add(engine_id, capacity, model)

    def request(
        self,
        owner_inbox: str = "_INBOX",
        body: bytes = b'{"prompt": "hi"}',
        stream: bool = False,
        model: str | None = None,
        client: tuple[str, str] | None = None,
        coordinator_id: str = COORDINATOR_ID,
        batched: bool = False,
    ) -> InflightRequest:
        """A request as admission builds it (not yet in the ledger)."""
        n = next(self._ids)
        reply_to = f"{owner_inbox}.client.{n}"
        owner, problem = self.replies.check(reply_to)
        assert owner is not None and problem is None, problem
        client_id, client_request_id = client if client is not None else (None, None)
        path = ReturnPath(
            f"{coordinator_id}-r{n}", coordinator_id, reply_to, "json", stream, client_request_id, client_id, batched
        )
        return InflightRequest(path, Encoding.JSON, body, client, model=model, owner=owner)


def build(max_payload: int = 1024 * 1024, **values: Any) -> Floor:
    """The first floor with ``values`` for settings, on a bus whose server takes ``max_payload``."""
    settings = Settings(**values)
    bus = RecordingBus(max_payload)
    spawned = Spawned()
    counters: Counter[str] = Counter()
    core = Core(COORDINATOR_ID, bus, Subjects(settings.subject_prefix), settings, counters, spawned)
    pool = EnginePool(settings.max_inflight_per_engine, departed_memory_s=2 * settings.heartbeat_timeout_s)
    peers = CoordinatorPeers(COORDINATOR_ID, settings.heartbeat_timeout_s)
    control = ControlState()
    results = ResultCache(settings.result_ttl_s, settings.result_cache_size, settings.result_cache_bytes)
    answers = Answers(core, ClientDeliveries(bus, counters), results)
    blocks = BlockIndex(settings.kv_index_size, settings.cache_aware_prediction_ttl_s)
    ledger = RequestLedger(core, pool, make_policy(settings, blocks), control, peers, answers)
    replies = ReplySubjects(core.subjects, InboxPrefixes(settings.reply_inbox_prefixes.split(",")), 256)
    kept = PeerReplies(peers.last_heard, settings.heartbeat_timeout_s, settings.max_buffered_bytes, counters)
    return Floor(settings, bus, core, spawned, pool, peers, control, results, answers, ledger, replies, kept, blocks)


def reply(entry: InflightRequest, body: bytes = b'{"type":"final"}', seq: int = 0, **fields: Any) -> RoutedReply:
    """An engine's reply to ``entry``, as it would come back."""
    return RoutedReply(entry.return_path, body, seq, **fields)
