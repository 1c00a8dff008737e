"""What every job of the engine runtime shares, and how a message routed to a job is described.

:class:`EngineCore` holds the engine's id, settings, backend, connection, subjects, counters
and task spawner, the step loop's events and lock, and the tracer (None while tracing is off). A job takes this core, the request
table (:mod:`engines.requests`) and the few other owners it reads, rather than a dozen
collaborators or a base class (docs/architecture.md, *The engine runtime, by job*).

:class:`Route` is one message a job serves: the payload type it is decoded into and the job's
method that receives it, checked against each other by mypy. The wiring
(:mod:`engines.runtime`) lists the routes and :mod:`engines.runtime_dispatch` serves them.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from msgspec import Struct

from engines.backend import Backend
from service.bus.direct import DirectClient
from service.bus.registry import Incoming
from service.ops.settings import Settings
from service.protocol.codec import PayloadDecoder, encode_msgpack
from service.protocol.subjects import Subjects

if TYPE_CHECKING:
    from service.ops.tracing.otel import Tracer

Spawn = Callable[[Coroutine[Any, Any, None]], None]
Payload = TypeVar("Payload")


@dataclass(frozen=True, slots=True)
class EngineCore:
    engine_id: str
    settings: Settings
    backend: Backend
    nc: DirectClient
    subjects: Subjects
    counters: Counter[str]
    spawn: Spawn  # runs a coroutine in the background until the engine stops
    wake: asyncio.Event  # set when the step loop may have work: a request in, unpaused, registered, reconnected
    connected: asyncio.Event  # set while NATS is reachable
    step_lock: asyncio.Lock  # held by a step, and by whatever must not overlap one (pause, weight swap)
    tracer: Tracer | None = None  # None: tracing off (service/ops/tracing)

    async def answer(self, reply: str | None, message: Struct) -> None:
        """Send ``message`` (msgpack, as between dpcoord processes) to ``reply``, if the sender gave one."""
        if reply:
            await self.nc.publish(reply, encode_msgpack(message))


@dataclass(frozen=True, slots=True)
class Route(Generic[Payload]):
    decoder: PayloadDecoder
    serve: Callable[[Incoming, Payload], Awaitable[None]]

    @classmethod
    def to(cls, payload: type[Payload], serve: Callable[[Incoming, Payload], Awaitable[None]]) -> Route[Payload]:
        """``serve`` receives each message as ``payload``."""
        return cls(PayloadDecoder(payload), serve)
