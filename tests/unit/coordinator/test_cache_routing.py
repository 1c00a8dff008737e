"""The cache_aware policy over a pool and a block index: held prefixes blended with load, the
yielding rule, random ties, load counted at once, prediction and its TTL, engines without KV
events, sessions and groups. No bus needed."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from service.coordinator.block_index import BlockIndex
from service.coordinator.cache_routing import CacheAware
from service.coordinator.pool import EnginePool, EngineRecord
from service.coordinator.route_key import RouteKey
from service.coordinator.routing import make_policy
from service.ops.settings import Settings
from service.protocol.kv_events import HeldPrefix
from service.protocol.messages import SubmitEnvelope, SubmitRequest
from service.protocol.prefix import TOKENS_PER_BLOCK, prefix_hashes
from tests.unit.coordinator.conftest import Clock

_ids = iter(range(1 << 40))


class Fleet:
    """A pool, its block index and the policy, as the coordinator wires them."""

    def __init__(self, engines: int, tracked: int | None = None, capacity: int = 256, **settings: Any) -> None:
        self.pool = EnginePool(max_inflight_per_engine=1024, departed_memory_s=10.0)
        chosen = Settings(routing_policy="cache_aware", **settings)
        self.index = BlockIndex(chosen.kv_index_size, chosen.cache_aware_prediction_ttl_s)
        policy = make_policy(chosen, self.index)
        assert isinstance(policy, CacheAware)
        self.policy = policy
        for n in range(engines):
            record = self.pool.add(f"e{n}", capacity)
            if tracked is None or n < tracked:
                self.index.track(record.engine_id, record)

    def engine(self, n: int) -> EngineRecord:
        record = self.pool.get(f"e{n}")
        assert record is not None
        return record

    def holds(self, n: int, prompt: list[int]) -> None:
        """Engine ``n``'s KV events said it holds every prefix of ``prompt``."""
        hashes = prefix_hashes(prompt)
        ends = [1 << index for index in range(len(hashes) - 1)] + [len(prompt) // TOKENS_PER_BLOCK]
        held = [HeldPrefix(prefix_hash, blocks) for prefix_hash, blocks in zip(hashes, ends, strict=True)]
        self.index.store(self.index.engines[f"e{n}"], held)

    def load(self, n: int, requests: int) -> None:
        for _ in range(requests):
            self.pool.assign(self.engine(n), f"r{next(_ids)}")

    def route(self, prompt: list[int] | None = None, session: str | None = None, group: str | None = None) -> str:
        """Choose and assign, as the ledger does; the engine's id."""
        key = RouteKey(prefix_hashes(prompt) if prompt else (), session, group)
        record = self.policy.choose(self.pool.everyone, key)
        assert record is not None
        self.pool.assign(record, f"r{next(_ids)}")
        return record.engine_id

    def loads(self) -> list[int]:
        return [self.engine(n).load for n in range(len(self.pool))]


def prompt(shared: int, own: int = 0, seed: int = 0) -> list[int]:
    """``shared`` blocks common to every seed, then ``own`` blocks of this seed's."""
    return list(range(shared * TOKENS_PER_BLOCK)) + [50_000 + seed] * (own * TOKENS_PER_BLOCK)


@pytest.fixture(autouse=True)
def seeded() -> None:
    random.seed(11)


def test_a_prompt_goes_to_the_engine_holding_its_longest_prefix_blended_with_load() -> None:
    fleet = Fleet(4)
    fleet.holds(1, prompt(8))
    fleet.holds(2, prompt(32))
    fleet.load(2, 5)  # 32 held blocks, 8 times over at 256 tokens a request: 16 requests' worth; score -11
    assert fleet.route(prompt(32, 2)) == "e2"  # beats e1's 8 blocks held, idle: score -4
    light = Fleet(4, cache_aware_prefix_weight=2.0)
    light.holds(1, prompt(8))
    light.holds(2, prompt(32))
    light.load(2, 5)  # twice over: 4 requests' worth; score 1
    assert light.route(prompt(32, 2)) == "e1"  # 8 blocks held, idle: score -1 beats the idle e0 and e3's 0
    light = Fleet(4, cache_aware_prefix_weight=2.0)
    light.holds(2, prompt(64))
    light.load(2, 7)
    assert light.route(prompt(64, 1)) == "e2"  # 64 blocks = 8 requests' worth


def test_affinity_yields_once_the_holder_passes_the_bound() -> None:
    """The bound is max(factor × mean, mean + slack): 1.25 and 8 by default."""
    fleet = Fleet(4)
    fleet.holds(0, prompt(512))  # worth 32 requests: only the bound stops it
    fleet.load(0, 11)
    fleet.load(1, 1)  # mean 3, bound 11
    assert fleet.route(prompt(512, 1)) == "e0"  # at 11: within
    assert fleet.route(prompt(512, 2)) != "e0"  # 12 > 3.25 + 8: yields, scored on load alone


def test_the_yielding_factor_is_a_setting() -> None:
    loose = Fleet(2, cache_aware_load_factor=3.0, cache_aware_load_slack=0.0)
    loose.holds(0, prompt(512))
    loose.load(0, 5)
    loose.load(1, 1)  # mean 3, bound 9
    assert loose.route(prompt(512, 1)) == "e0"
    strict = Fleet(2, cache_aware_load_factor=1.0, cache_aware_load_slack=0.0)
    strict.holds(0, prompt(512))
    strict.load(0, 5)
    strict.load(1, 1)  # mean 3, bound 3
    assert strict.route(prompt(512, 1)) == "e1"


def test_equal_scores_are_broken_at_random() -> None:
    fleet = Fleet(4, tracked=0)  # nothing held, nothing queued: every score is 0
    everyone = fleet.pool.everyone
    picks = Counter(fleet.policy.choose(everyone, RouteKey((), f"s{n}")).engine_id for n in range(400))  # type: ignore[union-attr]
    assert set(picks) == {"e0", "e1", "e2", "e3"}


def test_with_no_engine_publishing_kv_events_a_prompt_is_routed_as_least_loaded() -> None:
    fleet = Fleet(3, tracked=0)
    chosen = []
    for seed in range(6):
        chosen.append(fleet.route(prompt(64, 1, seed)))
        fleet.policy.turn_ended()
    assert chosen == ["e0", "e1", "e2"] * 2  # equals in turn, as least_loaded has them


def test_the_chosen_engines_queued_tokens_count_at_once() -> None:
    """Equal requests in flight, but one engine was just given a long prompt to prefill: the
    next requests go to the other one, before any KV event said so."""
    fleet = Fleet(2)
    long = fleet.route(prompt(513))
    assert fleet.pool.get(long).queued_tokens == 513 * TOKENS_PER_BLOCK  # type: ignore[union-attr]
    short = fleet.route([1] * 2 * TOKENS_PER_BLOCK)
    assert short != long and fleet.route([2] * 2 * TOKENS_PER_BLOCK) == short


def test_a_burst_of_unrelated_prompts_spreads() -> None:
    fleet = Fleet(4)
    for seed in range(40):
        fleet.route([seed] * 33 * TOKENS_PER_BLOCK)
    assert max(fleet.loads()) - min(fleet.loads()) <= 1


def test_a_hot_prefix_fills_its_holder_up_to_the_bound_then_spreads() -> None:
    fleet = Fleet(4)
    fleet.holds(0, prompt(512))
    holder = fleet.engine(0)
    chosen: Counter[str] = Counter()
    for seed in range(64):
        requests, bound = holder.load, fleet.policy.bound(fleet.pool.everyone)
        engine_id = fleet.route(prompt(512, 1, seed))
        chosen[engine_id] += 1
        assert engine_id != "e0" or requests <= bound
    assert chosen["e0"] == max(chosen.values()) and len(chosen) > 1  # the others that took it hold it too


def test_a_burst_follows_the_first_by_prediction_until_the_ttl(clock: Clock) -> None:
    fleet = Fleet(4)
    first = fleet.route(prompt(256, 1, seed=0))  # 4,112 tokens to prefill there
    assert all(fleet.route(prompt(256, 1, seed)) == first for seed in range(1, 6))  # no event yet: predicted
    clock.now += 2.5  # past cache_aware_prediction_ttl_s: what no event confirmed is forgotten
    assert fleet.route(prompt(256, 1, seed=9)) != first


def test_engines_without_kv_events_are_scored_on_load_alone() -> None:
    fleet = Fleet(2, tracked=1)  # e0 publishes KV events, e1 does not
    fleet.load(0, 1)
    assert fleet.route(prompt(64)) == "e1"
    assert fleet.engine(1).queued_tokens == 0  # its queue is unknown: nothing counted
    assert fleet.index.matches(prefix_hashes(prompt(64)), 0.0, 8) == {}  # and nothing predicted


def test_a_session_stays_home_and_moves_when_its_engine_leaves() -> None:
    fleet = Fleet(3)
    home = fleet.route(session="s")
    assert all(fleet.route(session="s") == home for _ in range(6))  # its load grows, within the slack
    fleet.pool.remove(home, departed=True)
    moved = fleet.route(session="s")
    assert moved != home
    assert all(fleet.route(session="s") == moved for _ in range(3))  # the new engine is its home


def test_a_session_moves_when_its_engine_is_overloaded_and_the_new_one_becomes_home() -> None:
    fleet = Fleet(3)
    home = fleet.route(session="s")
    fleet.load(int(home[1:]), 20)  # mean 7, bound 15: past it
    moved = fleet.route(session="s")
    assert moved != home
    for record in fleet.pool:
        for request_id in list(record.requests):
            fleet.pool.release(record.engine_id, request_id)
    assert fleet.route(session="s") == moved  # its old engine is idle again, but it moved


def test_a_group_goes_to_one_engine_unless_load_forbids() -> None:
    fleet = Fleet(4)
    assert len({fleet.route(prompt(32), group="g1") for _ in range(8)}) == 1
    assert len({fleet.route(prompt(33), group="g2") for _ in range(8)}) == 1
    tight = Fleet(4, cache_aware_load_slack=1.0)
    spread = Counter(tight.route(group="g") for _ in range(8))
    assert len(spread) > 1 and max(spread.values()) <= 3


def test_the_key_comes_from_the_envelope_or_the_plain_body() -> None:
    policy = Fleet(1).policy
    tokens = list(range(3 * TOKENS_PER_BLOCK))
    assert policy.key_of(SubmitRequest(tokens, session_id="s")) == RouteKey(prefix_hashes(tokens), "s")
    envelope = SubmitEnvelope(1, b"{}", prefix_hashes=[5, 6], group_id="g")
    assert policy.key_of(envelope) == RouteKey([5, 6], None, "g")
    assert policy.key_of(SubmitEnvelope(1, b"{}", session_id="s")) == RouteKey((), "s")
    assert policy.key_of(SubmitEnvelope(1, b"{}")) is None  # routed as least_loaded
    assert policy.key_of(SubmitRequest(tokens)) == RouteKey(prefix_hashes(tokens))
    assert policy.key_of(SubmitRequest(tokens[: TOKENS_PER_BLOCK - 1])) is None  # no whole block
    assert policy.key_of(SubmitRequest("é" * (TOKENS_PER_BLOCK - 1))) is None
    assert policy.key_of(SubmitRequest("é" * 32)) == RouteKey(prefix_hashes("é" * 32))  # 64 bytes


def test_without_kv_events_only_sessions_and_groups_make_a_key() -> None:
    """No engine publishes KV events: a prompt's hashes would steer nothing, so none are
    computed, unless the replica is still learning what the engines hold."""
    policy = Fleet(2, tracked=0).policy
    tokens = list(range(3 * TOKENS_PER_BLOCK))
    assert policy.key_of(SubmitRequest(tokens)) is None
    assert policy.key_of(SubmitRequest(tokens, group_id="g")) == RouteKey(prefix_hashes(tokens), None, "g")
    policy.index.learning = True
    assert policy.key_of(SubmitRequest(tokens)) == RouteKey(prefix_hashes(tokens))


def test_homes_are_bounded_in_count_and_age(clock: Clock) -> None:
    fleet = Fleet(2, session_table_size=2, session_ttl_s=10.0)
    for session in ("a", "b", "c"):
        fleet.route(session=session)
    assert len(fleet.policy.sessions) == 2 and fleet.policy.sessions.get("a", clock.now) is None
    clock.now += 11
    assert fleet.policy.sessions.get("c", clock.now) is None


def test_the_default_routes_a_fleet_without_kv_events_as_least_loaded() -> None:
    """cache_aware is the default; over engines that publish no KV events it makes least_loaded's
    choices, request for request (prompts with prefix hashes included)."""
    assert Settings().routing_policy == "cache_aware"
    pools, policies = [], []
    for settings in (Settings(), Settings(routing_policy="least_loaded")):
        pool = EnginePool(max_inflight_per_engine=1024, departed_memory_s=10.0)
        for n in range(3):
            pool.add(f"e{n}", 256)
        pools.append(pool)
        policies.append(make_policy(settings))
    for seed in range(24):
        key = RouteKey(prefix_hashes(prompt(8, 1, seed % 3)))
        chosen = [policy.choose(pool.everyone, key) for policy, pool in zip(policies, pools, strict=True)]
        records = [record for record in chosen if record is not None]
        assert len(records) == 2 and records[0].engine_id == records[1].engine_id
        for record, pool in zip(records, pools, strict=True):
            pool.assign(record, f"r{seed}")
            if seed % 5 == 0:  # some finish at once: loads differ
                assert pool.release(record.engine_id, f"r{seed}")
        if seed % 4 == 3:
            for policy in policies:
                policy.turn_ended()
