"""The handler registry: one decorated function per message header.

Extension contract: to support a new message, write
``async def handle_x(coordinator, sender, payload: SomeStruct) -> bool | None`` and decorate it
with ``@message_handler("x")``. The payload type is read from the ``payload`` annotation and
the body arrives already decoded into it. The coordinator subscribes to ``<prefix>.x`` because
the header is in the registry; its event loop never changes. A truthy return stops the loop.
Registering a header twice is an error at import time.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from service.protocol.codec import PayloadDecoder

if TYPE_CHECKING:
    from service.coordinator.coordinator import Coordinator, Sender

HandlerFn = Callable[["Coordinator", "Sender", Any], Awaitable[bool | None]]


@dataclass(frozen=True, slots=True)
class HandlerSpec:
    header: str
    fn: HandlerFn
    decoder: PayloadDecoder


class HandlerRegistry(Mapping[str, HandlerSpec]):
    def __init__(self, specs: Mapping[str, HandlerSpec] | None = None) -> None:
        self._specs: dict[str, HandlerSpec] = dict(specs or {})

    def message_handler(self, *headers: str) -> Callable[[HandlerFn], HandlerFn]:
        """Register ``fn`` as the handler of each header in ``headers``."""
        if not headers:
            raise ValueError("message_handler needs at least one header")

        def register(fn: HandlerFn) -> HandlerFn:
            payload_type = _payload_type(fn)
            if payload_type is None:
                raise TypeError(f"{fn.__qualname__} must annotate its payload parameter with a message type")
            decoder = PayloadDecoder(payload_type)
            for header in headers:
                key = str(header)
                if key in self._specs:
                    raise ValueError(f"duplicate handler for header {key!r}: {self._specs[key].fn.__qualname__}")
                self._specs[key] = HandlerSpec(key, fn, decoder)
            return fn

        return register

    def copy(self) -> HandlerRegistry:
        return HandlerRegistry(self._specs)

    def __getitem__(self, header: str) -> HandlerSpec:
        return self._specs[header]

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)


def _payload_type(fn: HandlerFn) -> type | None:
    """The ``payload`` annotation, resolved alone so handlers may import Coordinator for typing only."""
    annotation = getattr(fn, "__annotations__", {}).get("payload")
    if isinstance(annotation, str):
        annotation = eval(annotation, fn.__globals__)  # noqa: S307 - a type name from our own source
    return annotation


HANDLERS = HandlerRegistry()
message_handler = HANDLERS.message_handler
