"""A registry of message handlers, one per header: the dispatch pattern of the coordinator and
of the engine runtime.

Extension contract: to serve a new message, write
``async def handle_x(context, incoming: Incoming, payload: SomeStruct) -> None`` and decorate it
with ``@registry.message_handler("x")``. The payload type is read from the ``payload``
annotation and the body arrives already decoded into it. How the subscriber receives the
header is declared on the same decorator, so a new header touches one file:

- ``fanout=True``: every subscriber gets the message (no queue group), for messages that each
  coordinator replica must see; otherwise replicas share the subject in a queue group.
- ``direct=True``: handled on nats-py's reading task (:mod:`service.bus.direct`), for the hot
  path; such a handler must never wait for another NATS message.
- ``per_sender=True``: served on ``<header>.<sender>`` (a subscriber listens on ``<header>.*``)
  instead of ``<header>``: the subject's last token names the sender, and NATS permissions can
  let each sender publish only as itself. The handler reads it from :attr:`Incoming.sender`.
- ``addressed=True``: served on ``<header>.<own id>`` alone (no queue group), for messages one
  coordinator replica sends another.
- ``per_replica=True``: served in the queue group and also on ``<header>.<own id>`` (no queue
  group), for clients that address one replica (the arbiter of a submission's id).

Registering a header twice is an error at import time.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from service.protocol.codec import Encoding, PayloadDecoder

Context = TypeVar("Context")


@dataclass(slots=True)  # not frozen: a frozen dataclass is slower to build, and one is built per message
class Incoming:
    """A received message: its header, the NATS reply subject (None when the sender gave none),
    the encoding detected from its body, the body itself, the sender named by the subject
    (``per_sender`` headers), the inbox prefix that owns the reply subject (coordinator) and
    the raw NATS header block of a message handled on the reading task (``direct`` headers;
    None otherwise, and without one)."""

    header: str
    reply: str | None
    encoding: Encoding
    body: bytes
    sender: str | None = None
    owner: str | None = None
    headers: bytes | None = None


@dataclass(frozen=True, slots=True)
class HandlerSpec(Generic[Context]):
    """One header's handler. Its payload is typed ``Any`` here because the registry holds
    handlers of every payload type; each receives the type its own annotation names, since
    ``decoder`` is built from that annotation."""

    header: str
    fn: Callable[[Context, Incoming, Any], Awaitable[None]]
    decoder: PayloadDecoder
    fanout: bool
    direct: bool
    per_sender: bool = False
    addressed: bool = False
    per_replica: bool = False


class HandlerRegistry(Mapping[str, HandlerSpec[Context]], Generic[Context]):
    """Header → handler spec; ``Context`` is what the handlers receive as their first argument,
    so mypy checks both that each handler asks no more of it than its protocol says, and that
    the dispatcher passes an object providing every one."""

    def __init__(self, specs: Mapping[str, HandlerSpec[Context]] | None = None) -> None:
        self._specs: dict[str, HandlerSpec[Context]] = dict(specs or {})

    def message_handler(
        self,
        *headers: str,
        fanout: bool = False,
        direct: bool = False,
        per_sender: bool = False,
        addressed: bool = False,
        per_replica: bool = False,
    ) -> Callable[
        [Callable[[Context, Incoming, Any], Awaitable[None]]], Callable[[Context, Incoming, Any], Awaitable[None]]
    ]:
        """Register the decorated function as the handler of each header in ``headers``."""
        if not headers:
            raise ValueError("message_handler needs at least one header")

        def register(
            fn: Callable[[Context, Incoming, Any], Awaitable[None]],
        ) -> Callable[[Context, Incoming, Any], Awaitable[None]]:
            payload_type = inspect.get_annotations(fn, eval_str=True).get("payload")
            if payload_type is None:
                raise TypeError(
                    f"{getattr(fn, '__qualname__', fn)} must annotate its payload parameter with a message type"
                )
            decoder = PayloadDecoder(payload_type)
            for header in headers:
                key = str(header)
                if key in self._specs:
                    raise ValueError(
                        f"duplicate handler for header {key!r}: {getattr(self._specs[key].fn, '__qualname__', key)}"
                    )
                self._specs[key] = HandlerSpec(key, fn, decoder, fanout, direct, per_sender, addressed, per_replica)
            return fn

        return register

    def copy(self) -> HandlerRegistry[Context]:
        return HandlerRegistry(self._specs)

    def __getitem__(self, header: str) -> HandlerSpec[Context]:
        return self._specs[header]

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)
