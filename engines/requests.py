"""The request table: the one owner of the requests this engine holds.

It holds every request routed here and not yet answered, each an
:class:`~engines.replies.ActiveRequest` (its tokens, text, spans and the replies sent so far),
and the right to send each one's terminal reply. Nothing else writes that state: the jobs of
the runtime (intake, step loop, control, weight updates, membership) read it through
:meth:`ids`, ``len``, ``in``, the read-only :attr:`records` and :meth:`held_back`, and change
it only through these transitions:

- :meth:`supersede`: whether a routed request may start; a newer run of one held here
  (a migration back to this engine) replaces the older run silently, one routed twice is ignored.
- :meth:`start`: the backend queues it and it enters the table, or nothing changes and the
  backend's refusal is raised; :meth:`refuse` then sends its error reply.
- :meth:`record_step`: a step's outputs recorded; partials sent every ``stream_interval``
  tokens, and a finished request leaves with its final.
- :meth:`abort`, :meth:`abort_all`: leave with an ``abort`` final; :meth:`fail`,
  :meth:`fail_all`: leave with an error reply; :meth:`drop_all`: leave without a reply (a
  failed weight commit: the engine rejoins as one that restarted).
- :meth:`hold`: backpressure (docs/protocol.md): a request whose reader fell behind is held
  back, still here (it counts in the load and the heartbeat), and the backend steps it no more
  until released; of a hold and a release that arrive out of order, the newer ``seq`` wins.
- :meth:`hand_over`: a dead coordinator's requests name their adopter from now on.
- :meth:`resend`: terminal replies sent again, from the publisher's memory.

Leaving the table is the right to send the terminal reply, so each request gets exactly one;
what leaves it (other than by finishing in the backend) is also dropped from the backend, so
the backend holds what the table holds. :meth:`emptied` returns once nothing is left (a drain).

Per-token log-probabilities travel from ``TokenOutput`` through :meth:`ActiveRequest.record`
into its partials and final, kept beside its tokens by a
:class:`~engines.logprob_record.LogprobRecord` that :meth:`start` gives a request that asked
for them. KV-cache events belong to the step loop (:mod:`engines.runtime_steps`), once per step.

Timings: :meth:`start` stamps a request's arrival, :meth:`record_step` the step (its start and
end, which the step loop read) that made its first token and its last, and every final carries
them (``Final.timings``). A traced request (:meth:`start`'s ``trace``) has its spans made from
the same readings as it leaves, whichever way it leaves: a few clock readings per step and
per request, none per token.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

from engines.backend import Backend, GenerationRequest, TokenOutput
from engines.logprob_record import LogprobRecord
from engines.replies import ActiveRequest, ReplyPublisher
from service.protocol.codec import Encoding
from service.protocol.errors import WireError
from service.protocol.messages import FinishReason, WeightVersion
from service.protocol.routed import AdoptedRequest, RoutedReply, RoutedRequest
from service.protocol.subjects import Header

if TYPE_CHECKING:
    from service.ops.tracing.otel import EngineTrace

log = logging.getLogger(__name__)


class RequestTable:
    def __init__(
        self,
        engine_id: str,
        backend: Backend,
        publisher: ReplyPublisher,
        counters: Counter[str],
        stream_interval: int,
    ) -> None:
        self._engine_id = engine_id
        self._backend = backend
        self._publisher = publisher
        self._counters = counters
        self._stream_interval = stream_interval
        self._active: dict[str, ActiveRequest] = {}
        # A live, read-only view of the records, for what measures the requests (the step loop's
        # pace, engines/token_pace.py); nothing but this table changes a record.
        self.records: Mapping[str, ActiveRequest] = MappingProxyType(self._active)
        self._left = asyncio.Event()  # set whenever a request leaves; cleared by whoever waits
        self._hold_seqs: dict[str, int] = {}  # the newest hold or release applied, by request
        self._held_back: set[str] = set()  # by backpressure: the backend does not step them

    # ------------------------------------------------------------ reading

    def __len__(self) -> int:
        return len(self._active)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._active

    def ids(self) -> list[str]:
        return list(self._active)

    def held_back(self) -> list[str]:
        """The requests held back by backpressure."""
        return list(self._held_back)

    async def emptied(self) -> None:
        """Return once the table holds no request."""
        while self._active:
            self._left.clear()
            await self._left.wait()

    # ------------------------------------------------------------ entering

    def supersede(self, routed: RoutedRequest) -> bool:
        """Whether to start ``routed``: a request routed twice is ignored, unless it starts a
        newer run (a migration back to this engine), which replaces the older one silently."""
        request_id = routed.return_path.request_id
        active = self._active.get(request_id)
        if active is None:
            return True
        if routed.attempt <= active.attempt:
            log.warning("engine_id=%s request_id=%s routed twice; ignored", self._engine_id, request_id)
            return False
        del self._active[request_id]
        self._backend.abort(request_id)
        self._forget_hold(request_id)  # the newer run starts released
        self._counters["runs_superseded"] += 1
        return True

    def start(
        self,
        routed: RoutedRequest,
        encoding: Encoding,
        request: GenerationRequest,
        epoch: int | None,
        trace: EngineTrace | None = None,
    ) -> None:
        """Queue ``request`` in the backend and hold it; a migrated run starts after the tokens
        its earlier runs streamed, their span attributed to ``epoch``; ``trace``: the context of
        its spans when it is traced. Raises what the backend raises (a refusal), with nothing held."""
        request_id = request.request_id
        prompt_tokens = self._backend.add(request)
        active = ActiveRequest(
            routed.return_path,
            encoding,
            body=routed.body,
            attempt=routed.attempt,
            prompt_tokens=prompt_tokens,
            trace=trace,
        )
        if request.logprobs is not None or request.prompt_logprobs is not None:
            active.logprobs = LogprobRecord(
                self._backend.token_bytes, request.logprobs is not None, bool(request.logprobs)
            )
        if request.resume_tokens:
            try:
                active.resume(list(request.resume_tokens), self._backend.resumed_text(request_id), epoch)
                if active.logprobs is not None:
                    active.logprobs.resume(len(request.resume_tokens), routed.resume_logprobs)
            except BaseException:
                self._backend.abort(request_id)
                raise
        self._active[request_id] = active

    async def refuse(self, routed: RoutedRequest, encoding: Encoding, err: WireError) -> None:
        """The error reply of a routed request that does not enter the table."""
        reply = ActiveRequest(routed.return_path, encoding, attempt=routed.attempt).error(err)
        await self._publisher.publish(Header.ENGINE_REPLY, [reply])

    # ------------------------------------------------------------ a step

    async def record_step(
        self,
        outputs: list[TokenOutput],
        epoch: int | None,
        weight_version: WeightVersion | None,
        started: float | None = None,
        ended: float | None = None,
    ) -> None:
        """Record one step's ``outputs`` (generated under ``epoch`` and ``weight_version``, by
        the step that ran over ``[started, ended]``, monotonic; now when None) and send their
        replies: a streamed request's partial every ``stream_interval`` tokens, and its rest
        with the final of a request that finished, which leaves the table. Outputs of requests
        no longer held (aborted meanwhile) are dropped."""
        interval = self._stream_interval
        held = self._active
        partials: list[RoutedReply] = []
        finals: list[RoutedReply] = []
        if ended is None:
            ended = time.monotonic()
        if started is None:
            started = ended
        for output in outputs:
            active = held.get(output.request_id)
            if active is None:
                continue
            if not active.first_token and output.new_tokens:
                active.first_output(started, ended, output.cached_tokens)
            active.record(output, epoch, weight_version)
            if output.finish_reason is not None:
                del held[output.request_id]
                if self._hold_seqs:
                    self._forget_hold(output.request_id)
                if active.return_path.stream and active.unsent_tokens:
                    partials.append(active.partial())
                finals.append(active.final(self._engine_id, output.finish_reason, ended))
                if active.trace is not None:
                    active.trace_left(ended, output.finish_reason)
            elif active.return_path.stream and len(active.unsent_tokens) >= interval:
                partials.append(active.partial())
        if finals:
            self._left.set()
        await self._publisher.publish(Header.ENGINE_REPLY_PARTIAL, partials)
        await self._publisher.publish(Header.ENGINE_REPLY, finals)

    # ------------------------------------------------------------ backpressure

    def hold(self, request_id: str, held: bool, seq: int) -> bool:
        """Hold ``request_id`` back (``held``) or release it, when it is here and ``seq`` is
        newer than the last applied to it; whether that changed what the backend steps. A
        backend that cannot hold keeps stepping it (its client's bound ends the stream)."""
        if request_id not in self._active or seq <= self._hold_seqs.get(request_id, -1):
            return False
        self._hold_seqs[request_id] = seq
        if held == (request_id in self._held_back):
            return False
        if not held:
            self._held_back.discard(request_id)
            self._backend.release(request_id)
        elif self._backend.hold(request_id):
            self._held_back.add(request_id)
        else:
            self._counters["holds_not_applied"] += 1
            return False
        self._counters["holds" if held else "releases"] += 1
        return True

    def _forget_hold(self, request_id: str) -> None:
        self._hold_seqs.pop(request_id, None)
        self._held_back.discard(request_id)

    # ------------------------------------------------------------ leaving

    async def abort(self, request_id: str) -> bool:
        """End ``request_id`` with an ``abort`` final (its tokens so far); False if not held."""
        active = self._leave(request_id, "abort")
        if active is None:
            return False
        await self._publisher.publish(Header.ENGINE_REPLY, [active.final(self._engine_id, "abort")])
        return True

    async def abort_all(self) -> int:
        """End every request with an ``abort`` final; how many."""
        aborted = [self._leave(request_id, "abort") for request_id in list(self._active)]
        finals = [active.final(self._engine_id, "abort") for active in aborted if active is not None]
        await self._publisher.publish(Header.ENGINE_REPLY, finals)
        return len(finals)

    async def fail(self, request_ids: list[str], err: WireError) -> int:
        """End those of ``request_ids`` still held with the error reply ``err``; how many."""
        failed = [active for request_id in request_ids if (active := self._leave(request_id, error=err)) is not None]
        await self._publisher.publish(Header.ENGINE_REPLY, [active.error(err) for active in failed])
        return len(failed)

    async def fail_all(self, err: WireError) -> int:
        return await self.fail(list(self._active), err)

    def drop_all(self) -> int:
        """Forget every request without a reply (the coordinator routes them again); how many."""
        held = list(self._active)
        for request_id in held:
            self._leave(request_id)
        return len(held)

    def _leave(
        self, request_id: str, finish_reason: FinishReason | None = None, error: WireError | None = None
    ) -> ActiveRequest | None:
        active = self._active.pop(request_id, None)
        if active is not None:
            self._backend.abort(request_id)
            self._forget_hold(request_id)
            self._left.set()
            if active.trace is not None:
                active.trace_left(time.monotonic(), finish_reason, error)
        return active

    # ------------------------------------------------------------ across coordinators

    def hand_over(self, dead: str, adopter: str) -> list[AdoptedRequest]:
        """The requests of coordinator ``dead`` name ``adopter`` in their replies from now on;
        each described for the adopter (return path, body, partials sent, tokens, run)."""
        return [
            active.hand_over(adopter) for active in self._active.values() if active.return_path.coordinator_id == dead
        ]

    async def resend(self, request_ids: list[str]) -> list[str]:
        """Send again the terminal replies still remembered of ``request_ids``; the ids this
        engine neither remembers nor holds (they never arrived)."""
        publisher = self._publisher
        again = [reply for request_id in request_ids if (reply := publisher.recent(request_id)) is not None]
        unknown = [
            request_id
            for request_id in request_ids
            if publisher.recent(request_id) is None and request_id not in self._active
        ]
        log.info(
            "engine_id=%s: sending %d replies again; %d requests never arrived",
            self._engine_id,
            len(again),
            len(unknown),
        )
        await publisher.publish(Header.ENGINE_REPLY, again, remember=False)
        return unknown
