"""Reply batches: the replies one coordinator turn has for one client, in one NATS message.

A streamed token is one reply, so a client with many streams in flight (the gateway) would read
one NATS message per token of each, and the coordinator and nats-server would carry as many:
most of their CPU per token goes to the message, not to the reply. A client that sets
``SubmitEnvelope.batched_replies`` says it reads batches; the coordinator then may send the
replies it has for that client's requests in one turn (one engine's reply message) as one
batch, on the client's batch subject, in the order it would have sent them apart.

The rules (docs/protocol.md, *Reply batches*):
- The batch subject is the reply subject with its last token replaced by ``b``
  (:func:`batch_subject`): ``_INBOX.abc.17`` batches on ``_INBOX.abc.b``, next to the client's
  other reply subjects, so a client's wildcard inbox subscription (``_INBOX.abc.*``) receives
  both. Such a client must not use ``b`` as a reply token of its own.
- A batch is a msgpack array of ``[token, reply]`` pairs, both binary: ``token`` is the last
  token of the reply's own subject and ``reply`` its body, exactly as it would have gone alone
  (an empty body is the end of a stream, as ever).
- A turn's single reply for a client goes alone to its own subject, and so does any reply too
  big to share a message; a batch stays under the server's ``max_payload``.
- Nothing else changes: the same replies, in the same order per request, with core NATS's
  at-most-once delivery (a lost batch is lost replies, which the client's stream check and
  resubmission handle as before).
"""

from __future__ import annotations

import msgspec

BATCH_TOKEN = "b"
# Bytes of msgpack framing per pair besides its token and body (array and bin headers): a bound.
PAIR_OVERHEAD = 16

ReplyBatch = list[tuple[bytes, bytes]]
batch_decoder = msgspec.msgpack.Decoder(ReplyBatch)
_encoder = msgspec.msgpack.Encoder()


def batch_subject(reply_to: str) -> str | None:
    """Where replies to ``reply_to`` may go batched; None for a subject of one token, or one whose
    last token is the batch token itself."""
    prefix, dot, token = reply_to.rpartition(".")
    if not dot or not prefix or token == BATCH_TOKEN:
        return None
    return f"{prefix}.{BATCH_TOKEN}"


def encode_batch(pairs: ReplyBatch) -> bytes:
    return _encoder.encode(pairs)


def pair_size(pair: tuple[bytes, bytes]) -> int:
    """Bytes ``pair`` takes in a batch, framing included."""
    return len(pair[0]) + len(pair[1]) + PAIR_OVERHEAD
