"""The KV feed: the engines' KV events into the block index, in order, with snapshots to
recover (docs/protocol.md, *KV events*).

Contract:
- Only with ``routing_policy: cache_aware``; otherwise events are dropped unread and no
  snapshot is asked.
- An engine is tracked from the moment this replica knows it publishes events: its register
  or heartbeat carries ``kv_sequence``, or an event of it arrives while it is in the pool.
  Tracking starts with a snapshot (``<prefix>.engine.<id>.kv_snapshot``): when it registers
  (a restart: its cache is new), when a heartbeat introduces it (this replica adopted it, or
  started or restarted: the index is rebuilt from the engines' snapshots, with nothing to
  replay), and when it is first heard publishing.
- Events apply in their numbering: one whose ``sequence`` is not the next is a gap (a lost
  message, or an engine that restarted unseen), and so is a heartbeat whose ``kv_sequence``
  differs from the last event applied (a lost last event). A gap asks a snapshot. While one is
  asked, events wait in a bounded buffer; the answer replaces what the engine holds and sets
  its number, then the waiting events past it apply in order (a gap among them asks again).
  At most one snapshot per engine is asked at a time; one unanswered leaves the engine's
  number unknown, so its next event or heartbeat asks again.
- An engine that leaves the pool is forgotten at the next :meth:`KvFeed.sweep`; routing never
  chooses it meanwhile (its record left the pool).
- Each event's ``queued_tokens`` becomes the engine's queued tokens (:mod:`.cache_routing`).
- A replica that starts learns before it routes by the index: ``BlockIndex.learning`` holds
  from its start until the fleet has been heard (:meth:`KvFeed.tick`, every heartbeat interval:
  two intervals since the start, the last of them without a new engine) and every snapshot
  asked meanwhile is answered (or failed), or at the latest until warm-up ends
  (:meth:`KvFeed.warmed_up`); ``cache_aware`` routes no request by the index meanwhile, and
  ``release`` (the ledger's, passed in by the wiring) routes what waited once it is over.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec
from nats.errors import Error as NatsError

from service.coordinator.block_index import BlockIndex, EngineBlocks
from service.coordinator.core import Core
from service.coordinator.pool import EnginePool
from service.ops.log_limit import RateLimitedLog
from service.protocol.codec import encode_msgpack, msgpack_decoder
from service.protocol.kv_events import KvEvents, KvSnapshot
from service.protocol.membership import Heartbeat
from service.protocol.messages import Empty
from service.protocol.subjects import KV_SNAPSHOT

log = logging.getLogger(__name__)
_snapshot_decoder = msgpack_decoder(KvSnapshot)
_ASK = encode_msgpack(Empty())

# Events kept per engine while its snapshot is asked; beyond, they are dropped and it is asked again.
MAX_BUFFERED = 256


class KvFeed:
    def __init__(
        self,
        core: Core,
        index: BlockIndex,
        pool: EnginePool,
        release: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._core = core
        self._index = index
        self._pool = pool
        self._release = release
        self.enabled = core.settings.routing_policy == "cache_aware"
        self._counters = core.counters
        self._failures = RateLimitedLog(log)
        self._asking = 0  # snapshots asked and not answered (or failed) yet
        self._heard_all = False
        self._clock = clock
        self._started = self._last_new = clock()
        index.learning = self.enabled

    def tick(self) -> None:
        """Every heartbeat interval: engines gone from the pool forgotten (:meth:`sweep`), and
        while learning, whether every live engine has been heard (each beats once an interval:
        two since the start, and one without a new engine)."""
        self.sweep()
        if not self._index.learning or self._heard_all:
            return
        now, interval = self._clock(), self._core.settings.heartbeat_interval_s
        if now - self._started >= 2 * interval and now - self._last_new >= interval:
            self._heard_all = True
            self._settle()

    def warmed_up(self) -> None:
        """Warm-up is over: route by the index whatever is still asked."""
        self._heard_all = True
        if self._index.learning:
            self._index.learning = False
            self._release()

    def registered(self, engine_id: str, kv_sequence: int | None) -> None:
        """``engine_id`` registered (it restarted): a fresh snapshot, or none for an engine
        that publishes no events."""
        if not self.enabled:
            return
        record = self._pool.get(engine_id)
        if record is None or kv_sequence is None:
            self._index.forget(engine_id)
            return
        self._last_new = self._clock()
        self._ask(self._index.track(engine_id, record))

    def heard(self, heartbeat: Heartbeat) -> None:
        """A heartbeat: an engine this replica does not track yet is snapshotted (adopted, or
        this replica is new); a ``kv_sequence`` other than the last event applied is a gap."""
        if not self.enabled or heartbeat.kv_sequence is None:
            return
        engine = self._tracked(heartbeat.engine_id)
        if engine is not None and not engine.pending and engine.sequence != heartbeat.kv_sequence:
            self._counters["kv_gaps"] += 1
            self._ask(engine)

    def received(self, engine_id: str, events: KvEvents) -> None:
        """One engine step's events (sent on its own subject, so ``engine_id`` is the sender)."""
        if not self.enabled:
            return
        self._counters["kv_events"] += 1
        engine = self._tracked(engine_id)
        if engine is None:
            return
        if engine.pending:
            if len(engine.buffered) < MAX_BUFFERED:
                engine.buffered.append(events)
            else:
                engine.overflowed = True
            return
        if engine.sequence is None or events.sequence != engine.sequence + 1:
            self._counters["kv_gaps"] += 1
            engine.buffered.append(events)
            self._ask(engine)
            return
        self._apply(engine, events)

    def sweep(self) -> None:
        """Forget the engines that left the pool (or were replaced by a new registration)."""
        pool = self._pool
        for engine_id, engine in list(self._index.engines.items()):
            if pool.get(engine_id) is not engine.record:
                self._index.forget(engine_id)

    # ------------------------------------------------------------ inside

    def _tracked(self, engine_id: str) -> EngineBlocks | None:
        """The engine's entry; a new one, snapshot asked, for a pool engine not tracked yet
        (or tracked under an earlier record); None for an engine not in the pool."""
        record = self._pool.get(engine_id)
        if record is None:
            return None
        engine = self._index.engines.get(engine_id)
        if engine is None or engine.record is not record:
            self._last_new = self._clock()
            engine = self._index.track(engine_id, record)
            self._ask(engine)
        return engine

    def _apply(self, engine: EngineBlocks, events: KvEvents) -> None:
        index = self._index
        if events.evicted:
            index.evict(engine, events.evicted)
        if events.stored:
            index.store(engine, events.stored)
        engine.sequence = events.sequence
        engine.record.queued_tokens = events.queued_tokens

    def _ask(self, engine: EngineBlocks) -> None:
        if not engine.pending:
            engine.pending = True
            self._asking += 1
            self._core.spawn(self._snapshot(engine))

    def _settle(self) -> None:
        if self._index.learning and self._heard_all and not self._asking:
            self._index.learning = False
            self._release()

    async def _snapshot(self, engine: EngineBlocks) -> None:
        try:
            await self._take_snapshot(engine)
        finally:
            self._asking -= 1
            self._settle()

    async def _take_snapshot(self, engine: EngineBlocks) -> None:
        engine_id = engine.engine_id
        core = self._core
        self._counters["kv_snapshots_asked"] += 1
        try:
            msg = await core.nc.request(
                core.subjects.engine(engine_id, KV_SNAPSHOT), _ASK, timeout=core.settings.control_timeout_s
            )
            snapshot = _snapshot_decoder.decode(msg.data)
            if snapshot.engine_id != engine_id:
                raise ValueError(f"answered for engine {snapshot.engine_id[:64]!r}")
        except (NatsError, TimeoutError, msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            self._counters["kv_snapshots_failed"] += 1
            self._failures.warning("engine_id=%s: KV snapshot not answered: %s", engine_id, exc)
            engine.pending, engine.sequence, engine.overflowed = False, None, False
            engine.buffered.clear()
            return
        if self._index.engines.get(engine_id) is not engine:
            return  # forgotten, or tracked anew, meanwhile
        self._index.replace(engine, snapshot.held)
        engine.record.queued_tokens = snapshot.queued_tokens
        engine.sequence = snapshot.sequence
        engine.pending = False
        waiting, engine.buffered = engine.buffered, []
        again, engine.overflowed = engine.overflowed, False
        for events in waiting:
            if events.sequence <= snapshot.sequence:
                continue
            if events.sequence != engine.sequence + 1:
                again = True
                break
            self._apply(engine, events)
        if again:
            self._counters["kv_gaps"] += 1
            self._ask(engine)
