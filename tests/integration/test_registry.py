from __future__ import annotations

import pytest
from nats.aio.client import Client as NATS

from handlers import HANDLERS
from handlers.context import ControlContext
from service.bus.registry import HandlerRegistry, Incoming
from service.coordinator.coordinator import Coordinator
from service.ops.settings import Settings
from service.protocol.messages import Ack, ControlSignal
from service.protocol.subjects import Header
from tests.helpers import request_json


def test_every_header_has_exactly_one_handler() -> None:
    assert set(HANDLERS) == {str(header) for header in Header}


def test_duplicate_header_is_rejected_at_registration() -> None:
    registry = HANDLERS.copy()

    with pytest.raises(ValueError, match="duplicate handler for header 'pause'"):

        @registry.message_handler(Header.PAUSE)
        async def another_pause(coordinator: ControlContext, incoming: Incoming, payload: ControlSignal) -> None:
            return None


def test_handler_without_payload_type_is_rejected() -> None:
    registry: HandlerRegistry[object] = HandlerRegistry()
    with pytest.raises(TypeError, match="annotate its payload"):

        @registry.message_handler("untyped")
        async def untyped(coordinator, incoming, payload):  # type: ignore[no-untyped-def]
            return None


async def test_new_header_and_handler_add_a_subject_without_loop_changes(settings: Settings, nc: NATS) -> None:
    registry = HANDLERS.copy()

    @registry.message_handler("echo_state")
    async def handle_echo_state(coordinator: ControlContext, incoming: Incoming, payload: ControlSignal) -> None:
        await coordinator.reply(incoming, Ack("echo_state", state=coordinator.state, epoch=payload.epoch))

    async with Coordinator(settings, handlers=registry) as coordinator:
        reply = await request_json(nc, f"{settings.subject_prefix}.echo_state", {"epoch": 5})
        assert reply == {"type": "ack", "signal": "echo_state", "state": "running", "epoch": 5}
        bad = await request_json(nc, f"{settings.subject_prefix}.echo_state", {"epoch": "five"})
        assert bad["type"] == "error" and bad["error"]["code"] == 400
        assert coordinator.counters["error_400"] == 1


def test_delivery_mode_is_declared_with_the_handler() -> None:
    registry = HANDLERS.copy()

    @registry.message_handler("fanned_out", fanout=True, direct=True)
    async def fanned_out(coordinator: ControlContext, incoming: Incoming, payload: ControlSignal) -> None:
        return None

    assert registry["fanned_out"].fanout and registry["fanned_out"].direct
    assert HANDLERS[Header.SUBMIT_REQUEST].direct and not HANDLERS[Header.SUBMIT_REQUEST].fanout
    assert HANDLERS[Header.HEARTBEAT].fanout and not HANDLERS[Header.PAUSE].fanout
