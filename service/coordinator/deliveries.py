"""Replies on their way to clients, batched per client where it reads batches, held while NATS is down.

Inside :meth:`ClientDeliveries.batching` (the relay opens one per engine reply message), a
reply published with ``batched`` waits, and when the block ends the waiting replies leave as
reply batches (:mod:`service.protocol.reply_batches`): one message per client batch subject and
``max_payload``, a lone reply to its own subject, each client's in the order published. A batch
that fails to publish is logged and counted (``reply_batches_lost``), and the others still leave.

While the coordinator's connection is down, and for a grace period after it is back, replies
wait here in order, so that clients have re-subscribed their inboxes before replies reach
them. A held reply of a named client follows that client's resubmission to its new reply
subject instead of being sent twice.

What is held is bounded by ``max_bytes`` (bodies and subjects): beyond it the oldest held
replies are dropped and counted; a named client gets a dropped terminal reply again from the
result cache when it resubmits. A reply that fails to publish on release is logged and
skipped: the others still leave, and delivery opens again whatever happens.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from dataclasses import dataclass

from nats.aio.client import Client as NATS

from service.bus.batches import split_batches
from service.coordinator.requests import ClientKey
from service.ops.log_limit import RateLimitedLog
from service.protocol.reply_batches import BATCH_TOKEN, ReplyBatch, encode_batch, pair_size

log = logging.getLogger(__name__)

# Bytes a held reply costs besides its body and subject.
HELD_OVERHEAD = 100


@dataclass(slots=True, eq=False)
class HeldDelivery:
    subject: str
    body: bytes
    client_key: ClientKey | None

    @property
    def size(self) -> int:
        return len(self.body) + len(self.subject) + HELD_OVERHEAD


class ClientDeliveries:
    def __init__(self, nc: NATS, counters: Counter[str] | None = None, max_bytes: int = 64 * 1024 * 1024) -> None:
        self._nc = nc
        self._counters = counters if counters is not None else Counter()
        self._max_bytes = max_bytes
        self._open = True
        self._held: deque[HeldDelivery] = deque()
        self._held_by_client: dict[ClientKey, list[HeldDelivery]] = {}
        self._held_bytes = 0
        self._failures = RateLimitedLog(log)
        self._batches: dict[str, ReplyBatch] | None = None  # inside batching(): pairs by reply subject prefix

    async def publish(self, subject: str, body: bytes, client_key: ClientKey | None, batched: bool = False) -> None:
        """Send ``body`` to ``subject``; ``batched``: its client reads reply batches."""
        if self._open:
            batches = self._batches
            if batched and batches is not None:
                prefix, _, token = subject.rpartition(".")
                pairs = batches.get(prefix)
                if pairs is None:
                    pairs = batches[prefix] = []
                pairs.append((token.encode(), body))
                return
            await self._nc.publish(subject, body)
            return
        delivery = HeldDelivery(subject, body, client_key)
        self._held.append(delivery)
        self._held_bytes += delivery.size
        if client_key is not None:
            self._held_by_client.setdefault(client_key, []).append(delivery)
        while self._held_bytes > self._max_bytes and self._held:
            self._drop_oldest()

    def batching(self) -> Batching:
        """Batched replies published inside the block leave as reply batches when it ends (a block
        inside another one joins it)."""
        return Batching(self)

    def open_batches(self) -> bool:
        """Start collecting batched replies; False when a block already collects them."""
        if self._batches is not None:
            return False
        self._batches = {}
        return True

    async def send_batches(self) -> None:
        """Send what was collected since :meth:`open_batches`, and publish directly again."""
        batches, self._batches = self._batches or {}, None
        max_payload = self._nc.max_payload
        for prefix, pairs in batches.items():
            for group in split_batches(pairs, pair_size, max_payload):
                if len(group) == 1 or not self._open:  # a lone reply, or NATS went down meanwhile: each alone
                    for token, body in group:
                        await self.publish(f"{prefix}.{token.decode()}", body, None)
                    continue
                try:
                    await self._nc.publish(f"{prefix}.{BATCH_TOKEN}", encode_batch(group))
                except Exception as exc:
                    self._counters["reply_batches_lost"] += 1
                    self._failures.warning(
                        "reply batch of %d to %s.%s not sent: %s", len(group), prefix, BATCH_TOKEN, exc
                    )

    def _drop_oldest(self) -> None:
        dropped = self._held.popleft()
        self._held_bytes -= dropped.size
        self._counters["held_replies_dropped"] += 1
        if dropped.client_key is not None:
            held = self._held_by_client.get(dropped.client_key)
            if held is not None:
                held.pop(0)  # a client's held replies are in order too: its oldest is this one
                if not held:
                    del self._held_by_client[dropped.client_key]

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
        try:
            while self._held:
                delivery = self._held.popleft()
                self._held_bytes -= delivery.size
                try:
                    await self._nc.publish(delivery.subject, delivery.body)
                except Exception as exc:
                    self._counters["held_replies_dropped"] += 1
                    self._failures.warning("held reply to %s not delivered: %s", delivery.subject, exc)
        finally:
            self._held_by_client.clear()
            self._open = True


class Batching:
    """The block of :meth:`ClientDeliveries.batching` (a class: the relay opens one per engine
    message, and a generator-based context manager costs several times as much)."""

    __slots__ = ("_deliveries", "_outer")

    def __init__(self, deliveries: ClientDeliveries) -> None:
        self._deliveries = deliveries
        self._outer = False

    async def __aenter__(self) -> None:
        self._outer = self._deliveries.open_batches()

    async def __aexit__(self, *exc_info: object) -> None:
        if self._outer:
            await self._deliveries.send_batches()
