"""Message headers and the NATS subjects they become.

A header ``h`` is served by the coordinator on ``<prefix>.<h>``; engine messages also on
``<prefix>.<h>.<engine_id>``, the subject engines send them on, so that NATS permissions can
let each engine speak only as itself and the coordinator takes the sender from the subject.
Engines listen on ``<prefix>.engine.<engine_id>.<h>`` for messages routed to them and on
``<prefix>.engines.<h>`` for broadcasts. Each process also answers NATS Services API status
requests on ``<prefix>.status.<role>.<id>``.

Replies go only to inboxes (:class:`InboxPrefixes`): the first tokens of a reply subject name
its owner, whom NATS permissions let alone read it.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass


class Header(enum.StrEnum):
    # From clients.
    CONNECT = "connect"
    SUBMIT_REQUEST = "submit_request"
    ABORT_REQUEST = "abort_request"
    HOLD_REQUEST = "hold_request"  # an extension: backpressure from a client whose reader fell behind
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
    UPDATE_WEIGHTS = "update_weights"  # an extension: the fleet's weights from a checkpoint directory
    # From engines.
    REGISTER = "register"
    HEARTBEAT = "heartbeat"
    ENGINE_REPLY = "engine_reply"
    ENGINE_REPLY_PARTIAL = "engine_reply_partial"
    DISCONNECT = "disconnect"
    KV_EVENTS = "kv_events"  # an extension: the prefix blocks an engine stored and evicted (kv_events.py)
    # Between coordinator replicas.
    COORDINATOR_HEARTBEAT = "coordinator_heartbeat"
    # A replica that does not hold a request asks the others (``<prefix>.<header>.<recipient>``).
    FORWARD_SUBMISSION = "forward_submission"
    FORWARD_ABORT = "forward_abort"
    # Named submissions handed, as their clients sent them, to the replica arbitrating their ids;
    # and the ids a replica holds that another arbitrates (service/protocol/arbiter.py).
    ARBITER_SUBMISSION = "arbiter_submission"
    ARBITER_CLAIMS = "arbiter_claims"
    FORWARD_HOLD = "forward_hold"


# Routed to one engine only (``<prefix>.engine.<id>.resend_replies``): the coordinator asks for
# replies it missed; there is no coordinator subject of that name.
RESEND_REPLIES = "resend_replies"
# Asked of one engine only (``<prefix>.engine.<id>.kv_snapshot``, an extension): the prefix
# blocks it holds and the number of its last KV event; there is no coordinator subject of that name.
KV_SNAPSHOT = "kv_snapshot"
# Broadcast to every engine (``<prefix>.engines.adopt``) by the replica that adopts a dead one's
# requests; not a coordinator subject.
ADOPT = "adopt"

# Broadcast to engines only (``<prefix>.engines.<name>``), the two phases of ``update_weights``:
# every engine loads and checks the checkpoint, then, once all of them could, every one swaps.
# There are no coordinator subjects of these names.
PREPARE_WEIGHTS = "prepare_weights"
COMMIT_WEIGHTS = "commit_weights"
DISCARD_WEIGHTS = "discard_weights"  # an update refused: what was staged is freed

CONTROL_HEADERS: frozenset[Header] = frozenset(
    {Header.PAUSE, Header.UNPAUSE, Header.SUSPEND, Header.RESUME, Header.STOP, Header.SET_GENERATION_EPOCH}
)
PROFILER_HEADERS: frozenset[Header] = frozenset({Header.START_CUDA_PROFILER, Header.STOP_CUDA_PROFILER})

# Sent by engines to the coordinator (NATS permissions give engines exactly these).
ENGINE_HEADERS: frozenset[Header] = frozenset(
    {
        Header.REGISTER,
        Header.HEARTBEAT,
        Header.DISCONNECT,
        Header.ENGINE_REPLY,
        Header.ENGINE_REPLY_PARTIAL,
        Header.KV_EVENTS,
    }
)

# Second tokens under the prefix that carry routed requests and broadcasts to engines.
_ENGINE_NAMESPACES = frozenset({"engine", "engines"})
_HEADERS = frozenset(Header)

# What an engine or coordinator id may hold: it becomes a subject token, so no dots, wildcards or
# whitespace; this is stricter than NATS, so an id is also safe in logs, URLs and metric labels.
_ID = re.compile(r"[A-Za-z0-9_-]+")
ID_PATTERN = r"^[A-Za-z0-9_-]+$"


def id_problem(value: str, max_bytes: int) -> str | None:
    """Why ``value`` cannot be an engine or coordinator id, or None when it can."""
    if len(value) > max_bytes:
        return f"is longer than {max_bytes} bytes"
    if not _ID.fullmatch(value):
        return "may hold only letters, digits, '_' and '-' (it becomes a NATS subject token)"
    return None


def utf8_length(text: str) -> int:
    """Bytes of ``text`` in UTF-8, without encoding it when it is ASCII (the common case)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def publishable(subject: str) -> bool:
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

    def sent_by(self, header: str, sender: str) -> str:
        """The subject an engine sends ``header`` on: the sender's id is its last token."""
        return f"{self.prefix}.{header}.{sender}"

    def addressed_to(self, header: str, recipient: str) -> str:
        """The subject one coordinator replica serves ``header`` on for messages to it alone."""
        return f"{self.prefix}.{header}.{recipient}"

    def sent_by_any(self, header: str) -> str:
        return f"{self.prefix}.{header}.*"

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
        token, so future headers are covered), ``<prefix>.<header>.>``, ``<prefix>.engine.>``
        and ``<prefix>.engines.>``. System subjects (``$SYS``, ``$JS``, ...) and malformed
        subjects are refused too."""
        if not publishable(subject):
            return "is not a valid publish subject"
        if subject[0] == "$":
            return "is a system subject"
        if subject == self.prefix:
            return f"is a subject dpcoord serves under {self.prefix}"
        if subject.startswith(self.prefix) and subject[len(self.prefix)] == ".":
            head, dot, _ = subject[len(self.prefix) + 1 :].partition(".")
            if not dot or head in _ENGINE_NAMESPACES or head in _HEADERS:
                return f"is a subject dpcoord serves under {self.prefix}"
        return None

    def header_of(self, subject: str) -> str:
        """The last token of a subject: the header it carries."""
        return subject.rpartition(".")[2]


class InboxPrefixes:
    """The inbox prefixes replies may go under, and the owner a reply subject names.

    A subject is under prefix ``P`` when its first tokens are ``P``'s, with at least one token
    after them; the last of them may also extend ``P``'s last token with ``_`` and more, so
    ``_INBOX`` also covers the per-user ``_INBOX_client.…`` and ``_INBOX_admin.…`` (nats-py's
    and the ``nats`` CLI's ``--inbox-prefix``). The owner is those first tokens as the subject
    spells them: where NATS lets each user subscribe only under its own inbox prefix, a reply
    to one owner reaches no other user."""

    __slots__ = ("_exact", "_extended", "_multi", "first", "prefixes")

    def __init__(self, prefixes: Sequence[str]) -> None:
        if not prefixes:
            raise ValueError("at least one inbox prefix is needed")
        self.prefixes = tuple(prefixes)
        single = [prefix for prefix in prefixes if "." not in prefix]
        # A subject under a prefix itself is owned by this very string: owners then hash and
        # compare as the same object (they key per-owner tallies on the hot path).
        self._exact = tuple((prefix + ".", prefix) for prefix in single)
        self._extended = tuple(prefix + "_" for prefix in single)
        self._multi = tuple(prefix.split(".") for prefix in prefixes if "." in prefix)
        # The prefix owner() tries first, with its dot: a subject starting with the dotted form
        # (and valid, see Subjects.reply_problem) is owned by it, so a hot path may match it inline.
        self.first: tuple[str, str] = (
            self._exact[0] if self._exact else (".".join(self._multi[0]) + ".", ".".join(self._multi[0]))
        )

    def owner(self, subject: str) -> str | None:
        """The inbox prefix ``subject`` is under, as spelled there; None when it is under none."""
        for dotted, exact in self._exact:
            if subject.startswith(dotted) and len(subject) > len(dotted):
                return exact
        if subject.startswith(self._extended):
            end = subject.find(".")
            if 0 < end < len(subject) - 1:
                return subject[:end]
        if self._multi:
            tokens = subject.split(".")
            for prefix in self._multi:
                count = len(prefix)
                last = tokens[count - 1] if len(tokens) > count else ""
                if (
                    last
                    and tokens[: count - 1] == prefix[:-1]
                    and (last == prefix[-1] or last.startswith(prefix[-1] + "_"))
                ):
                    return ".".join(tokens[:count])
        return None

    def overlap(self, subjects: Subjects) -> str | None:
        """Why replies under these prefixes could reach a subject dpcoord serves (or the system's
        ``$`` subjects), or None when none can. Settings refuse an overlap, so a subject under an
        inbox prefix needs only :func:`publishable` to be a safe reply subject."""
        served = subjects.prefix
        for prefix in self.prefixes:
            if prefix.startswith("$"):
                return f"inbox prefix {prefix!r} is a system subject"
            if prefix == served or prefix.startswith(served + ".") or self.owner(served + ".x") is not None:
                return f"inbox prefix {prefix!r} overlaps the subjects dpcoord serves under {served!r}"
        return None

    def describe(self) -> str:
        return ", ".join(f"{prefix}.>" for prefix in self.prefixes)


class ReplySubjects:
    """Where the coordinator may send replies, the one rule every path asks: a subject no longer
    than ``max_bytes`` in UTF-8, under an inbox prefix (its owner), and none that dpcoord serves
    (:meth:`Subjects.reply_problem`). The coordinator's hot path matches the same rule inline."""

    __slots__ = ("_max_bytes", "_subjects", "inboxes")

    def __init__(self, subjects: Subjects, inboxes: InboxPrefixes, max_bytes: int) -> None:
        self._subjects = subjects
        self.inboxes = inboxes
        self._max_bytes = max_bytes

    def check(self, subject: str) -> tuple[str | None, str | None]:
        """The owner of ``subject`` and why it may not receive replies (None when it may)."""
        if utf8_length(subject) > self._max_bytes:
            return None, f"is longer than max_id_bytes ({self._max_bytes})"
        owner = self.inboxes.owner(subject)
        if owner is None:
            return None, f"is not under an inbox prefix ({self.inboxes.describe()})"
        return owner, self._subjects.reply_problem(subject)
