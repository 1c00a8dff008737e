"""RecordingBus: a test double of the coordinator's connection, for unit tests of its jobs
without a NATS server.

It is a :class:`service.bus.direct.DirectClient` that never connects and stands in for the
methods the jobs call on it: ``publish`` (recorded, in order), ``request`` and the
``new_inbox``/``subscribe`` pair a broadcast uses (answered by responders a test registers,
as engines or peers would answer), ``flush`` (a no-op), ``max_payload`` and
``is_connected``. Everything the jobs publish is in :attr:`RecordingBus.published`;
integration tests keep the real server (tests/conftest.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from nats.aio.msg import Msg
from nats.errors import NoRespondersError

from service.bus.direct import DirectClient

# A responder answers a message published on its subject: the bodies of its replies.
Responder = Callable[[bytes], list[bytes]]


@dataclass(frozen=True, slots=True)
class Published:
    subject: str
    body: bytes
    reply: str = ""

    def decode(self, type: Any = Any) -> Any:
        """The body as msgpack (the coordinator's encoding towards engines and peers)."""
        return msgspec.msgpack.decode(self.body, type=type)

    def json(self) -> Any:
        return msgspec.json.decode(self.body)


class _Subscription:
    def __init__(self, bus: RecordingBus, subject: str) -> None:
        self._bus = bus
        self.subject = subject

    async def unsubscribe(self) -> None:
        self._bus.subscribers.pop(self.subject, None)


class RecordingBus(DirectClient):
    """Test double: records publishes instead of sending them (see the module docstring)."""

    def __init__(self, max_payload: int = 1024 * 1024) -> None:
        super().__init__()
        self.published: list[Published] = []
        self.responders: dict[str, Responder] = {}
        self.subscribers: dict[str, Callable[[Msg], Awaitable[None]]] = {}
        self.connected = True
        self.refusals: dict[str, Exception] = {}  # subject prefix -> what a publish there raises
        self._max_payload_double = max_payload
        self._inboxes = itertools.count()

    # ------------------------------------------------------------ what the jobs call

    @property
    def max_payload(self) -> int:
        return self._max_payload_double

    @property
    def is_connected(self) -> bool:
        return self.connected

    @property
    def is_reconnecting(self) -> bool:
        return False

    def new_inbox(self) -> str:
        return f"_INBOX.double.{next(self._inboxes)}"

    async def subscribe(self, subject: str, queue: str = "", cb: Any = None, **_: Any) -> Any:  # type: ignore[override]
        self.subscribers[subject] = cb
        return _Subscription(self, subject)

    async def publish(
        self, subject: str, payload: bytes = b"", reply: str = "", headers: dict[str, str] | None = None
    ) -> None:
        for prefix, refusal in self.refusals.items():
            if subject.startswith(prefix):
                raise refusal
        self.published.append(Published(subject, payload, reply))
        responder = self.responders.get(subject)
        if responder is not None and reply:
            callback = self.subscribers.get(reply)
            for answer in responder(payload):
                if callback is not None:
                    await callback(Msg(self, subject=reply, data=answer))

    async def request(  # type: ignore[override]
        self, subject: str, payload: bytes = b"", timeout: float = 0.5, **_: Any
    ) -> Msg:
        self.published.append(Published(subject, payload, "_INBOX.request"))
        responder = self.responders.get(subject)
        answers = responder(payload) if responder is not None else []
        if not answers:
            raise NoRespondersError
        return Msg(self, subject="_INBOX.request", data=answers[0])

    async def flush(self, timeout: int = 10) -> None:
        return None

    # ------------------------------------------------------------ what tests read

    def on(self, subject: str) -> list[Published]:
        """What was published on ``subject``, in order."""
        return [message for message in self.published if message.subject == subject]

    def to(self, prefix: str) -> list[Published]:
        """What was published on subjects starting with ``prefix`` (an inbox), in order."""
        return [message for message in self.published if message.subject.startswith(prefix)]
