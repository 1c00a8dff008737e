"""Broadcast a signal to every engine and collect their confirmations, so control is acknowledged."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from service.protocol.codec import msgpack_decoder
from service.protocol.routed import EngineAck

log = logging.getLogger(__name__)
_ack_decoder = msgpack_decoder(EngineAck)


@dataclass(slots=True)
class BroadcastResult:
    acks: dict[str, EngineAck] = field(default_factory=dict)
    missing: set[str] = field(default_factory=set)

    @property
    def failed(self) -> dict[str, str]:
        return {engine_id: ack.detail for engine_id, ack in self.acks.items() if not ack.ok}


async def broadcast(nc: NATS, subject: str, body: bytes, expected: set[str], timeout_s: float) -> BroadcastResult:
    """Publish ``body`` on ``subject`` and wait until every engine in ``expected`` confirmed it,
    or ``timeout_s`` passed; ``missing`` names the engines that stayed silent."""
    result = BroadcastResult()
    all_confirmed = asyncio.Event()

    async def on_ack(msg: Msg) -> None:
        try:
            ack = _ack_decoder.decode(msg.data)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            log.warning("undecodable confirmation on %s: %s", subject, exc)
            return
        if ack.engine_id in expected:
            result.acks[ack.engine_id] = ack
            if expected.issubset(result.acks):
                all_confirmed.set()

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=on_ack)
    try:
        await nc.publish(subject, body, reply=inbox)
        if expected:
            try:
                await asyncio.wait_for(all_confirmed.wait(), timeout_s)
            except TimeoutError:
                pass
    finally:
        await sub.unsubscribe()
    result.missing = expected.difference(result.acks)
    return result
