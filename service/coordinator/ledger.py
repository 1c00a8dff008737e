"""The request ledger: the one owner of a request's life inside a replica.

It holds the request table (:mod:`.requests`), the queue of requests waiting for an engine
(one fair queue per model named, :mod:`.models` and :mod:`.fair_queue`), the engine slot each
routed request takes (:mod:`.pool`) and each owner's tally of them, the deadlines, the
requests routed in this loop turn that the outbox has yet to publish, and the right to send
each request's one terminal reply. The jobs (admission, outbox, relay, fleet, control, …)
read requests through it and change where a request is only through its transitions:

- :meth:`admit`: an accepted request enters with its deadline armed; routed at once to the
  engine admission chose (:meth:`engine_for`), else queued (and the queue released).
- routing (inside :meth:`admit` and :meth:`release`): the engine's slot is taken, the owner's
  tally raised, and the request joins that engine's batch of this turn, which the outbox takes
  with :meth:`take_routed` (``routed`` is set while one waits).
- :meth:`release`: while the coordinator runs, queued requests are routed as engines serving
  their model have room, owners in turn, passing over one that holds ``max_client_share`` of
  the fleet's slots while others wait; once this replica heard the fleet, one that no engine
  can serve fails with 503 (or 404 for a model no engine serves). A request asking for
  log-probabilities goes only to engines that announce them (503 when none does).
- :meth:`requeue`: its engine lost a request: a new run of it (a migration, counted, when it
  streamed) goes first in its owner's line, its slot freed.
- :meth:`hold_adopted`: a dead replica's request, handed over by the engine running it.
- :meth:`repoint`: a resubmission moves the replies to a new reply subject.
- :meth:`finish`: the request leaves the table, which is the right to send its terminal
  reply (the caller sends it, once; None when another path answered first); its slot is
  freed and the queue released right here, so no job calls back up into admission.
- :meth:`fail`, :meth:`abort` and the deadline: :meth:`finish`, then the error reply or the
  ``abort`` final through :mod:`.answers`, and the engine told to drop it.

A stream's progress on an entry (partials delivered, tokens kept, a final that came early)
is the relay's record; the ledger reads it (an early final is the better answer than an error).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import msgspec

from service.coordinator.answers import Answers
from service.coordinator.control_state import ControlState
from service.coordinator.core import Core
from service.coordinator.models import HeldRequests
from service.coordinator.peers import CoordinatorPeers
from service.coordinator.pool import EngineGroup, EnginePool, EngineRecord
from service.coordinator.requests import ClientKey, InflightRequest, RequestTable
from service.coordinator.route_key import RouteKey
from service.coordinator.routing import RoutingPolicy
from service.coordinator.timers import CoarseTimers
from service.ops.latency import RequestLatency
from service.protocol.errors import ErrorCode, WireError
from service.protocol.messages import SubmitEnvelope, SubmitRequest
from service.protocol.state import CoordinatorState

RUNNING = CoordinatorState.RUNNING


def unknown_model(pool: EnginePool, model: str) -> WireError:
    served = ", ".join(pool.models()) or "none"
    return WireError(ErrorCode.NOT_FOUND, f"model {model!r} is not served by any engine (served: {served})")


def no_logprobs_engine(model: str | None) -> WireError:
    serving = "" if model is None else f" serving model {model!r}"
    return WireError(
        ErrorCode.NO_ENGINE,
        f"no engine{serving} computes log-probabilities (sampling_params.logprobs, prompt_logprobs): "
        "its engines are of an earlier release",
    )


class RequestLedger:
    def __init__(
        self,
        core: Core,
        pool: EnginePool,
        policy: RoutingPolicy,
        control: ControlState,
        peers: CoordinatorPeers,
        answers: Answers,
    ) -> None:
        self._spawn = core.spawn
        self._counters = core.counters
        self._share = core.settings.max_client_share
        self._request_timeout_s = core.settings.request_timeout_s
        self._pool = pool
        self._policy = policy
        self._control = control
        self._peers = peers
        self._answers = answers
        self._table = RequestTable()
        self._queue = HeldRequests(self._table)
        self._deadlines = CoarseTimers()
        self._routed: dict[str, list[InflightRequest]] = {}  # engine id -> requests routed this turn
        self.routed = asyncio.Event()  # set while routed requests wait for the outbox
        self.latency = RequestLatency()

    # ------------------------------------------------------------ reading

    def get(self, request_id: str) -> InflightRequest | None:
        return self._table.get(request_id)

    def find_client(self, key: ClientKey) -> InflightRequest | None:
        return self._table.find_client(key)

    def client_keys(self) -> list[ClientKey]:
        """The ids held that name a ``client_request_id`` (what this replica claims)."""
        return self._table.client_keys()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._table

    def __len__(self) -> int:
        return len(self._table)

    def __iter__(self) -> Iterator[InflightRequest]:
        """A snapshot: entries may finish while it is read."""
        return iter(self._table)

    @property
    def queued(self) -> int:
        """Requests waiting for an engine, not counting those answered while they waited."""
        return self._table.queued_count

    @property
    def queued_bytes(self) -> int:
        return self._table.queued_bytes

    def held_by(self, owner: str) -> int:
        """Engine slots ``owner``'s requests hold."""
        return self._table.held_by(owner)

    @property
    def running(self) -> bool:
        return self._control.state is RUNNING

    @property
    def state(self) -> CoordinatorState:
        """The control state this replica follows (running, paused, ...)."""
        return self._control.state

    def routing_key(self, submit: SubmitRequest | SubmitEnvelope) -> RouteKey | None:
        return self._policy.key_of(submit)

    def engine_for(
        self, group: EngineGroup | None, model: str | None, key: RouteKey | None, logprobs: bool = False
    ) -> EngineRecord | None:
        """The engine a new request of ``model`` goes to at once; None while the coordinator is
        not running, no engine serves the model yet, or requests of the model wait (they go
        first). A request asking for ``logprobs`` goes only to an engine that computes them."""
        if self._control.state is not RUNNING or group is None or model in self._queue.by_model:
            return None
        engine = self._policy.choose(group, key)
        if logprobs and engine is not None and not engine.logprobs:
            return group.least_loaded_computing_logprobs()
        return engine

    # ------------------------------------------------------------ entering

    def admit(self, entry: InflightRequest, timeout_s: float | None, engine: EngineRecord | None) -> None:
        """Hold an accepted request until its deadline (``timeout_s``, else ``request_timeout_s``):
        routed to ``engine``, or queued when None."""
        request_id = entry.return_path.request_id
        entry.deadline = self._deadlines.call_later(timeout_s or self._request_timeout_s, self._expire, request_id)
        self._table.add(entry)
        self._counters["submitted"] += 1
        if engine is not None:
            self._route(entry, engine)
            return
        self._queue.append(entry)
        if self._control.state is RUNNING:
            self.release()

    def hold_adopted(self, entry: InflightRequest, engine_id: str, attempt: int) -> bool:
        """Hold a dead replica's request as if this replica had routed it to ``engine_id`` (run
        ``attempt``); False when it is held already."""
        request_id = entry.return_path.request_id
        if request_id in self._table:
            return False
        entry.engine_id = engine_id
        entry.attempts = attempt + 1
        entry.deadline = self._deadlines.call_later(self._request_timeout_s, self._expire, request_id)
        self._table.add(entry)
        record = self._pool.get(engine_id)
        if record is not None:
            self._pool.assign(record, request_id)
        self._table.held[entry.owner] += 1
        return True

    def repoint(self, entry: InflightRequest, reply_to: str, stream: bool) -> None:
        """A resubmission: ``entry``'s replies go to ``reply_to`` from now on."""
        entry.return_path = msgspec.structs.replace(entry.return_path, reply_to=reply_to, stream=stream)

    # ------------------------------------------------------------ routing

    def _route(self, entry: InflightRequest, engine: EngineRecord) -> None:
        entry.engine_id = engine.engine_id
        entry.attempts += 1
        entry.routed_at = now = time.monotonic()
        if not engine.requests:
            engine.last_progress = now  # idle until now: its progress is watched from here (fleet.py)
        self._pool.assign(engine, entry.return_path.request_id)
        self._table.held[entry.owner] += 1  # its owner holds one more slot
        batch = self._routed.get(engine.engine_id)
        if batch is None:
            self._routed[engine.engine_id] = [entry]
            self.routed.set()
        else:
            batch.append(entry)

    def take_routed(self) -> dict[str, list[InflightRequest]]:
        """The requests routed since the last call, per engine, for the outbox to publish; the
        routing policy's turn ends."""
        routed, self._routed = self._routed, {}
        self.routed.clear()
        self._policy.turn_ended()
        return routed

    @property
    def routing(self) -> bool:
        """Routed requests wait for the outbox to take them."""
        return bool(self._routed)

    def still_routed(self, entry: InflightRequest, engine_id: str) -> bool:
        """``entry`` is open and still ``engine_id``'s (not answered or routed elsewhere meanwhile)."""
        return entry.engine_id == engine_id and entry.return_path.request_id in self._table

    def release(self) -> None:
        """Route queued requests while the coordinator runs and some engine serving their model
        has room (see the module docstring)."""
        over_share = self._over_share()
        for model, queue in self._queue.queues():
            while self._control.state is RUNNING:
                entry = queue.peek(over_share)
                if entry is None:
                    self._queue.discard(model)
                    break
                group = self._pool.group(model)
                if group is None or len(group) == 0:
                    if not self._peers.warmed_up:
                        break  # heartbeats are about to introduce the fleet
                    queue.pop(entry)
                    err = (
                        WireError(ErrorCode.NO_ENGINE, "no engine available")
                        if model is None
                        else unknown_model(self._pool, model)
                    )
                    failed = self._pop(entry.return_path.request_id)
                    if failed is not None:
                        self._spawn(self._answers.error(failed, err))
                    continue
                if entry.logprobs and not group.computing_logprobs:
                    if not self._peers.warmed_up:
                        break
                    queue.pop(entry)
                    failed = self._pop(entry.return_path.request_id)
                    if failed is not None:
                        self._spawn(self._answers.error(failed, no_logprobs_engine(model)))
                    continue
                engine = self._policy.choose(group, entry.routing_key)
                if entry.logprobs and engine is not None and not engine.logprobs:
                    engine = group.least_loaded_computing_logprobs()
                if engine is None:
                    break
                queue.pop(entry)
                self._route(entry, engine)

    def _over_share(self) -> Callable[[str], bool]:
        share = self._share
        if share >= 1.0:
            return _never
        limit = share * self._pool.capacity
        held = self._table.held

        def over_share(owner: str) -> bool:
            return held.get(owner, 0) >= limit

        return over_share

    def requeue(self, entry: InflightRequest, migrated: bool = False) -> None:
        """Its engine lost ``entry``: a new run of it (``migrated``: one that resumes after what
        it streamed, counted in ``migrations``) waits first in its owner's line, first in turn.
        Whoever requeues calls :meth:`release` once done."""
        if migrated:
            entry.migrations += 1
        entry.new_run()
        engine_id = entry.engine_id
        if engine_id is not None:
            self._pool.release(engine_id, entry.return_path.request_id)
            self._table.unrouted(entry)
        entry.engine_id = None
        self._queue.appendleft(entry)

    async def drained(self, timeout_s: float) -> None:
        """Until nothing waits for an engine (a replica about to leave its requests to its peers:
        queued requests are routed as engines free slots), the coordinator stops running, or
        ``timeout_s`` passed."""
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + timeout_s
        while True:  # the queue drains as engines answer: nothing to wait on but the next look
            if not self.queued or self._control.state is not RUNNING or loop.time() >= give_up_at:
                return
            await asyncio.sleep(0.05)

    # ------------------------------------------------------------ leaving

    def finish(self, request_id: str) -> InflightRequest | None:
        """Take a request out for its terminal reply, which the caller then sends, once; None
        when another path answered it already. Its engine slot goes to the next waiting request."""
        entry = self._pop(request_id)
        if entry is not None and entry.engine_id is not None and self._table.queued_count:
            self.release()
        return entry

    def _pop(self, request_id: str) -> InflightRequest | None:
        entry = self._table.pop(request_id)
        if entry is None:
            return None
        self.latency.observe_finished(entry.admitted_at)
        if entry.engine_id is not None:
            self._pool.release(entry.engine_id, request_id)
        return entry

    async def fail(self, request_id: str, err: WireError) -> bool:
        """Answer an open request with ``err`` and tell its engine to drop it; False when it was
        answered already. A final that arrived early, behind a lost partial, is the better
        answer, so it goes out instead."""
        entry = self.finish(request_id)
        if entry is None:
            return False
        if entry.early_final is not None:
            await self._answers.final(entry, entry.early_final.body)
            return True
        await self._answers.error(entry, err)
        if entry.engine_id is not None:
            await self._answers.tell_engine_abort(entry.engine_id, request_id)
        return True

    async def abort(self, entry: InflightRequest) -> None:
        """A client's abort: a queued request ends here with an ``abort`` final; a routed one
        is aborted by its engine, whose final says ``abort``."""
        if entry.engine_id is not None:
            await self._answers.tell_engine_abort(entry.engine_id, entry.return_path.request_id)
            return
        if self.finish(entry.return_path.request_id) is not None:
            await self._answers.aborted(entry)

    async def tell_engine_abort(self, engine_id: str, request_id: str) -> None:
        """Best effort: ``engine_id`` drops ``request_id`` (taken from it, or answered already)."""
        await self._answers.tell_engine_abort(engine_id, request_id)

    def _expire(self, request_id: str) -> None:
        entry = self._table.get(request_id)
        if entry is None:
            return
        entry.deadline = None
        self._spawn(self.fail(request_id, WireError(ErrorCode.TIMED_OUT, "request deadline passed")))

    def forget_idle_owners(self) -> None:
        """Housekeeping: drop the tallies of owners holding no slot."""
        self._table.forget_idle_owners()


def _never(owner: str) -> bool:
    return False
