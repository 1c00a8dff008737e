"""The client library's span of a submission (:mod:`service.ops.tracing`), ended however the
submission ends: its final, its error, or its reader stopping."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from service.client.calls import ClientError
from service.protocol.errors import ErrorCode

if TYPE_CHECKING:
    from service.ops.tracing.otel import SubmitSpan


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
