"""What the fleet's control signals last set on this engine: paused or not, the generation
epoch, and the revision of the shared control record they came from.

Contract: this object is the one writer of that state, through its transitions; the jobs
read ``paused`` and ``epoch``. Coordinator replicas broadcast independently, so two signals
may reach an engine in the opposite order: :meth:`apply` lets through only a signal whose
revision is newer than the last applied (it brings its record's epoch), which leaves every
engine in the state of the highest revision. A signal without a revision (profiler signals,
a coordinator without shared state) is always applied. A registration's answer sets all
three (:meth:`joined`): it is the record as the coordinator holds it.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.protocol.routed import EngineSignal


@dataclass(slots=True)
class ControlState:
    paused: bool = False
    epoch: int | None = None
    revision: int = 0  # of the shared control record, as last applied

    def apply(self, signal: EngineSignal) -> str | None:
        """None: apply ``signal`` (its epoch is now this engine's when it carries a revision);
        else why it is confirmed without effect (a newer revision was applied already)."""
        if signal.revision is None:
            return None
        if signal.revision <= self.revision:
            return f"superseded by revision {self.revision}"
        self.revision = signal.revision
        self.epoch = signal.epoch
        return None

    def joined(self, state: str, epoch: int | None, revision: int) -> None:
        """A coordinator added this engine, in the fleet's ``state``, ``epoch`` and ``revision``."""
        self.paused = state != "running"
        self.epoch = epoch
        self.revision = revision

    def pause(self) -> None:
        self.paused = True

    def unpause(self) -> None:
        self.paused = False

    def set_epoch(self, epoch: int | None) -> None:
        self.epoch = epoch
