"""The engine runtime's first floor (core, control state, weights, request table) wired as
engines/runtime.py wires it, on a :class:`~tests.unit.coordinator.bus_double.RecordingBus`
(the same test double of the connection the coordinator's jobs are tested on), so each job is
built on it alone and tested without a NATS server. The backend is the echo test double
(engines/echo.py) unless a test gives another."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import msgspec

from engines.backend import Backend
from engines.control_state import ControlState
from engines.echo import EchoBackend
from engines.replies import ReplyPublisher
from engines.requests import RequestTable
from engines.runtime_core import EngineCore
from engines.weight_updates import EngineWeights
from service.ops.settings import Settings
from service.protocol.routed import EngineReplyBatch, ReturnPath, RoutedReply, RoutedRequest
from service.protocol.subjects import Header, Subjects
from tests.unit.coordinator.bus_double import RecordingBus

ENGINE_ID = "e1"
COORDINATOR_ID = "c1"


class Spawned:
    """The core's task spawner: tests await what the jobs started in the background."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Future[None]] = []

    def __call__(self, coro: Coroutine[Any, Any, None]) -> None:
        self.tasks.append(asyncio.ensure_future(coro))

    def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()


@dataclass
class Floor:
    settings: Settings
    bus: RecordingBus
    core: EngineCore
    spawned: Spawned
    backend: Backend
    control: ControlState
    weights: EngineWeights
    requests: RequestTable
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    def routed(
        self,
        prompt: str = "abc",
        max_tokens: int = 3,
        stream: bool = False,
        attempt: int = 0,
        resume_tokens: list[int] | None = None,
        request_id: str | None = None,
        coordinator_id: str = COORDINATOR_ID,
        **params: Any,
    ) -> RoutedRequest:
        """A request as a coordinator routes it here, its body in JSON (``params``: more
        sampling parameters)."""
        n = next(self._ids)
        body = msgspec.json.encode({"prompt": prompt, "sampling_params": {"max_tokens": max_tokens, **params}})
        path = ReturnPath(
            request_id or f"{coordinator_id}-r{n}", coordinator_id, f"_INBOX.client.{n}", "json", stream, n
        )
        return RoutedRequest(path, body, attempt, resume_tokens)

    def replies(self, header: str = Header.ENGINE_REPLY) -> list[RoutedReply]:
        """Every reply published on ``header``'s subject, in order."""
        subject = self.core.subjects.sent_by(header, ENGINE_ID)
        return [
            reply
            for sent in self.bus.on(subject)
            for reply in msgspec.msgpack.decode(sent.body, type=EngineReplyBatch).replies
        ]

    def bodies(self, header: str = Header.ENGINE_REPLY) -> list[dict[str, Any]]:
        """The client bodies of those replies (JSON, as the requests of :meth:`routed` ask)."""
        return [msgspec.json.decode(reply.body) for reply in self.replies(header)]


def build(backend: Backend | None = None, max_payload: int = 1024 * 1024, **values: Any) -> Floor:
    """The first floor with ``values`` for settings, on a bus whose server takes ``max_payload``."""
    settings = Settings(**values)
    bus = RecordingBus(max_payload)
    spawned = Spawned()
    counters: Counter[str] = Counter()
    backend = backend or EchoBackend()
    connected = asyncio.Event()
    connected.set()
    subjects = Subjects(settings.subject_prefix)
    lock = asyncio.Lock()
    core = EngineCore(ENGINE_ID, settings, backend, bus, subjects, counters, spawned, asyncio.Event(), connected, lock)
    publisher = ReplyPublisher(ENGINE_ID, bus, subjects, counters, settings.recent_replies_bytes)
    requests = RequestTable(ENGINE_ID, backend, publisher, counters, settings.stream_interval)
    weights = EngineWeights(ENGINE_ID, backend, lock)
    return Floor(settings, bus, core, spawned, backend, ControlState(), weights, requests)
