"""Routing work per request, in process: a policy's choice, the slot taken, the slot freed.

No NATS and no other process, so the figure is the routing itself, for each policy and fleet
size: it must not grow with the fleet. Each request carries the 8 prefix hashes of a 1,056-token
prompt (one of 8 shared system prompts), so ``prefix`` does its lookups; for ``cache_aware``
every engine publishes KV events and the system prompts are held, each by one engine in 8, as
their events would have said, so it scores holders (and predicts). Requests are routed 64 at a
time (a loop turn ends every 8) and then all answered. The best of 5 repetitions counts.

Run: ``python -m benchmarks.routing_cost`` (``--engines 2,1000,3000``).
"""

from __future__ import annotations

import argparse
import random
import sys
import timeit

from service.coordinator.block_index import BlockIndex
from service.coordinator.pool import EnginePool
from service.coordinator.routing import make_policy
from service.ops.settings import Settings
from service.protocol.kv_events import HeldPrefix
from service.protocol.messages import SubmitEnvelope
from service.protocol.prefix import prefix_hashes

POLICIES = ("least_loaded", "p2c", "round_robin", "prefix", "cache_aware")


def microseconds_per_request(
    policy_name: str, engines: int, batch: int = 64, repeat: int = 5, number: int = 20
) -> float:
    pool = EnginePool(max_inflight_per_engine=256, departed_memory_s=6.0)
    settings = Settings(routing_policy=policy_name)
    index = BlockIndex(settings.kv_index_size, settings.cache_aware_prediction_ttl_s)
    rng = random.Random(7)
    systems = [[rng.randrange(32000) for _ in range(1024)] for _ in range(8)]
    for rank in range(engines):
        engine = index.track(f"e{rank}", pool.add(f"e{rank}", 256))
        hashes = prefix_hashes(systems[rank % 8])
        index.store(engine, [HeldPrefix(value, 1 << position) for position, value in enumerate(hashes)])
    policy = make_policy(settings, index)
    submissions = [
        SubmitEnvelope(
            1, b"", prefix_hashes=prefix_hashes(systems[index % 8] + [rng.randrange(32000) for _ in range(32)])
        )
        for index in range(batch)
    ]
    request_ids = [f"r{index}" for index in range(batch)]

    def cycle() -> None:
        routed = []
        for index, (submit, request_id) in enumerate(zip(submissions, request_ids, strict=True)):
            record = policy.choose(pool.everyone, policy.key_of(submit))
            if record is None:
                raise RuntimeError("every engine is full")
            pool.assign(record, request_id)
            routed.append(record.engine_id)
            if index % 8 == 7:
                policy.turn_ended()
        for engine_id, request_id in zip(routed, request_ids, strict=True):
            pool.release(engine_id, request_id)

    best = min(timeit.repeat(cycle, number=number, repeat=repeat))
    return best / (number * batch) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.routing_cost", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--engines", type=lambda text: [int(part) for part in text.split(",")], default=[2, 100, 1000, 3000]
    )
    args = parser.parse_args()
    print("engines  " + "  ".join(f"{name:>12}" for name in POLICIES) + "   (us per request)")
    for engines in args.engines:
        costs = [microseconds_per_request(name, engines) for name in POLICIES]
        print(f"{engines:>7}  " + "  ".join(f"{cost:>12.2f}" for cost in costs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
