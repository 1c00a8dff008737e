"""The coordinator's view of live engines: capacity, in-flight requests, last heartbeat, model.

Every change is O(1) in the number of engines, so a fleet of thousands costs what a few do:
registering, leaving, a heartbeat, a request routed (:meth:`EnginePool.assign`) or answered
(:meth:`EnginePool.release`), and finding engines that fell silent (which reads only those).

Routing chooses within an :class:`EngineGroup`: the whole fleet (requests that name no model)
or the engines serving one model. Each group indexes its engines three ways, so no policy
scans them:

- engines with room bucketed by load, for least-loaded routing: bucket ``n`` holds the
  engines with ``n`` requests in flight, in the order they entered it, so the least loaded
  engine is the oldest member of the lowest non-empty bucket and equals take turns. Finding
  that bucket walks up from a lower bound on it, over at most ``max_inflight_per_engine``
  empty buckets, whatever the fleet's size;
- engines with room in turn, for round robin;
- a list to sample from uniformly, for the power of two choices.

Loads change through the pool alone, which keeps an engine's groups in step.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from service.protocol.messages import ServedModel


@dataclass(slots=True, eq=False)
class EngineRecord:
    engine_id: str
    capacity: int
    model: str | None = None  # the model it serves (engines older than model names report none)
    last_seen: float = field(default_factory=time.monotonic)
    requests: set[str] = field(default_factory=set)
    reconciling: bool = False
    in_pool: bool = False
    # Progress, watched while it holds requests (fleet.py): its last reply, step or start of work.
    last_progress: float = field(default_factory=time.monotonic)
    steps: int | None = None  # the step count its last heartbeat reported
    # It registered (or was adopted) on its own subjects, <prefix>.<header>.<engine_id>: then no
    # message on the plain <prefix>.<header> of earlier releases may speak for it (fleet.py).
    own_subjects: bool = True
    # Prompt tokens waiting for their prefill, as its last KV event said plus those routed since
    # (cache_aware routing); 0 for an engine that publishes no KV events.
    queued_tokens: int = 0
    logprobs: bool = False  # it computes log-probabilities (announced; engines of earlier releases do not)

    @property
    def load(self) -> int:
        return len(self.requests)

    @property
    def has_room(self) -> bool:
        return len(self.requests) < self.capacity


class EngineGroup:
    """Engines that may take the same requests, indexed for routing (see the module docstring)."""

    def __init__(self, model: str | None = None) -> None:
        self.model = model  # the model its members serve; None: the whole fleet (every engine in the pool)
        self._members: list[EngineRecord] = []
        self.computing_logprobs = 0  # members that compute log-probabilities
        self._position: dict[EngineRecord, int] = {}
        self._by_load: list[OrderedDict[EngineRecord, None]] = [OrderedDict()]  # engines with room, by load
        self.lowest_load = 0  # no engine with room has less load; exact after least_loaded() found one
        self.requests = 0  # the members' requests in flight, summed (their mean load)
        self._in_turn: OrderedDict[EngineRecord, None] = OrderedDict()  # engines with room, next in turn first

    def add(self, record: EngineRecord) -> None:
        """A member with zero load."""
        self._position[record] = len(self._members)
        self._members.append(record)
        self.computing_logprobs += record.logprobs
        self._by_load[0][record] = None
        self.lowest_load = 0
        self._in_turn[record] = None

    def remove(self, record: EngineRecord) -> None:
        self.requests -= len(record.requests)
        self.computing_logprobs -= record.logprobs
        index = self._position.pop(record)
        last = self._members.pop()
        if last is not record:
            self._members[index] = last
            self._position[last] = index
        if record.has_room:
            del self._by_load[len(record.requests)][record]
            del self._in_turn[record]

    def raised(self, record: EngineRecord, load: int) -> None:
        """``record``'s load went from ``load`` to ``load + 1``; beyond its capacity (requests
        adopted from a dead replica) it stays full."""
        self.requests += 1
        if load >= record.capacity:
            return
        by_load = self._by_load
        del by_load[load][record]
        load += 1
        if load < record.capacity:
            if load == len(by_load):
                by_load.append(OrderedDict())
            by_load[load][record] = None
        else:
            del self._in_turn[record]

    def lowered(self, record: EngineRecord, load: int) -> None:
        """``record``'s load went from ``load`` to ``load - 1``."""
        self.requests -= 1
        if load > record.capacity:
            return
        by_load = self._by_load
        if load < record.capacity:
            del by_load[load][record]
        else:
            self._in_turn[record] = None
        load -= 1
        by_load[load][record] = None
        if load < self.lowest_load:
            self.lowest_load = load

    def least_loaded(self) -> EngineRecord | None:
        """Fewest requests in flight among members with room, equals in turn (``lowest_load`` is
        its load); None when all are full."""
        by_load = self._by_load
        lowest = self.lowest_load
        while lowest < len(by_load):
            bucket = by_load[lowest]
            if bucket:
                self.lowest_load = lowest
                return next(iter(bucket))
            lowest += 1
        self.lowest_load = lowest
        return None

    def least_loaded_computing_logprobs(self) -> EngineRecord | None:
        """The least loaded member with room that computes log-probabilities: a scan, for a fleet
        where some engines predate them (an upgrade under way), rare and short-lived."""
        return min(
            (record for record in self._members if record.logprobs and record.has_room),
            key=lambda record: record.load,
            default=None,
        )

    def next_in_turn(self) -> EngineRecord | None:
        """The member with room that has waited longest for its turn; None when all are full."""
        in_turn = self._in_turn
        if not in_turn:
            return None
        record = next(iter(in_turn))
        in_turn.move_to_end(record)
        return record

    def sample_two(self) -> tuple[EngineRecord, EngineRecord]:
        """Two distinct members uniformly at random, full or not (the same one twice when the
        group has one); the group must not be empty."""
        members = self._members
        count = len(members)
        first = int(random.random() * count)
        if count == 1:
            return members[0], members[0]
        second = int(random.random() * (count - 1))
        if second >= first:
            second += 1
        return members[first], members[second]

    def __contains__(self, record: object) -> bool:
        return record in self._position

    def __len__(self) -> int:
        return len(self._members)

    def __iter__(self) -> Iterator[EngineRecord]:
        return iter(self._members)


class EnginePool:
    """Live engines, plus recently departed ones: a heartbeat sent just before an engine left
    must not bring it back (only registering again does)."""

    def __init__(self, max_inflight_per_engine: int, departed_memory_s: float) -> None:
        self._max_inflight = max_inflight_per_engine
        self._departed_memory_s = departed_memory_s
        self._engines: dict[str, EngineRecord] = {}
        self._by_silence: OrderedDict[str, EngineRecord] = OrderedDict()  # least recently heard first
        self._departed: OrderedDict[str, float] = OrderedDict()  # engine id -> when it left, oldest first
        self.everyone = EngineGroup()
        self._models: dict[str, EngineGroup] = {}
        self.capacity = 0  # the live engines' slots, summed

    # ------------------------------------------------------------ membership

    def add(
        self,
        engine_id: str,
        capacity: int,
        model: str | None = None,
        own_subjects: bool = True,
        logprobs: bool = False,
    ) -> EngineRecord:
        """Adds a fresh record with zero load; an existing one must be removed first."""
        record = EngineRecord(engine_id, min(capacity, self._max_inflight), model, in_pool=True)
        record.own_subjects = own_subjects
        record.logprobs = logprobs
        self._engines[engine_id] = record
        self._by_silence[engine_id] = record
        self._departed.pop(engine_id, None)
        self.capacity += record.capacity
        self.everyone.add(record)
        if model is not None:
            serving = self._models.get(model)
            if serving is None:
                serving = self._models[model] = EngineGroup(model)
            serving.add(record)
        return record

    def remove(self, engine_id: str, departed: bool) -> EngineRecord | None:
        """``departed``: the engine left on purpose, so its stray heartbeats must not re-add it.
        An engine removed for silence is taken back by its next heartbeat."""
        record = self._engines.pop(engine_id, None)
        if record is None:
            return None
        record.in_pool = False
        self.capacity -= record.capacity
        del self._by_silence[engine_id]
        self.everyone.remove(record)
        if record.model is not None:
            serving = self._models[record.model]
            serving.remove(record)
            if not serving:
                del self._models[record.model]
        if departed:
            now = time.monotonic()
            self._forget_departed(now)
            self._departed[engine_id] = now
        return record

    def _forget_departed(self, now: float) -> None:
        departed = self._departed
        while departed:
            engine_id, left_at = next(iter(departed.items()))
            if now - left_at < self._departed_memory_s:
                return
            del departed[engine_id]

    def recently_departed(self, engine_id: str) -> bool:
        departed_at = self._departed.get(engine_id)
        return departed_at is not None and time.monotonic() - departed_at < self._departed_memory_s

    def get(self, engine_id: str) -> EngineRecord | None:
        return self._engines.get(engine_id)

    def __len__(self) -> int:
        return len(self._engines)

    def __iter__(self) -> Iterator[EngineRecord]:
        return iter(self.everyone)

    # ------------------------------------------------------------ models

    def group(self, model: str | None) -> EngineGroup | None:
        """The engines a request naming ``model`` may go to (any engine for None); None when no
        engine serves that model."""
        return self.everyone if model is None else self._models.get(model)

    def models(self) -> list[str]:
        return sorted(self._models)

    def served(self) -> list[ServedModel]:
        """Each model with its engines' count, capacity and load (read at a client's request)."""
        return [
            ServedModel(
                name, len(group), sum(record.capacity for record in group), sum(record.load for record in group)
            )
            for name, group in sorted(self._models.items())
        ]

    # ------------------------------------------------------------ load

    def assign(self, record: EngineRecord, request_id: str) -> None:
        """``request_id`` is now in flight on ``record``."""
        requests = record.requests
        if request_id in requests:
            return
        load = len(requests)
        requests.add(request_id)
        if not record.in_pool:
            return
        self.everyone.raised(record, load)
        if record.model is not None:
            self._models[record.model].raised(record, load)

    def release(self, engine_id: str, request_id: str) -> bool:
        """``request_id`` no longer occupies a slot of engine ``engine_id``; False when it did not
        (or that engine is gone: a new record of the same engine never held it)."""
        record = self._engines.get(engine_id)
        if record is None:
            return False
        requests = record.requests
        if request_id not in requests:
            return False
        load = len(requests)
        requests.remove(request_id)
        self.everyone.lowered(record, load)
        if record.model is not None:
            self._models[record.model].lowered(record, load)
        return True

    # ------------------------------------------------------------ liveness

    def heard(self, record: EngineRecord) -> None:
        """A heartbeat from ``record``'s engine."""
        record.last_seen = time.monotonic()
        self._by_silence.move_to_end(record.engine_id)

    def heard_all(self) -> None:
        """Count every engine as just heard (after this coordinator's own connection was down)."""
        now = time.monotonic()
        for record in self._engines.values():
            record.last_seen = now

    def silent_since(self, cutoff: float) -> list[EngineRecord]:
        """Engines last heard before ``cutoff``; reads only those, plus one."""
        silent = []
        for record in self._by_silence.values():
            if record.last_seen >= cutoff:
                break
            silent.append(record)
        return silent
