"""The control state and generation epoch as this replica knows them: its copy of the record
all replicas share (:mod:`service.coordinator.shared_state`).

Read on the hot path (admission, engine registration), which never touches JetStream;
written only by :class:`service.coordinator.control.Control` as the shared record changes.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.protocol.state import CoordinatorState


@dataclass(slots=True)
class ControlState:
    state: CoordinatorState = CoordinatorState.RUNNING
    epoch: int | None = None
