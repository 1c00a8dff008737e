"""Property-based: random bytes and random maps on every subject, coordinator's and engines',
after which the coordinator still serves a normal request and every reply was well formed."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import msgpack
import nats
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from engines.echo import EchoBackend
from engines.runtime import EngineRuntime
from handlers import HANDLERS
from service.coordinator.coordinator import Coordinator
from service.protocol.state import CoordinatorState
from service.protocol.subjects import COMMIT_WEIGHTS, DISCARD_WEIGHTS, ENGINE_HEADERS, PREPARE_WEIGHTS, Header
from tests.conftest import make_settings
from tests.helpers import decode_reply

T = TypeVar("T")
FIELD_NAMES = [
    "prompt",
    "sampling_params",
    "stream",
    "client_request_id",
    "client_id",
    "reply_to",
    "request_id",
    "epoch",
    "engine_id",
    "replies",
    "load",
    "capacity",
    "max_tokens",
    "temperature",
    "top_p",
    "route",
    "body",
]
REPLY_TYPES = {"partial", "final", "error", "ack", "connect_ack", "models"}

scalars = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=20)
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
maps = st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=10), values, max_size=6)
bodies = st.binary(max_size=256) | maps.map(lambda m: json.dumps(m).encode()) | maps.map(lambda m: msgpack.packb(m))


class LoopThread:
    """An event loop in a thread, so hypothesis (synchronous) can drive async services."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


class FuzzTarget:
    def __init__(self, nats_url: str) -> None:
        self.settings = make_settings(nats_url)
        self.coordinator = Coordinator(self.settings, HANDLERS)
        self.engines: list[EngineRuntime] = []
        self.replies: list[bytes] = []

    async def start(self) -> None:
        await self.coordinator.start()
        self.nc = await nats.connect(self.settings.nats_url)
        await self.nc.subscribe("_INBOX.fuzz.>", cb=self._on_reply)
        await self.add_engine()
        await self.add_engine()

    async def add_engine(self) -> None:
        engine = EngineRuntime(self.settings, EchoBackend())
        await engine.start()
        await asyncio.wait_for(engine.registered.wait(), 10)
        self.engines.append(engine)

    async def _on_reply(self, msg: Any) -> None:
        self.replies.append(msg.data)

    async def publish(self, subject: str, body: bytes, reply: str) -> None:
        await self.nc.publish(subject, body, reply=reply)

    async def recover_and_submit(self) -> dict[str, Any]:
        """Undo what valid control messages among the garbage did, then submit normally."""
        await self.nc.flush()
        client = self.nc
        prefix = self.settings.subject_prefix
        if self.coordinator.state is CoordinatorState.SUSPENDED:
            await client.request(f"{prefix}.resume", b"{}", timeout=10)
        if self.coordinator.state is CoordinatorState.PAUSED:
            await client.request(f"{prefix}.unpause", b"{}", timeout=10)
        if not any(engine.registered.is_set() and not engine._stop_requested.is_set() for engine in self.engines):
            await self.add_engine()
        msg = await client.request(
            f"{prefix}.submit_request", b'{"prompt": "alive?", "sampling_params": {"max_tokens": 6}}', timeout=10
        )
        return decode_reply(msg.data)

    async def stop(self) -> None:
        for engine in self.engines:
            await engine.stop()
        await self.coordinator.stop()
        await self.nc.close()


@pytest.fixture
def target(nats_url: str) -> Iterator[tuple[LoopThread, FuzzTarget]]:
    thread = LoopThread()
    fuzz_target = FuzzTarget(nats_url)
    thread.run(fuzz_target.start())
    yield thread, fuzz_target
    thread.run(fuzz_target.stop())
    thread.close()


def subjects_of(target: FuzzTarget) -> list[str]:
    prefix = target.settings.subject_prefix
    engine_id = target.engines[0].engine_id
    coordinator = [
        f"{prefix}.{header}.{engine_id}" if header in ENGINE_HEADERS else f"{prefix}.{header}"
        for header in Header
        if header is not Header.SHUTDOWN
    ]
    routed = [
        f"{prefix}.engine.{engine_id}.{header}" for header in (Header.SUBMIT_REQUEST, Header.ABORT_REQUEST, "bogus")
    ]
    broadcast = [f"{prefix}.engines.{header}" for header in Header if header not in (Header.STOP, Header.SHUTDOWN)]
    broadcast += [f"{prefix}.engines.{name}" for name in (PREPARE_WEIGHTS, COMMIT_WEIGHTS, DISCARD_WEIGHTS)]
    return coordinator + routed + broadcast


def test_garbage_on_every_subject_never_breaks_the_service(target: tuple[LoopThread, FuzzTarget]) -> None:
    thread, fuzz_target = target
    subjects = subjects_of(fuzz_target)
    counter = iter(range(10**9))

    @given(subject=st.sampled_from(subjects), body=bodies)
    @hypothesis_settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def publish(subject: str, body: bytes) -> None:
        thread.run(fuzz_target.publish(subject, body, f"_INBOX.fuzz.{next(counter)}"))

    publish()
    reply = thread.run(fuzz_target.recover_and_submit())
    assert reply["type"] == "final" and reply["generated_text"] == "alive?"
    assert fuzz_target.coordinator.counters["error_400"] > 0
    assert sum(engine.counters["malformed"] for engine in fuzz_target.engines) > 0
    for data in filter(None, fuzz_target.replies):
        decoded = decode_reply(data)
        register_ack, engine_ack = {"coordinator_id", "state"}, {"engine_id", "signal", "ok"}
        assert decoded.get("type") in REPLY_TYPES or register_ack <= decoded.keys() or engine_ack <= decoded.keys(), (
            data
        )
