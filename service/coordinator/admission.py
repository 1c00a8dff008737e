"""Admission: accepting a submission, or refusing it with a code, and the queue of requests
waiting for an engine.

Contract:
- A submission is refused before it is accepted (400 bad reply subject, 409 an anonymous
  client's id already in flight, 429 queue full, 503 no engine), or accepted: then it holds a
  deadline (504 when it passes) and ends with exactly one terminal reply (see the relay).
- A named client's repeated ``(client_id, client_request_id)`` is answered, never run twice: a
  request in flight answers the new reply subject, a cached result is sent again.
- A submission naming a ``model`` goes only to engines serving it (the pool's group for it);
  one that names a model no engine serves is refused with 404.
- Accepted requests are routed at once while the coordinator runs and an engine (serving their
  model) has room; otherwise they wait in the queue of their model, in order, until
  :meth:`Admission.release_queue`. A replica that has not yet heard the fleet (one heartbeat
  timeout after it starts) queues rather than answering 503 or 404.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec

from service.bus.registry import Incoming
from service.coordinator.control_state import ControlState
from service.coordinator.deliveries import ClientDeliveries
from service.coordinator.models import HeldRequests
from service.coordinator.outbox import Outbox
from service.coordinator.peers import CoordinatorPeers
from service.coordinator.pool import EngineGroup, EnginePool
from service.coordinator.relay import ReplyRelay
from service.coordinator.requests import ClientKey, InflightRequest, RequestTable
from service.coordinator.routing import RoutingPolicy
from service.coordinator.timers import CoarseTimers
from service.ops.settings import Settings
from service.protocol.codec import detect_encoding
from service.protocol.errors import ErrorCode, WireError
from service.protocol.messages import ReturnPath, SubmitEnvelope, SubmitRequest
from service.protocol.state import CoordinatorState
from service.protocol.subjects import Subjects

log = logging.getLogger(__name__)


class Admission:
    def __init__(
        self,
        coordinator_id: str,
        settings: Settings,
        subjects: Subjects,
        requests: RequestTable,
        pool: EnginePool,
        peers: CoordinatorPeers,
        policy: RoutingPolicy,
        control: ControlState,
        outbox: Outbox,
        relay: ReplyRelay,
        deliveries: ClientDeliveries,
        counters: Counter[str],
        spawn: Callable[[Coroutine[Any, Any, object]], None],
    ) -> None:
        self._id = coordinator_id
        self._settings = settings
        self._subjects = subjects
        self._requests = requests
        self._pool = pool
        self._peers = peers
        self._policy = policy
        self._control = control
        self._outbox = outbox
        self._relay = relay
        self._deliveries = deliveries
        self._counters = counters
        self._spawn = spawn
        self._queue = HeldRequests()
        self._deadlines = CoarseTimers()
        self._sequence = itertools.count()

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def admit(self, incoming: Incoming, submit: SubmitRequest | SubmitEnvelope) -> None:
        """Route or queue a submission. An envelope's body is forwarded undecoded (the engine validates it)."""
        if submit.reply_to is not None and (problem := self._subjects.reply_problem(submit.reply_to)):
            raise WireError(ErrorCode.MALFORMED, f"reply_to {submit.reply_to!r} {problem}")
        reply_to = submit.reply_to or incoming.reply
        if reply_to is None:
            self._counters["submit_without_reply"] += 1
            log.warning("submission without reply subject dropped (client_request_id=%s)", submit.client_request_id)
            return
        if isinstance(submit, SubmitEnvelope):
            body, encoding, timeout_s = submit.body, detect_encoding(submit.body), submit.timeout_s
        else:
            body, encoding, timeout_s = incoming.body, incoming.encoding, submit.sampling_params.timeout_s
        client_key = None
        if submit.client_request_id is not None:
            client_key = (submit.client_id, submit.client_request_id)
            if await self._resubmitted(client_key, reply_to, submit.stream):
                return
        running = self._control.state is CoordinatorState.RUNNING
        if running and len(self._pool) == 0 and self._peers.warmed_up:
            raise WireError(ErrorCode.NO_ENGINE, "no engine available")
        model = submit.model
        group = self._pool.everyone if model is None else self._engines_serving(model)
        key = self._policy.key_of(submit)
        engine = self._policy.choose(group, key) if running and group is not None else None
        if engine is None and len(self._queue) >= self._settings.max_queued_requests:
            raise WireError(ErrorCode.OVERLOADED, f"coordinator queue full ({self._settings.max_queued_requests} held)")

        request_id = f"{self._id}-{next(self._sequence)}"
        return_path = ReturnPath(
            request_id, self._id, reply_to, encoding.value, submit.stream, submit.client_request_id, submit.client_id
        )
        entry = InflightRequest(return_path, encoding, body, client_key, model, routing_key=key)
        entry.deadline = self._deadlines.call_later(
            timeout_s or self._settings.request_timeout_s, self._expire, request_id
        )
        self._requests.add(entry)
        self._counters["submitted"] += 1
        if engine is None:
            self._queue.append(entry)
        else:
            self._outbox.send(entry, engine)

    def _engines_serving(self, model: str) -> EngineGroup | None:
        """404 for a model no engine serves, unless this replica is still learning the fleet
        (then None: the request waits for heartbeats to introduce the fleet)."""
        group = self._pool.group(model)
        if group is not None or not self._peers.warmed_up:
            return group
        raise self._unknown_model(model)

    def _unknown_model(self, model: str) -> WireError:
        served = ", ".join(self._pool.models()) or "none"
        return WireError(ErrorCode.NOT_FOUND, f"model {model!r} is not served by any engine (served: {served})")

    async def _resubmitted(self, client_key: ClientKey, reply_to: str, stream: bool) -> bool:
        """Answer a repeated ``(client_id, client_request_id)``; False when it is new.

        Anonymous clients share one namespace, so for them a repeat in flight is refused."""
        existing = self._requests.find_client(client_key)
        if client_key[0] is None:
            if existing is not None:
                raise WireError(ErrorCode.CONFLICT, f"client_request_id {client_key[1]!r} is already in flight")
            return False
        if existing is not None:
            existing.return_path = msgspec.structs.replace(existing.return_path, reply_to=reply_to, stream=stream)
            self._counters["resubmitted"] += 1
            return True
        if self._deliveries.repoint(client_key, reply_to):
            self._counters["resubmitted"] += 1
            return True
        return await self._relay.replay(client_key, reply_to, stream)

    def requeue(self, entry: InflightRequest) -> None:
        """Put a request whose engine lost it at the head of the queue, to be routed again."""
        entry.engine_id = None
        self._queue.appendleft(entry)

    async def release_queue(self) -> None:
        """Route queued requests while the coordinator runs and some engine serving their model has room."""
        for model, queue in self._queue.queues():
            while queue and self._control.state is CoordinatorState.RUNNING:
                entry = queue[0]
                if entry.return_path.request_id not in self._requests:
                    self._queue.popleft(model)
                    continue
                group = self._pool.group(model)
                if group is None or len(group) == 0:
                    if not self._peers.warmed_up:
                        break  # heartbeats are about to introduce the fleet
                    self._queue.popleft(model)
                    err = (
                        WireError(ErrorCode.NO_ENGINE, "no engine available")
                        if model is None
                        else self._unknown_model(model)
                    )
                    await self._relay.fail(entry.return_path.request_id, err)
                    continue
                engine = self._policy.choose(group, entry.routing_key)
                if engine is None:
                    break
                self._queue.popleft(model)
                self._outbox.send(entry, engine)

    def _expire(self, request_id: str) -> None:
        entry = self._requests.get(request_id)
        if entry is None:
            return
        entry.deadline = None
        self._spawn(self._relay.fail(request_id, WireError(ErrorCode.TIMED_OUT, "request deadline passed")))
