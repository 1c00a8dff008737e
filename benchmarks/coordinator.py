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
import itertools
import json
import logging
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmarks.load import Target, Window, pipelined, sequential, streaming
from benchmarks.progress import Progress
from benchmarks.py_spy_profile import fold, record
from benchmarks.stack import BenchStack, StackConfig
from service.ops import event_loop
from service.protocol.codec import encode_msgpack
from service.protocol.messages import SamplingParams, SubmitEnvelope, SubmitRequest
from service.protocol.subjects import Header

RESULTS_DIR = Path("benchmarks") / "results"  # relative to where it runs: the repository root, git-ignored


@dataclass(frozen=True, slots=True)
class Goal:
    """A target ratio: ``value`` must be >= ``bound`` (or <= for ``at_most``)."""

    name: str
    bound: float
    at_most: bool = False

    def met(self, value: float) -> bool:
        return value <= self.bound if self.at_most else value >= self.bound


TARGETS = {
    "pipelined_vs_raw_2hop": Goal("pipelined throughput / raw 2-hop echo", 0.8),
    "sequential_p50_vs_raw_4hop": Goal("sequential p50 / raw 4-hop relay", 1.0, at_most=True),
    "coordinator_cpu_us_per_request": Goal("coordinator CPU per request, pipelined (us)", 10.0, at_most=True),
    "streaming_vs_raw_relay": Goal("streamed partials/s / raw one-way relay", 0.5),
    "long_prompt_vs_short": Goal("throughput 10,000-token / 10-token prompts", 0.7),
}


def submission(prompt: list[int], max_tokens: int, stream: bool = False) -> bytes:
    """A plain contract body, as a program without the client library (or `nats pub`) sends it."""
    return encode_msgpack(SubmitRequest(prompt, SamplingParams(max_tokens=max_tokens), stream))


class Enveloped:
    """The client library's wire format: each request an envelope with its own client_request_id
    (named client, so the coordinator does its idempotency bookkeeping) around one encoded body."""

    def __init__(self, body: bytes, stream: bool, client_id: str) -> None:
        self._body = body
        self._stream = stream
        self._client_id = client_id
        self._ids = itertools.count()

    def __call__(self) -> bytes:
        return encode_msgpack(SubmitEnvelope(1, self._body, self._stream, next(self._ids), self._client_id))


def constant(body: bytes) -> Callable[[], bytes]:
    return lambda: body


def long_prompt(tokens: int, seed: int = 7) -> list[int]:
    """Token ids drawn from a 32k vocabulary: about 3 bytes each in msgpack."""
    rng = random.Random(seed)
    return [rng.randrange(32000) for _ in range(tokens)]


@dataclass(slots=True)
class Bodies:
    short: bytes
    long: bytes
    stream: bytes


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
            steps.append(("sequential", name, lambda name=name: self._sequential(name)))
        for name in (
            "raw_2hop",
            "raw_4hop",
            "dpcoord",
            "dpcoord_plain",
            "dpcoord_long_prompt",
            "dpcoord_plain_long_prompt",
            "raw_4hop_long_prompt",
        ):
            steps.append(("pipelined", name, lambda name=name: self._pipelined(name)))
        for name in ("raw_relay", "dpcoord_stream"):
            steps.append(("streaming", name, lambda name=name: self._streaming(name)))
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


def percentile(sorted_values: list[float], pct: float) -> float:
    """Nearest-rank percentile of already sorted values (NaN for none)."""
    if not sorted_values:
        return float("nan")
    rank = math.ceil(pct / 100 * len(sorted_values))
    return sorted_values[min(len(sorted_values), max(1, rank)) - 1]


# name: (scenario, numerator measurement, denominator measurement or None, field); a
# denominator of None reports the numerator's field itself (CPU microseconds per message).
FIGURES: dict[str, tuple[str, str, str | None, str]] = {
    "pipelined_vs_raw_2hop": ("pipelined", "dpcoord", "raw_2hop", "per_s"),
    "pipelined_vs_raw_4hop": ("pipelined", "dpcoord", "raw_4hop", "per_s"),
    "pipelined_plain_vs_raw_2hop": ("pipelined", "dpcoord_plain", "raw_2hop", "per_s"),
    "long_prompt_vs_short": ("pipelined", "dpcoord_long_prompt", "dpcoord", "per_s"),
    "long_prompt_plain_vs_short_plain": ("pipelined", "dpcoord_plain_long_prompt", "dpcoord_plain", "per_s"),
    "raw_4hop_long_prompt_vs_short": ("pipelined", "raw_4hop_long_prompt", "raw_4hop", "per_s"),
    "sequential_p50_vs_raw_4hop": ("sequential", "dpcoord", "raw_4hop", "p50_us"),
    "sequential_p50_vs_raw_2hop": ("sequential", "dpcoord", "raw_2hop", "p50_us"),
    "sequential_plain_p50_vs_raw_4hop": ("sequential", "dpcoord_plain", "raw_4hop", "p50_us"),
    "streaming_vs_raw_relay": ("streaming", "dpcoord_stream", "raw_relay", "per_s"),
    "coordinator_cpu_us_per_request": ("pipelined", "dpcoord", None, "cpu_us_per_coordinator"),
    "coordinator_cpu_us_per_request_plain": ("pipelined", "dpcoord_plain", None, "cpu_us_per_coordinator"),
    "coordinator_cpu_us_per_request_long_prompt": ("pipelined", "dpcoord_long_prompt", None, "cpu_us_per_coordinator"),
    "coordinator_cpu_us_per_partial": ("streaming", "dpcoord_stream", None, "cpu_us_per_coordinator"),
    "raw_relay_cpu_us_per_request": ("pipelined", "raw_4hop", None, "cpu_us_per_raw_relay"),
    "raw_relay_cpu_us_per_request_long_prompt": ("pipelined", "raw_4hop_long_prompt", None, "cpu_us_per_raw_relay"),
    "raw_relay_cpu_us_per_partial": ("streaming", "raw_relay", None, "cpu_us_per_raw_stream_relay"),
}


def _field(measurement: dict[str, Any], name: str) -> float:
    if name.startswith("cpu_us_per_"):
        return measurement["cpu_us_per"][name.removeprefix("cpu_us_per_")]
    return measurement[name]


def round_ratios(measured: dict[str, dict[str, dict[str, Any]]]) -> dict[str, float]:
    """The figures of one round, from whatever that round measured."""
    figures: dict[str, float] = {}
    for key, (scenario, numerator, denominator, field_name) in FIGURES.items():
        results = measured.get(scenario, {})
        if numerator not in results or (denominator is not None and denominator not in results):
            continue
        value = _field(results[numerator], field_name)
        figures[key] = value if denominator is None else value / _field(results[denominator], field_name)
    return figures


def summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds: of each measurement, and of each per-round ratio."""
    medians: dict[str, dict[str, dict[str, float]]] = {}
    for scenario in ("sequential", "pipelined", "streaming"):
        names = {name for r in rounds for name in r["measured"].get(scenario, {})}
        for name in sorted(names):
            values = [r["measured"][scenario][name] for r in rounds if name in r["measured"].get(scenario, {})]
            keys = [key for key in ("p50_us", "p99_us", "per_s") if key in values[0]]
            entry = {key: statistics.median(v[key] for v in values) for key in keys}
            for proc in values[0].get("cpu_us_per", {}):
                entry[f"cpu_us_per_{proc}"] = statistics.median(v["cpu_us_per"][proc] for v in values)
            entry["errors"] = sum(v["errors"] for v in values)
            medians.setdefault(scenario, {})[name] = entry
    ratio_names = {key for r in rounds for key in r["ratios"]}
    ratios = {
        key: statistics.median(r["ratios"][key] for r in rounds if key in r["ratios"]) for key in sorted(ratio_names)
    }
    spread = {
        key: [
            min(r["ratios"][key] for r in rounds if key in r["ratios"]),
            max(r["ratios"][key] for r in rounds if key in r["ratios"]),
        ]
        for key in sorted(ratio_names)
    }
    targets = {
        key: {
            "name": target.name,
            "value": ratios[key],
            "bound": target.bound,
            "at_most": target.at_most,
            "met": target.met(ratios[key]),
        }
        for key, target in TARGETS.items()
        if key in ratios
    }
    return {"medians": medians, "ratios": ratios, "ratio_range": spread, "targets": targets}


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "nats_py": metadata.version("nats-py"),
        "msgspec": metadata.version("msgspec"),
        "load_average_at_start": os.getloadavg(),
    }


def print_report(summary: dict[str, Any], out: Any = sys.stdout) -> None:
    medians = summary["medians"]
    out.write("\nmedians over rounds\n")
    for name, entry in medians.get("sequential", {}).items():
        cpu = "  ".join(
            f"{key.removeprefix('cpu_us_per_')} {value:.1f} us"
            for key, value in entry.items()
            if key.startswith("cpu_us_per_") and value >= 0.2  # idle processes left out
        )
        out.write(
            f"  sequential {name:<25} p50 {entry['p50_us']:6.0f} us  p99 {entry['p99_us']:6.0f} us   cpu/req: {cpu}\n"
        )
    for scenario, unit in (("pipelined", "req/s"), ("streaming", "msg/s")):
        for name, entry in medians.get(scenario, {}).items():
            cpu = "  ".join(
                f"{key.removeprefix('cpu_us_per_')} {value:.1f} us"
                for key, value in entry.items()
                if key.startswith("cpu_us_per_") and value >= 0.2  # idle processes left out
            )
            errors = f"  ERRORS {entry['errors']}" if entry["errors"] else ""
            out.write(f"  {scenario:<10} {name:<25} {entry['per_s']:10.0f} {unit}   cpu/msg: {cpu}{errors}\n")
    out.write("\nratios (median of per-round ratios, [min, max])\n")
    for key, value in summary["ratios"].items():
        low, high = summary["ratio_range"][key]
        out.write(f"  {key:<34} {value:7.3f}  [{low:.3f}, {high:.3f}]\n")
    out.write("\ntargets\n")
    for target in summary["targets"].values():
        sign = "<=" if target["at_most"] else ">="
        verdict = "met" if target["met"] else "MISSED"
        out.write(f"  {target['name']:<48} {target['value']:7.3f} (target {sign} {target['bound']:g})  {verdict}\n")


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
