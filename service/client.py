"""The async client library: submit, stream, abort, control and shutdown, each with a timeout.

It speaks msgpack. Error replies raise :class:`ClientError` with the wire code.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from service.errors import ErrorCode, WireError
from service.nats_connection import connect_nats
from service.settings import Settings
from service.subjects import Header, Subjects
from service.wire import (
    AbortRequest,
    Ack,
    ClientRequestId,
    ConnectAck,
    ConnectRequest,
    ControlSignal,
    Empty,
    ErrorReply,
    Final,
    Partial,
    Reply,
    SamplingParams,
    SubmitEnvelope,
    SubmitRequest,
    encode_msgpack,
)

_reply_decoder = msgspec.msgpack.Decoder(Reply)


class ClientError(WireError):
    """The coordinator or an engine answered with an error reply."""


def _check(reply: Reply) -> Reply:
    if isinstance(reply, ErrorReply):
        raise ClientError(reply.error.code, reply.error.message)
    return reply


class DpcoordClient:
    def __init__(self, nc: NATS, subjects: Subjects, client_id: str, coordinator_id: str, owns_connection: bool) -> None:
        self.nc = nc
        self.subjects = subjects
        self.client_id = client_id
        self.coordinator_id = coordinator_id
        self._owns_connection = owns_connection

    @classmethod
    async def connect(
        cls, settings: Settings, client_id: str | None = None, timeout: float = 10.0, nc: NATS | None = None
    ) -> DpcoordClient:
        """Connect to NATS (unless ``nc`` is given) and shake hands with a coordinator."""
        owns = nc is None
        connection = nc or await connect_nats(settings, name="dpcoord-client")
        subjects = Subjects(settings.subject_prefix)
        try:
            ack = await _call(connection, subjects.coordinator(Header.CONNECT), ConnectRequest(client_id), timeout)
        except BaseException:
            if owns:
                await connection.close()
            raise
        if not isinstance(ack, ConnectAck):
            raise ClientError(ErrorCode.INTERNAL, f"unexpected connect reply {ack!r}")
        return cls(connection, subjects, ack.client_id, ack.coordinator_id, owns)

    async def close(self) -> None:
        if self._owns_connection:
            await self.nc.drain()

    async def __aenter__(self) -> DpcoordClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _submission(self, prompt: str | list[int], stream: bool, client_request_id: ClientRequestId | None, sampling: dict[str, Any]) -> bytes:
        """A :class:`SubmitEnvelope`, so the coordinator routes it without decoding the prompt."""
        params = SamplingParams(**{key: value for key, value in sampling.items() if value is not None})
        body = encode_msgpack(SubmitRequest(prompt, params, stream, client_request_id, self.client_id))
        return encode_msgpack(SubmitEnvelope(1, body, stream, client_request_id, self.client_id, None, params.timeout_s))

    async def submit(
        self, prompt: str | list[int], *, client_request_id: ClientRequestId | None = None, timeout: float = 60.0, **sampling: Any
    ) -> Final:
        """Run a request and return its final reply; sampling keywords are SamplingParams fields."""
        body = self._submission(prompt, False, client_request_id, sampling)
        reply = await _call_raw(self.nc, self.subjects.coordinator(Header.SUBMIT_REQUEST), body, timeout)
        if not isinstance(reply, Final):
            raise ClientError(ErrorCode.INTERNAL, f"unexpected reply {reply!r}")
        return reply

    async def stream(
        self, prompt: str | list[int], *, client_request_id: ClientRequestId | None = None, timeout: float = 60.0, **sampling: Any
    ) -> AsyncIterator[Partial | Final]:
        """Yield partials, then the final; ``timeout`` bounds the whole stream."""
        deadline = time.monotonic() + timeout
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        try:
            body = self._submission(prompt, True, client_request_id, sampling)
            await self.nc.publish(self.subjects.coordinator(Header.SUBMIT_REQUEST), body, reply=inbox)
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"stream not finished within {timeout} s")
                try:
                    msg = await sub.next_msg(timeout=remaining)
                except NatsTimeoutError:
                    raise TimeoutError(f"stream not finished within {timeout} s") from None
                if not msg.data:
                    return
                reply = _check(_reply_decoder.decode(msg.data))
                if isinstance(reply, (Partial, Final)):
                    yield reply
        finally:
            await sub.unsubscribe()

    async def abort(
        self, client_request_id: ClientRequestId | None = None, *, request_id: str | None = None, timeout: float = 10.0
    ) -> Ack:
        message = AbortRequest(client_request_id, self.client_id if request_id is None else None, request_id)
        return await self._ack(Header.ABORT_REQUEST, message, timeout)

    async def control(self, signal: Header, epoch: int | None = None, timeout: float = 30.0) -> Ack:
        """Send a control or profiler signal; returns once every engine confirmed it."""
        return await self._ack(signal, ControlSignal(epoch), timeout)

    async def pause(self, timeout: float = 30.0) -> Ack:
        return await self.control(Header.PAUSE, timeout=timeout)

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
        reply = await _call(self.nc, self.subjects.coordinator(header), message, timeout)
        if not isinstance(reply, Ack):
            raise ClientError(ErrorCode.INTERNAL, f"unexpected reply to {header}: {reply!r}")
        return reply


async def _call(nc: NATS, subject: str, message: msgspec.Struct, timeout: float) -> Reply:
    return await _call_raw(nc, subject, encode_msgpack(message), timeout)


async def _call_raw(nc: NATS, subject: str, body: bytes, timeout: float) -> Reply:
    try:
        msg = await nc.request(subject, body, timeout=timeout)
    except NoRespondersError:
        raise ClientError(ErrorCode.NO_ENGINE, f"no coordinator is listening on {subject}") from None
    except NatsTimeoutError:
        raise TimeoutError(f"no reply on {subject} within {timeout} s") from None
    return _check(_reply_decoder.decode(msg.data))


__all__ = ["ClientError", "DpcoordClient"]
