"""Stalled readers: HTTP clients that open long streams through the gateway and read nothing
(issue 34 item 2), beside clients that read normally, measured in one run.

Path: HTTP clients (this process) -> ``dpcoord gateway`` -> coordinator -> echo engines at full
speed, each its own process (benchmarks/stalled_stack.py). Steps:

1. ``--normal`` streams of ``--normal-tokens`` read as they come, ``--rounds`` times: the
   baseline throughput (tokens a second over all of them), each stream checked exact;
2. ``--stalled`` streams of ``--stalled-tokens`` whose clients read nothing, and
   ``--trickling`` more that read a byte a second; once the engines' generated tokens stop
   growing (read from their ``/metrics``), what they generated for the stalled streams;
3. the normal streams again, ``--rounds`` times, beside the stalled ones: their throughput as a
   ratio of the baseline, exactness, and whether the engines generated anything for the
   stalled streams meanwhile;
4. ``--verify`` of the stalled streams read to their end now (released: exact), the others
   closed; then the baseline again, so the ratio is against the baseline on either side.

Throughout: the gateway's RSS, sampled every 0.1 s, its rise over the figure before step 2; and
per normal round the gateway's CPU per token (from /proc), steadier than throughput on a shared
machine.
Targets (issue 34): a rise of at most 64 MiB, normal streams exact and unslowed, and the
stalled streams not generated to their end while they stall. ``--stall-s`` (600 by default)
keeps the stall limit out of the measurement.

Run: ``python -m benchmarks.stalled_readers`` (``--help`` lists the knobs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, machine
from benchmarks.proc_cpu import cpu_seconds
from benchmarks.stack import StackConfig
from benchmarks.stalled_stack import StalledStack, drain_whole, open_stalled, read_stream, rss_mib, trickle
from service.bus.server import free_port
from service.ops import event_loop
from service.protocol.codec import encode_msgpack
from service.protocol.messages import SamplingParams, SubmitRequest


class RssWatch:
    """The gateway's RSS, sampled until stopped; its highest value."""

    def __init__(self, pid: int) -> None:
        self._pid = pid
        self.highest = rss_mib(pid)
        self._task = asyncio.ensure_future(self._sample())

    async def _sample(self) -> None:
        while True:
            self.highest = max(self.highest, rss_mib(self._pid))
            await asyncio.sleep(0.1)  # sampling another process: nothing to await on

    def stop(self) -> None:
        self._task.cancel()


async def normal_round(port: int, streams: int, tokens: int, pid: int) -> tuple[float, float, int]:
    """Over ``streams`` streams read as they come: tokens a second, the gateway's CPU
    microseconds per token, and how many streams were exact."""
    started, cpu = time.perf_counter(), cpu_seconds(pid)
    exact = await asyncio.gather(*(read_stream(port, tokens) for _ in range(streams)))
    total = streams * tokens
    return total / (time.perf_counter() - started), (cpu_seconds(pid) - cpu) * 1e6 / total, sum(exact)


async def normal_rounds(port: int, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    rounds = [await normal_round(port, args.normal, args.normal_tokens, pid) for _ in range(args.rounds)]
    return {
        "tokens_per_s": statistics.median(rate for rate, _, _ in rounds),
        "rounds_tokens_per_s": [round(rate) for rate, _, _ in rounds],
        "gateway_cpu_us_per_token": statistics.median(cpu for _, cpu, _ in rounds),
        "exact": sum(exact for _, _, exact in rounds),
        "streams": args.normal * args.rounds,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    gateway_env = {
        "DPCOORD_GATEWAY_STREAM_BUFFER_BYTES": str(args.buffer_bytes),
        "DPCOORD_GATEWAY_STREAM_STALL_S": str(args.stall_s),
        "DPCOORD_REQUEST_TIMEOUT_S": "3600",
    }
    config = StackConfig(args.nats_url, args.engines, args.event_loop, args.normal_tokens)
    stack = StalledStack(config, gateway_env)
    async with stack:
        await stack.start_fleet(encode_msgpack(SubmitRequest("probe", SamplingParams(max_tokens=1))))
        port = free_port()
        await stack.start_gateway(port)
        pid = stack.pids["gateway"]
        await normal_round(port, args.normal, 64, pid)  # warm up the gateway's connections and allocator
        baseline = await normal_rounds(port, pid, args)
        rss_before = rss_mib(pid)
        before_stall = await stack.settled_tokens()
        watch = RssWatch(pid)
        stalled = [open_stalled(port, args.stalled_tokens) for _ in range(args.stalled)]
        trickling = [open_stalled(port, args.stalled_tokens) for _ in range(args.trickling)]
        stop = asyncio.Event()
        tricklers = [asyncio.ensure_future(trickle(sock, stop)) for sock in trickling]
        held = await stack.settled_tokens(quiet_s=2.0)
        beside = await normal_rounds(port, pid, args)
        after = await stack.settled_tokens()
        rss_stalled = watch.highest
        stop.set()
        await asyncio.gather(*tricklers)
        verified = await asyncio.gather(*(drain_whole(sock, args.stalled_tokens) for sock in stalled[: args.verify]))
        for sock in stalled[args.verify :] + trickling:
            sock.close()
        watch.stop()
        await stack.settled_tokens()
        again = await normal_rounds(port, pid, args)
        stalled_count = args.stalled + args.trickling
        generated_while_stalled = held - before_stall
        return {
            "machine": machine(),
            "args": vars(args) | {"output": str(args.output)},
            "gateway_rss_mib": {"before": round(rss_before, 1), "highest_while_stalled": round(rss_stalled, 1)},
            "gateway_rss_rise_mib": round(rss_stalled - rss_before, 1),
            "baseline": baseline,
            "baseline_after": again,
            "beside_stalled": beside,
            "throughput_ratio": round(
                beside["tokens_per_s"] / statistics.mean([baseline["tokens_per_s"], again["tokens_per_s"]]), 3
            ),
            "gateway_cpu_per_token_ratio": round(
                beside["gateway_cpu_us_per_token"]
                / statistics.mean([baseline["gateway_cpu_us_per_token"], again["gateway_cpu_us_per_token"]]),
                3,
            ),
            "stalled_streams": stalled_count,
            "generated_for_stalled_tokens": generated_while_stalled,
            "generated_per_stalled_stream": round(generated_while_stalled / stalled_count),
            "stalled_stream_tokens": args.stalled_tokens,
            "generated_for_stalled_meanwhile": after - held - beside["streams"] * args.normal_tokens,
            "verified_exact_after_release": f"{sum(verified)} of {len(verified)}",
        }


def print_report(results: dict[str, Any]) -> None:
    rss = results["gateway_rss_mib"]
    print(
        f"gateway RSS: {rss['before']} MiB before, {rss['highest_while_stalled']} MiB at most while "
        f"{results['stalled_streams']} streams stalled: a rise of {results['gateway_rss_rise_mib']} MiB (target <= 64)"
    )
    base, again, beside = results["baseline"], results["baseline_after"], results["beside_stalled"]
    print(
        f"normal streams: {beside['tokens_per_s']:.0f} tokens/s beside the stalled ones, {base['tokens_per_s']:.0f} "
        f"before and {again['tokens_per_s']:.0f} after without them: {results['throughput_ratio']:.2f}x; exact "
        f"{beside['exact']} of {beside['streams']} (without: {base['exact'] + again['exact']} of "
        f"{base['streams'] + again['streams']})"
    )
    print(
        f"gateway CPU per normal token: {beside['gateway_cpu_us_per_token']:.1f} us beside the stalled ones, "
        f"{base['gateway_cpu_us_per_token']:.1f} and {again['gateway_cpu_us_per_token']:.1f} without: "
        f"{results['gateway_cpu_per_token_ratio']:.2f}x"
    )
    print(
        f"engines generated {results['generated_per_stalled_stream']} tokens per stalled stream of "
        f"{results['stalled_stream_tokens']}, then {results['generated_for_stalled_meanwhile']:.0f} more for all "
        f"of them while the normal streams ran; read afterwards: {results['verified_exact_after_release']} exact"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats-url", default=None, help="use this NATS server instead of an embedded one")
    parser.add_argument("--engines", type=int, default=2, help="echo engine processes (default 2)")
    parser.add_argument("--normal", type=int, default=50, help="normal streams at a time (default 50)")
    parser.add_argument("--normal-tokens", type=int, default=2000, help="tokens per normal stream (default 2000)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the normal streams per step (default 3)")
    parser.add_argument("--stalled", type=int, default=20, help="streams whose clients read nothing (default 20)")
    parser.add_argument("--trickling", type=int, default=5, help="streams read a byte a second (default 5)")
    parser.add_argument("--stalled-tokens", type=int, default=40000, help="tokens per stalled stream (default 40000)")
    parser.add_argument("--verify", type=int, default=2, help="stalled streams read whole at the end (default 2)")
    parser.add_argument("--buffer-bytes", type=int, default=1 << 20, help="gateway_stream_buffer_bytes (1 MiB)")
    parser.add_argument("--stall-s", type=float, default=600.0, help="gateway_stream_stall_s (default 600)")
    parser.add_argument("--event-loop", choices=("auto", "asyncio", "uvloop"), default="auto")
    parser.add_argument("--output", type=Path, default=None, help="JSON results path (default benchmarks/results/)")


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    results = event_loop.run(run(args), args.event_loop)
    print_report(results)
    output = args.output or RESULTS_DIR / f"stalled-readers-{time.strftime('%Y%m%d-%H%M%S')}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2, default=str))
    print(f"\nresults: {output}")
    return 0


def build_parser(prog: str = "python -m benchmarks.stalled_readers") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    add_arguments(parser)
    return parser


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
