"""The client library's last guard on log-probabilities: a final without those asked for is
no answer to the request. Coordinators of this release route such requests only to engines that
compute them (docs/protocol.md, *Log-probabilities*); behind one of an earlier release an engine
of an earlier release may still answer, ignoring the fields."""

from __future__ import annotations

from typing import Any

from service.client.calls import ClientError
from service.protocol.errors import ErrorCode
from service.protocol.messages import Final


def with_logprobs(final: Final, sampling: dict[str, Any]) -> Final:
    """``final``, unless it lacks the log-probabilities ``sampling`` asked for: an engine of an
    earlier release (behind a coordinator of one, which routes by no feature) ignores the
    fields, and a final without them is no answer to the request. An ``abort`` final carries
    those of the tokens generated so far (none when no engine ran it)."""
    if not sampling or final.finish_reason == "abort":
        return final
    missing = [
        name
        for name, present in (("logprobs", final.token_logprobs), ("prompt_logprobs", final.prompt_logprobs))
        if sampling.get(name) is not None and present is None
    ]
    if missing:
        raise ClientError(
            ErrorCode.NO_ENGINE,
            f"engine {final.engine_id} answered without the {' and '.join(missing)} asked for "
            "(an engine of an earlier release ignores them)",
        )
    return final
