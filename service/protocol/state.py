"""Coordinator states, the declarative table of control-signal transitions, and the control
record that coordinator replicas share.

Each signal names the states it may leave, the state it moves to, and the states in which
a repeat is acknowledged without change. Every (state, signal) pair outside the table is
refused with 409.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from msgspec import Struct

from service.protocol.errors import ErrorCode, WireError
from service.protocol.subjects import Header


class CoordinatorState(enum.StrEnum):
    RUNNING = "running"
    PAUSED = "paused"
    SUSPENDED = "suspended"
    STOPPING = "stopping"


_ALL_STATES = frozenset(CoordinatorState)


@dataclass(frozen=True, slots=True)
class Transition:
    allowed_from: frozenset[CoordinatorState]
    new_state: CoordinatorState | None  # None: the signal changes no state
    idempotent_in: frozenset[CoordinatorState] = frozenset()


S = CoordinatorState
TRANSITIONS: dict[Header, Transition] = {
    Header.PAUSE: Transition(frozenset({S.RUNNING}), S.PAUSED, idempotent_in=frozenset({S.PAUSED, S.SUSPENDED})),
    Header.UNPAUSE: Transition(frozenset({S.PAUSED}), S.RUNNING),
    Header.SUSPEND: Transition(frozenset({S.PAUSED}), S.SUSPENDED),
    Header.RESUME: Transition(frozenset({S.SUSPENDED}), S.PAUSED),
    Header.STOP: Transition(frozenset({S.PAUSED, S.SUSPENDED}), S.STOPPING),
    Header.SET_GENERATION_EPOCH: Transition(_ALL_STATES, None),
}


@dataclass(frozen=True, slots=True)
class Decision:
    """What a signal does in a state: ``changes`` is False for an idempotent repeat."""

    changes: bool
    new_state: CoordinatorState


def decide(state: CoordinatorState, signal: Header) -> Decision:
    """Raises WireError(409) when the table forbids ``signal`` in ``state``."""
    transition = TRANSITIONS[signal]
    if state in transition.idempotent_in:
        return Decision(changes=False, new_state=state)
    if state not in transition.allowed_from:
        raise WireError(ErrorCode.CONFLICT, f"{signal} is not allowed in state {state}")
    return Decision(changes=True, new_state=transition.new_state or state)


# What the replica that finishes a stop writes (back to running): a stop's retry finds it done.
STOP_DONE = "stop_done"


def signal_edit(
    signal: Header, epoch: int | None, coordinator_id: str, retry: bool = False
) -> Callable[[ControlRecord], ControlRecord | None]:
    """The change ``signal`` makes to a record: the table's new state (and for
    ``set_generation_epoch`` the epoch), or None when it changes nothing. A ``retry`` (the same
    signal again, its first answer lost) changes nothing when the record is what the signal
    wrote: its last signal (a stop's, or the end of that stop; an epoch's, with that epoch).
    Raises WireError 409 when the table forbids the signal."""

    def edit(current: ControlRecord) -> ControlRecord | None:
        if retry and _wrote(current, signal, epoch):
            return None
        decision = decide(current.state, signal)
        if not decision.changes:
            return None
        new_epoch = epoch if signal is Header.SET_GENERATION_EPOCH else current.epoch
        return msgspec.structs.replace(
            current, state=decision.new_state, epoch=new_epoch, signal=signal.value, coordinator_id=coordinator_id
        )

    return edit


def _wrote(record: ControlRecord, signal: Header, epoch: int | None) -> bool:
    if signal is Header.SET_GENERATION_EPOCH:
        return record.signal == signal.value and record.epoch == epoch
    return record.signal == signal.value or (signal is Header.STOP and record.signal == STOP_DONE)


class ControlRecord(Struct, kw_only=True):
    """The control state of one subject prefix, shared by every coordinator replica: the value
    of key ``<prefix>`` in the JetStream key-value bucket ``<prefix>_control`` (dots of the
    prefix become ``_``), written with compare-and-set on the key's revision. Encoded in JSON,
    so ``nats kv get`` shows it.

    ``shutdown`` counts shutdown signals: a replica exits when it rises above the value it read
    at start. ``signal`` and ``coordinator_id`` say what wrote the record and which replica.
    ``weight_version``, ``weight_path`` and ``weight_digest`` (extensions) are the weights the
    fleet serves since the last ``update_weights``; None before any.
    """

    state: CoordinatorState = CoordinatorState.RUNNING
    epoch: int | None = None
    shutdown: int = 0
    signal: str = ""
    coordinator_id: str = ""
    weight_version: str | int | None = None
    weight_path: str | None = None
    weight_digest: str | None = None


@dataclass(frozen=True, slots=True)
class Written:
    """What a change left in the shared record: the record, its revision, and whether this
    change wrote it (False: the signal changed nothing, as an idempotent repeat)."""

    record: ControlRecord
    revision: int
    changed: bool
