"""The client library's spans (:mod:`service.ops.tracing`): one per submission, ended however
the submission ends: its final, its error, or its reader stopping."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
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

    def span(
        self, subject: str, client_request_id: ClientRequestId, model: str | None, stream: bool
    ) -> SubmitSpan | None:
        tracer = self._tracer
        return None if tracer is None else tracer.submit(subject, client_request_id, model, stream)

    async def close(self) -> None:
        tracer, self._tracer = self._tracer, None
        if tracer is not None and self._owned:
            await asyncio.to_thread(tracer.close)  # exports what is left: off the event loop


@contextmanager
def traced(span: SubmitSpan | None) -> Iterator[None]:
    """Inside the block a submission runs; ``span`` (None: not traced) fails with the error that
    ends it, and is closed when the block ends (after :meth:`SubmitSpan.finished`, nothing more)."""
    if span is None:
        yield
        return
    try:
        yield
    except ClientError as exc:
        span.failed(exc.code, exc.message)
        raise
    except TimeoutError as exc:
        span.failed(ErrorCode.TIMED_OUT, str(exc))
        raise
    finally:
        span.close()
