"""The control state, generation epoch and fleet weights as this replica knows them: its copy
of the record all replicas share (:mod:`service.coordinator.shared_state`).

Read on the hot path (admission, engine registration), which never touches JetStream;
written only by :class:`service.coordinator.control.Control` as the shared record changes.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.protocol.state import ControlRecord, CoordinatorState


@dataclass(slots=True)
class ControlState:
    state: CoordinatorState = CoordinatorState.RUNNING
    epoch: int | None = None
    weight_version: str | int | None = None  # None: engines serve the weights they started with
    weight_path: str | None = None

    def copy_from(self, record: ControlRecord) -> None:
        self.state, self.epoch = record.state, record.epoch
        self.weight_version, self.weight_path = record.weight_version, record.weight_path
