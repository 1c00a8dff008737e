"""Publishes that NATS refused, so a caller stops waiting for a reply that cannot come.

NATS answers a publish its permissions forbid with an asynchronous ``-ERR 'Permissions
Violation for Publish to "<subject>"'``, which nats-py hands to the connection's error
callback (lower-cased) and nothing else: the caller would otherwise wait out its timeout. A
caller watches the subject it publishes to and is told, with a message naming the subject, if
NATS refuses it. A refused subscription (say, to the reply inbox) is told to every watcher,
since no reply can arrive on that connection, unless it was marked optional: one the caller
does without (the client library's watch on coordinator heartbeats, which some NATS users
may not read), logged once instead.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_VIOLATION = re.compile(r'permissions violation for (publish|subscription) to "([^"]*)"', re.IGNORECASE)

OnRefused = Callable[[str], object]
log = logging.getLogger(__name__)


class PublishRefusals:
    def __init__(self) -> None:
        self._watchers: dict[str, list[OnRefused]] = {}
        self._optional: dict[str, str] = {}  # lower-cased subject -> what goes without it

    def optional(self, subject: str, without: str) -> None:
        """A subscription to ``subject`` that NATS may refuse without harm to any reply:
        ``without`` says what goes missing, in the one warning logged then."""
        self._optional[subject.lower()] = without

    @contextmanager
    def watch(self, subject: str, on_refused: OnRefused) -> Iterator[None]:
        """Call ``on_refused(message)`` if NATS refuses a publish to ``subject`` while the block
        runs; enter the block before publishing."""
        key = subject.lower()
        self._watchers.setdefault(key, []).append(on_refused)
        try:
            yield
        finally:
            watchers = self._watchers[key]
            watchers.remove(on_refused)
            if not watchers:
                del self._watchers[key]

    async def on_error(self, exc: Exception) -> None:
        """The connection's error listener."""
        match = _VIOLATION.search(str(exc))
        if match is None:
            return
        operation, subject = match.groups()
        if operation.lower() == "publish":
            message = f"NATS refused the publish to {subject}: permissions violation"
            told = list(self._watchers.get(subject.lower(), ()))
        elif (without := self._optional.pop(subject.lower(), None)) is not None:
            log.warning("NATS refused the subscription to %s (permissions violation): %s", subject, without)
            return
        else:
            message = f"NATS refused the subscription to {subject}: permissions violation, so no reply can arrive"
            told = [watcher for watchers in self._watchers.values() for watcher in watchers]
        for on_refused in told:
            on_refused(message)
