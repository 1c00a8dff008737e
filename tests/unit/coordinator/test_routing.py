"""Routing policies over the engine pool: least loaded with rotated ties and a batching slack,
power of two choices, round robin, and prefix-aware routing with its bounds. No bus needed."""

from __future__ import annotations

import hashlib
import random
from collections import Counter

import pytest

from service.coordinator.cache_routing import CANDIDATES
from service.coordinator.pool import EnginePool, EngineRecord
from service.coordinator.prefix_routing import OWNERS_PER_PREFIX, SWEEP_EVERY, PrefixAware, PrefixTable
from service.coordinator.route_key import RouteKey
from service.coordinator.routing import LeastLoaded, PowerOfTwoChoices, RoundRobin, RoutingPolicy, make_policy
from service.ops.settings import Settings
from service.protocol.messages import SubmitEnvelope, SubmitRequest
from service.protocol.prefix import MAX_PREFIX_HASHES, TOKENS_PER_BLOCK, prefix_hashes

_ids = iter(range(1 << 40))


def pool_of(*loads: int, capacity: int = 4) -> EnginePool:
    pool = EnginePool(max_inflight_per_engine=1024, departed_memory_s=10.0)
    for index, load in enumerate(loads):
        record = pool.add(f"e{index}", capacity)
        for _ in range(load):
            pool.assign(record, f"r{next(_ids)}")
    return pool


def route(pool: EnginePool, policy: RoutingPolicy, key: list[int] | None = None) -> EngineRecord | None:
    """Choose and assign, as the coordinator does."""
    record = policy.choose(pool.everyone, RouteKey(key) if key else None)
    if record is not None:
        pool.assign(record, f"r{next(_ids)}")
    return record


def loads(pool: EnginePool) -> list[int]:
    return [record.load for record in sorted(pool, key=lambda record: record.engine_id)]


# ---------------------------------------------------------------- least loaded


def test_least_loaded_picks_the_emptiest() -> None:
    pool = pool_of(3, 1, 2)
    assert LeastLoaded().choose(pool.everyone).engine_id == "e1"  # type: ignore[union-attr]


def test_least_loaded_rotates_ties() -> None:
    pool = pool_of(0, 0, 0, capacity=100)
    policy = LeastLoaded()
    picks: Counter[str] = Counter()
    for _ in range(30):
        record = route(pool, policy)
        assert record is not None
        picks[record.engine_id] += 1
        policy.turn_ended()
    assert picks == {"e0": 10, "e1": 10, "e2": 10}


def test_an_engine_answering_a_request_is_least_loaded_again() -> None:
    pool = pool_of(2, 2)
    policy = LeastLoaded()
    e1 = pool.get("e1")
    assert e1 is not None
    pool.release(e1.engine_id, next(iter(e1.requests)))
    assert policy.choose(pool.everyone) is e1
    assert not pool.release(e1.engine_id, "never-routed-here")


def test_full_engines_are_skipped_and_none_when_all_full() -> None:
    assert LeastLoaded().choose(pool_of(4, 4, 3).everyone).engine_id == "e2"  # type: ignore[union-attr]
    for policy_type in (LeastLoaded, PowerOfTwoChoices, RoundRobin):
        assert policy_type().choose(pool_of(4, 4).everyone) is None
        assert policy_type().choose(pool_of().everyone) is None


def test_a_full_engine_gets_room_back_when_a_request_ends() -> None:
    pool = pool_of(4, 4)
    e0 = pool.get("e0")
    assert e0 is not None
    pool.release(e0.engine_id, next(iter(e0.requests)))
    for policy_type in (LeastLoaded, PowerOfTwoChoices, RoundRobin):
        assert policy_type().choose(pool.everyone) is e0


def test_slack_keeps_one_engine_batching_within_the_bound() -> None:
    """Within one loop turn the engine receiving a batch keeps getting requests while its load
    is at most the least loaded engine's plus the slack; a new turn starts from the least loaded."""
    pool = pool_of(*[0] * 50, capacity=100)
    policy = LeastLoaded(load_slack=4)
    first = [route(pool, policy) for _ in range(12)]
    assert [record.engine_id for record in first] == ["e0"] * 5 + ["e1"] * 5 + ["e2"] * 2  # type: ignore[union-attr]
    policy.turn_ended()
    assert route(pool, policy).engine_id == "e3"  # type: ignore[union-attr]


def test_slack_bounds_every_choice_whatever_the_releases() -> None:
    """Requests end in any order; every choice still lands within the slack of the least loaded."""
    pool = pool_of(*[0] * 7, capacity=1000)
    policy = LeastLoaded(load_slack=3)
    rng = random.Random(5)
    for step in range(3000):
        if rng.random() < 0.6:
            lowest = min(loads(pool))
            record = route(pool, policy)
            assert record is not None and record.load - 1 <= lowest + 3, f"step {step}: {loads(pool)}"
        else:
            busy = [record for record in pool if record.load]
            if busy:
                record = rng.choice(busy)
                pool.release(record.engine_id, next(iter(record.requests)))
        if rng.random() < 0.2:
            policy.turn_ended()


def test_slack_zero_is_exact_least_loaded() -> None:
    pool = pool_of(*[0] * 5, capacity=100)
    policy = LeastLoaded(load_slack=0)
    for _ in range(23):
        route(pool, policy)
        assert max(loads(pool)) - min(loads(pool)) <= 1


def test_a_batching_engine_that_left_is_not_chosen() -> None:
    pool = pool_of(0, 0, capacity=100)
    policy = LeastLoaded(load_slack=10)
    first = route(pool, policy)
    assert first is not None
    pool.remove(first.engine_id, departed=True)
    assert route(pool, policy) is not first


# ---------------------------------------------------------------- power of two choices


def test_p2c_with_two_engines_takes_the_less_loaded() -> None:
    pool = pool_of(3, 1)
    policy = PowerOfTwoChoices()
    assert all(policy.choose(pool.everyone).engine_id == "e1" for _ in range(20))  # type: ignore[union-attr]


def test_p2c_keeps_loads_close() -> None:
    random.seed(11)
    pool = pool_of(*[0] * 100, capacity=1000)
    policy = PowerOfTwoChoices()
    for _ in range(2000):
        route(pool, policy)
        policy.turn_ended()
    assert max(loads(pool)) - min(loads(pool)) <= 5, loads(pool)


def test_p2c_never_returns_a_full_engine() -> None:
    random.seed(3)
    pool = pool_of(*[4] * 30, 0, capacity=4)
    policy = PowerOfTwoChoices()
    assert all(policy.choose(pool.everyone).engine_id == "e30" for _ in range(20))  # type: ignore[union-attr]


# ---------------------------------------------------------------- round robin


def test_round_robin_cycles_and_skips_full() -> None:
    pool = pool_of(0, 4, 0)
    policy = RoundRobin()
    assert [policy.choose(pool.everyone).engine_id for _ in range(4)] == ["e0", "e2", "e0", "e2"]  # type: ignore[union-attr]


# ---------------------------------------------------------------- cost independent of the fleet's size


class CountingSet(set[str]):
    """An engine's request set that counts how often routing reads it."""

    reads = 0

    def __len__(self) -> int:
        CountingSet.reads += 1
        return super().__len__()


@pytest.mark.parametrize("name", ["least_loaded", "p2c", "round_robin", "prefix", "cache_aware"])
def test_a_choice_reads_a_bounded_number_of_engines(name: str) -> None:
    """Routing 2,000 requests over 10,000 engines reads a few engines per choice, never the fleet."""
    pool = EnginePool(max_inflight_per_engine=256, departed_memory_s=10.0)
    for index in range(10_000):
        record = pool.add(f"e{index}", 256)
        record.requests = CountingSet()
    policy = make_policy(Settings(routing_policy=name))
    key = RouteKey(prefix_hashes(list(range(40 * TOKENS_PER_BLOCK))), session_id="s")
    CountingSet.reads = 0
    for index in range(2000):
        chosen = policy.choose(pool.everyone, key if index % 2 else None)
        assert chosen is not None
        pool.assign(chosen, f"r{index}")
        if index % 3 == 0:
            policy.turn_ended()
    bound = {"prefix": 2 * OWNERS_PER_PREFIX * MAX_PREFIX_HASHES, "cache_aware": 4 * CANDIDATES}.get(name, 10)
    assert CountingSet.reads / 2000 <= bound


# ---------------------------------------------------------------- prefix-aware


def prefix_policy(pool: EnginePool, load_bound: int = 32, size: int = 1000, ttl_s: float = 60.0) -> PrefixAware:
    return PrefixAware(LeastLoaded(), PrefixTable(size, ttl_s), load_bound)


def prompt(shared: int, own: int, seed: int) -> list[int]:
    """``shared`` system-prompt blocks common to every seed, then ``own`` blocks of this seed's."""
    return list(range(shared * TOKENS_PER_BLOCK)) + [10_000 + seed] * (own * TOKENS_PER_BLOCK)


def test_prompts_sharing_a_prefix_go_to_the_same_engine() -> None:
    pool = pool_of(*[0] * 8, capacity=256)
    policy = prefix_policy(pool)
    engines = {route(pool, policy, prefix_hashes(prompt(64, 2, seed))).engine_id for seed in range(20)}  # type: ignore[union-attr]
    assert len(engines) == 1


def test_unrelated_prompts_spread_by_load() -> None:
    pool = pool_of(*[0] * 8, capacity=256)
    policy = prefix_policy(pool)
    for seed in range(16):
        route(pool, policy, prefix_hashes([seed] * (4 * TOKENS_PER_BLOCK)))
        policy.turn_ended()
    assert loads(pool) == [2] * 8


def test_a_hot_prefix_spreads_past_the_load_bound() -> None:
    pool = pool_of(*[0] * 8, capacity=256)
    policy = prefix_policy(pool, load_bound=3)
    key = prefix_hashes(prompt(64, 0, 0))
    for _ in range(40):
        route(pool, policy, key)
        policy.turn_ended()
        assert max(loads(pool)) - min(loads(pool)) <= 3 + 1
    owners = [record for record in pool if record.load]
    assert len(owners) > 1


def test_owners_per_prefix_are_bounded() -> None:
    table = PrefixTable(100, 60.0)
    pool = pool_of(*[0] * 10)
    for record in pool:
        table.record([7], record, now=0.0)
    assert [record.engine_id for record in table.owners(7, now=0.0)] == [
        f"e{i}" for i in range(10 - OWNERS_PER_PREFIX, 10)
    ]


def test_prefix_table_is_bounded_in_count_and_age() -> None:
    table = PrefixTable(max_entries=5, ttl_s=10.0)
    [engine] = list(pool_of(0))
    table.record(list(range(20)), engine, now=0.0)
    assert len(table) == 5 and table.owners(19, now=0.0) == [engine] and table.owners(0, now=0.0) == []
    assert table.owners(19, now=10.5) == []  # too old to trust, and forgotten
    for _ in range(SWEEP_EVERY):
        table.record([100], engine, now=11.0)
    assert len(table) == 1  # the other expired ones were swept within SWEEP_EVERY choices


def test_an_owner_that_left_is_not_chosen() -> None:
    pool = pool_of(0, 0, capacity=256)
    policy = prefix_policy(pool)
    key = prefix_hashes(prompt(8, 1, 0))
    first = route(pool, policy, key)
    assert first is not None
    pool.remove(first.engine_id, departed=True)
    assert route(pool, policy, key) is not first


def test_longest_known_prefix_wins() -> None:
    pool = pool_of(*[0] * 4, capacity=256)
    policy = prefix_policy(pool)
    short = route(pool, policy, prefix_hashes(prompt(2, 0, 0)))
    policy.turn_ended()
    long = route(pool, policy, prefix_hashes(prompt(32, 0, 0)))  # shares 2 blocks with `short`: same engine
    policy.turn_ended()
    assert short is long
    other = route(pool, policy, prefix_hashes([9] * 32 * TOKENS_PER_BLOCK))
    policy.turn_ended()
    assert other is not short
    assert route(pool, policy, prefix_hashes(prompt(32, 3, 1))) is long


def test_prefix_key_comes_from_the_envelope_or_the_plain_prompt() -> None:
    policy = prefix_policy(pool_of(0))
    tokens = list(range(3 * TOKENS_PER_BLOCK))
    assert policy.key_of(SubmitRequest(tokens)) == RouteKey(prefix_hashes(tokens))
    assert policy.key_of(SubmitEnvelope(1, b"{}", prefix_hashes=[5, 6])) == RouteKey([5, 6])
    assert policy.key_of(SubmitEnvelope(1, b"{}")) is None
    assert LeastLoaded().key_of(SubmitRequest(tokens)) is None


# ---------------------------------------------------------------- prefix hashes


def test_prefix_hashes_are_chained_at_growing_block_counts() -> None:
    tokens = list(range(100 * TOKENS_PER_BLOCK + 5))
    hashes = prefix_hashes(tokens)
    assert len(hashes) == 8  # blocks 1, 2, 4, 8, 16, 32, 64 and 100
    assert prefix_hashes(tokens[: 64 * TOKENS_PER_BLOCK]) == hashes[:7]
    changed = tokens.copy()
    changed[3] += 1
    assert set(prefix_hashes(changed)).isdisjoint(hashes)  # every hash covers the first block
    assert prefix_hashes(tokens[: TOKENS_PER_BLOCK - 1]) == []
    assert all(0 <= value < 2**64 for value in hashes)


def test_prefix_hashes_of_text_and_tokens_differ_and_are_bounded() -> None:
    assert prefix_hashes("a" * 64) != prefix_hashes([ord("a")] * 64)
    assert len(prefix_hashes("x" * 64 * 100_000)) == MAX_PREFIX_HASHES
    assert prefix_hashes([2**40] * TOKENS_PER_BLOCK) == []  # no vocabulary has such ids; the engine refuses it


def test_prefix_hashes_follow_the_documented_recipe() -> None:
    """The values are part of the wire contract (docs/protocol.md): recomputed here from its words."""

    def blake(data: bytes) -> bytes:
        return hashlib.blake2b(data, digest_size=8).digest()

    tokens = list(range(3 * 16 + 2))
    raw = b"".join(token.to_bytes(4, "little") for token in tokens)
    first = blake(b"t" + raw[:64])
    second = blake(first + raw[64:128])
    third = blake(second + raw[128:192])  # the last whole block (3), after 1 and 2
    assert prefix_hashes(tokens) == [int.from_bytes(digest, "little") for digest in (first, second, third)]
    text = "é" * 40  # 80 bytes of UTF-8: one whole block
    assert prefix_hashes(text) == [int.from_bytes(blake(b"s" + text.encode()[:64]), "little")]


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="fastest"):
        make_policy(Settings.model_construct(routing_policy="fastest"))  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["least_loaded", "p2c", "round_robin", "prefix", "cache_aware"])
def test_a_choice_stays_within_the_model_group(name: str) -> None:
    """A request naming a model goes to an engine serving it, even when the engine batching
    this turn serves another model, or a prefix was last given to another model's engine."""
    pool = EnginePool(max_inflight_per_engine=256, departed_memory_s=10.0)
    for index in range(4):
        pool.add(f"a{index}", 256, "alpha")
        pool.add(f"b{index}", 256, "beta")
    policy = make_policy(Settings(routing_policy=name, routing_load_slack=100))
    key = RouteKey(prefix_hashes(list(range(4 * TOKENS_PER_BLOCK))), session_id="s", group_id="g")
    alpha, beta = pool.group("alpha"), pool.group("beta")
    assert alpha is not None and beta is not None
    for index in range(40):
        group, model = (alpha, "alpha") if index % 2 else (beta, "beta")
        record = policy.choose(group, key)
        assert record is not None and record.model == model
        pool.assign(record, f"r{index}")


def test_chat_messages_hash_as_their_documented_text() -> None:
    class Turn:
        def __init__(self, role: str, content: str) -> None:
            self.role, self.content = role, content

    system = Turn("system", "You are a careful assistant. " * 4)
    text = f"system\0{system.content}\0".encode()
    first = hashlib.blake2b(b"c" + text[:64], digest_size=8).digest()
    hashes = prefix_hashes(None, [system, Turn("user", "hi")])
    assert hashes[0] == int.from_bytes(first, "little")
    assert prefix_hashes(None, [system, Turn("user", "bye")])[:2] == hashes[:2]  # the shared system message
    assert prefix_hashes(None, None) == [] and prefix_hashes(None, []) == []
