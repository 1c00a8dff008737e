"""The arbiter of a request id (service/protocol/arbiter.py): the rule docs/protocol.md states,
computed here from it alone, and rendezvous hashing's property that a replica joining moves
only the ids it wins."""

from __future__ import annotations

import xxhash

from service.protocol.arbiter import BUCKETS, ArbiterTable, bucket_of


def by_the_rule(replicas: list[str], client_id: str | None, client_request_id: str | int) -> str:
    bucket = xxhash.xxh3_64_intdigest(f"{client_id or ''}\x00{client_request_id}".encode()) % 4096
    scores = {
        r: xxhash.xxh3_64_intdigest(bucket.to_bytes(2, "little"), xxhash.xxh3_64_intdigest(r.encode()))
        for r in replicas
    }
    return min(replicas, key=lambda replica: (-scores[replica], replica))


def test_the_arbiter_is_the_documented_rules() -> None:
    replicas = ["c-a", "c-b", "c-c"]
    table = ArbiterTable(reversed(replicas))  # the order given does not matter
    ids: list[tuple[str | None, str | int]] = [("alice", n) for n in range(300)] + [(None, "x"), ("bob", "é")]
    assert all(table.of(cid, crid) == by_the_rule(replicas, cid, crid) for cid, crid in ids)
    assert bucket_of(None, 7) == bucket_of("", 7) and 0 <= bucket_of("alice", "q") < BUCKETS


def test_a_replica_joining_moves_only_the_ids_it_wins() -> None:
    before = ArbiterTable(["c1", "c2", "c3"])
    after = ArbiterTable(["c1", "c2", "c3", "c4"])
    moved = [b for b in range(BUCKETS) if before.of_bucket(b) != after.of_bucket(b)]
    assert all(after.of_bucket(b) == "c4" for b in moved)
    assert 0.18 < len(moved) / BUCKETS < 0.32  # about a quarter
    shares = [sum(1 for b in range(BUCKETS) if after.of_bucket(b) == r) / BUCKETS for r in ("c1", "c2", "c3", "c4")]
    assert all(0.2 < share < 0.3 for share in shares)
