"""Message headers and the NATS subjects they become.

A header ``h`` is served by the coordinator on ``<prefix>.<h>``. Engines listen on
``<prefix>.engine.<engine_id>.<h>`` for messages routed to them and on
``<prefix>.engines.<h>`` for broadcasts. Each process also answers NATS Services API status
requests on ``<prefix>.status.<role>.<id>``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Header(enum.StrEnum):
    # From clients.
    CONNECT = "connect"
    SUBMIT_REQUEST = "submit_request"
    ABORT_REQUEST = "abort_request"
    LIST_MODELS = "list_models"
    PAUSE = "pause"
    UNPAUSE = "unpause"
    SUSPEND = "suspend"
    RESUME = "resume"
    STOP = "stop"
    SET_GENERATION_EPOCH = "set_generation_epoch"
    START_CUDA_PROFILER = "start_cuda_profiler"
    STOP_CUDA_PROFILER = "stop_cuda_profiler"
    SHUTDOWN = "shutdown"
    # From engines.
    REGISTER = "register"
    HEARTBEAT = "heartbeat"
    ENGINE_REPLY = "engine_reply"
    ENGINE_REPLY_PARTIAL = "engine_reply_partial"
    DISCONNECT = "disconnect"
    # Between coordinator replicas.
    COORDINATOR_HEARTBEAT = "coordinator_heartbeat"


# Routed to one engine only (``<prefix>.engine.<id>.resend_replies``): the coordinator asks for
# replies it missed; there is no coordinator subject of that name.
RESEND_REPLIES = "resend_replies"

CONTROL_HEADERS: frozenset[Header] = frozenset(
    {Header.PAUSE, Header.UNPAUSE, Header.SUSPEND, Header.RESUME, Header.STOP, Header.SET_GENERATION_EPOCH}
)
PROFILER_HEADERS: frozenset[Header] = frozenset({Header.START_CUDA_PROFILER, Header.STOP_CUDA_PROFILER})

# Sent by engines to the coordinator (NATS permissions give engines exactly these).
ENGINE_HEADERS: frozenset[Header] = frozenset(
    {Header.REGISTER, Header.HEARTBEAT, Header.DISCONNECT, Header.ENGINE_REPLY, Header.ENGINE_REPLY_PARTIAL}
)

# Second tokens under the prefix that carry routed requests and broadcasts to engines.
_ENGINE_NAMESPACES = frozenset({"engine", "engines"})


def _publishable(subject: str) -> bool:
    """No whitespace or control characters, no wildcards (anywhere), no empty tokens."""
    return (
        bool(subject)
        and subject.isprintable()
        and " " not in subject
        and "*" not in subject
        and ">" not in subject
        and ".." not in subject
        and subject[0] != "."
        and subject[-1] != "."
    )


@dataclass(frozen=True, slots=True)
class Subjects:
    """Builds every subject from one prefix, so no module formats subjects by hand."""

    prefix: str = "dpcoord"

    def coordinator(self, header: str) -> str:
        return f"{self.prefix}.{header}"

    def engine(self, engine_id: str, header: str) -> str:
        return f"{self.prefix}.engine.{engine_id}.{header}"

    def engine_wildcard(self, engine_id: str) -> str:
        return f"{self.prefix}.engine.{engine_id}.*"

    def broadcast(self, header: str) -> str:
        return f"{self.prefix}.engines.{header}"

    def broadcast_wildcard(self) -> str:
        return f"{self.prefix}.engines.*"

    def status(self, role: str, instance_id: str) -> str:
        """The NATS Services API status endpoint of one coordinator or engine."""
        return f"{self.prefix}.status.{role}.{instance_id}"

    def reply_problem(self, subject: str) -> str | None:
        """Why ``subject`` may not receive replies, or None when it may.

        The coordinator publishes replies with NATS rights broader than its clients'. A reply
        subject that dpcoord itself serves would let a client turn a reply into a control
        signal or an engine message (a confused deputy): ``<prefix>.<header>`` (any single
        token, so future headers are covered), ``<prefix>.engine.>`` and ``<prefix>.engines.>``.
        System subjects (``$SYS``, ``$JS``, ...) and malformed subjects are refused too."""
        if not _publishable(subject):
            return "is not a valid publish subject"
        if subject[0] == "$":
            return "is a system subject"
        if subject == self.prefix:
            return f"is a subject dpcoord serves under {self.prefix}"
        if subject.startswith(self.prefix) and subject[len(self.prefix)] == ".":
            head, dot, _ = subject[len(self.prefix) + 1 :].partition(".")
            if not dot or head in _ENGINE_NAMESPACES:
                return f"is a subject dpcoord serves under {self.prefix}"
        return None

    def header_of(self, subject: str) -> str:
        """The last token of a subject: the header it carries."""
        return subject.rpartition(".")[2]
