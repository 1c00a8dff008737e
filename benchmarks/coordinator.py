"""Coordinator benchmark: dpcoord against raw nats-py baselines measured in the same run.

Path measured: client -> coordinator -> echo engine -> coordinator -> client, each its own
process. Baselines, on the same nats-server and with the same client code:

- raw 2-hop: nats-py request-reply to an echo process (the client-bound limit);
- raw 4-hop: client -> relay -> echo -> relay -> client, the relay re-publishing with its own
  inbox and mapping answers back (a coordinator's shape with no logic);
- raw one-way relay: a source process publishes each streamed message through a relay process.

Measurements are short and interleaved, round after round (the order flips each round), and
every target is judged on the median of its per-round ratios, because on a shared 2-core
machine absolute numbers drift from one minute to the next.

Run: ``dpcoord bench`` (or ``python -m benchmarks.coordinator``); ``--help`` lists the knobs.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, machine, percentile
from benchmarks.coordinator_bodies import Bodies, Enveloped, constant, long_prompt, submission
from benchmarks.coordinator_figures import round_ratios, summarise
from benchmarks.coordinator_report import print_report
from benchmarks.load import Target, Window, pipelined, sequential, streaming
from benchmarks.progress import Progress
from benchmarks.py_spy_profile import fold, record
from benchmarks.stack import BenchStack, StackConfig
from service.ops import event_loop
from service.protocol.subjects import Header


class Bench:
    def __init__(self, args: argparse.Namespace, stack: BenchStack, bodies: Bodies) -> None:
        self.args = args
        self.stack = stack
        self.bodies = bodies
        submit = stack.subjects.coordinator(Header.SUBMIT_REQUEST)
        # One client id per target: a repeated (client_id, client_request_id) would be answered
        # from the coordinator's result cache instead of running.
        self.targets = {
            "raw_2hop": Target(stack.raw.echo, constant(bodies.short)),
            "raw_4hop": Target(stack.raw.relay, constant(bodies.short)),
            "raw_4hop_long_prompt": Target(stack.raw.relay, constant(bodies.long)),
            "dpcoord": Target(submit, Enveloped(bodies.short, False, "bench-short")),
            "dpcoord_plain": Target(submit, constant(bodies.short)),
            "dpcoord_long_prompt": Target(submit, Enveloped(bodies.long, False, "bench-long")),
            "dpcoord_plain_long_prompt": Target(submit, constant(bodies.long)),
            "raw_relay": Target(stack.raw.stream, constant(bodies.stream)),
            "dpcoord_stream": Target(submit, Enveloped(bodies.stream, True, "bench-stream")),
        }
        watched = (
            "client",
            "nats_server",
            "coordinator",
            "engine0",
            "raw_relay",
            "raw_echo",
            "raw_stream_relay",
            "raw_stream_source",
        )
        self.watch = {name: pid for name, pid in stack.pids.items() if name in watched}

    def steps(self) -> list[tuple[str, str, Callable[[], Awaitable[dict[str, Any]]]]]:
        """(scenario, name, measure) for one round, in a fixed order."""
        args = self.args
        steps: list[tuple[str, str, Callable[[], Awaitable[dict[str, Any]]]]] = []
        for name in ("raw_2hop", "raw_4hop", "dpcoord", "dpcoord_plain"):
            steps.append(("sequential", name, partial(self._sequential, name)))
        for name in (
            "raw_2hop",
            "raw_4hop",
            "dpcoord",
            "dpcoord_plain",
            "dpcoord_long_prompt",
            "dpcoord_plain_long_prompt",
            "raw_4hop_long_prompt",
        ):
            steps.append(("pipelined", name, partial(self._pipelined, name)))
        for name in ("raw_relay", "dpcoord_stream"):
            steps.append(("streaming", name, partial(self._streaming, name)))
        if args.only:
            steps = [step for step in steps if step[0] in args.only]
        return steps

    async def profile(self, directory: Path) -> dict[str, Any]:
        """One more pipelined dpcoord window per prompt size, with py-spy sampling the coordinator and engine."""
        directory.mkdir(parents=True, exist_ok=True)
        found: dict[str, Any] = {}
        for name in ("dpcoord", "dpcoord_long_prompt"):
            sampled = {proc: directory / f"{name}-{proc}.txt" for proc in ("coordinator", "engine0")}
            seconds = self.args.warmup + self.args.duration
            spies = [await record(self.stack.pids[proc], seconds, path) for proc, path in sampled.items()]
            window = await pipelined(self.stack.nc, self.targets[name], self.args.inflight, 0.0, seconds, self.watch)
            for spy in spies:
                _, stderr = await spy.communicate()
                if spy.returncode:
                    raise RuntimeError(f"py-spy failed: {stderr.decode().strip()}")
            found[name] = {"window": window_result(window)}
            for proc, path in sampled.items():
                folded = fold(path.read_text())
                found[name][proc] = {
                    "samples": folded.samples,
                    "file": str(path),
                    "self": folded.table(),
                    "inclusive": folded.inclusive_table(),
                }
        return found

    async def _sequential(self, name: str) -> dict[str, Any]:
        latencies, window = await sequential(self.stack.nc, self.targets[name], self.args.sequential_count, self.watch)
        latencies.sort()
        return {"p50_us": percentile(latencies, 50), "p99_us": percentile(latencies, 99), **window_result(window)}

    async def _pipelined(self, name: str) -> dict[str, Any]:
        window = await pipelined(
            self.stack.nc, self.targets[name], self.args.inflight, self.args.warmup, self.args.duration, self.watch
        )
        return window_result(window)

    async def _streaming(self, name: str) -> dict[str, Any]:
        window = await streaming(
            self.stack.nc,
            self.targets[name],
            self.args.stream_inflight,
            self.args.warmup,
            self.args.duration,
            self.watch,
        )
        return window_result(window)


def window_result(window: Window) -> dict[str, Any]:
    return {
        "per_s": window.rate,
        "completed": window.completed,
        "seconds": window.seconds,
        "errors": window.errors,
        "cpu_us_per": {name: window.cpu_us_per(name) for name in window.cpu},
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    short = submission(list(range(1, args.short_prompt + 1)), max_tokens=1)
    bodies = Bodies(
        short=short,
        long=submission(long_prompt(args.long_prompt), max_tokens=1),
        stream=submission(list(range(1, args.short_prompt + 1)), max_tokens=args.tokens, stream=True),
    )
    config = StackConfig(args.nats_url, args.engines, args.event_loop, args.tokens)
    async with BenchStack(config) as stack:
        await stack.start_dpcoord(short)
        final_bytes, partial_bytes = await stack.reply_sizes(short, bodies.stream)
        await stack.start_raw(final_bytes, partial_bytes)
        bench = Bench(args, stack, bodies)
        steps = bench.steps()
        progress = Progress(len(steps) * args.rounds)
        rounds: list[dict[str, Any]] = []
        for index in range(args.rounds):
            ordered = steps if index % 2 == 0 else list(reversed(steps))
            measured: dict[str, dict[str, Any]] = {}
            for scenario, name, measure in ordered:
                progress.step(f"round {index + 1}/{args.rounds} {scenario} {name}")
                measured.setdefault(scenario, {})[name] = await measure()
            ratios = round_ratios(measured)
            rounds.append({"measured": measured, "ratios": ratios})
            progress.note(" ".join(f"{key}={value:.3g}" for key, value in ratios.items()))
        progress.done()
        profiles = await bench.profile(args.profile) if args.profile else {}
    return {
        "benchmark": "coordinator",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(),
        "event_loop": event_loop.resolve(args.event_loop),
        "config": vars(args),
        "bytes": {
            "short_submit": len(bodies.short),
            "long_submit": len(bodies.long),
            "final": final_bytes,
            "partial": partial_bytes,
        },
        "rounds": rounds,
        "summary": summarise(rounds),
        "profiles": profiles,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats-url", default=None, help="use this NATS server instead of an embedded one")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of every measurement (default 5)")
    parser.add_argument("--duration", type=float, default=2.0, help="seconds measured per throughput step (default 2)")
    parser.add_argument("--warmup", type=float, default=0.5, help="seconds of load before each measured window")
    parser.add_argument("--sequential-count", type=int, default=2000, help="requests per sequential step")
    parser.add_argument("--inflight", type=int, default=256, help="requests in flight when pipelined (default 256)")
    parser.add_argument("--stream-inflight", type=int, default=64, help="streams in flight (default 64)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per streamed request (default 64)")
    parser.add_argument("--short-prompt", type=int, default=10, help="tokens in the short prompt (default 10)")
    parser.add_argument("--long-prompt", type=int, default=10_000, help="tokens in the long prompt (default 10000)")
    parser.add_argument("--engines", type=int, default=1, help="echo engine processes (default 1)")
    parser.add_argument(
        "--event-loop",
        choices=("auto", "asyncio", "uvloop"),
        default="auto",
        help="event loop of every process, client and baselines included (default auto)",
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=("sequential", "pipelined", "streaming"),
        help="run only this scenario (repeatable)",
    )
    parser.add_argument("--quick", action="store_true", help="2 rounds of 1 s: a smoke run, too noisy to judge targets")
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="after the rounds, sample coordinator and engine with py-spy under pipelined load; stacks go to DIR",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="JSON results path (default benchmarks/results/coordinator-<time>.json)",
    )


def main(args: argparse.Namespace) -> int:
    if args.quick:
        args.rounds, args.duration, args.warmup, args.sequential_count = 2, 1.0, 0.3, 500
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    results = event_loop.run(run(args), args.event_loop)
    print_report(results["summary"])
    output = args.output or RESULTS_DIR / f"coordinator-{time.strftime('%Y%m%d-%H%M%S')}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2, default=str))
    print(f"\nresults: {output}")
    return 0


def build_parser(prog: str = "python -m benchmarks.coordinator") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    add_arguments(parser)
    return parser


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
