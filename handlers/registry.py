"""The coordinator's handler registry: one decorated function per message header.

Extension contract: to serve a new message, write
``async def handle_x(coordinator: SomeContext, incoming: Incoming, payload: SomeStruct) -> None``
in a module of this package and decorate it with ``@message_handler("x")`` (plus
``fanout=True`` / ``direct=True`` for its delivery mode, see :mod:`service.bus.registry`). The
coordinator subscribes to ``<prefix>.x`` because the header is in the registry it is given;
its event loop never changes. ``SomeContext`` is one of the narrow protocols of
:mod:`handlers.context`: all a handler may ask of the coordinator.
"""

from __future__ import annotations

from handlers.context import CoordinatorContext
from service.bus.registry import HandlerRegistry

HANDLERS: HandlerRegistry[CoordinatorContext] = HandlerRegistry()
message_handler = HANDLERS.message_handler
