"""The engine's one dispatch path on a recording bus: routed messages go to their route,
broadcasts to their handler in engines/handlers.py (on a recording context), and both follow
one error rule: malformed messages are counted, logged and answered with an error ack."""

from __future__ import annotations

from typing import Any

import pytest
from nats.aio.msg import Msg

from engines.handlers import ENGINE_HANDLERS, EngineContext
from engines.runtime_core import Route
from engines.runtime_dispatch import EngineDispatch
from service.bus.registry import HandlerRegistry, Incoming
from service.protocol.codec import encode_msgpack
from service.protocol.messages import PauseMode
from service.protocol.routed import EngineAck, EngineSignal, RoutedAbort, WeightSignal
from tests.unit.engines.wiring import ENGINE_ID, Floor, build


class RecordingContext:
    """Test double of the broadcast handlers' context: records each call; ``fails`` names a
    call that raises."""

    def __init__(self, floor: Floor, fails: str = "") -> None:
        self.calls: list[tuple[str, Any]] = []
        self._floor = floor
        self._fails = fails

    def _record(self, name: str, argument: object = None) -> None:
        if name == self._fails:
            raise RuntimeError(f"{name} broke")
        self.calls.append((name, argument))

    async def pause(self, mode: PauseMode | None = None) -> None:
        self._record("pause", mode)

    async def unpause(self) -> None:
        self._record("unpause")

    async def suspend(self) -> None:
        self._record("suspend")

    async def resume(self) -> None:
        self._record("resume")

    async def stop_serving(self) -> str:
        self._record("stop_serving")
        return "0 requests failed"

    def set_epoch(self, epoch: int | None) -> None:
        self._record("set_epoch", epoch)

    async def prepare_weights(self, signal: WeightSignal) -> EngineAck:
        self._record("prepare_weights", signal.version)
        return EngineAck(ENGINE_ID, "prepare_weights", True, weight_version=signal.version)

    def discard_weights(self, signal: WeightSignal) -> None:
        self._record("discard_weights", signal.version)

    async def commit_weights(self, signal: WeightSignal) -> EngineAck:
        self._record("commit_weights", signal.version)
        return EngineAck(ENGINE_ID, "commit_weights", True)

    async def acknowledge(self, incoming: Incoming, ack: EngineAck) -> None:
        await self._floor.core.answer(incoming.reply, ack)

    def start_profiler(self) -> str:
        return "started"

    def stop_profiler(self) -> str:
        return "stopped"

    async def hand_over(self, incoming: Incoming, adoption: Any) -> None:
        self._record("hand_over", adoption.adopter)

    async def confirm(self, incoming: Incoming, detail: str = "") -> None:
        await self._floor.core.answer(incoming.reply, EngineAck(ENGINE_ID, incoming.header, True, detail))

    def request_stop(self) -> None:
        self._record("request_stop")


class Wired:
    def __init__(self, fails: str = "", revision_applied: int = 0) -> None:
        self.floor = build()
        self.context = RecordingContext(self.floor, fails)
        self.aborted: list[str] = []
        self.applied = revision_applied
        routed = {"abort_request": Route.to(RoutedAbort, self._abort)}
        self.dispatch = EngineDispatch(self.floor.core, routed, ENGINE_HANDLERS, self.context, self._superseded)

    async def _abort(self, incoming: Incoming, abort: RoutedAbort) -> None:
        self.aborted.append(abort.request_id)

    def _superseded(self, signal: EngineSignal) -> str | None:
        if signal.revision is not None and signal.revision <= self.applied:
            return "superseded"
        return None

    async def routed(self, header: str, body: bytes, reply: str = "") -> None:
        await self.dispatch.routed(self.floor.core.subjects.engine(ENGINE_ID, header), reply, body, None)

    async def broadcast(self, header: str, body: bytes, reply: str = "_INBOX.c.1") -> None:
        subject = self.floor.core.subjects.broadcast(header)
        await self.dispatch.broadcast(Msg(self.floor.bus, subject=subject, reply=reply, data=body))

    def acks(self, reply: str = "_INBOX.c.1") -> list[EngineAck]:
        return [sent.decode(EngineAck) for sent in self.floor.bus.on(reply)]


async def test_a_routed_message_goes_straight_to_its_route() -> None:
    wired = Wired()
    await wired.routed("abort_request", encode_msgpack(RoutedAbort("r1")))
    assert wired.aborted == ["r1"] and wired.floor.bus.published == []


@pytest.mark.parametrize(
    ("header", "body", "code"),
    [("abort_request", b"\xc1", 400), ("abort_request", b'{"request_id": 5}', 400), ("bogus", b"{}", 404)],
)
async def test_a_malformed_routed_message_is_counted_and_answered_where_a_reply_subject_was_given(
    header: str, body: bytes, code: int
) -> None:
    wired = Wired()
    await wired.routed(header, body)  # no reply subject: nothing to answer
    await wired.routed(header, body, reply="_INBOX.c.9")
    [ack] = wired.acks("_INBOX.c.9")
    assert not ack.ok and ack.code == code and ack.signal == header
    assert wired.floor.core.counters["malformed"] == 2 and len(wired.floor.bus.published) == 1


async def test_a_broadcast_goes_to_its_handler_and_is_confirmed() -> None:
    wired = Wired()
    await wired.broadcast("pause", encode_msgpack(EngineSignal(mode="drain")))
    await wired.broadcast("set_generation_epoch", b'{"epoch": 3}')
    assert wired.context.calls == [("pause", "drain"), ("set_epoch", 3)]
    assert [(ack.signal, ack.ok) for ack in wired.acks()] == [("pause", True), ("set_generation_epoch", True)]


async def test_stop_is_confirmed_before_the_engine_stops() -> None:
    wired = Wired()
    await wired.broadcast("stop", encode_msgpack(EngineSignal()))
    assert [name for name, _ in wired.context.calls] == ["stop_serving", "request_stop"]
    assert wired.acks()[0].detail == "0 requests failed"


async def test_a_control_signal_older_than_the_last_applied_is_confirmed_without_its_handler() -> None:
    wired = Wired(revision_applied=5)
    await wired.broadcast("pause", encode_msgpack(EngineSignal(revision=5)))
    await wired.broadcast("start_cuda_profiler", encode_msgpack(EngineSignal(revision=5)))  # not a control signal
    assert wired.context.calls == []
    assert [(ack.ok, ack.detail) for ack in wired.acks()] == [(True, "superseded"), (True, "started")]


async def test_malformed_broadcasts_and_failed_handlers_get_an_error_ack() -> None:
    wired = Wired(fails="suspend")
    await wired.broadcast("pause", b"not msgpack")
    await wired.broadcast("no_such_signal", b"{}")
    await wired.broadcast("suspend", encode_msgpack(EngineSignal()))
    undecodable, unknown, failed = wired.acks()
    assert (undecodable.ok, undecodable.code) == (False, 400) and "undecodable" in undecodable.detail
    assert (unknown.ok, unknown.code) == (False, 404)
    assert (failed.ok, failed.code, failed.detail) == (False, 500, "RuntimeError: suspend broke")
    assert wired.floor.core.counters["malformed"] == 2


def test_the_broadcast_registry_holds_broadcasts_only() -> None:
    registry: HandlerRegistry[EngineContext] = HandlerRegistry()

    @registry.message_handler("pause")
    async def routed_by_mistake(engine: EngineContext, incoming: Incoming, payload: EngineSignal) -> None:
        """Test double: a handler registered without ``fanout``."""

    with pytest.raises(ValueError, match="broadcast"):
        EngineDispatch(build().core, {}, registry, RecordingContext(build()), lambda signal: None)
