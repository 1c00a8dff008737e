"""Aborting when the HTTP client goes away.

:class:`DisconnectWatch` listens for ``http.disconnect`` while a request is served and calls its
``on_disconnect`` (the gateway aborts the request's submissions, so the engine frees them).
:func:`watch_disconnect` gives a request not streamed a :class:`DepartureWatch` instead when the
server is the gateway's edge: the same, on the connection's departure callbacks, without a task
per request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from starlette.types import Receive, Scope

from service.gateway.edge import Departure, departure_of


class DisconnectWatch:
    """Waits for the HTTP client to leave, until ``stop()``; then calls ``on_disconnect``, which
    answers whether it found every submission to abort.

    A client that leaves within moments of its request can beat its submission to the
    coordinator, which then knows no such request; a stream then calls ``on_disconnect`` once
    more at the next reply (:meth:`replied`), when the submission has surely arrived."""

    def __init__(self, receive: Receive, on_disconnect: Callable[[], Awaitable[bool]]) -> None:
        self.disconnected = False
        self._receive = receive
        self._on_disconnect = on_disconnect
        self._stopped = False
        self._missed = False
        self._task = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        if not self._stopped:
            self.disconnected = True
            self._missed = not await self._on_disconnect()

    async def replied(self) -> None:
        if self._missed:
            self._missed = False
            await self._on_disconnect()

    def stop(self) -> None:
        """The response is complete: a disconnect from now on is the connection closing normally."""
        self._stopped = True
        self._task.cancel()


class DepartureWatch:
    """:class:`DisconnectWatch` on the edge's :class:`~service.gateway.edge.Departure`: no task
    waits on ``receive()``; the connection's loss calls ``on_disconnect``."""

    def __init__(self, departure: Departure, on_disconnect: Callable[[], Awaitable[bool]]) -> None:
        self.disconnected = False
        self._departure = departure
        self._on_disconnect = on_disconnect
        self._aborting: asyncio.Future[bool] | None = None
        departure.add(self._left)

    def _left(self) -> None:
        self.disconnected = True
        self._aborting = asyncio.ensure_future(self._on_disconnect())

    async def replied(self) -> None:
        """Nothing to do: a request not streamed has no later reply to retry the abort at."""

    def stop(self) -> None:
        self._departure.discard(self._left)


def watch_disconnect(
    scope: Scope, receive: Receive, on_disconnect: Callable[[], Awaitable[bool]]
) -> DisconnectWatch | DepartureWatch:
    """For a request not streamed: a DepartureWatch under the gateway's edge, else a DisconnectWatch."""
    departure = departure_of(scope)
    if departure is None:
        return DisconnectWatch(receive, on_disconnect)
    return DepartureWatch(departure, on_disconnect)
