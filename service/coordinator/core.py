"""What every job of the coordinator shares: its id, the connection, the subjects, the
settings, the counters, the task spawner and the tracer (None while tracing is off). A job takes this core and the state it works on,
rather than a dozen positional collaborators."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from service.bus.direct import DirectClient
from service.ops.settings import Settings
from service.protocol.subjects import Subjects

if TYPE_CHECKING:
    from service.ops.tracing.otel import Tracer

Spawn = Callable[[Coroutine[Any, Any, object]], None]


@dataclass(frozen=True, slots=True)
class Core:
    id: str
    nc: DirectClient
    subjects: Subjects
    settings: Settings
    counters: Counter[str]
    spawn: Spawn
    tracer: Tracer | None = None  # None: tracing off (service/ops/tracing)
