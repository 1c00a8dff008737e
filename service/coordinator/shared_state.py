"""The control state that every coordinator replica of one subject prefix shares.

The state of the transition table, the generation epoch and the shutdown count live in one
:class:`ControlRecord`, the value of key ``<prefix>`` in the JetStream key-value bucket
``<prefix>_control`` (dots of the prefix become ``_``). NATS replicates the bucket as it
replicates any stream: three replicas in a cluster, one on a single server.

Contract:

- ``open(nc)`` runs before the coordinator subscribes anything. It opens or creates the
  bucket, reads the record (writing the initial one on first use) and starts watching the
  key, so a replica that starts while the fleet is paused serves paused from its first
  message. Without JetStream it asks whether another replica already serves the prefix and
  raises :class:`ReplicaConflict` if one answers; alone, it keeps the record in memory and
  logs one warning that replicas need JetStream.
- ``record`` and ``revision`` are this replica's copy. The hot path reads the fields that
  ``on_change`` copies into the coordinator and never touches JetStream.
- ``change(edit)`` reads the current record from the bucket, passes it to ``edit`` (which
  validates and returns the next record, or None when there is nothing to write) and writes
  the result with compare-and-set on the revision it read. On a conflict it reads again and
  calls ``edit`` again on the newer record, so two concurrent changes can never both start
  from the same record. ``apply_signal`` is the edit of a control signal: the transition
  table of :mod:`service.protocol.state` decides (a retry that finds its signal done changes
  nothing).
- ``on_change(previous, current)`` runs for every record this replica learns after
  ``open``, its own writes and other replicas' alike, in revision order and at most once per
  revision. Revisions written while this replica was cut off from NATS are skipped: it learns
  the latest, with ``previous`` the last one it knew.
- ``reconnected()`` watches anew after a NATS reconnect (the server may have restarted and
  lost the watch; a new watch delivers the latest record first); ``close()`` stops watching
  and is safe to call twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import msgspec
from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import KeyValueConfig, StorageType
from nats.js.client import JetStreamContext
from nats.js.errors import (
    BadRequestError,
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    ServerError,
    ServiceUnavailableError,
)
from nats.js.kv import KeyValue

from service.protocol.codec import encode_msgpack, msgpack_decoder
from service.protocol.errors import ErrorCode, WireError
from service.protocol.membership import CoordinatorHeartbeat
from service.protocol.state import ControlRecord, Written, signal_edit
from service.protocol.subjects import Header, Subjects

log = logging.getLogger(__name__)

# Conflicting writes in a row before a signal is refused; each conflict means another
# replica's signal went through, so this bounds the wait, never progress.
MAX_WRITE_ATTEMPTS = 32
# Revisions of the record kept in the bucket: `nats kv history` shows the recent changes.
HISTORY = 64
# How long a replica without JetStream waits for another replica to answer its question.
PRESENCE_TIMEOUT_S = 1.0
# How long a starting replica waits for JetStream that answers "temporarily unavailable"
# (a cluster electing its leader) before it gives up, so its pod is restarted.
JETSTREAM_WAIT_S = 30.0
# JetStream's error codes for "replicas > 1 not supported in non-clustered mode", and for
# "JetStream not enabled" (for the server, for this account).
_NOT_CLUSTERED = 10074
_NO_JETSTREAM = frozenset({10076, 10039})
# "No suitable peers for placement": a cluster whose servers have not all joined yet cannot
# place the bucket's three replicas; asked again, like a cluster still electing its leader.
_NO_PEERS_YET = 10005

ChangeListener = Callable[[ControlRecord, ControlRecord], None]
_record_decoder = msgspec.json.Decoder(ControlRecord)
_heartbeat_decoder = msgpack_decoder(CoordinatorHeartbeat)


class ReplicaConflict(RuntimeError):
    """Another replica serves this prefix and there is no JetStream to share state with it."""


def bucket_name(prefix: str) -> str:
    """``dpcoord`` -> ``dpcoord_control``; ``a.b`` -> ``a_b_control``. The key is the prefix
    itself, so prefixes that map to one bucket still have records of their own."""
    return f"{prefix.replace('.', '_')}_control"


class SharedControlState:
    def __init__(self, prefix: str, coordinator_id: str, timeout_s: float, on_change: ChangeListener) -> None:
        self.bucket = bucket_name(prefix)
        self.key = prefix
        self.record = ControlRecord()
        self.revision = 0
        self._subjects = Subjects(prefix)
        self._coordinator_id = coordinator_id
        self._timeout_s = timeout_s
        self._on_change = on_change
        self._kv: KeyValue | None = None
        self._follower: asyncio.Task[None] | None = None
        self._rewatching: asyncio.Task[None] | None = None  # referenced, so it runs to its end
        self._closed = False

    @property
    def shared(self) -> bool:
        """True when the record lives in JetStream; False for one coordinator alone."""
        return self._kv is not None

    # ------------------------------------------------------------ lifecycle

    async def open(self, nc: NATS) -> None:
        kv = await self._open_bucket(nc.jetstream(timeout=self._timeout_s))
        if kv is None:
            await self._refuse_if_not_alone(nc)
            log.warning(
                "NATS has no JetStream: this coordinator keeps its control state to itself, so it must be the "
                "only replica on prefix %s (start nats-server with -js to run several)",
                self.key,
            )
            return
        self._kv = kv
        record, revision = await self._first_read(kv)
        self.record, self.revision = record, revision
        self._follower = asyncio.ensure_future(self._follow(kv))
        log.info(
            "control state in JetStream bucket %s, key %s: %s at revision %d",
            self.bucket,
            self.key,
            record.state,
            revision,
        )

    async def close(self) -> None:
        self._closed = True
        await self._stop_following()

    def reconnected(self) -> None:
        if self._kv is not None and not self._closed:
            self._rewatching = asyncio.ensure_future(self._rewatch(self._kv))

    async def _rewatch(self, kv: KeyValue) -> None:
        await self._stop_following()
        if not self._closed and self._follower is None:  # a later reconnect's rewatch may have started one
            self._follower = asyncio.ensure_future(self._follow(kv))

    async def _stop_following(self) -> None:
        """Cancel the watch, again if needed: a cancellation that meets a reply just as it
        arrives is lost inside ``asyncio.wait_for`` (Python 3.11), and nats-py waits with it."""
        follower, self._follower = self._follower, None
        while follower is not None and not follower.done():
            follower.cancel()
            await asyncio.wait({follower}, timeout=0.1)

    async def _open_bucket(self, js: JetStreamContext) -> KeyValue | None:
        """The bucket, created on first use; None when this NATS (or account) has no JetStream.
        While JetStream answers "temporarily unavailable", "no suitable peers" (a cluster still
        forming) or not at all (a cluster still electing its leader), ask again for up to
        ``JETSTREAM_WAIT_S``."""
        patience = _Patience()
        while True:
            try:
                try:
                    return await js.key_value(self.bucket)
                except BucketNotFoundError:
                    return await self._create_bucket(js)
            except ServiceUnavailableError as exc:
                if exc.code is None or exc.err_code in _NO_JETSTREAM:  # no responders, or not enabled
                    return None
                problem = f"JetStream unavailable ({exc.description})"
            except BadRequestError as exc:
                if exc.err_code != _NO_PEERS_YET:
                    raise
                problem = f"JetStream cannot place the bucket's replicas yet ({exc.description})"
            except NatsTimeoutError:
                problem = (
                    f"JetStream did not answer within {self._timeout_s:g} s (not ready yet, or may this NATS user "
                    f"not publish to $JS.API for bucket {self.bucket}? docs/security.md)"
                )
            if patience.spent:
                raise RuntimeError(f"{problem}; gave up after {JETSTREAM_WAIT_S:g} s")
            await patience.wait(problem)

    async def _create_bucket(self, js: JetStreamContext) -> KeyValue:
        config = KeyValueConfig(
            bucket=self.bucket,
            history=HISTORY,
            storage=StorageType.FILE,
            replicas=3,
            description=f"dpcoord control state of subject prefix {self.key}",
        )
        try:
            return await js.create_key_value(config)
        except ServerError as exc:
            if exc.err_code != _NOT_CLUSTERED:
                raise
        log.info("NATS is not clustered: bucket %s gets one replica", self.bucket)
        return await js.create_key_value(config.evolve(replicas=1))

    async def _refuse_if_not_alone(self, nc: NATS) -> None:
        """Ask ``<prefix>.coordinator_heartbeat`` with a reply subject before subscribing
        anything: every live replica answers with its id (handlers/engine.py)."""
        probe = encode_msgpack(CoordinatorHeartbeat(self._coordinator_id))
        subject = self._subjects.coordinator(Header.COORDINATOR_HEARTBEAT)
        try:
            answer = await nc.request(subject, probe, timeout=PRESENCE_TIMEOUT_S)
        except (NoRespondersError, NatsTimeoutError):
            return
        try:
            other = _heartbeat_decoder.decode(answer.data).coordinator_id
        except (msgspec.DecodeError, msgspec.ValidationError):
            other = "?"
        raise ReplicaConflict(
            f"coordinator {other} already serves prefix {self.key} and NATS has no JetStream to share control "
            "state with it; run one coordinator, or start nats-server with -js (docs/reliability.md)"
        )

    # ------------------------------------------------------------ reading and writing

    async def apply_signal(self, signal: Header, epoch: int | None, retry: bool = False) -> Written:
        """Change the record as control ``signal`` says (:func:`~service.protocol.state.signal_edit`);
        409 when the table forbids it in the current state, as read from the bucket."""
        return await self.change(signal_edit(signal, epoch, self._coordinator_id, retry))

    async def change(self, edit: Callable[[ControlRecord], ControlRecord | None]) -> Written:
        kv = self._kv
        if kv is None:
            written = edit(self.record)
            if written is None:
                return Written(self.record, self.revision, changed=False)
            self.learn(written, self.revision + 1)
            return Written(written, self.revision, changed=True)
        for _ in range(MAX_WRITE_ATTEMPTS):
            current, revision = await self._read(kv)
            self.learn(current, revision)
            written = edit(current)
            if written is None:
                return Written(current, revision, changed=False)
            try:
                new_revision = await kv.update(self.key, msgspec.json.encode(written), last=revision)
            except KeyWrongLastSequenceError:
                continue
            except NatsError as exc:
                raise _unavailable(exc) from exc
            self.learn(written, new_revision)
            return Written(written, new_revision, changed=True)
        raise WireError(
            ErrorCode.CONFLICT,
            f"the control state changed {MAX_WRITE_ATTEMPTS} times while this signal was applied; send it again",
        )

    async def _read(self, kv: KeyValue) -> tuple[ControlRecord, int]:
        """The record and its revision, as the bucket has them now; the first reader writes the initial record."""
        while True:
            try:
                entry = await kv.get(self.key)
            except KeyNotFoundError:
                initial = ControlRecord(coordinator_id=self._coordinator_id)
                try:
                    return initial, await kv.create(self.key, msgspec.json.encode(initial))
                except KeyWrongLastSequenceError:
                    continue  # another replica wrote it first
                except NatsError as exc:
                    raise _unavailable(exc) from exc
            except NatsError as exc:
                raise _unavailable(exc) from exc
            try:
                return _record_decoder.decode(entry.value or b""), entry.revision or 0
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise WireError(
                    ErrorCode.INTERNAL,
                    f"control record {self.bucket}/{self.key} at revision {entry.revision} is unreadable ({exc}); "
                    "put a valid one with `nats kv put` or delete the key",
                ) from exc

    async def _first_read(self, kv: KeyValue) -> tuple[ControlRecord, int]:
        """:meth:`_read`, asked again for up to ``JETSTREAM_WAIT_S`` while the bucket does not
        answer: a bucket just created with three replicas serves only once its own leader is
        elected, which on a loaded cluster can take longer than one ``control_timeout_s``."""
        patience = _Patience()
        while True:
            try:
                return await self._read(kv)
            except WireError as exc:
                if exc.code != ErrorCode.NO_ENGINE or patience.spent:
                    raise
                await patience.wait(exc.message)

    async def refresh(self) -> bool:
        """Read the record again and learn it if newer; True when the watch had missed it. A
        watch can stall without an error (an ordered consumer whose stream leader moved in a
        cluster failover), so the coordinator also reads the record every few seconds, and a
        stale copy lasts no longer than that."""
        kv = self._kv
        if kv is None or self._closed:
            return False
        try:
            record, revision = await self._read(kv)
        except WireError:
            return False  # unreachable for now: the next round reads again
        if revision <= self.revision:
            return False
        log.warning(
            "control state %s/%s: the watch missed revision %d (this copy had %d); read it",
            self.bucket,
            self.key,
            revision,
            self.revision,
        )
        self.learn(record, revision)
        return True

    def learn(self, record: ControlRecord, revision: int) -> None:
        """Take a record read or watched at ``revision``: it replaces this replica's copy, and
        ``on_change`` hears of it, only when newer than the copy."""
        if revision <= self.revision:
            return
        previous, self.record, self.revision = self.record, record, revision
        if record.state is not previous.state or record.epoch != previous.epoch or record.shutdown != previous.shutdown:
            log.info(
                "control state %s, epoch %s, revision %d (%s by %s)",
                record.state,
                record.epoch,
                revision,
                record.signal,
                record.coordinator_id,
            )
        self._on_change(previous, record)

    async def _follow(self, kv: KeyValue) -> None:
        """Watch the key for as long as the coordinator runs, starting over after any failure.
        A new watch delivers the latest record first, so nothing written meanwhile is missed."""
        delay = 0.05
        while True:
            watcher = None
            try:
                watcher = await kv.watch(self.key)
                delay = 0.05
                async for entry in watcher:
                    if entry is None or entry.operation is not None or entry.revision is None:
                        continue  # the end-of-history marker, or a delete (the next change writes a fresh record)
                    try:
                        self.learn(_record_decoder.decode(entry.value or b""), entry.revision)
                    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                        log.error("control record at revision %d is unreadable, ignored: %s", entry.revision, exc)
            except (NatsError, WireError, OSError) as exc:
                log.warning("watching control state %s/%s: %s; trying again", self.bucket, self.key, exc)
            except Exception:
                log.exception("following control state %s/%s failed; trying again", self.bucket, self.key)
            finally:
                if watcher is not None:
                    with contextlib.suppress(NatsError, OSError):
                        await watcher.stop()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)


class _Patience:
    """Asking JetStream again while it is not ready yet: for up to ``JETSTREAM_WAIT_S``, after
    waits that double from 0.1 s to 2 s, each logged with what JetStream said."""

    def __init__(self) -> None:
        self._deadline = time.monotonic() + JETSTREAM_WAIT_S
        self._delay = 0.1

    @property
    def spent(self) -> bool:
        return time.monotonic() > self._deadline

    async def wait(self, problem: str) -> None:
        log.warning("%s; asking again", problem)
        await asyncio.sleep(self._delay)
        self._delay = min(self._delay * 2, 2.0)


def _unavailable(exc: Exception) -> WireError:
    return WireError(ErrorCode.NO_ENGINE, f"shared control state unavailable (JetStream: {type(exc).__name__} {exc})")
