"""Fleet-size benchmark: what the coordinator costs with 2 engines and with thousands.

For each routing policy, one fleet per size N (default 2, 100, 1,000 and 3,000), all up at once
on one nats-server: each a coordinator process and N engines written from docs/protocol.md
alone (benchmarks/doc_engines.py), all in one process, which answer every request at once. A
load client in this process offers the same request rate to every fleet in turn (open loop,
benchmarks/offered_load.py), by default 60% of what the whole machine achieves closed-loop
with the smallest fleet, measured first in the same run. Per fleet it measures:

- registration: wall time until all N engines are acknowledged, and the coordinator's CPU
  over that time (the engines start heartbeating as they are acknowledged);
- idle: the coordinator's CPU, in % of a core, with N engines heartbeating and no requests;
- under load, in rounds of one window per fleet (the order flips each round): achieved rate,
  p50/p99 latency of the requests sent in the window, the coordinator's CPU per request and in
  % of a core, requests per routed message (from the coordinator's counters), lost and
  duplicated replies, and how busy the machine was (CPU of every other process);
- the targets, on the median of per-round ratios to the smallest fleet, since on a shared
  machine absolute figures drift from one minute to the next.

Every request is a client-library envelope around a 10-token prompt asking for one token; it
carries the prefix hashes of a 1,056-token prompt (one of 8 shared 1,024-token system prompts
plus 32 tokens of its own), as the client library sends for such a prompt, so that the
``prefix`` policy has work to do. The coordinator never decodes the body, so its work is what
it would be for the long prompt.

With ``--cached-prompts N`` every engine holds the prefixes of its last N prompts and publishes
KV events (benchmarks/doc_prefix_cache.py), and each request's body is its long prompt: one
event per routed message that brought a prompt new to the engine, as many stored and evicted
prefixes as it says, the realistic rate for ``cache_aware`` (``--policies cache_aware``).

Run: ``dpcoord bench --simulated-engines 2,100,1000,3000`` (or ``python -m benchmarks.fleet``);
``--help`` lists the knobs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, machine
from benchmarks.fleet_bench import FleetBench, RunningFleet
from benchmarks.fleet_report import print_report
from benchmarks.fleet_summary import FleetResult, summarise
from benchmarks.fleet_targets import judge
from benchmarks.progress import Progress
from service.bus.server import EmbeddedNatsServer
from service.ops import event_loop


async def run(args: argparse.Namespace) -> dict[str, Any]:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_dir = RESULTS_DIR / f"fleet-{stamp}-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    server = None if args.nats_url else EmbeddedNatsServer().start()
    nats_url = args.nats_url or server.url  # type: ignore[union-attr]
    load_before = os.getloadavg()
    results: list[FleetResult] = []
    rate, reference = args.rate, None
    try:
        async with FleetBench(args, nats_url, server.pid if server else None, log_dir) as bench:
            for policy in args.policies:
                progress = Progress(len(args.simulated_engines) * (args.rounds + 1) + 1)
                fleets: list[RunningFleet] = []
                try:
                    for engines in args.simulated_engines:
                        progress.step(f"{policy}: starting {engines} engines")
                        fleets.append(await bench.start(policy, engines))
                    progress.step(f"{policy}: idle CPU of every fleet")
                    await bench.measure_idle(fleets)
                    if rate is None:
                        reference = await bench.closed_loop_rate(fleets[0])
                        rate = reference * args.offered_share
                        progress.note(f"offering {rate:,.0f} req/s to every fleet ({reference:,.0f} closed-loop)")
                    for index in range(args.rounds):
                        for fleet in fleets if index % 2 == 0 else list(reversed(fleets)):
                            progress.step(f"{policy}: round {index + 1}/{args.rounds}, {fleet.engines} engines")
                            await bench.load_window(fleet, rate)
                finally:
                    for fleet in fleets:
                        await bench.stop(fleet)
                progress.done()
                results.extend(summarise(fleets, rate))
    finally:
        if server is not None:
            server.stop()
    return {
        "benchmark": "fleet",
        "started": stamp,
        "machine": machine(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "event_loop": event_loop.resolve(args.event_loop),
        "config": vars(args),
        "reference_closed_loop_per_s": reference,
        "offered_per_s": rate,
        "results": [asdict(r) for r in results],
        "targets": judge(results),
        "logs": str(log_dir),
    }


def _sizes(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--simulated-engines",
        type=_sizes,
        default=[2, 100, 1000, 3000],
        metavar="N,N,...",
        help="fleet sizes, smallest first: the first is the baseline (default 2,100,1000,3000)",
    )
    parser.add_argument(
        "--policies",
        type=lambda text: text.split(","),
        default=["least_loaded"],
        metavar="P,P,...",
        help="routing policies, each over every fleet size (default least_loaded; also p2c, round_robin, prefix, "
        "cache_aware)",
    )
    parser.add_argument(
        "--cached-prompts",
        type=int,
        default=0,
        help="with more than 0: each engine holds that many prompts' prefixes and publishes KV events",
    )
    parser.add_argument(
        "--rate", type=float, default=None, help="offered requests/s (default: a share of the closed-loop rate)"
    )
    parser.add_argument(
        "--offered-share", type=float, default=0.6, help="share of the closed-loop rate to offer (default 0.6)"
    )
    parser.add_argument(
        "--inflight", type=int, default=256, help="requests in flight when calibrating closed-loop (default 256)"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="load windows per fleet, interleaved across fleets (default 3)"
    )
    parser.add_argument("--duration", type=float, default=3.0, help="seconds measured per load window (default 3)")
    parser.add_argument(
        "--warmup", type=float, default=1.0, help="seconds of load before each measured window (default 1)"
    )
    parser.add_argument("--idle", type=float, default=4.0, help="seconds of idle CPU measured per fleet (default 4)")
    parser.add_argument("--nats-url", default=None, help="use this NATS server instead of an embedded one")
    parser.add_argument(
        "--event-loop", choices=("auto", "asyncio", "uvloop"), default="auto", help="the coordinator's event loop"
    )
    parser.add_argument(
        "--coordinator-source",
        type=Path,
        default=None,
        metavar="DIR",
        help="run the coordinator from this source tree, to compare another commit",
    )
    parser.add_argument(
        "--output", type=Path, default=None, help="JSON results path (default benchmarks/results/fleet-<time>.json)"
    )


def main(args: argparse.Namespace) -> int:
    results = event_loop.run(run(args), args.event_loop)
    reference = results["reference_closed_loop_per_s"]
    share = (
        f" ({args.offered_share:.0%} of {reference:,.0f} req/s closed-loop with {args.simulated_engines[0]} engines)"
        if reference
        else ""
    )
    load = results["load_average_before"]
    header = (
        f"fleet benchmark: offered {results['offered_per_s']:,.0f} req/s{share}; {results['machine']['cores']} cores, "
        f"load average {load[0]:.2f} before and {results['load_average_after'][0]:.2f} after"
    )
    print_report([FleetResult(**r) for r in results["results"]], results["targets"], header)
    output = args.output or RESULTS_DIR / f"fleet-{results['started']}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2, default=str))
    print(f"\nresults: {output}\ncoordinator logs: {results['logs']}")
    return 0


def build_parser(prog: str = "python -m benchmarks.fleet") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    add_arguments(parser)
    return parser


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
