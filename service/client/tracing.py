"""The client library's spans (:mod:`service.ops.tracing`): one per submission, ended however
the submission ends: its final, its error, or its reader stopping."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from service.client.calls import ClientError
from service.ops.tracing import TracingSettings, start_tracing
from service.protocol.errors import ErrorCode
from service.protocol.messages import ClientRequestId

if TYPE_CHECKING:
    from service.ops.tracing.otel import SubmitSpan, Tracer


class ClientTracing:
    """The tracer submissions' spans go to (None: tracing off), and whether the library closes it."""

    def __init__(self, tracer: Tracer | None = None, owned: bool = False) -> None:
        self._tracer = tracer
        self._owned = owned

    @classmethod
    def of(cls, settings: TracingSettings, tracer: Tracer | None) -> ClientTracing:
        """``tracer`` (the caller's), or one from settings (the library's own, closed with it)."""
        if tracer is not None:
            return cls(tracer)
        return cls(start_tracing(settings, "dpcoord-client"), owned=True)

    def start(
        self, subject: str, client_request_id: ClientRequestId, model: str | None, stream: bool
    ) -> tuple[SubmitSpan | None, Mapping[str, str] | None]:
        """A submission's span and the NATS headers of its publishes; ``(None, None)`` untraced."""
        tracer = self._tracer
        if tracer is None:
            return None, None
        span = tracer.submit(subject, client_request_id, model, stream)
        return span, span.headers

    async def close(self) -> None:
        tracer, self._tracer = self._tracer, None
        if tracer is not None and self._owned:
            await asyncio.to_thread(tracer.close)  # exports what is left: off the event loop


class _Untraced:
    """The block of an untraced submission: nothing happens around it (and next to nothing is spent)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: object) -> None:
        return None


_UNTRACED = _Untraced()


class _Traced:
    __slots__ = ("_span",)

    def __init__(self, span: SubmitSpan) -> None:
        self._span = span

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        span = self._span
        if isinstance(exc, ClientError):
            span.failed(exc.code, exc.message)
        elif isinstance(exc, TimeoutError):
            span.failed(ErrorCode.TIMED_OUT, str(exc))
        span.close()


def traced(span: SubmitSpan | None) -> AbstractContextManager[None]:
    """The block a submission runs in: ``span`` (None: not traced) fails with the error that ends
    it, and is closed when the block ends (after :meth:`SubmitSpan.finished`, nothing more),
    also when its reader stops reading a stream."""
    return _UNTRACED if span is None else _Traced(span)
