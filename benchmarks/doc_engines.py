"""Engines written from docs/protocol.md alone: no import from this project, msgpack by hand.

They serve two purposes. The fleet benchmark (benchmarks/fleet.py) runs thousands of them in
one process, light enough that the coordinator is what gets measured. The conformance test
(tests/test_conformance.py) runs a few against a real coordinator. Either way, a coordinator
that serves them serves any engine written from the documentation, and a mistake in the
documentation shows up as a failure here rather than in someone else's engine.

What an engine does, as the documentation says (everything it sends goes on
``<prefix>.<header>.<engine_id>``, the subject naming the sender):

- register on ``<prefix>.register.<engine_id>`` (a request) with ``{engine_id, capacity, backend,
  paused}``; the answer ``{coordinator_id, state, epoch}`` says whether to start paused;
- heartbeat ``{engine_id, load, capacity, active}`` on ``<prefix>.heartbeat.<engine_id>`` every interval;
- take routed requests from ``<prefix>.engine.<engine_id>.submit_request``: ``[[[route, body], ...]]``,
  where ``route`` is ``[request_id, coordinator_id, reply_to, encoding, stream,
  client_request_id, client_id]`` and ``body`` the client's submission in ``encoding``;
- answer with ``{engine_id, replies: [[route, body, seq], ...]}`` on ``<prefix>.engine_reply.<engine_id>``
  (finals and errors) and ``<prefix>.engine_reply_partial.<engine_id>`` (partials), each body the client's
  reply encoded in the route's encoding;
- abort on ``<prefix>.engine.<engine_id>.abort_request``; resend on ``...resend_replies``;
- confirm broadcasts on ``<prefix>.engines.<signal>`` with ``{engine_id, signal, ok, detail}``,
  applying a control signal only when its ``revision`` is newer than the last applied;
- leave with ``{engine_id, reason}`` on ``<prefix>.disconnect.<engine_id>``;
- with ``kv_events``, hold a prefix cache and publish its KV events (benchmarks/doc_prefix_cache.py).

Generation is the echo backend's rule: the n-th generated token is the prompt's token n mod its
length (a text prompt's tokens are its UTF-8 bytes); ``max_tokens`` defaults to 16. With
``token_delay_s`` 0 a request is answered as soon as it arrives, all its tokens at once;
otherwise every active request advances one token per step of that length.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgpack
import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from benchmarks.doc_prefix_cache import DocPrefixCache, prefixes

RECENT_FINALS_KEPT = 10_000


@dataclass(slots=True)
class Active:
    route: list[Any]
    prompt: list[int]
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    partials_sent: int = 0


@dataclass(slots=True)
class DocEngine:
    engine_id: str
    active: dict[str, Active] = field(default_factory=dict)
    paused: bool = False
    registered: bool = False
    revision: int | None = None  # of the shared control state last applied
    cache: DocPrefixCache | None = None  # with KV events

    def kv(self) -> dict[str, int]:
        """``kv_sequence`` for register and heartbeat, when it publishes KV events."""
        return {} if self.cache is None else {"kv_sequence": self.cache.sequence}


def _encode(message: dict[str, Any], encoding: str) -> bytes:
    if encoding == "json":
        return json.dumps(message).encode()
    return msgpack.packb(message)


def _decode_body(body: bytes, encoding: str) -> dict[str, Any]:
    if encoding == "json":
        return json.loads(body or b"{}")
    return msgpack.unpackb(body)


def _prompt_tokens(prompt: Any) -> list[int]:
    return list(prompt.encode()) if isinstance(prompt, str) else list(prompt)


def _text(tokens: list[int]) -> str:
    return bytes(token for token in tokens if token < 256).decode(errors="replace")


class DocEngineFleet:
    """Many engines on one NATS connection. ``start`` subscribes, ``register`` registers them
    all (each heartbeats from its acknowledgement on), ``leave`` disconnects them."""

    def __init__(
        self,
        nc: NATS,
        prefix: str,
        engine_ids: list[str],
        capacity: int = 256,
        heartbeat_interval_s: float = 1.0,
        token_delay_s: float = 0.0,
        cached_prompts: int = 0,
    ) -> None:
        """``cached_prompts``: with more than 0, each engine holds the prefixes of that many
        prompts and publishes KV events."""
        self.nc = nc
        self.prefix = prefix
        self.engines = {
            engine_id: DocEngine(engine_id, cache=DocPrefixCache(cached_prompts) if cached_prompts else None)
            for engine_id in engine_ids
        }
        self.capacity = capacity
        self.heartbeat_interval_s = heartbeat_interval_s
        self.token_delay_s = token_delay_s
        self.coordinator_ids: set[str] = set()
        self.signals: list[tuple[str, str, dict[str, Any]]] = []  # (engine_id, signal, payload) confirmed
        self.requests_served = 0
        self._recent: OrderedDict[str, list[Any]] = OrderedDict()  # request_id -> [route, body, seq] of its final
        self._tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        for engine_id in self.engines:
            await self.nc.subscribe(f"{self.prefix}.engine.{engine_id}.*", cb=self._on_routed)
        await self.nc.subscribe(f"{self.prefix}.engines.*", cb=self._on_broadcast)
        await self.nc.flush()
        if self.token_delay_s:
            self._tasks.append(asyncio.create_task(self._step_loop()))

    async def register(self, concurrency: int = 256, timeout_s: float = 30.0) -> None:
        """Register every engine (several registrations in flight at once)."""
        gate = asyncio.Semaphore(concurrency)
        self._tasks.append(asyncio.create_task(self._heartbeats()))

        async def one(engine: DocEngine) -> None:
            message = msgpack.packb(
                {"engine_id": engine.engine_id, "capacity": self.capacity, "backend": "doc", "paused": False}
                | engine.kv()
            )
            async with gate:
                subject = f"{self.prefix}.register.{engine.engine_id}"
                ack = msgpack.unpackb((await self.nc.request(subject, message, timeout=timeout_s)).data)
            self.coordinator_ids.add(ack["coordinator_id"])
            engine.paused = ack["state"] != "running"
            engine.revision = ack.get("revision")
            engine.registered = True

        await asyncio.gather(*(one(engine) for engine in self.engines.values()))

    async def leave(self, reason: str = "shutdown") -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for engine_id in self.engines:
            await self.nc.publish(
                f"{self.prefix}.disconnect.{engine_id}", msgpack.packb({"engine_id": engine_id, "reason": reason})
            )
        await self.nc.flush()

    async def _heartbeats(self) -> None:
        """Every registered engine once per interval, spread over it in ten slices."""
        engines = list(self.engines.values())
        slices = [engines[index::10] for index in range(10)]
        while True:
            for part in slices:
                started = time.monotonic()
                for engine in part:
                    if not engine.registered:
                        continue
                    beat = {
                        "engine_id": engine.engine_id,
                        "load": len(engine.active),
                        "capacity": self.capacity,
                        "active": list(engine.active),
                    } | engine.kv()
                    await self.nc.publish(f"{self.prefix}.heartbeat.{engine.engine_id}", msgpack.packb(beat))
                await asyncio.sleep(max(0.0, self.heartbeat_interval_s / 10 - (time.monotonic() - started)))

    # ------------------------------------------------------------ routed messages

    async def _on_routed(self, msg: Msg) -> None:
        _, _, rest = msg.subject.partition(".engine.")
        engine_id, _, header = rest.rpartition(".")
        engine = self.engines[engine_id]
        if header == "submit_request":
            [requests] = msgpack.unpackb(msg.data)
            await self._submit(engine, requests)
        elif header == "abort_request":
            await self._abort(engine, msgpack.unpackb(msg.data)["request_id"])
        elif header == "resend_replies":
            await self._resend(engine, msgpack.unpackb(msg.data)["request_ids"], msg.reply)
        elif header == "kv_snapshot" and engine.cache is not None and msg.reply:
            await self.nc.publish(msg.reply, msgpack.packb(engine.cache.snapshot(engine.engine_id)))

    async def _submit(self, engine: DocEngine, requests: list[list[Any]]) -> None:
        partials: list[list[Any]] = []
        finals: list[list[Any]] = []
        for route, body, *_ in requests:  # a retry or migration carries attempt and resume tokens after them
            request_id, encoding = route[0], route[3]
            try:
                submit = _decode_body(body, encoding)
                prompt = _prompt_tokens(submit["prompt"])
                max_tokens = (submit.get("sampling_params") or {}).get("max_tokens") or 16
            except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
                finals.append(self._error(route, 400, f"bad submission: {exc}", 0))
                continue
            self.requests_served += 1
            if engine.cache is not None:
                engine.cache.ran(prefixes(submit.get("prompt"), submit.get("messages")))
            active = Active(route, prompt, max_tokens)
            if self.token_delay_s:
                engine.active[request_id] = active
                continue
            while not self._advance(active):
                pass
            if route[4] and active.tokens:
                partials.append(self._partial(active, active.tokens))
            finals.append(self._final(engine, active, "length" if prompt else "stop"))
        await self._send(engine, "engine_reply_partial", partials)
        await self._send(engine, "engine_reply", finals)
        events = engine.cache.events(engine.engine_id) if engine.cache is not None else None
        if events is not None:
            await self.nc.publish(f"{self.prefix}.kv_events.{engine.engine_id}", msgpack.packb(events))

    async def _abort(self, engine: DocEngine, request_id: str) -> None:
        active = engine.active.pop(request_id, None)
        if active is not None:
            await self._send(engine, "engine_reply", [self._final(engine, active, "abort")])

    async def _resend(self, engine: DocEngine, request_ids: list[str], reply: str) -> None:
        again = [self._recent[request_id] for request_id in request_ids if request_id in self._recent]
        unknown = [
            request_id
            for request_id in request_ids
            if request_id not in self._recent and request_id not in engine.active
        ]
        await self._send(engine, "engine_reply", again, remember=False)
        if reply:
            await self.nc.publish(reply, msgpack.packb({"unknown": unknown}))

    async def _step_loop(self) -> None:
        while True:
            await asyncio.sleep(self.token_delay_s)
            for engine in self.engines.values():
                if engine.paused or not engine.active:
                    continue
                partials, finals = [], []
                for request_id, active in list(engine.active.items()):
                    before = len(active.tokens)
                    done = self._advance(active)
                    if active.route[4] and len(active.tokens) > before:
                        partials.append(self._partial(active, active.tokens[before:]))
                    if done:
                        del engine.active[request_id]
                        finals.append(self._final(engine, active, "length" if active.prompt else "stop"))
                await self._send(engine, "engine_reply_partial", partials)
                await self._send(engine, "engine_reply", finals)

    @staticmethod
    def _advance(active: Active) -> bool:
        """One token; True when the request is finished."""
        if not active.prompt:
            return True
        active.tokens.append(active.prompt[len(active.tokens) % len(active.prompt)])
        return len(active.tokens) >= active.max_tokens

    # ------------------------------------------------------------ replies

    def _partial(self, active: Active, new_tokens: list[int]) -> list[Any]:
        route = active.route
        message = {
            "type": "partial",
            "request_id": route[0],
            "client_request_id": route[5],
            "new_tokens": new_tokens,
            "text": _text(new_tokens),
        }
        reply = [route, _encode(message, route[3]), active.partials_sent]
        active.partials_sent += 1
        return reply

    def _final(self, engine: DocEngine, active: Active, finish_reason: str) -> list[Any]:
        route = active.route
        message = {
            "type": "final",
            "request_id": route[0],
            "client_request_id": route[5],
            "engine_id": engine.engine_id,
            "generated_tokens": active.tokens,
            "generated_text": _text(active.tokens),
            "finish_reason": finish_reason,
        }
        return [route, _encode(message, route[3]), active.partials_sent]

    def _error(self, route: list[Any], code: int, text: str, seq: int) -> list[Any]:
        message = {
            "type": "error",
            "error": {"code": code, "message": text},
            "client_request_id": route[5],
            "request_id": route[0],
        }
        return [route, _encode(message, route[3]), seq]

    async def _send(self, engine: DocEngine, header: str, replies: list[list[Any]], remember: bool = True) -> None:
        if not replies:
            return
        if remember and header == "engine_reply":
            for reply in replies:
                self._recent[reply[0][0]] = reply
            while len(self._recent) > RECENT_FINALS_KEPT:
                self._recent.popitem(last=False)
        payload = msgpack.packb({"engine_id": engine.engine_id, "replies": replies})
        await self.nc.publish(f"{self.prefix}.{header}.{engine.engine_id}", payload)

    # ------------------------------------------------------------ broadcasts

    async def _apply(self, engine: DocEngine, signal: str) -> str:
        if signal in ("pause", "suspend"):
            engine.paused = True
        elif signal == "unpause":
            engine.paused = False
        elif signal == "stop":
            engine.paused = True
            failed = [
                self._error(active.route, 503, f"engine {engine.engine_id} stopped", active.partials_sent)
                for active in engine.active.values()
            ]
            engine.active.clear()
            await self._send(engine, "engine_reply", failed)
            return f"{len(failed)} requests failed"
        return ""

    async def _on_broadcast(self, msg: Msg) -> None:
        signal = msg.subject.rpartition(".")[2]
        payload = msgpack.unpackb(msg.data) if msg.data else {}
        revision = payload.get("revision")
        for engine in self.engines.values():
            if revision is not None and engine.revision is not None and revision <= engine.revision:
                detail = f"superseded by revision {engine.revision}"  # a newer state was applied already
            else:
                if revision is not None:
                    engine.revision = revision
                detail = await self._apply(engine, signal)
            self.signals.append((engine.engine_id, signal, payload))
            if msg.reply:
                ack = {"engine_id": engine.engine_id, "signal": signal, "ok": True, "detail": detail}
                await self.nc.publish(msg.reply, msgpack.packb(ack))


async def _serve(args: argparse.Namespace) -> None:
    """A fleet as its own process, for the benchmark: registers, prints one line, heartbeats
    until SIGTERM, then leaves."""
    nc = await nats.connect(args.nats_url, name=f"doc-engines-{args.id_prefix}", pending_size=64 * 1024 * 1024)
    ids = [f"{args.id_prefix}{index}" for index in range(args.count)]
    fleet = DocEngineFleet(
        nc, args.prefix, ids, args.capacity, args.heartbeat_interval, cached_prompts=args.cached_prompts
    )
    await fleet.start()
    started = time.perf_counter()
    await fleet.register()
    print(f"registered {len(ids)} {time.perf_counter() - started:.6f}", flush=True)
    stopping = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopping.set)
    await stopping.wait()
    await fleet.leave()
    print(f"served {fleet.requests_served}", flush=True)
    await nc.drain()


def main() -> None:
    parser = argparse.ArgumentParser(description="Run many engines written from docs/protocol.md in this process")
    parser.add_argument("--nats-url", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--id-prefix", default="doc-")
    parser.add_argument("--capacity", type=int, default=256)
    parser.add_argument("--heartbeat-interval", type=float, default=1.0)
    parser.add_argument("--cached-prompts", type=int, default=0, help="with more than 0: KV events")
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.run(_serve(args))
    except ImportError:
        asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
