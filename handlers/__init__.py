"""Message handlers of the coordinator, one per header; importing this package registers them all.

See :mod:`handlers.registry` for the extension contract. The command line hands
:data:`HANDLERS` to the coordinator; the coordinator itself never imports this package.
"""

from handlers import client, control, engine, replica, weights  # noqa: F401  (registration on import)
from handlers.registry import HANDLERS, message_handler

__all__ = ["HANDLERS", "message_handler"]
