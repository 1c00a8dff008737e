"""Cache-aware routing benchmark (issue 33): where requests go, and what the engines' prefix
caches then save, for ``least_loaded``, ``prefix`` and ``cache_aware``, measured in one run.

Four torch engines on CPU (the random model, prefix caching on, one CPU thread each) stay up
for the whole run; each policy gets its own coordinator, which adopts them from their heartbeats
(benchmarks/cache_fleet.py). Per policy, three workloads run through the client library
(benchmarks/cache_workloads.py): GRPO (16 prompts of 512 tokens, 8 samples each, one group
per prompt, at once), multi-turn (32 sessions of 4 turns, each turn adding 64 tokens to the last
prompt and its answer) and uniform (unrelated prompts, a fixed number in flight); the uniform
one in more rounds, the order of the policies alternating, since it is the one compared on
throughput (``--uniform-rounds``). Figures (benchmarks/cache_figures.py): prefix-cache hit
ratio against the workload's ideal, TTFT p50/p99, requests/s, the largest engine load over the
mean and the engines' CPU per request.

Then the replica restart: with ``cache_aware``, a multi-turn run whose coordinator is replaced
after the first turn (the new one learns the fleet from heartbeats and rebuilds its index from
the engines' snapshots): the hit ratio of the later turns against the same turns of the run
without a restart.

Run: ``python -m benchmarks.cache_routing`` (a few minutes on 2 cores); ``--help`` for the knobs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.cache_figures import Figures, figures, hit_ratio, judge, round_ratios
from benchmarks.cache_fleet import CacheFleet
from benchmarks.cache_workloads import WorkloadRun, grpo, multi_turn, uniform
from benchmarks.common import RESULTS_DIR, machine
from benchmarks.progress import Progress
from service.client import DpcoordClient
from service.ops.settings import Settings

POLICIES = ("least_loaded", "prefix", "cache_aware")
WORKLOADS = ("grpo", "multi-turn", "uniform")


class Bench:
    def __init__(self, args: argparse.Namespace, fleet: CacheFleet) -> None:
        self.args = args
        self.fleet = fleet
        self.rng = random.Random(args.seed)
        self.rows: list[Figures] = []
        self.later: dict[str, float] = {}  # policy -> hit ratio of the multi-turn turns after the first
        self.moved: dict[str, list[int]] = {}  # policy -> sessions that changed engine, per turn
        self.later_ideal = 0.0
        self.restart: dict[str, float] | None = None

    async def ready(self, policy: str) -> None:
        """A coordinator with ``policy``, once it routes a request with prefix hashes: a replica
        that starts holds those while it learns what the engines hold, and no workload's
        figures should count that (but the restart's, which measures it)."""
        await self.fleet.coordinator(policy)
        async with await self.client() as client:
            await client.submit(list(range(16)), max_tokens=1, timeout=60)

    def client(self) -> Any:
        settings = Settings(nats_url=self.fleet.url, subject_prefix=self.fleet.subjects.prefix)
        return DpcoordClient.connect(settings)

    async def workload(self, policy: str, name: str) -> None:
        args, fleet = self.args, self.fleet
        before = await fleet.prefix_cache()
        cpu_before = fleet.engine_cpu_s()
        async with await self.client() as client:
            if name == "grpo":
                run = await grpo(
                    client, self.rng, args.grpo_prompts, args.grpo_samples, args.grpo_length, args.max_tokens
                )
            elif name == "multi-turn":
                run = await self._multi_turn(client, policy, restart=False)
            else:
                run = await uniform(
                    client, self.rng, args.uniform_requests, args.uniform_length, args.concurrency, args.max_tokens
                )
        cpu = fleet.engine_cpu_s() - cpu_before
        self.rows.append(figures(run, policy, fleet.engine_ids, before, await fleet.prefix_cache(), cpu))

    async def _multi_turn(self, client: DpcoordClient, policy: str, restart: bool) -> WorkloadRun:
        args, fleet = self.args, self.fleet
        marks: list[dict[str, tuple[int, int]]] = []

        async def between() -> None:
            if restart:
                await fleet.coordinator(policy, restart=True)
            marks.append(await fleet.prefix_cache())

        run = await multi_turn(
            client, self.rng, args.sessions, args.turns, args.first_turn, args.turn_tokens, args.max_tokens, between
        )
        later = hit_ratio(marks[0], await fleet.prefix_cache())
        self.moved[f"{policy}{' across a restart' if restart else ''}"] = run.moved
        if restart:
            self.restart = {"before": self.later[policy], "after": later}
        else:
            self.later[policy], self.later_ideal = later, run.later_ideal
        return run

    async def restarted(self) -> None:
        async with await self.client() as client:
            await self._multi_turn(client, "cache_aware", restart=True)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_dir = RESULTS_DIR / f"cache-routing-{stamp}-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    beat = str(args.heartbeat_interval)
    engine_env = {
        "DPCOORD_BACKEND": "torch",
        "DPCOORD_DEVICE": "cpu",
        "DPCOORD_CPU_THREADS": "1",
        "DPCOORD_KV_CACHE_GB": str(args.kv_cache_gb),
        "DPCOORD_MAX_CONTEXT": "2048",
        "DPCOORD_HEARTBEAT_INTERVAL_S": beat,
    }
    coordinator_env = {
        "DPCOORD_HEARTBEAT_INTERVAL_S": beat,
        "DPCOORD_HEARTBEAT_TIMEOUT_S": str(6 * args.heartbeat_interval),
    }
    coordinator_env |= {f"DPCOORD_{key.upper()}": value for key, value in args.set}
    policies = args.policies
    restart = "cache_aware" in policies and "multi-turn" in args.workloads and not args.no_restart
    progress = Progress(len(policies) * (len(args.workloads) + args.uniform_rounds - 1) + restart)
    names = tuple(args.workloads)
    rounds: list[tuple[list[str], tuple[str, ...]]] = [(policies, names)]
    if "uniform" in names:
        rounds += [(policies[:: -1 if n % 2 == 0 else 1], ("uniform",)) for n in range(args.uniform_rounds - 1)]
    async with CacheFleet(args.engines, engine_env, coordinator_env, log_dir) as fleet:
        bench = Bench(args, fleet)
        for round_policies, names in rounds:
            for policy in round_policies:
                await bench.ready(policy)
                for name in names:
                    progress.step(f"{policy}: {name}")
                    await bench.workload(policy, name)
        if restart:
            progress.step("cache_aware: multi-turn across a replica restart")
            await bench.ready("cache_aware")
            await bench.restarted()
        progress.done()
    rows = _merge_rounds(bench.rows)
    return {
        "benchmark": "cache-routing",
        "started": stamp,
        "machine": machine(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "config": {key: value for key, value in vars(args).items() if key != "output"},
        "results": [asdict(row) | {"of_ideal": row.of_ideal} for row in rows],
        "multi_turn_later_turns": {
            "hit_ratio": bench.later,
            "ideal": bench.later_ideal,
            "restart": bench.restart,
            "sessions_moved_per_turn": bench.moved,
        },
        "uniform_rounds": {
            field: round_ratios(bench.rows, "uniform", field) for field in ("requests_per_s", "engine_cpu_ms")
        },
        "targets": judge(rows, bench.rows, bench.restart),
        "logs": str(log_dir),
    }


def _merge_rounds(rows: list[Figures]) -> list[Figures]:
    """One row per workload and policy: a workload run in two rounds counts both (the mean of each figure)."""
    merged: dict[tuple[str, str], list[Figures]] = {}
    for row in rows:
        merged.setdefault((row.workload, row.policy), []).append(row)
    result = []
    for (workload, policy), runs in merged.items():
        fields = {
            name: sum(getattr(run, name) for run in runs) / len(runs)
            for name in (
                "hit_ratio",
                "ideal",
                "ttft_p50_ms",
                "ttft_p99_ms",
                "requests_per_s",
                "load_max_over_mean",
                "engine_cpu_ms",
            )
        }
        result.append(
            Figures(workload, policy, sum(r.requests for r in runs), engines_used=runs[0].engines_used, **fields)
        )
    return sorted(result, key=lambda row: (row.workload, POLICIES.index(row.policy)))


def print_report(results: dict[str, Any]) -> None:
    load = results["load_average_before"], results["load_average_after"]
    print(
        f"cache-aware routing: {results['config']['engines']} torch engines on CPU; "
        f"{results['machine']['cores']} cores, load average {load[0][0]:.2f} before, {load[1][0]:.2f} after"
    )
    print(
        f"{'workload':11} {'policy':13} {'hit ratio':>9} {'ideal':>6} {'of ideal':>8} {'TTFT p50':>9} "
        f"{'p99':>8} {'req/s':>7} {'max/mean':>8} {'engine CPU':>10}"
    )
    for row in results["results"]:
        print(
            f"{row['workload']:11} {row['policy']:13} {row['hit_ratio']:9.3f} {row['ideal']:6.3f} "
            f"{row['of_ideal']:8.2f} {row['ttft_p50_ms']:7.0f}ms {row['ttft_p99_ms']:6.0f}ms "
            f"{row['requests_per_s']:7.2f} {row['load_max_over_mean']:8.2f} {row['engine_cpu_ms']:8.0f}ms"
        )
    later = results["multi_turn_later_turns"]
    if later["hit_ratio"]:
        hits = ", ".join(f"{policy} {value:.3f}" for policy, value in later["hit_ratio"].items())
        moved = "; ".join(f"{policy} {count}" for policy, count in later["sessions_moved_per_turn"].items())
        print(f"multi-turn turns 2..: ideal {later['ideal']:.3f}, hit ratio {hits}")
        print(f"  sessions that changed engine, per turn: {moved}")
    if later["restart"]:
        restart = later["restart"]
        print(f"  cache_aware across a replica restart: {restart['after']:.3f} (before {restart['before']:.3f})")
    rounds = results["uniform_rounds"]
    if rounds["requests_per_s"]:
        ratios = " ".join(f"{ratio:.2f}" for ratio in rounds["requests_per_s"])
        cpu = " ".join(f"{ratio:.2f}" for ratio in rounds["engine_cpu_ms"])
        print(f"uniform, cache_aware / least_loaded by round: requests/s {ratios}; engine CPU per request {cpu}")
    print("targets (cache_aware):")
    for target in results["targets"]:
        sign = "<=" if target["at_most"] else ">="
        print(
            f"  {'met ' if target['met'] else 'MISS'} {target['name']}: {target['value']:.3f} ({sign} {target['bound']})"
        )


def _setting(text: str) -> tuple[str, str]:
    key, _, value = text.partition("=")
    if not value:
        raise argparse.ArgumentTypeError("a coordinator setting is NAME=VALUE")
    return key, value


def build_parser(prog: str = "python -m benchmarks.cache_routing") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--policies", type=lambda text: text.split(","), default=list(POLICIES), help="routing policies compared")
    add("--engines", type=int, default=4)
    add("--workloads", type=lambda text: text.split(","), default=list(WORKLOADS), help="grpo,multi-turn,uniform")
    add("--grpo-prompts", type=int, default=16)
    add("--grpo-samples", type=int, default=8)
    add("--grpo-length", type=int, default=512)
    add("--sessions", type=int, default=32)
    add("--turns", type=int, default=4)
    add("--first-turn", type=int, default=256, help="tokens of a session's first prompt")
    add("--turn-tokens", type=int, default=64, help="tokens each turn adds")
    add("--uniform-requests", type=int, default=96)
    add("--uniform-length", type=int, default=256)
    add("--concurrency", type=int, default=16, help="uniform requests in flight")
    add("--uniform-rounds", type=int, default=3, help="uniform runs per policy, the policies' order alternating")
    add("--max-tokens", type=int, default=4, help="tokens generated per request")
    add("--kv-cache-gb", type=float, default=0.0625, help="each engine's KV cache")
    add("--heartbeat-interval", type=float, default=0.5)
    add("--set", type=_setting, action="append", default=[], metavar="NAME=VALUE", help="a coordinator setting")
    add("--no-restart", action="store_true", help="skip the replica restart")
    add("--seed", type=int, default=1)
    add("--output", type=Path, default=None, help="JSON results (default benchmarks/results/cache-routing-<time>.json)")
    return parser


def main(args: argparse.Namespace) -> int:
    results = asyncio.run(run(args))
    print_report(results)
    output = args.output or RESULTS_DIR / f"cache-routing-{results['started']}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2, default=str))
    print(f"\nresults: {output}\nlogs: {results['logs']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
