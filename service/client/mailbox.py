"""The mailbox of one submission: what it hears, in arrival order, read by that submission alone.

One reader takes every item ready at once (a reader that handles the items ready together
wakes once for them), at most :data:`TAKE_BYTES` of replies a time once that many wait, so a
reader that comes back after a stall takes its backlog in pieces of bounded size. It counts the
replies not taken yet (:attr:`Mailbox.unread`, in bytes as they sit in memory: each reply's
body plus :data:`ITEM_BYTES`), which is what a stream's flow control reads
(:mod:`service.client.flow`): a mailbox with a :class:`Watcher` calls it when ``unread`` passes
:attr:`Mailbox.alarm` (as a reply arrives) and when it falls to :attr:`Mailbox.release_at` (as
the reader takes). Without a watcher both marks are out of reach, so a submission that is not
a stream pays two comparisons per reply.
"""

from __future__ import annotations

import asyncio
import sys
from collections import deque
from typing import Protocol

# What one reply's body costs beyond its bytes: the bytes object's header and the deque's slot.
ITEM_BYTES = 48
# Bytes of replies one take hands over at most, once more than that wait (at least one reply).
TAKE_BYTES = 64 * 1024
NEVER = sys.maxsize  # an alarm no mailbox reaches
NOT_HELD = -1  # a release mark no mailbox falls to


class Watcher(Protocol):
    def filled(self, unread: int) -> None:
        """``unread`` passed the alarm mark (a reply just arrived)."""

    def drained(self, unread: int) -> None:
        """``unread`` fell to the release mark (the reader just took)."""


class Mailbox:
    __slots__ = ("_items", "_loop", "_waiter", "alarm", "deadline", "release_at", "unread", "watcher")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._items: deque[object] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._loop = loop
        self.deadline: dict[bytes, Mailbox] | None = None  # the deadline bucket it waits in
        self.unread = 0  # bytes of the replies not taken yet (ITEM_BYTES more each)
        self.alarm = NEVER  # the watcher hears when unread passes this
        self.release_at = NOT_HELD  # the watcher hears when unread falls to this
        self.watcher: Watcher | None = None

    def put_reply(self, body: bytes) -> None:
        """A reply's body (empty: the end-of-stream marker), counted in ``unread``."""
        self._items.append(body)
        unread = self.unread = self.unread + len(body) + ITEM_BYTES
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if unread > self.alarm and self.watcher is not None:
            self.watcher.filled(unread)

    def put_nowait(self, item: object) -> None:
        """A marker (reconnected, expired, a lost replica, ...): it counts nothing."""
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def newest(self) -> object | None:
        """The item that arrived last, if any is waiting."""
        return self._items[-1] if self._items else None

    def starving(self) -> bool:
        """Whether the reader waits and nothing is there for it."""
        return not self._items and self._waiter is not None

    def discard(self) -> None:
        """Forget every item waiting (a stream given up: its replies will never be read)."""
        self._items.clear()
        self.unread = 0

    async def take(self) -> list[object]:
        """Everything queued, in arrival order (at most about :data:`TAKE_BYTES` of replies),
        waiting for the first item if there is none."""
        items = self._items
        while not items:
            waiter = self._waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        if self.unread > TAKE_BYTES:
            taken = self._take_some()
        else:
            self.unread = 0
            if len(items) == 1:
                taken = [items.popleft()]
            else:
                taken = list(items)
                items.clear()
        if self.unread <= self.release_at and self.watcher is not None:
            self.watcher.drained(self.unread)
        return taken

    def _take_some(self) -> list[object]:
        """The oldest items, up to the first that brings the replies taken to TAKE_BYTES."""
        items = self._items
        taken: list[object] = []
        size = 0
        while items and size < TAKE_BYTES:
            item = items.popleft()
            taken.append(item)
            if isinstance(item, bytes):
                size += len(item) + ITEM_BYTES
        self.unread -= size
        return taken
