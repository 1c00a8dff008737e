"""Limits an engine holds every submission to before its backend sees it (400 beyond them).

Stop strings are checked against the generated text after every token, so their count and
length are capped (``max_stop_strings``, ``max_stop_string_bytes``): 100,000 of them made
every step of every request sharing the engine slow. ``max_tokens`` may not exceed the
backend's context (:attr:`engines.backend.Backend.max_context`): a request asking for 10^12
tokens would hold its slot until its deadline. Token ids are checked against the vocabulary
by the backend itself, in ``add``. A migrated request's resume tokens must leave room for
one more token under its ``max_tokens``: an earlier run with that many tokens had finished.
"""

from __future__ import annotations

from service.ops.settings import Settings
from service.protocol.errors import ErrorCode, WireError
from service.protocol.messages import SubmitRequest
from service.protocol.subjects import utf8_length


def check_limits(submit: SubmitRequest, settings: Settings, max_context: int | None) -> None:
    params = submit.sampling_params
    stop = params.stop
    if stop:
        if len(stop) > settings.max_stop_strings:
            raise WireError(
                ErrorCode.MALFORMED, f"{len(stop)} stop strings exceed max_stop_strings ({settings.max_stop_strings})"
            )
        limit = settings.max_stop_string_bytes
        if any(len(text) > limit or utf8_length(text) > limit for text in stop):
            raise WireError(ErrorCode.MALFORMED, f"a stop string is longer than max_stop_string_bytes ({limit})")
    if max_context is not None and params.max_tokens is not None and params.max_tokens > max_context:
        raise WireError(
            ErrorCode.MALFORMED, f"max_tokens {params.max_tokens} exceeds the engine's context of {max_context} tokens"
        )


def check_resume(resume_tokens: list[int], max_tokens: int) -> None:
    if len(resume_tokens) >= max_tokens:
        raise WireError(
            ErrorCode.MALFORMED,
            f"{len(resume_tokens)} resume tokens leave nothing to generate under max_tokens {max_tokens}",
        )
