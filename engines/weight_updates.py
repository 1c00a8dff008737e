"""The weights one engine serves: their version and digest, an update staged and not yet
swapped, and why the engine cannot serve the fleet's weights, if it cannot.

Contract (``update_weights``, docs/protocol.md):
- ``prepare`` loads and checks a checkpoint in a worker thread while the engine keeps serving
  its current weights, digests its files (:mod:`service.protocol.checkpoint`) and keeps it
  staged; it answers with an ``EngineAck`` carrying the version and digest, or the refusal's
  code (400: the checkpoint does not fit the model) and message. Preparing again replaces
  what was staged; ``discard`` frees it.
- ``commit`` swaps in what was staged for that version, or loads it first when this engine
  missed the prepare (it registered meanwhile). It swaps under the runtime's step lock: no step
  runs meanwhile. A commit whose record revision is not newer than the one this engine's
  weights came from (``revision``) changes nothing, nor does one of the version and digest it
  already serves (a coordinator repairing a fleet sends it to every engine).
- ``version`` is what every token generated from now on carries (``weight_versions`` spans);
  None means the weights the engine started with. ``problem`` says why the engine could not
  load the weights the fleet serves: it is shown in the engine's status, and the engine stays
  out of the pool until it can.
- Each phase is said in the log as it runs (:class:`~service.ops.progress.Progress`): staging,
  then the digest (bytes read of the checkpoint's, a bar on a terminal, a line every few
  seconds otherwise), then the swap (its time going by), each with what it took.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from engines.backend import Backend
from service.ops.progress import Progress
from service.protocol.checkpoint import checkpoint_digest, checkpoint_files
from service.protocol.errors import ErrorCode, WireError
from service.protocol.messages import WeightVersion
from service.protocol.routed import EngineAck, WeightSignal
from service.protocol.subjects import COMMIT_WEIGHTS, PREPARE_WEIGHTS

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Staged:
    version: WeightVersion
    path: str
    digest: str
    weights: object  # what the backend's stage_weights returned


class EngineWeights:
    def __init__(self, engine_id: str, backend: Backend, step_lock: asyncio.Lock) -> None:
        self._engine_id = engine_id
        self._backend = backend
        self._step_lock = step_lock
        self.version: WeightVersion | None = None
        self.digest: str | None = None
        self.problem: str | None = None
        self.revision = 0  # of the control record the current weights came from
        self._staged: Staged | None = None
        self.changed = asyncio.Event()  # set when version or problem change; cleared by whoever waits

    async def load(self, path: str, version: WeightVersion) -> Staged:
        """Read and check a checkpoint; raises WireError (400 for one that does not fit)."""
        started = time.perf_counter()
        staged = await asyncio.to_thread(self._load, path, version)
        log.info(
            "engine_id=%s: weights %r from %s staged in %.2f s (%s)",
            self._engine_id,
            version,
            path,
            time.perf_counter() - started,
            staged.digest,
        )
        return staged

    def _load(self, path: str, version: WeightVersion) -> Staged:
        what = f"engine_id={self._engine_id}: weights {version!r}"
        log.info("%s: staging from %s", what, path)
        weights = self._backend.stage_weights(Path(path))
        files = checkpoint_files(path)
        progress = Progress(f"{what}: digest", sum(file.stat().st_size for file in files), log)
        digest = checkpoint_digest(files, progress.advance)
        progress.done()
        return Staged(version, path, digest, weights)

    async def prepare(self, signal: WeightSignal) -> EngineAck:
        self._staged = None  # what an earlier prepare staged is freed before this one loads
        try:
            staged = await self.load(signal.path, signal.version)
        except Exception as exc:
            return self._refusal(PREPARE_WEIGHTS, exc)
        self._staged = staged
        return self._ack(PREPARE_WEIGHTS, staged)

    def discard(self, signal: WeightSignal) -> None:
        if self._staged is not None and self._staged.version == signal.version:
            self._staged = None

    async def commit(self, signal: WeightSignal) -> EngineAck:
        if signal.revision is not None and signal.revision <= self.revision:
            serving = self.version == signal.version
            detail = "" if serving else f"superseded by revision {self.revision}: serving {self.version!r}"
            return EngineAck(self._engine_id, COMMIT_WEIGHTS, serving, detail, self.version, self.digest)
        staged, self._staged = self._staged, None
        if signal.digest is not None and (self.version, self.digest) == (signal.version, signal.digest):
            self.revision = signal.revision or self.revision
            return EngineAck(self._engine_id, COMMIT_WEIGHTS, True, signal.digest, self.version, self.digest)
        try:
            if staged is None or staged.version != signal.version or staged.path != signal.path:
                staged = await self.load(signal.path, signal.version)
            await self.swap(staged)
        except Exception as exc:
            self.problem = f"cannot load weights {signal.version!r} from {signal.path}: {_describe(exc)}"
            self.changed.set()
            return self._refusal(COMMIT_WEIGHTS, exc)
        self.revision = signal.revision or self.revision
        return self._ack(COMMIT_WEIGHTS, staged)

    async def swap(self, staged: Staged) -> None:
        progress = Progress(f"engine_id={self._engine_id}: weights {staged.version!r}: swap", None, log)
        async with self._step_lock, progress.ticking():
            await self._backend.swap_weights(staged.weights)
            progress.done()
            self.version, self.digest, self.problem = staged.version, staged.digest, None
            self.changed.set()
        log.info("engine_id=%s: serving weights %r (%s)", self._engine_id, staged.version, staged.digest)

    async def adopt(self, path: str, version: WeightVersion, revision: int) -> bool:
        """Load and swap in the fleet's weights (recorded at ``revision``) before registering;
        False (and ``problem``) when it cannot."""
        try:
            if not path:
                raise WireError(ErrorCode.MALFORMED, "the coordinator named no checkpoint directory")
            await self.swap(await self.load(path, version))
            self.revision = revision
        except Exception as exc:
            self.problem = f"cannot load the fleet's weights {version!r} from {path}: {_describe(exc)}"
            self.changed.set()
            log.error("engine_id=%s: %s; not serving until it can", self._engine_id, self.problem)
            return False
        return True

    def _ack(self, signal: str, staged: Staged) -> EngineAck:
        return EngineAck(
            self._engine_id, signal, True, staged.digest, weight_version=staged.version, digest=staged.digest
        )

    def _refusal(self, signal: str, exc: Exception) -> EngineAck:
        code = exc.code if isinstance(exc, WireError) else int(ErrorCode.INTERNAL)
        if not isinstance(exc, WireError):
            log.exception("engine_id=%s: %s failed", self._engine_id, signal)
        return EngineAck(self._engine_id, signal, False, _describe(exc), weight_version=self.version, code=code)


def _describe(exc: Exception) -> str:
    return exc.message if isinstance(exc, WireError) else f"{type(exc).__name__}: {exc}"
