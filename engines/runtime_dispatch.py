"""The engine's one dispatch path: both subscriptions, and every message turned into an
answer whatever happens.

An engine receives messages routed to it alone on ``<prefix>.engine.<engine_id>.<header>``
(handled on nats-py's reading task, :mod:`service.bus.direct`: the hot path) and broadcasts
on ``<prefix>.engines.<header>`` (one at a time, in arrival order). Each header has a
:class:`~engines.runtime_core.Route`: routed ones go straight to the job that serves them
(the wiring lists them), broadcasts to their handler in :mod:`engines.handlers`.

Contract, the same for both: a header without a route, or a body that does not decode into
its payload, is malformed: counted (``malformed``), logged (rate-limited) and answered with an
error ``EngineAck`` (code 404 or 400; the detail says ``undecodable`` for a body) where the
sender gave a reply subject. A handler's ``WireError`` is answered with its code, and any other
failure is logged with its traceback and answered with code 500.
A control signal whose revision is not newer than the last applied is confirmed without
calling its handler (``superseded``, given by the wiring). Nothing reaches the reader or the
subscription's task.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

from nats.aio.msg import Msg

from engines.handlers import EngineContext
from engines.runtime_core import EngineCore, Route
from service.bus.registry import HandlerRegistry, Incoming
from service.ops.log_limit import RateLimitedLog
from service.protocol.codec import detect_encoding
from service.protocol.errors import ErrorCode, WireError
from service.protocol.routed import EngineAck, EngineSignal
from service.protocol.subjects import CONTROL_HEADERS

log = logging.getLogger(__name__)


class EngineDispatch:
    def __init__(
        self,
        core: EngineCore,
        routed: Mapping[str, Route[Any]],
        broadcasts: HandlerRegistry[EngineContext],
        context: EngineContext,
        superseded: Callable[[EngineSignal], str | None],
    ) -> None:
        self._core = core
        self._engine_id = core.engine_id
        self._subjects = core.subjects
        self._routed = dict(routed)
        self._broadcasts: dict[str, Route[Any]] = {}
        for header, spec in broadcasts.items():
            if not spec.fanout:
                raise ValueError(f"engine handler for {header!r} must be a broadcast (fanout=True)")
            if header in CONTROL_HEADERS and spec.decoder.type is not EngineSignal:
                raise TypeError(f"engine handler for control signal {header!r} must take an EngineSignal")
            self._broadcasts[header] = Route(spec.decoder, functools.partial(spec.fn, context))
        self._superseded = superseded
        self._malformed_log = RateLimitedLog(log)
        self._failure_log = RateLimitedLog(log)

    async def subscribe(self) -> None:
        nc, subjects = self._core.nc, self._subjects
        await nc.subscribe_direct(subjects.engine_wildcard(self._engine_id), self.routed)
        await nc.subscribe(subjects.broadcast_wildcard(), cb=self.broadcast)

    async def routed(self, subject: str, reply: str, body: bytes, headers: bytes | None) -> None:
        """A message routed to this engine alone (a direct handler: it never waits for another);
        ``headers``: its raw NATS header block (a traced request's ``traceparent``)."""
        header = self._subjects.header_of(subject)
        await self.dispatch(header, self._routed.get(header), reply, body, headers)

    async def broadcast(self, msg: Msg) -> None:
        """A message to every engine."""
        header = self._subjects.header_of(msg.subject)
        await self.dispatch(header, self._broadcasts.get(header), msg.reply, msg.data)

    async def dispatch(
        self, header: str, route: Route[Any] | None, reply: str, body: bytes, headers: bytes | None = None
    ) -> None:
        incoming = Incoming(header, reply or None, detect_encoding(body), body, headers=headers)
        if route is None:
            await self._malformed(incoming, ErrorCode.NOT_FOUND, f"engines serve no {header!r} message here")
            return
        try:
            payload = route.decoder.decode(body, incoming.encoding)
        except WireError as err:
            await self._malformed(incoming, err.code, f"undecodable {header}: {err.message}")
            return
        try:
            if header in CONTROL_HEADERS and (detail := self._superseded(payload)) is not None:
                await self._core.answer(incoming.reply, EngineAck(self._engine_id, header, True, detail))
                return
            await route.serve(incoming, payload)
        except WireError as err:
            self._failure_log.warning("engine_id=%s refused %s: %s", self._engine_id, header, err)
            await self._refuse(incoming, err.code, err.message)
        except Exception as exc:
            self._failure_log.exception("engine_id=%s: %s failed", self._engine_id, header)
            await self._refuse(incoming, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    async def _malformed(self, incoming: Incoming, code: int, detail: str) -> None:
        self._core.counters["malformed"] += 1
        self._malformed_log.warning(
            "engine_id=%s dropped %s message (%d bytes): %s",
            self._engine_id,
            incoming.header,
            len(incoming.body),
            detail,
        )
        await self._refuse(incoming, code, detail)

    async def _refuse(self, incoming: Incoming, code: int, detail: str) -> None:
        ack = EngineAck(self._engine_id, incoming.header, False, detail, code=code)
        try:
            await self._core.answer(incoming.reply, ack)
        except Exception:
            self._failure_log.exception("engine_id=%s: answering %s failed", self._engine_id, incoming.header)
