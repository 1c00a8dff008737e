"""The owners (inbox prefixes) that sent ``connect``: only they may ask for ``shutdown``.

Every replica sees every ``connect`` (fan-out), so any replica can answer a shutdown. Bounded:
the least recently connected are forgotten beyond :data:`MAX_KNOWN_CLIENTS`.
"""

from __future__ import annotations

from collections import OrderedDict

from service.protocol.errors import ErrorCode, WireError

MAX_KNOWN_CLIENTS = 10_000


class KnownClients:
    def __init__(self, limit: int = MAX_KNOWN_CLIENTS) -> None:
        self._limit = limit
        self._owners: OrderedDict[str, None] = OrderedDict()

    def connected(self, owner: str | None) -> None:
        if owner is None:
            return
        owners = self._owners
        owners[owner] = None
        owners.move_to_end(owner)
        if len(owners) > self._limit:
            owners.popitem(last=False)

    def check_shutdown(self, owner: str | None) -> None:
        """Raises 403 unless ``owner`` connected."""
        if owner is None or owner not in self._owners:
            raise WireError(
                ErrorCode.FORBIDDEN, "shutdown is honoured only from a client that connected (send connect first)"
            )
