"""Replies on their way to clients, held while NATS is down.

While the coordinator's connection is down, and for a grace period after it is back, replies
wait here in order, so that clients have re-subscribed their inboxes before replies reach
them. A held reply of a named client follows that client's resubmission to its new reply
subject instead of being sent twice.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from nats.aio.client import Client as NATS

from service.coordinator.requests import ClientKey

log = logging.getLogger(__name__)


@dataclass(slots=True)
class HeldDelivery:
    subject: str
    body: bytes
    client_key: ClientKey | None


class ClientDeliveries:
    def __init__(self, nc: NATS) -> None:
        self._nc = nc
        self._open = True
        self._held: deque[HeldDelivery] = deque()
        self._held_by_client: dict[ClientKey, list[HeldDelivery]] = {}

    async def publish(self, subject: str, body: bytes, client_key: ClientKey | None) -> None:
        if self._open:
            await self._nc.publish(subject, body)
            return
        delivery = HeldDelivery(subject, body, client_key)
        self._held.append(delivery)
        if client_key is not None:
            self._held_by_client.setdefault(client_key, []).append(delivery)

    def repoint(self, client_key: ClientKey, subject: str) -> bool:
        """Send what is held for ``client_key`` to ``subject`` instead; False if nothing is held."""
        held = self._held_by_client.get(client_key)
        if held is None:
            return False
        for delivery in held:
            delivery.subject = subject
        return True

    def hold(self) -> None:
        self._open = False

    async def release(self) -> None:
        """Publish everything held, in order, then deliver directly again."""
        log.info("delivering %d replies held across the NATS reconnect", len(self._held))
        while self._held:
            delivery = self._held.popleft()
            await self._nc.publish(delivery.subject, delivery.body)
        self._held_by_client.clear()
        self._open = True
