"""The client library's reply inbox and its watch on the coordinator replicas.

Replies to every submission arrive on one wildcard subscription per client, ``<inbox>.*``, each
submission on its own token of it (:class:`Exchanges`). Each submission's queue also hears of
reconnects (:data:`RECONNECTED`) and of coordinator replicas that stopped heartbeating
(:class:`CoordinatorLost`, from :class:`CoordinatorWatch`), after which it resubmits, and of
publishes NATS refused (:class:`Refused`, or :data:`ADDRESS_REFUSED` for a replica's own
submission subject, after which it sends to the subject all replicas share).

A reply is queued as its body (``bytes``; empty for the end-of-stream marker), NATS's
no-responders status as :data:`NO_RESPONDERS`. The client reads reply batches
(:mod:`service.protocol.reply_batches`): a batch, on the inbox's ``b`` token, is split into its
replies, each queued as if it had come alone. On a :class:`~service.bus.direct.DirectClient`
connection the inbox is an inline subscription (:meth:`Exchanges.on_inline`), so a reply costs
no nats-py ``Msg``, queue or task; on another connection, a callback subscription
(:meth:`Exchanges.on_reply`).

A submission's queue is a :class:`~service.client.mailbox.Mailbox`: one reader, which takes
every item ready at once, replies counted in bytes (a stream's flow control bounds them:
:mod:`service.client.flow`), and one deadline for the whole submission (its bucket's timer
queues :data:`EXPIRED`), which costs far less per reply than an ``asyncio.Queue`` read under an
``asyncio.timeout`` (a timer rescheduled for every reply: a fifth of the gateway's CPU per
streamed event, measured with py-spy in docs/gateway.md).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import Callable

import msgspec
from nats.aio.msg import Msg

from service.client.mailbox import Mailbox
from service.ops.log_limit import RateLimitedLog
from service.protocol.arbiter import ArbiterTable
from service.protocol.membership import CoordinatorHeartbeat
from service.protocol.messages import ClientRequestId
from service.protocol.reply_batches import BATCH_TOKEN, batch_decoder
from service.protocol.subjects import Header, Subjects

log = logging.getLogger(__name__)
BATCH = BATCH_TOKEN.encode()  # the last token of the inbox's batch subject

RECONNECTED = object()
EXPIRED = object()  # queued by a mailbox's deadline timer
NO_RESPONDERS = object()  # NATS's status reply: no coordinator subscribed to the submission subject
ADDRESS_REFUSED = object()  # NATS refused a publish to a replica's own submission subject
DEADLINE_RESOLUTION_S = 0.05
heartbeat_decoder = msgspec.msgpack.Decoder(CoordinatorHeartbeat)


class Refused:
    """Queued for a submission whose publish NATS refused."""

    def __init__(self, message: str) -> None:
        self.message = message


class CoordinatorLost:
    """Queued for every submission when a coordinator replica stopped heartbeating."""

    def __init__(self, coordinator_id: str) -> None:
        self.coordinator_id = coordinator_id


class Exchanges:
    """Mailboxes of the submissions in progress, by their token of the reply inbox; each hears
    about reconnects, lost coordinators and refused publishes, and :data:`EXPIRED` at its
    deadline (after what came before).

    Deadlines are kept in buckets of :data:`DEADLINE_RESOLUTION_S`, each with one timer for all
    its mailboxes, rather than a timer per submission (about a microsecond less per request). A
    mailbox expires up to that much after its deadline; the client library waits a margin of
    seconds beyond the coordinator's own deadline anyway. Made inside the event loop it serves."""

    def __init__(self) -> None:
        self.queues: dict[bytes, Mailbox] = {}  # by the reply subject's last token
        self.inbox = ""  # the reply subjects' prefix, set once connected
        self._tokens = itertools.count()
        self._bad_batches = RateLimitedLog(log)
        self._loop = asyncio.get_running_loop()  # kept: on Python 3.11 each lookup costs a getpid()
        self._deadlines: dict[int, dict[bytes, Mailbox]] = {}  # bucket number -> its mailboxes

    def open(self, timeout_s: float) -> tuple[str, Mailbox]:
        """A fresh reply subject and the mailbox its replies go to, expiring after ``timeout_s``."""
        text = str(next(self._tokens))
        token = text.encode()
        mailbox = self.queues[token] = Mailbox(self._loop)
        due = math.ceil((self._loop.time() + timeout_s) / DEADLINE_RESOLUTION_S)
        bucket = self._deadlines.get(due)
        if bucket is None:
            bucket = self._deadlines[due] = {}
            self._loop.call_at(due * DEADLINE_RESOLUTION_S, self._expire, due)
        bucket[token] = mailbox
        mailbox.deadline = bucket
        return f"{self.inbox}.{text}", mailbox

    def close(self, reply_subject: str) -> None:
        token = reply_subject.rpartition(".")[2].encode()
        mailbox = self.queues.pop(token, None)
        if mailbox is not None and mailbox.deadline is not None:
            mailbox.deadline.pop(token, None)

    def _expire(self, due: int) -> None:
        for mailbox in self._deadlines.pop(due, {}).values():
            mailbox.deadline = None
            mailbox.put_nowait(EXPIRED)

    def on_inline(self, subject: bytes, data: bytes, headers: bytes | None) -> None:
        """The inbox's inline handler (service/bus/direct.py)."""
        token = subject[subject.rfind(b".") + 1 :]
        if token == BATCH:
            self._on_batch(data)
            return
        queue = self.queues.get(token)
        if queue is not None:  # else a late reply to a submission that ended
            if not data and headers is not None and headers.startswith(b"NATS/1.0 503"):
                queue.put_nowait(NO_RESPONDERS)
            else:
                queue.put_reply(data)

    async def on_reply(self, msg: Msg) -> None:
        """The inbox's callback on a connection that is not a DirectClient."""
        token = msg.subject.rpartition(".")[2].encode()
        if token == BATCH:
            self._on_batch(msg.data)
            return
        queue = self.queues.get(token)
        if queue is not None:
            if not msg.data and bool(msg.headers) and msg.headers.get("Status") == "503":  # type: ignore[union-attr]
                queue.put_nowait(NO_RESPONDERS)
            else:
                queue.put_reply(msg.data)

    def _on_batch(self, data: bytes) -> None:
        """A reply batch: each reply to its submission's mailbox, in the batch's order."""
        try:
            pairs = batch_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._bad_batches.warning("reply batch of %d bytes dropped: %s", len(data), exc)
            return
        queues = self.queues
        for token, body in pairs:
            queue = queues.get(token)
            if queue is not None:
                queue.put_reply(body)

    def reconnected(self) -> None:
        for queue in self.queues.values():
            queue.put_nowait(RECONNECTED)

    def coordinator_lost(self, coordinator_id: str) -> None:
        lost = CoordinatorLost(coordinator_id)
        for queue in self.queues.values():
            queue.put_nowait(lost)

    def address_refused(self) -> None:
        """NATS refused a publish to a replica's own submission subject: every submission is
        told, as each may have sent one."""
        for queue in self.queues.values():
            queue.put_nowait(ADDRESS_REFUSED)

    def refused(self, message: str) -> None:
        """NATS refused a publish to the submission subject: every submission is told, as each
        may be the one refused."""
        refused = Refused(message)
        for queue in self.queues.values():
            queue.put_nowait(refused)


class CoordinatorWatch:
    """Coordinator replicas by their heartbeats; one silent for ``timeout_s`` (the replicas'
    heartbeat timeout plus an interval, so that they found it dead and adopted its requests
    first) is reported lost once. The replicas that arbitrate request ids give the arbiter of
    each (:mod:`service.protocol.arbiter`), whose own submission subject ``address`` names."""

    def __init__(
        self, exchanges: Exchanges, interval_s: float, timeout_s: float, subjects: Subjects | None = None
    ) -> None:
        self._exchanges = exchanges
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._subjects = subjects  # None: the watch names no arbiter
        self._last_seen: dict[str, float] = {}
        self._arbitrating: set[str] = set()
        self._table: ArbiterTable | None = None
        self._own_subjects: dict[str, str] = {}  # replica -> its own submission subject
        self.addressing = subjects is not None  # False once NATS refused a replica's own subject
        self._task: asyncio.Task[None] | None = None
        self._started_at = time.monotonic()

    async def on_heartbeat(self, msg: Msg) -> None:
        if msg.reply:
            return  # a replica asking whether another serves the prefix, not a heartbeat
        try:
            beat = heartbeat_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        coordinator_id = beat.coordinator_id
        self._last_seen[coordinator_id] = time.monotonic()
        if (beat.arbitrates and not beat.leaving) != (coordinator_id in self._arbitrating):
            if beat.arbitrates and not beat.leaving:
                self._arbitrating.add(coordinator_id)
            else:
                self._arbitrating.discard(coordinator_id)
            self._arbiters_changed()

    def address_refused(self, message: str) -> None:
        """NATS refused a replica's own submission subject: every submission goes to the shared one."""
        self.addressing = False
        self._exchanges.address_refused()

    def arbiter_subject(self, client_id: str | None, client_request_id: ClientRequestId) -> str | None:
        """The submission subject of the replica arbitrating this id; None while none is known
        (or NATS refused such a subject): then the subject all replicas share."""
        table = self._table
        if table is None or not self.addressing:
            return None
        return self._own_subjects[table.of(client_id, client_request_id)]

    def address_of(self, client_id: str | None, client_request_id: ClientRequestId) -> Callable[[], str | None]:
        """Where a submission of this id goes, asked at each publish: :meth:`arbiter_subject`."""
        return lambda: self.arbiter_subject(client_id, client_request_id)

    def arbiter_of(self, client_id: str | None, client_request_id: ClientRequestId) -> str | None:
        """The replica arbitrating this id, as the client knows the replicas; None: none known."""
        return None if self._table is None else self._table.of(client_id, client_request_id)

    def _arbiters_changed(self) -> None:
        replicas, subjects = self._arbitrating, self._subjects
        if not replicas or subjects is None:
            self._table = None
            return
        self._table = ArbiterTable(replicas)
        self._own_subjects = {replica: subjects.addressed_to(Header.SUBMIT_REQUEST, replica) for replica in replicas}

    def heard_of(self, coordinator_id: str) -> None:
        """A reply named a coordinator: it is watched from now on, whether or not its heartbeats
        have come yet."""
        if coordinator_id not in self._last_seen:
            self._last_seen[coordinator_id] = time.monotonic()

    def start(self) -> None:
        self._started_at = time.monotonic()
        self._task = asyncio.ensure_future(self._watch())

    async def heard_all(self) -> None:
        """Until every live replica has surely been heard (each beats every interval): only a
        replica heard can be reported lost."""
        await asyncio.sleep(max(0.0, self._started_at + 1.5 * self._interval_s - time.monotonic()))

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def reconnected(self) -> None:
        """Nothing could be heard while cut off: silence counts from now."""
        now = time.monotonic()
        self._last_seen = dict.fromkeys(self._last_seen, now)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            now = time.monotonic()
            lost = [peer for peer, seen in self._last_seen.items() if now - seen >= self._timeout_s]
            for coordinator_id in lost:
                del self._last_seen[coordinator_id]
                self._exchanges.coordinator_lost(coordinator_id)
            if self._arbitrating.intersection(lost):
                self._arbitrating.difference_update(lost)
                self._arbiters_changed()
