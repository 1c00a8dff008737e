"""The engine runtime's shared state, and the two ways it answers a message.

:class:`RuntimeCore` holds what every part of the runtime reads: settings, the backend, the
NATS client, the requests in flight (``_active``), the step loop's events and lock, counters
and the reply publisher. The jobs are built on it, one module each, and
:class:`engines.runtime.EngineRuntime` puts them together:

- :mod:`engines.runtime_membership`: registration and heartbeats;
- :mod:`engines.runtime_requests`: routed requests in, aborts and replies sent again;
- :mod:`engines.runtime_steps`: the step loop and the replies of each step;
- :mod:`engines.runtime_control`: broadcasts (control signals, weights, hand-overs).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter

from engines.backend import Backend, TokenOutput
from engines.handlers import EngineContext
from engines.replies import ActiveRequest, ReplyPublisher
from engines.token_pace import TokenPace
from engines.weight_updates import EngineWeights
from service.bus.direct import DirectClient
from service.bus.registry import HandlerSpec, Incoming
from service.ops.log_limit import RateLimitedLog
from service.ops.settings import Settings
from service.protocol.codec import detect_encoding, encode_msgpack
from service.protocol.messages import EngineAck
from service.protocol.subjects import Subjects

log = logging.getLogger("engines.runtime")


class RuntimeCore:
    def __init__(self, settings: Settings, backend: Backend) -> None:
        self.settings = settings
        self.backend = backend
        self.engine_id = settings.engine_id or f"e{uuid.uuid4().hex[:12]}"
        self.served_model_name = settings.served_model_name or backend.default_model_name
        self.subjects = Subjects(settings.subject_prefix)
        self.paused = False
        self.epoch: int | None = None
        self.control_revision = 0  # of the shared control state, as last applied
        self.counters: Counter[str] = Counter()
        self.registered = asyncio.Event()
        self._malformed_log = RateLimitedLog(log)
        self._active: dict[str, ActiveRequest] = {}
        self._wake = asyncio.Event()
        self._connected = asyncio.Event()
        self._connected.set()
        self._step_lock = asyncio.Lock()
        self._stepped = asyncio.Event()  # set after every step and abort: a drain waits on it
        self.weights = EngineWeights(self.engine_id, backend, self._step_lock)
        self._stop_requested = asyncio.Event()
        self._stopped = False
        self._tasks: list[asyncio.Task[None]] = []
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._steps = 0
        self.pace = TokenPace()  # tokens generated and inter-token latency, for /metrics
        self._unsent: list[TokenOutput] = []  # the last step's outputs, published during the next step
        self._nc = DirectClient()
        self._replies = ReplyPublisher(
            self.engine_id, self._nc, self.subjects, self.counters, settings.recent_replies_bytes
        )

    @property
    def nc(self) -> DirectClient:
        return self._nc

    @property
    def load(self) -> int:
        return len(self._active)

    def _context(self) -> EngineContext:
        """The runtime as its handlers see it: :class:`engines.runtime.EngineRuntime` is one."""
        raise NotImplementedError

    async def _dispatch(self, spec: HandlerSpec[EngineContext], reply: str, data: bytes) -> None:
        incoming = Incoming(spec.header, reply or None, detect_encoding(data), data)
        await spec.fn(self._context(), incoming, spec.decoder.decode(data, incoming.encoding))

    async def _answer(self, reply: str | None, ack: EngineAck) -> None:
        if reply:
            await self.nc.publish(reply, encode_msgpack(ack))
