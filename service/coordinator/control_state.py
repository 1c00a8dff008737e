"""The control state and generation epoch as this replica knows them.

Read on the hot path (admission, engine registration); written only by
:class:`service.coordinator.control.Control`.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.protocol.state import CoordinatorState


@dataclass(slots=True)
class ControlState:
    state: CoordinatorState = CoordinatorState.RUNNING
    epoch: int | None = None
