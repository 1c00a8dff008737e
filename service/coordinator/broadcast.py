"""Broadcast a signal to every engine and collect their confirmations, so control is acknowledged."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
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


# How often a broadcast that may stop waiting for engines that left asks whether they did.
RECHECK_S = 0.1


async def broadcast(
    nc: NATS,
    subject: str,
    body: bytes,
    expected: set[str],
    timeout_s: float,
    still_expected: Callable[[str], bool] | None = None,
) -> BroadcastResult:
    """Publish ``body`` on ``subject`` and wait until every engine in ``expected`` confirmed it,
    or ``timeout_s`` passed; ``missing`` names the engines that stayed silent. With
    ``still_expected``, an engine it says no to (one that left the pool, found dead) is waited
    for no more, nor named missing: its silence would otherwise cost the whole timeout."""
    result = BroadcastResult()
    all_confirmed = asyncio.Event()
    expected = set(expected)

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
            await _confirmed(all_confirmed, timeout_s, expected, result, still_expected)
    finally:
        await sub.unsubscribe()
    result.missing = expected.difference(result.acks)
    return result


async def _confirmed(
    all_confirmed: asyncio.Event,
    timeout_s: float,
    expected: set[str],
    result: BroadcastResult,
    still_expected: Callable[[str], bool] | None,
) -> None:
    """Until every engine still expected confirmed, or ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (left := deadline - loop.time()) > 0:
        try:
            await asyncio.wait_for(all_confirmed.wait(), left if still_expected is None else min(left, RECHECK_S))
            return
        except TimeoutError:
            if still_expected is None:
                return
        expected.difference_update([engine_id for engine_id in expected if not still_expected(engine_id)])
        if expected.issubset(result.acks):
            return
