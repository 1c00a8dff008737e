"""The whole transition table, every (state, signal) pair: as data, and live over NATS."""

from __future__ import annotations

import msgspec
import pytest
from nats.aio.client import Client as NATS

from service.coordinator.coordinator import Coordinator
from service.protocol.errors import WireError
from service.protocol.state import CoordinatorState, decide
from service.protocol.subjects import CONTROL_HEADERS, Header
from tests.conftest import EngineFactory
from tests.helpers import request_json

S = CoordinatorState
H = Header
SAME = "acked without change"
REFUSED = 409

# Written out by hand from the wire contract, independent of service/protocol/state.py.
EXPECTED: dict[tuple[CoordinatorState, Header], CoordinatorState | str | int] = {
    (S.RUNNING, H.PAUSE): S.PAUSED,
    (S.PAUSED, H.PAUSE): SAME,
    (S.SUSPENDED, H.PAUSE): SAME,
    (S.STOPPING, H.PAUSE): REFUSED,
    (S.RUNNING, H.UNPAUSE): REFUSED,
    (S.PAUSED, H.UNPAUSE): S.RUNNING,
    (S.SUSPENDED, H.UNPAUSE): REFUSED,
    (S.STOPPING, H.UNPAUSE): REFUSED,
    (S.RUNNING, H.SUSPEND): REFUSED,
    (S.PAUSED, H.SUSPEND): S.SUSPENDED,
    (S.SUSPENDED, H.SUSPEND): REFUSED,
    (S.STOPPING, H.SUSPEND): REFUSED,
    (S.RUNNING, H.RESUME): REFUSED,
    (S.PAUSED, H.RESUME): REFUSED,
    (S.SUSPENDED, H.RESUME): S.PAUSED,
    (S.STOPPING, H.RESUME): REFUSED,
    (S.RUNNING, H.STOP): REFUSED,
    (S.PAUSED, H.STOP): S.STOPPING,
    (S.SUSPENDED, H.STOP): S.STOPPING,
    (S.STOPPING, H.STOP): REFUSED,
    (S.RUNNING, H.SET_GENERATION_EPOCH): S.RUNNING,
    (S.PAUSED, H.SET_GENERATION_EPOCH): S.PAUSED,
    (S.SUSPENDED, H.SET_GENERATION_EPOCH): S.SUSPENDED,
    (S.STOPPING, H.SET_GENERATION_EPOCH): S.STOPPING,
}


def test_expected_table_covers_every_pair() -> None:
    assert set(EXPECTED) == {(state, signal) for state in S for signal in CONTROL_HEADERS}


@pytest.mark.parametrize(("state", "signal"), sorted(EXPECTED))
def test_table(state: CoordinatorState, signal: Header) -> None:
    expected = EXPECTED[(state, signal)]
    if expected == REFUSED:
        with pytest.raises(WireError) as caught:
            decide(state, signal)
        assert caught.value.code == 409
        return
    decision = decide(state, signal)
    if expected == SAME:
        assert (decision.changes, decision.new_state) == (False, state)
    else:
        assert decision.new_state == expected


@pytest.mark.parametrize(("state", "signal"), sorted(EXPECTED))
async def test_table_live(
    state: CoordinatorState, signal: Header, coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    [engine] = await start_engines(1)
    # Put the fleet straight into the state under test, as another replica's signal would.
    await coordinator.shared.change(lambda current: msgspec.structs.replace(current, state=state))
    assert coordinator.state is state
    reply = await request_json(nc, coordinator.subjects.coordinator(signal), {"epoch": 3})
    expected = EXPECTED[(state, signal)]
    if expected == REFUSED:
        assert reply["type"] == "error" and reply["error"]["code"] == 409, reply
        assert coordinator.state is state
        return
    assert reply["type"] == "ack" and reply["signal"] == signal, reply
    assert reply["state"] == (state if expected == SAME else expected)
    if signal is Header.STOP:
        await engine.run_until_stopped()
        assert coordinator.state is S.RUNNING and len(coordinator.engines) == 0
    elif expected != SAME:
        assert coordinator.state is expected
