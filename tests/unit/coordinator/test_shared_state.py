"""The shared control state without a server: the bucket's name, control signals decided by the
transition table, and ``on_change`` once per revision, in order. (On JetStream, with replicas
as processes: tests/integration/test_replicas.py.)"""

from __future__ import annotations

import msgspec
import pytest

from service.coordinator.shared_state import SharedControlState, bucket_name
from service.protocol.errors import WireError
from service.protocol.state import ControlRecord, CoordinatorState
from service.protocol.subjects import Header

S = CoordinatorState


@pytest.fixture
def changes() -> list[tuple[ControlRecord, ControlRecord]]:
    return []


@pytest.fixture
def shared(changes: list[tuple[ControlRecord, ControlRecord]]) -> SharedControlState:
    """Never opened on a server: the in-memory record a coordinator alone keeps."""
    return SharedControlState("fleet.a", "c1", 1.0, lambda previous, current: changes.append((previous, current)))


def test_bucket_named_after_the_prefix_key_is_the_prefix(shared: SharedControlState) -> None:
    assert bucket_name("dpcoord") == "dpcoord_control"
    assert (shared.bucket, shared.key) == ("fleet_a_control", "fleet.a")
    assert not shared.shared


async def test_signals_follow_the_table_and_name_their_writer(
    shared: SharedControlState, changes: list[tuple[ControlRecord, ControlRecord]]
) -> None:
    paused = await shared.apply_signal(Header.PAUSE, None)
    assert (paused.changed, paused.record.state, paused.revision) == (True, S.PAUSED, 1)
    assert (paused.record.signal, paused.record.coordinator_id) == ("pause", "c1")
    repeat = await shared.apply_signal(Header.PAUSE, None)
    assert (repeat.changed, repeat.revision) == (False, 1)
    epoch = await shared.apply_signal(Header.SET_GENERATION_EPOCH, 4)
    assert (epoch.record.state, epoch.record.epoch, epoch.revision) == (S.PAUSED, 4, 2)
    with pytest.raises(WireError) as refused:
        await shared.apply_signal(Header.RESUME, None)
    assert refused.value.code == 409 and shared.revision == 2
    unpaused = await shared.apply_signal(Header.UNPAUSE, None)
    assert (unpaused.record.state, unpaused.record.epoch) == (S.RUNNING, 4)  # the epoch stays
    assert [(previous.state, current.state) for previous, current in changes] == [
        (S.RUNNING, S.PAUSED),
        (S.PAUSED, S.PAUSED),
        (S.PAUSED, S.RUNNING),
    ]


async def test_a_change_that_writes_nothing_tells_nobody(
    shared: SharedControlState, changes: list[tuple[ControlRecord, ControlRecord]]
) -> None:
    written = await shared.change(lambda current: None)
    assert (written.changed, written.revision) == (False, 0) and changes == []


async def test_revisions_already_known_are_not_applied_again(
    shared: SharedControlState, changes: list[tuple[ControlRecord, ControlRecord]]
) -> None:
    """A watch may deliver a replica's own write after the write returned, or an older one
    after a newer: each revision is applied once, never backwards."""
    await shared.change(lambda current: msgspec.structs.replace(current, state=S.PAUSED))
    await shared.change(lambda current: msgspec.structs.replace(current, shutdown=1))
    assert shared.revision == 2
    shared.learn(ControlRecord(state=S.SUSPENDED), 1)
    shared.learn(ControlRecord(state=S.SUSPENDED), 2)
    assert shared.record.state is S.PAUSED and len(changes) == 2
    assert changes[1][0].shutdown == 0 and changes[1][1].shutdown == 1
