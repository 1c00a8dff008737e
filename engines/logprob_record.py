"""One request's log-probabilities on their way into its replies.

A :class:`LogprobRecord` belongs to the request table's record of a request that asked for
log-probabilities (:class:`engines.replies.ActiveRequest`; a request that asked none has no
record and pays nothing). It keeps each generated token's logprob and alternatives, aligned with
the tokens (those an earlier run delivered first, on a migration), and the prompt's, and gives
each partial the values of its own tokens and the final all of them, with the bytes of every
token id they name (:meth:`engines.backend.Backend.token_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from engines.backend import PromptLogprobs, TokenOutput
from service.protocol.errors import ErrorCode, WireError
from service.protocol.logprobs import StreamedLogprobs, TopLogprob

TokenBytes = Callable[[Iterable[int]], dict[int, bytes]]


@dataclass(slots=True)
class ReplyLogprobs:
    """The logprob fields of one reply, as :class:`~service.protocol.messages.Partial` and
    :class:`~service.protocol.messages.Final` name them."""

    token_logprobs: list[float] | None
    top_logprobs: list[list[TopLogprob]] | None
    token_bytes: dict[int, bytes]
    prompt: PromptLogprobs | None = None


@dataclass(slots=True, eq=False)
class LogprobRecord:
    """``generated``: the request asked for its generated tokens' logprobs (``top``: with
    alternatives); it may have asked for its prompt's alone."""

    bytes_of: TokenBytes
    generated: bool
    top: bool
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[TopLogprob]] = field(default_factory=list)
    unsent: int = 0  # the first token whose logprob no partial carried yet
    prompt: PromptLogprobs | None = None

    def resume(self, tokens: int, delivered: StreamedLogprobs | None) -> None:
        """Start after the logprobs an earlier run delivered for its ``tokens`` tokens (a
        migration), as its own; raises WireError 400 when they do not cover those tokens."""
        if not self.generated:
            return
        if (
            delivered is None
            or len(delivered.token_logprobs) != tokens
            or (self.top and (delivered.top_logprobs is None or len(delivered.top_logprobs) != tokens))
        ):
            raise WireError(ErrorCode.MALFORMED, "resume_tokens come without their logprobs (resume_logprobs)")
        self.logprobs.extend(delivered.token_logprobs)
        if self.top and delivered.top_logprobs is not None:
            self.top_logprobs.extend(delivered.top_logprobs)
        self.unsent = len(self.logprobs)

    def streamed(self) -> StreamedLogprobs:
        """The logprobs of every token so far, as a coordinator keeps them for a migration."""
        return StreamedLogprobs(list(self.logprobs), list(self.top_logprobs) if self.top else None)

    def record(self, output: TokenOutput) -> None:
        """Raises ValueError for a backend output whose logprobs do not match its tokens."""
        if output.prompt is not None:
            self.prompt = output.prompt
        if not self.generated or not output.new_tokens:
            return
        logprobs, top = output.logprobs, output.top_logprobs
        count = len(output.new_tokens)
        if logprobs is None or len(logprobs) != count or (self.top and (top is None or len(top) != count)):
            raise ValueError(f"request_id={output.request_id}: the backend's logprobs do not match its tokens")
        self.logprobs.extend(logprobs)
        if self.top and top is not None:
            self.top_logprobs.extend(top)

    def partial(self, tokens: list[int]) -> ReplyLogprobs:
        """The fields of the partial carrying ``tokens``, the ones recorded since the last partial
        (asked only when the request asked for its generated tokens' logprobs)."""
        start, self.unsent = self.unsent, len(self.logprobs)
        top = self.top_logprobs[start:] if self.top else None
        return ReplyLogprobs(self.logprobs[start:], top, self.bytes_of(_named(tokens, top)))

    def final(self, tokens: list[int]) -> ReplyLogprobs:
        """The fields of the final carrying every one of ``tokens`` (and the prompt's)."""
        top = self.top_logprobs if self.generated and self.top else None
        named = _named(tokens, top) if self.generated else set()
        prompt = self.prompt
        if prompt is not None:
            named.update(prompt.token_ids)
            for alternatives in prompt.top_logprobs or ():
                named.update(token for token, _ in alternatives or ())
        return ReplyLogprobs(self.logprobs if self.generated else None, top, self.bytes_of(named), prompt)


def _named(tokens: list[int], top: list[list[TopLogprob]] | None) -> set[int]:
    """The token ids ``tokens`` and their alternatives name."""
    if not top:
        return set(tokens)
    return {token for alternatives in top for token, _ in alternatives}.union(tokens)
