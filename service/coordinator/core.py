"""What every job of the coordinator shares: its id, the connection, the subjects, the
settings, the counters and the task spawner. A job takes this core and the state it works on,
rather than a dozen positional collaborators."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from service.bus.direct import DirectClient
from service.ops.settings import Settings
from service.protocol.subjects import Subjects

Spawn = Callable[[Coroutine[Any, Any, object]], None]


@dataclass(frozen=True, slots=True)
class Core:
    id: str
    nc: DirectClient
    subjects: Subjects
    settings: Settings
    counters: Counter[str]
    spawn: Spawn
