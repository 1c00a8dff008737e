"""Splitting a batch of messages so that each NATS message stays under the server's max_payload.

The coordinator batches routed requests per engine and the engines batch their replies; both
bound each message the same way, with :func:`split_batches` and :data:`BATCH_OVERHEAD`, and
count each item with :func:`item_size`.
Callers deal with an item that cannot fit alone before splitting (see :func:`fits_alone`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from service.protocol.logprobs import StreamedLogprobs
from service.protocol.routed import ReturnPath
from service.protocol.subjects import utf8_length

Item = TypeVar("Item")

# Bytes of msgpack framing a batch message adds around its items (array headers, the
# engine id of a reply batch): a generous bound.
BATCH_OVERHEAD = 256
# Bytes of msgpack framing around one item, besides the sizes the caller counts.
ITEM_OVERHEAD = 64
# Bytes msgpack takes for one token id at most (ids fit 31 bits: a uint32, tag included).
TOKEN_BYTES = 5
# Bytes msgpack takes for one logprob (a float64, tag included) and for one alternative (an
# array of two: a token id and a logprob).
LOGPROB_BYTES = 9
ALTERNATIVE_BYTES = 1 + TOKEN_BYTES + LOGPROB_BYTES


def logprob_size(logprobs: StreamedLogprobs | None) -> int:
    """Bytes ``logprobs`` take beside a routed request's or reply's tokens, at most."""
    if logprobs is None:
        return 0
    size = LOGPROB_BYTES * len(logprobs.token_logprobs)
    for alternatives in logprobs.top_logprobs or ():
        size += 5 + ALTERNATIVE_BYTES * len(alternatives)
    return size


def batch_limit(max_payload: int) -> int:
    """The bytes of items one batch may hold under the server's ``max_payload``."""
    return max_payload - BATCH_OVERHEAD


def fits_alone(size: int, max_payload: int) -> bool:
    return size <= batch_limit(max_payload)


def item_size(
    body: bytes, return_path: ReturnPath, tokens: list[int] | None = None, logprobs: StreamedLogprobs | None = None
) -> int:
    """Bytes one routed request or reply takes in a batch: its body, every string of its return
    path in UTF-8 as msgpack carries them (the coordinator's ids and the encoding name are
    ASCII; an integer ``client_request_id`` fits :data:`ITEM_OVERHEAD`), the token ids it
    carries beside the body (a routed request's resume tokens, a partial's tokens) and their
    logprobs, and the framing around them."""
    text = return_path.reply_to + (return_path.client_id or "")
    client_request_id = return_path.client_request_id
    if isinstance(client_request_id, str):
        text += client_request_id
    size = (
        len(body)
        + len(return_path.request_id)
        + len(return_path.coordinator_id)
        + len(return_path.encoding)
        + utf8_length(text)
        + ITEM_OVERHEAD
    )
    if tokens:
        size += TOKEN_BYTES * len(tokens)
    if logprobs is not None:
        size += logprob_size(logprobs)
    return size


def split_batches(items: Iterable[Item], size_of: Callable[[Item], int], max_payload: int) -> Iterator[list[Item]]:
    """Consecutive groups of ``items`` whose summed ``size_of`` stays within the batch limit.

    An item larger than the limit still leaves, alone in its group: callers check
    :func:`fits_alone` first and replace or refuse such items."""
    limit = batch_limit(max_payload)
    batch: list[Item] = []
    size = 0
    for item in items:
        item_size = size_of(item)
        if batch and size + item_size > limit:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += item_size
    if batch:
        yield batch
