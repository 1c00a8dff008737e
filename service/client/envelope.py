"""The client library's submission as it travels: a :class:`SubmitEnvelope` around the contract
body, so the coordinator routes it without decoding the prompt."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from service.client.calls import ClientError
from service.protocol.codec import encode_msgpack
from service.protocol.errors import ErrorCode
from service.protocol.messages import ChatMessage, ClientRequestId, SamplingParams, SubmitEnvelope, SubmitRequest
from service.protocol.prefix import prefix_hashes


def envelope(
    client_id: str,
    prompt: str | list[int] | None,
    messages: Sequence[ChatMessage] | None,
    model: str | None,
    stream: bool,
    client_request_id: ClientRequestId | None,
    timeout: float,
    sampling: dict[str, Any],
    session_id: str | None = None,
    group_id: str | None = None,
    held_notices: bool = False,
) -> tuple[bytes, ClientRequestId]:
    """The encoded envelope of one submission of ``client_id``, and its ``client_request_id``
    (drawn when None); it carries the prompt's prefix hashes for prefix-aware routing (none for a
    prompt shorter than one block), the session and group for cache-aware routing, whether the
    body asks for log-probabilities, and asks for a ``Held`` notice when ``held_notices``."""
    params = SamplingParams(**{key: value for key, value in sampling.items() if value is not None})
    if params.timeout_s is None:
        params.timeout_s = timeout
    # 128 random bits in hex (uuid4 gives 122, for five times the CPU), drawn per request: an
    # id one caller learns tells nothing of the next (docs/security.md, blind aborts)
    request_id = client_request_id if client_request_id is not None else os.urandom(16).hex()
    chat = list(messages) if messages is not None else None
    try:
        body = encode_msgpack(SubmitRequest(prompt, params, stream, request_id, client_id, None, model, chat))
    except OverflowError:  # Python integers have no bound; msgpack's stop at 64 bits
        raise ClientError(ErrorCode.MALFORMED, "an integer of the submission does not fit in 64 bits") from None
    hashes = prefix_hashes(prompt, chat) or None
    message = SubmitEnvelope(1, body, stream, request_id, client_id, None, params.timeout_s, model, hashes)
    message.batched_replies, message.logprobs = True, params.asks_logprobs
    message.session_id, message.group_id, message.held_notices = session_id, group_id, held_notices
    return encode_msgpack(message), request_id
