"""KvEngineDouble: a test double of an engine with a prefix cache, on raw nats-py, speaking
the KV events of docs/protocol.md (*KV events*) with what a test makes it hold, and losing
events on the way when a test says so (the engine runtime's real events are tested with echo
and torch engines).

It registers and heartbeats with ``kv_sequence``, answers ``kv_snapshot`` with what the test
made it hold, publishes one numbered KV event per :meth:`KvEngineDouble.hold` (optionally as if
some were lost on the way), and answers every routed request at once with a final naming
itself, so a test reads from the final which engine the coordinator chose. It generates
nothing: it is no engine, only the wire of one.
"""

from __future__ import annotations

import asyncio

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from service.protocol.codec import Encoding, encode, encode_msgpack
from service.protocol.kv_events import HeldPrefix, KvEvents, KvSnapshot
from service.protocol.membership import EngineDisconnect, EngineRegister, Heartbeat
from service.protocol.messages import Final
from service.protocol.prefix import prefix_hashes
from service.protocol.routed import EngineReplyBatch, RoutedReply, RoutedRequestBatch
from service.protocol.subjects import KV_SNAPSHOT, Header, Subjects

_batch_decoder = msgspec.msgpack.Decoder(RoutedRequestBatch)


def prefix_ends(hashes: list[int], prompt_blocks: int) -> list[int]:
    """The length in blocks of each prefix hash: 1, 2, 4, ..., then the prompt's last whole block."""
    return [1 << index for index in range(len(hashes) - 1)] + [prompt_blocks][: len(hashes)]


class KvEngineDouble:
    def __init__(self, nc: NATS, prefix: str, engine_id: str, capacity: int = 64, interval_s: float = 0.2) -> None:
        self._nc = nc
        self._subjects = Subjects(prefix)
        self.engine_id = engine_id
        self._capacity = capacity
        self._interval_s = interval_s
        self.held: dict[int, int] = {}  # prefix hash -> blocks
        self.sequence = 0
        self.snapshots = 0  # kv_snapshot questions answered
        self._subscription: Subscription | None = None
        self._beats: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Subscribe, register (with ``kv_sequence``) and heartbeat from now on."""
        self._subscription = await self._nc.subscribe(
            self._subjects.engine_wildcard(self.engine_id), cb=self._on_routed
        )
        await self._nc.flush()
        register = EngineRegister(self.engine_id, self._capacity, backend="kv-double", kv_sequence=self.sequence)
        await self._nc.request(
            self._subjects.sent_by(Header.REGISTER, self.engine_id), encode_msgpack(register), timeout=5
        )
        self._beats = asyncio.create_task(self._heartbeats())

    async def stop(self) -> None:
        if self._beats is not None:
            self._beats.cancel()
        if self._subscription is not None:
            await self._subscription.unsubscribe()
        body = encode_msgpack(EngineDisconnect(self.engine_id, "test over"))
        await self._nc.publish(self._subjects.sent_by(Header.DISCONNECT, self.engine_id), body)

    async def hold(self, prompt: list[int], lost: int = 0) -> None:
        """From now on it holds every prefix of ``prompt``: one KV event, numbered after
        ``lost`` events that never reached anyone."""
        hashes = prefix_hashes(prompt)
        stored = [
            HeldPrefix(prefix_hash, blocks)
            for prefix_hash, blocks in zip(hashes, prefix_ends(hashes, len(prompt) // 16), strict=True)
            if prefix_hash not in self.held
        ]
        self.held.update((item.prefix_hash, item.blocks) for item in stored)
        self.sequence += 1 + lost
        event = KvEvents(self.engine_id, self.sequence, stored)
        await self._nc.publish(self._subjects.sent_by(Header.KV_EVENTS, self.engine_id), encode_msgpack(event))

    async def _heartbeats(self) -> None:
        subject = self._subjects.sent_by(Header.HEARTBEAT, self.engine_id)
        while True:
            beat = Heartbeat(self.engine_id, 0, self._capacity, [], kv_sequence=self.sequence)
            await self._nc.publish(subject, encode_msgpack(beat))
            await asyncio.sleep(self._interval_s)

    async def _on_routed(self, msg: Msg) -> None:
        header = self._subjects.header_of(msg.subject)
        if header == KV_SNAPSHOT:
            self.snapshots += 1
            held = [HeldPrefix(prefix_hash, blocks) for prefix_hash, blocks in self.held.items()]
            await msg.respond(encode_msgpack(KvSnapshot(self.engine_id, self.sequence, held)))
        elif header == Header.SUBMIT_REQUEST:
            replies = []
            for routed in _batch_decoder.decode(msg.data).requests:
                path = routed.return_path
                final = Final(path.request_id, path.client_request_id, self.engine_id, [1], "x", "length")
                replies.append(RoutedReply(path, encode(final, Encoding(path.encoding)), attempt=routed.attempt))
            body = encode_msgpack(EngineReplyBatch(self.engine_id, replies))
            await self._nc.publish(self._subjects.sent_by(Header.ENGINE_REPLY, self.engine_id), body)
