"""Weight updates: one checkpoint for the whole fleet, loaded in two phases and acknowledged.

Contract (``<prefix>.update_weights``, docs/protocol.md):
- Allowed while the fleet is ``paused`` or ``suspended`` (409 otherwise, and 409 while this
  replica runs another update); 503 with no engine to check the checkpoint.
- Prepare: every engine in the pool reads the checkpoint and checks it against its model,
  still holding its old weights, and confirms with the version and the files' digest. If any
  refuses (400 names the first tensor that does not fit), stays silent, or the digests
  differ, the update is refused, every engine is told to discard what it staged, and the fleet
  keeps its weights: no engine swapped.
- Record: the version, path and digest are written to the control record every replica
  shares, with compare-and-set, while the state is still paused or suspended. From then on
  an engine that registers loads them before it is added to the pool.
- Commit: every engine in the pool swaps (one that joined after the prepare loads first). The
  ``Ack`` carries the version and digest once every engine confirmed them (the digest the
  prepare agreed on); an engine that did not is removed from the pool (it registers again, which loads the recorded weights first) and
  the error names it. The recorded version stands.
- Repair: an engine in the pool whose heartbeats report other weights than the recorded ones
  for ``2 * heartbeat_timeout_s`` (the replica that recorded them died before it committed, or
  this replica added the engine before it learned the record) while no update runs here is
  sent the commit of the recorded weights again, and removed if it cannot take them. A
  commit an engine already applied changes nothing, so a repair that meets another replica's
  commit is harmless.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import msgspec
from msgspec import Struct

from service.bus.registry import Incoming
from service.coordinator.broadcast import BroadcastResult, broadcast
from service.coordinator.core import Core
from service.coordinator.pool import EnginePool
from service.coordinator.shared_state import SharedControlState
from service.protocol.codec import encode_msgpack
from service.protocol.errors import ErrorCode, WireError
from service.protocol.messages import Ack, UpdateWeights, WeightVersion, error_reply
from service.protocol.routed import WeightSignal
from service.protocol.state import ControlRecord, CoordinatorState
from service.protocol.subjects import COMMIT_WEIGHTS, DISCARD_WEIGHTS, PREPARE_WEIGHTS, Header

log = logging.getLogger(__name__)

UPDATABLE = frozenset({CoordinatorState.PAUSED, CoordinatorState.SUSPENDED})


class WeightUpdates:
    def __init__(
        self,
        core: Core,
        shared: SharedControlState,
        pool: EnginePool,
        remove_engine: Callable[[str, str], Awaitable[None]],
        reply: Callable[[Incoming, Struct], Awaitable[None]],
    ) -> None:
        self._id = core.id
        self._settings = core.settings
        self._nc = core.nc
        self._subjects = core.subjects
        self._shared = shared
        self._pool = pool
        self._remove_engine = remove_engine
        self._counters = core.counters
        self._reply = reply
        self._spawn = core.spawn
        self._lock = asyncio.Lock()
        self._lagging: dict[str, float] = {}  # engine id -> when its heartbeats first showed other weights
        self._repairing = False

    def check(self, state: CoordinatorState) -> None:
        """Raises WireError 409 unless an update may start now."""
        if state not in UPDATABLE:
            raise WireError(
                ErrorCode.CONFLICT, f"update_weights is allowed only while paused or suspended, not {state}"
            )
        if self._lock.locked():
            raise WireError(ErrorCode.CONFLICT, "another update_weights is in progress on this coordinator")

    async def update(self, incoming: Incoming, request: UpdateWeights) -> None:
        """Run the update and answer ``incoming``: an ``Ack``, or the error that says why not."""
        async with self._lock:
            try:
                ack = await self._update(request)
            except WireError as err:
                self._counters[f"error_{err.code}"] += 1
                self._counters["weight_updates_refused"] += 1
                log.warning("update_weights %r from %s: %s %s", request.version, request.path, err.code, err.message)
                await self._reply(incoming, error_reply(err))
                return
        self._counters["weight_updates"] += 1
        await self._reply(incoming, ack)

    async def _update(self, request: UpdateWeights) -> Ack:
        expected = {record.engine_id for record in self._pool}
        if not expected:
            raise WireError(ErrorCode.NO_ENGINE, "no engine to load the checkpoint; start engines first")
        signal = WeightSignal(request.path, request.version)
        prepared = await self._broadcast(PREPARE_WEIGHTS, signal, expected)
        try:
            digest = agreed_digest(prepared, request)
            written = await self._shared.change(lambda current: self._record(current, request, digest))
        except WireError:
            await self._nc.publish(self._subjects.broadcast(DISCARD_WEIGHTS), encode_msgpack(signal))
            raise
        log.info("update_weights %r (%s) recorded at revision %d", request.version, digest, written.revision)
        revision = written.revision if self._shared.shared else None
        commit = WeightSignal(request.path, request.version, revision, digest)
        committed = await self._broadcast(COMMIT_WEIGHTS, commit, {record.engine_id for record in self._pool})
        failed = await self._remove_failed(committed, commit)
        if failed:
            names = "; ".join(f"{engine_id}: {detail}" for engine_id, detail in sorted(failed.items()))
            raise WireError(
                ErrorCode.TIMED_OUT if committed.missing else ErrorCode.INTERNAL,
                f"weights {request.version!r} recorded, but engines left the pool until they load them: {names}",
            )
        return Ack(
            Header.UPDATE_WEIGHTS,
            state=written.record.state,
            revision=written.revision,
            engines={engine_id: ack.detail for engine_id, ack in committed.acks.items()},
            weight_version=request.version,
            digest=digest,
        )

    async def _remove_failed(self, committed: BroadcastResult, commit: WeightSignal) -> dict[str, str]:
        """Remove from the pool every engine that did not confirm ``commit`` with its version
        and digest; what each did instead."""
        failed = dict(committed.failed)
        failed.update(
            (engine_id, f"serves {ack.weight_version!r} ({ack.digest})")
            for engine_id, ack in committed.acks.items()
            if ack.ok and (ack.weight_version != commit.version or ack.digest != commit.digest)
        )
        failed.update((engine_id, "no confirmation") for engine_id in committed.missing)
        for engine_id in sorted(failed):
            await self._remove_engine(engine_id, f"could not commit weights {commit.version!r}")
        return failed

    def heard(self, engine_id: str, version: WeightVersion | None) -> None:
        """A heartbeat of an engine in the pool: start a repair when it lagged long enough."""
        record = self._shared.record
        if record.weight_version is None or version == record.weight_version:
            self._lagging.pop(engine_id, None)
            return
        now = time.monotonic()
        since = self._lagging.setdefault(engine_id, now)
        if self._repairing or self._lock.locked() or now - since < 2 * self._settings.heartbeat_timeout_s:
            return
        self._repairing = True
        self._spawn(self._repair())

    async def _repair(self) -> None:
        try:
            record = self._shared.record
            lagging = {engine_id for engine_id in self._lagging if self._pool.get(engine_id) is not None}
            if record.weight_version is None or record.weight_path is None or not lagging:
                return
            revision = self._shared.revision if self._shared.shared else None
            commit = WeightSignal(record.weight_path, record.weight_version, revision, record.weight_digest)
            self._counters["weight_repairs"] += 1
            log.warning(
                "engines %s serve other weights than the recorded %r: sending its commit again",
                ", ".join(sorted(lagging)),
                record.weight_version,
            )
            failed = await self._remove_failed(await self._broadcast(COMMIT_WEIGHTS, commit, lagging), commit)
            for engine_id, detail in sorted(failed.items()):
                log.warning("engine_id=%s left the pool: %s", engine_id, detail)
        finally:
            self._lagging.clear()
            self._repairing = False

    def _record(self, current: ControlRecord, request: UpdateWeights, digest: str) -> ControlRecord:
        if current.state not in UPDATABLE:
            raise WireError(
                ErrorCode.CONFLICT, f"the fleet left the paused state ({current.state}) during update_weights"
            )
        return msgspec.structs.replace(
            current,
            weight_version=request.version,
            weight_path=request.path,
            weight_digest=digest,
            signal=Header.UPDATE_WEIGHTS.value,
            coordinator_id=self._id,
        )

    async def _broadcast(self, header: str, signal: WeightSignal, expected: set[str]) -> BroadcastResult:
        return await broadcast(
            self._nc,
            self._subjects.broadcast(header),
            encode_msgpack(signal),
            expected,
            self._settings.long_control_timeout_s,
        )


def agreed_digest(result: BroadcastResult, request: UpdateWeights) -> str:
    """The digest every engine prepared; raises WireError when one refused, stayed silent or
    read other bytes. A refusal for the checkpoint itself (400) wins: it is the caller's to fix."""
    keeps = "; the fleet keeps its weights"
    refused = {engine_id: ack for engine_id, ack in result.acks.items() if not ack.ok}
    if refused:
        mismatched = sorted(engine_id for engine_id, ack in refused.items() if ack.code == ErrorCode.MALFORMED)
        if mismatched:
            first = mismatched[0]
            raise WireError(
                ErrorCode.MALFORMED,
                f"checkpoint {request.path} refused by engines {', '.join(mismatched)}: {refused[first].detail}{keeps}",
            )
        names = "; ".join(f"{engine_id}: {ack.detail}" for engine_id, ack in sorted(refused.items()))
        raise WireError(ErrorCode.INTERNAL, f"engines could not load checkpoint {request.path}: {names}{keeps}")
    if result.missing:
        names = ", ".join(sorted(result.missing))
        raise WireError(ErrorCode.TIMED_OUT, f"no confirmation from engines {names} loading {request.path}{keeps}")
    digests = {ack.digest for ack in result.acks.values()}
    digest = digests.pop() if len(digests) == 1 else None
    if digest is None:
        seen = ", ".join(f"{engine_id}: {ack.digest}" for engine_id, ack in sorted(result.acks.items()))
        raise WireError(ErrorCode.CONFLICT, f"engines read different files at {request.path} ({seen}){keeps}")
    return digest
