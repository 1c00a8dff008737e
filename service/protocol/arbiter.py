"""Which coordinator replica arbitrates a request id: rendezvous hashing over the replicas.

Every submission that names a ``client_request_id`` has one arbiter among the replicas of its
prefix, the one replica that may run it (docs/protocol.md, *Resubmission*). Anyone who knows
the replicas names the same arbiter without asking: the coordinators, and the client library,
which sends each submission straight to its arbiter (``<prefix>.submit_request.<arbiter>``).

The rule, for a client to compute it alike:

- an id's bucket is the low 12 bits of XXH3-64 (seed 0) of ``<client_id>\\0<client_request_id>``
  in UTF-8, each part as its text (no ``client_id``: the empty text; an integer id: its decimal
  digits);
- a bucket's arbiter is the replica with the highest XXH3-64 of the bucket number as two bytes,
  little-endian, seeded with the XXH3-64 (seed 0) of the replica's id in UTF-8; ties go to the
  lowest id.

So a replica that joins or leaves moves only the buckets it wins or held, about ``1/n`` of
them (the property of rendezvous hashing), and a lookup costs one hash and one list index.
"""

from __future__ import annotations

from collections.abc import Iterable

import xxhash

BUCKET_BITS = 12
BUCKETS = 1 << BUCKET_BITS
_MASK = BUCKETS - 1
_hash = xxhash.xxh3_64_intdigest


def bucket_of(client_id: str | None, client_request_id: str | int) -> int:
    """The bucket of an id (see the module docstring)."""
    return _hash(_id_bytes(f"{client_id or ''}\x00{client_request_id}")) & _MASK


def _id_bytes(text: str) -> bytes:
    try:
        return text.encode()
    except UnicodeEncodeError:  # a lone surrogate, which JSON can carry
        return text.encode("utf-8", "surrogatepass")


class ArbiterTable:
    """The arbiter of every bucket among ``replicas``, computed once (``BUCKETS`` times the
    replicas' number of hashes: milliseconds), read in O(1)."""

    __slots__ = ("_winners", "replicas")

    def __init__(self, replicas: Iterable[str]) -> None:
        self.replicas = frozenset(replicas)
        if not self.replicas:
            raise ValueError("an arbiter table needs at least one replica")
        seeds = [(replica, _hash(replica.encode("utf-8", "surrogatepass"))) for replica in sorted(self.replicas)]
        if len(seeds) == 1:
            self._winners = [seeds[0][0]] * BUCKETS
            return
        winners = []
        for bucket in range(BUCKETS):
            data = bucket.to_bytes(2, "little")
            best, best_score = seeds[0][0], -1
            for replica, seed in seeds:
                score = _hash(data, seed)
                if score > best_score:
                    best, best_score = replica, score
            winners.append(best)
        self._winners = winners

    def of(self, client_id: str | None, client_request_id: str | int) -> str:
        """The replica arbitrating ``(client_id, client_request_id)`` (:func:`bucket_of`, inlined:
        every named submission asks)."""
        text = f"{client_id or ''}\x00{client_request_id}"
        try:
            data = text.encode()
        except UnicodeEncodeError:
            data = text.encode("utf-8", "surrogatepass")
        return self._winners[_hash(data) & _MASK]

    def of_bucket(self, bucket: int) -> str:
        return self._winners[bucket]
