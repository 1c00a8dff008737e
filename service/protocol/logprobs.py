"""Log-probabilities on the wire (an extension, docs/protocol.md, *Log-probabilities*): the bounds
of the sampling parameters that ask for them, the pairs that name alternatives, and what travels
beside a stream's tokens between engines and coordinators. The client-facing fields are
:class:`~service.protocol.messages.Partial`'s and :class:`~service.protocol.messages.Final`'s."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct

# How many alternatives a token may list, and which distribution they are of: the model's own ("raw") or the one sampled from, after
# temperature, top-k and top-p ("processed").
MAX_LOGPROBS = 20
LogprobCount = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
LogprobsMode = Literal["raw", "processed"]
# One alternative at a position: a token id and its log-probability, encoded as a pair.
TopLogprob = tuple[int, float]


class StreamedLogprobs(Struct, array_like=True, gc=False):
    """Log-probabilities of tokens a stream delivered, aligned with their ids, carried beside a
    partial's ``tokens`` (:class:`~service.protocol.routed.RoutedReply`) so the coordinator
    keeps them for a migration without decoding the client's body, and handed to the engine that
    resumes the stream (:class:`~service.protocol.routed.RoutedRequest`), whose final carries
    every token's."""

    token_logprobs: list[float]
    top_logprobs: list[list[TopLogprob]] | None = None
