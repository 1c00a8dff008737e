"""The async client library: submit, stream, abort, list models, control, weight updates and
shutdown, each with a timeout.

It speaks msgpack. Error replies raise :class:`ClientError` with the wire code.

Replies to every submission arrive on one wildcard subscription per client,
``<inbox>.*``, each submission on its own token of it (as nats-py's own request/reply does), so
a submission costs no SUB and UNSUB of its own.

Core NATS delivers at most once; the library closes the gap for submissions. Every submission
carries this client's id and a unique client_request_id, which makes it idempotent at the
coordinator (a repeat is answered from the request in flight or from the result cache, never
run twice). So the library resubmits on NATS's no-responders status (no coordinator
subscribed yet), with backoff until the deadline, and after every reconnect, when a reply may
have been lost. It also resubmits when the replica that holds a request (the one its id names,
learnt from the first reply; any, before one came) stops heartbeating, since the requests a
dead replica had not yet sent to an engine are known to their clients alone. Every publish
after the first is marked as a resubmission (docs/reliability.md). Each goes to the replica
arbitrating its id (:mod:`service.protocol.arbiter`, :mod:`.publishing`).

A publish that NATS refuses (permissions violation) raises ClientError 403 at once, on
connections the library opened itself; NATS reports the refusal only to the connection's error
callback, so the call would otherwise wait out its timeout. A stream's unread replies are
bounded (:meth:`DpcoordClient.stream`, :mod:`service.client.flow`).

Traced (:mod:`service.ops.tracing`), a submission is a ``dpcoord.submit`` span, its
``traceparent`` in every publish's NATS headers. ``on_held`` hears a ``Held`` notice (a pause).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import ExitStack, aclosing, asynccontextmanager
from typing import TYPE_CHECKING, Any

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription

from service.bus.connection import close_nats, connect_nats
from service.bus.direct import DirectClient, DirectSubscription
from service.bus.refusals import PublishRefusals
from service.client.calls import ClientError, call
from service.client.envelope import envelope
from service.client.exchanges import CoordinatorWatch, Exchanges
from service.client.flow import DEFAULT_FLOW, FlowControl, FlowLimits, StreamStalled
from service.client.holds import HoldChannel
from service.client.logprobs import with_logprobs
from service.client.publishing import SubmitPublisher
from service.client.signals import signal_answered
from service.client.submission import OnHeld, Submission
from service.client.tracing import ClientTracing, traced
from service.ops.settings import Settings
from service.protocol.errors import ErrorCode
from service.protocol.messages import (
    AbortRequest,
    Ack,
    ChatMessage,
    ClientRequestId,
    ConnectAck,
    ConnectRequest,
    ControlSignal,
    Empty,
    Final,
    ModelList,
    Partial,
    PauseMode,
    UpdateWeights,
    WeightVersion,
)
from service.protocol.streams import StreamBroken, StreamCheck
from service.protocol.subjects import Header, Subjects

if TYPE_CHECKING:
    from service.ops.tracing.otel import Tracer


class DpcoordClient:
    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        client_id: str,
        coordinator_id: str,
        owns_connection: bool,
        exchanges: Exchanges,
        refusals: PublishRefusals,
        replies: Subscription | DirectSubscription,
        watch: CoordinatorWatch,
        tracing: ClientTracing | None = None,
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.client_id = client_id
        self.coordinator_id = coordinator_id
        self._owns_connection = owns_connection
        self._exchanges = exchanges
        self._refusals = refusals
        self._replies = replies
        self._watch = watch
        self._tracing = tracing or ClientTracing()
        self._submit_subject = subjects.coordinator(Header.SUBMIT_REQUEST)
        self._holds = HoldChannel(nc, subjects.coordinator(Header.HOLD_REQUEST), exchanges.inbox, self.abort)
        # One watch on the submission subject for the client's life: a refusal tells every
        # submission in progress (as a watch per submission would, for less per submission).
        self._watches = ExitStack()
        self._watches.enter_context(refusals.watch(self._submit_subject, exchanges.refused))
        self._publish = SubmitPublisher(nc, self._submit_subject, refusals, self._watches, watch)

    @classmethod
    async def connect(
        cls,
        settings: Settings,
        client_id: str | None = None,
        timeout: float = 10.0,
        nc: NATS | None = None,
        tracer: Tracer | None = None,
    ) -> DpcoordClient:
        """Connect to NATS (unless ``nc`` is given: then resubmission after reconnects is the
        caller's business) and shake hands with a coordinator within ``timeout``. A NATS that
        cannot be reached raises :class:`~service.bus.connection.NatsUnreachable` (a
        ``ConnectionError``) after ``settings.nats_connect_timeout_s`` per server in its URL.
        ``tracer`` (the caller's to close): where spans go; by default from settings."""
        exchanges, refusals, subjects = Exchanges(), PublishRefusals(), Subjects(settings.subject_prefix)
        beat_s = settings.heartbeat_interval_s
        watch = CoordinatorWatch(exchanges, beat_s, settings.heartbeat_timeout_s + beat_s, subjects)
        owns = nc is None

        def reconnected() -> None:
            watch.reconnected()
            exchanges.reconnected()

        connection = nc or await connect_nats(
            settings, name="dpcoord-client", on_reconnect=reconnected, on_error=refusals.on_error, give_up=True
        )
        exchanges.inbox = connection.new_inbox()
        replies: Subscription | DirectSubscription
        if isinstance(connection, DirectClient):
            replies = await connection.subscribe_inline(f"{exchanges.inbox}.*", exchanges.on_inline)
        else:
            replies = await connection.subscribe(
                f"{exchanges.inbox}.*", cb=exchanges.on_reply, pending_msgs_limit=-1, pending_bytes_limit=-1
            )
        heartbeat_subject = subjects.coordinator(Header.COORDINATOR_HEARTBEAT)
        refusals.optional(heartbeat_subject, "requests of a coordinator that dies wait for their deadline")
        heartbeats = await connection.subscribe(heartbeat_subject, cb=watch.on_heartbeat)
        try:
            ack = await call(
                connection, refusals, subjects.coordinator(Header.CONNECT), ConnectRequest(client_id), timeout
            )
        except BaseException:
            if owns:
                await connection.close()
            else:
                await replies.unsubscribe()
                await heartbeats.unsubscribe()
            raise
        if not isinstance(ack, ConnectAck):
            raise ClientError(ErrorCode.INTERNAL, f"unexpected connect reply {ack!r}")
        watch.start()
        tracing = ClientTracing.of(settings, tracer)
        return cls(
            connection, subjects, ack.client_id, ack.coordinator_id, owns, exchanges, refusals, replies, watch, tracing
        )

    async def close(self) -> None:
        self._watch.stop()
        self._watches.close()
        await self._tracing.close()
        if self._owns_connection:
            await close_nats(self.nc)
        elif not (self.nc.is_closed or self.nc.is_draining):
            await self._replies.unsubscribe()

    async def __aenter__(self) -> DpcoordClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def submit(
        self,
        prompt: str | list[int] | None = None,
        *,
        messages: Sequence[ChatMessage] | None = None,
        model: str | None = None,
        client_request_id: ClientRequestId | None = None,
        timeout: float = 60.0,
        session_id: str | None = None,
        group_id: str | None = None,
        on_held: OnHeld | None = None,
        **sampling: Any,
    ) -> Final:
        """Run a request and return its final reply; sampling keywords are SamplingParams fields.

        Log-probabilities: ``logprobs=k`` (0 to 20) gives each generated token's logprob with its
        ``k`` most likely alternatives (``token_logprobs``, ``top_logprobs`` and ``token_bytes``
        of the replies), ``prompt_logprobs=k`` the prompt's (``prompt_logprobs``,
        ``prompt_top_logprobs``, ``prompt_token_ids`` of the final), ``logprobs_mode="processed"``
        those of the distribution sampled from rather than the model's (``"raw"``).

        Give a ``prompt`` or chat ``messages`` (which the engine renders with its chat template);
        ``model`` sends it only to engines serving that model (404 when none does). ``timeout``
        bounds the wait and is also the request's deadline at the coordinator. With the
        ``cache_aware`` routing policy, submissions of one ``session_id`` (the turns of a
        conversation) stay on one engine while it has room, and so do those of one ``group_id``
        (the samples of one prompt): its prefix cache serves what they share. ``on_held`` is
        called with the ``Held`` notice if the request waits because the fleet is not running."""
        body, request_id = envelope(
            self.client_id, prompt, messages, model, False, client_request_id, timeout, sampling,
            session_id, group_id, on_held is not None,
        )  # fmt: skip
        span, headers = self._tracing.start(self._submit_subject, request_id, model, False)
        address = self._watch.address_of(self.client_id, request_id)
        submission = Submission(
            self._publish, self._exchanges, self._watch, body, timeout, None, headers, on_held, address
        )
        try:
            with traced(span):
                await submission.start()
                while replies := await submission.replies():
                    if isinstance(final := replies[-1], Final):
                        if span is not None:
                            span.finished(final)
                        return with_logprobs(final, sampling)
        finally:
            submission.close()
        raise ClientError(ErrorCode.INTERNAL, "submission ended without a final reply")

    async def stream(
        self,
        prompt: str | list[int] | None = None,
        *,
        messages: Sequence[ChatMessage] | None = None,
        model: str | None = None,
        client_request_id: ClientRequestId | None = None,
        timeout: float = 60.0,
        session_id: str | None = None,
        group_id: str | None = None,
        on_held: OnHeld | None = None,
        flow: FlowLimits = DEFAULT_FLOW,
        **sampling: Any,
    ) -> AsyncGenerator[Partial | Final, None]:
        """Yield partials, then the final, for the arguments of :meth:`submit`; ``timeout`` bounds the whole stream.

        ``flow`` bounds the replies not read: past it the request is held; stalled, aborted (``StreamStalled``).

        The stream is exact (:class:`~service.protocol.streams.StreamCheck`): duplicates and an
        older run's partials are dropped; after a gap, or two runs that do not join, no further
        partial is yielded and the final (every token) fills the rest in; a final that does not
        extend the partials yielded raises ClientError 502."""
        batches = self.stream_batches(
            prompt,
            messages=messages,
            model=model,
            client_request_id=client_request_id,
            timeout=timeout,
            session_id=session_id,
            group_id=group_id,
            on_held=on_held,
            flow=flow,
            **sampling,
        )
        async with aclosing(batches):
            async for replies in batches:
                for reply in replies:
                    yield reply

    async def stream_batches(
        self,
        prompt: str | list[int] | None = None,
        *,
        messages: Sequence[ChatMessage] | None = None,
        model: str | None = None,
        client_request_id: ClientRequestId | None = None,
        timeout: float = 60.0,
        session_id: str | None = None,
        group_id: str | None = None,
        on_held: OnHeld | None = None,
        flow: FlowLimits = DEFAULT_FLOW,
        **sampling: Any,
    ) -> AsyncGenerator[list[Partial | Final], None]:
        """The replies of :meth:`stream`, checked the same way, as the lists that arrived
        together: for a reader that writes the replies ready together at once (the gateway), a
        wake-up per list rather than per reply."""
        body, request_id = envelope(
            self.client_id, prompt, messages, model, True, client_request_id, timeout, sampling,
            session_id, group_id, on_held is not None,
        )  # fmt: skip
        check = StreamCheck()
        span, headers = self._tracing.start(self._submit_subject, request_id, model, True)
        control = FlowControl(flow, self._holds)
        address = self._watch.address_of(self.client_id, request_id)
        submission = Submission(
            self._publish, self._exchanges, self._watch, body, timeout, control, headers, on_held, address
        )
        try:
            with traced(span):
                await submission.start()
                while replies := await submission.replies():
                    passed: list[Partial | Final] = []
                    broken: StreamBroken | None = None
                    try:
                        for reply in replies:
                            if isinstance(reply, Final):
                                check.finish(reply)
                                passed.append(with_logprobs(reply, sampling))
                                if span is not None:
                                    span.finished(reply)
                            elif check.accept(reply):
                                passed.append(reply)
                    except StreamBroken as exc:
                        broken = exc  # raised after the partials before it
                    if passed:
                        yield passed
                    if broken is not None:
                        raise ClientError(broken.code, broken.message)
                    if isinstance(replies[-1], Final):
                        return
        finally:
            submission.close()

    def arbiter_of(self, client_request_id: ClientRequestId) -> str | None:
        """The replica this client sends ``client_request_id`` to (its arbiter); None: any."""
        return self._watch.arbiter_of(self.client_id, client_request_id)

    async def abort(
        self, client_request_id: ClientRequestId | None = None, *, request_id: str | None = None, timeout: float = 10.0
    ) -> Ack:
        message = AbortRequest(client_request_id, self.client_id if request_id is None else None, request_id)
        return await self._ack(Header.ABORT_REQUEST, message, timeout)

    async def list_models(self, timeout: float = 10.0) -> ModelList:
        """The models the fleet serves, as the coordinator that answers sees it."""
        reply = await call(self.nc, self._refusals, self.subjects.coordinator(Header.LIST_MODELS), Empty(), timeout)
        if not isinstance(reply, ModelList):
            raise ClientError(ErrorCode.INTERNAL, f"unexpected reply to {Header.LIST_MODELS}: {reply!r}")
        return reply

    async def control(
        self, signal: Header, epoch: int | None = None, timeout: float = 30.0, mode: PauseMode | None = None
    ) -> Ack:
        """Send a control or profiler signal; returns once every engine confirmed it, even if the
        replica taking it dies (:mod:`.signals`; ``timeout`` must cover a drain)."""
        subject, message = self.subjects.coordinator(signal), ControlSignal(epoch, mode)
        return await signal_answered(self.nc, self._refusals, self._exchanges, self._watch, subject, message, timeout)

    async def pause(self, timeout: float = 30.0, mode: PauseMode | None = None) -> Ack:
        """Returns once no engine runs a step: ``keep`` (the default) freezes the requests in
        flight, ``abort`` ends them with their tokens so far, ``drain`` waits until they finished."""
        return await self.control(Header.PAUSE, timeout=timeout, mode=mode)

    @asynccontextmanager
    async def paused(self, mode: PauseMode = "keep", timeout: float = 600.0) -> AsyncIterator[Ack]:
        """``async with client.paused(mode="drain"):`` the fleet is paused inside the block
        (the pause's ``Ack`` is its value) and unpaused when it ends, however it ends."""
        ack = await self.pause(timeout=timeout, mode=mode)
        try:
            yield ack
        finally:
            await self.unpause(timeout=timeout)

    async def update_weights(self, path: str, version: WeightVersion, timeout: float = 900.0) -> Ack:
        """Load the checkpoint directory ``path`` on every engine as weights ``version``, while
        paused or suspended; returns once every engine serves it (the ``Ack`` has its digest).
        Raises ClientError 400 naming the first tensor that does not fit (no engine changed)."""
        return await self._ack(Header.UPDATE_WEIGHTS, UpdateWeights(path, version), timeout)

    async def unpause(self, timeout: float = 30.0) -> Ack:
        return await self.control(Header.UNPAUSE, timeout=timeout)

    async def suspend(self, timeout: float = 30.0) -> Ack:
        return await self.control(Header.SUSPEND, timeout=timeout)

    async def resume(self, timeout: float = 30.0) -> Ack:
        return await self.control(Header.RESUME, timeout=timeout)

    async def stop(self, timeout: float = 30.0) -> Ack:
        return await self.control(Header.STOP, timeout=timeout)

    async def set_generation_epoch(self, epoch: int, timeout: float = 30.0) -> Ack:
        return await self.control(Header.SET_GENERATION_EPOCH, epoch=epoch, timeout=timeout)

    async def start_profiler(self, timeout: float = 30.0) -> Ack:
        return await self.control(Header.START_CUDA_PROFILER, timeout=timeout)

    async def stop_profiler(self, timeout: float = 30.0) -> Ack:
        return await self.control(Header.STOP_CUDA_PROFILER, timeout=timeout)

    async def shutdown(self, timeout: float = 10.0) -> Ack:
        return await self._ack(Header.SHUTDOWN, Empty(), timeout)

    async def _ack(self, header: Header, message: msgspec.Struct, timeout: float) -> Ack:
        reply = await call(self.nc, self._refusals, self.subjects.coordinator(header), message, timeout)
        if not isinstance(reply, Ack):
            raise ClientError(ErrorCode.INTERNAL, f"unexpected reply to {header}: {reply!r}")
        return reply


__all__ = ["ClientError", "DpcoordClient", "FlowLimits", "StreamStalled"]
