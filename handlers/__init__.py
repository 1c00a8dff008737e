"""Message handlers of the coordinator, one per header; importing this package registers them all.

See :mod:`handlers.registry` for the extension contract.
"""

from handlers.registry import HANDLERS, HandlerRegistry, message_handler
from handlers import client, control, engine  # noqa: F401  (registration on import)

__all__ = ["HANDLERS", "HandlerRegistry", "message_handler"]
