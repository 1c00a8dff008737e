"""Gateway A/B: this checkout's gateway against another revision's, on one stack, in one run.

Two gateway processes, this checkout's and ``--baseline REV``'s (extracted with ``git archive``,
benchmarks/common.py), serve the same coordinator, echo engine and nats-server. Windows of the
same load (benchmarks/http_load.py: ``--connections`` pipelined keep-alive connections) go to
one and then the other, the order flipping each round, and each window gives the gateway's CPU
per request. Two workloads: short completions (16 tokens, not streamed) and 64-token streams.
Each round's ratio is current / baseline CPU per request; the median ratio is the result.

Measured this way, the two gateways share the machine's state of the moment (its speed moves by
a fifth between runs on a shared 2-core machine), which two separate ``dpcoord bench --gateway``
runs do not.

Run: ``python -m benchmarks.gateway_ab --baseline REV`` (``--help`` lists the knobs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import extract
from benchmarks.http_load import Pipelined, post
from benchmarks.proc_cpu import cpu_seconds
from benchmarks.stack import BenchStack, StackConfig
from service.bus.server import free_port
from service.ops import event_loop
from service.protocol.codec import encode_msgpack
from service.protocol.messages import SamplingParams, SubmitRequest

MODEL = "dpcoord-echo"
GATEWAYS = ("current", "baseline")


async def window(port: int, pid: int, raw: bytes, stream: bool, args: argparse.Namespace) -> tuple[float, float]:
    """(CPU µs per request of process ``pid``, requests/s) over one measured window."""
    load = Pipelined("127.0.0.1", port, raw, args.connections, stream)
    stop = asyncio.Event()
    running = asyncio.ensure_future(load.run_until(stop))
    try:
        await asyncio.sleep(args.warmup)
        done, cpu, started = load.completed, cpu_seconds(pid), time.perf_counter()
        await asyncio.sleep(args.duration)
        completed, used = load.completed - done, cpu_seconds(pid) - cpu
        seconds = time.perf_counter() - started
    finally:
        stop.set()
        await running
    if load.errors or not completed:
        raise RuntimeError(f"the gateway on port {port} answered {load.errors} error(s), {completed} success(es)")
    return used / completed * 1e6, completed / seconds


async def run(args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    probe = encode_msgpack(SubmitRequest("Hello", SamplingParams(max_tokens=1)))
    results: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="dpcoord-gateway-ab-") as temp:
        baseline = extract(args.baseline, Path(temp) / "baseline")
        async with BenchStack(StackConfig(None, 1, args.event_loop, args.tokens)) as stack:
            await stack.start_dpcoord(probe)
            ports = {name: free_port() for name in GATEWAYS}
            await stack.start_gateway(ports["current"], name="current")
            await stack.start_gateway(ports["baseline"], name="baseline", tree=baseline)
            for workload, stream, tokens in (("request", False, args.max_tokens), ("stream", True, args.tokens)):
                body = {"model": MODEL, "prompt": "Hello", "max_tokens": tokens, "stream": stream}
                raw = post("127.0.0.1", "/v1/completions", json.dumps(body).encode())
                rounds = results[workload] = []
                for index in range(args.rounds):
                    order = GATEWAYS if index % 2 == 0 else GATEWAYS[::-1]
                    measured = {name: await window(ports[name], stack.pids[name], raw, stream, args) for name in order}
                    rounds.append(
                        {f"{name}_cpu_us": measured[name][0] for name in GATEWAYS}
                        | {f"{name}_per_s": measured[name][1] for name in GATEWAYS}
                        | {"ratio": measured["current"][0] / measured["baseline"][0]}
                    )
                    print_round(workload, index, rounds[-1])
    return results


def print_round(workload: str, index: int, entry: dict[str, float]) -> None:
    print(
        f"{workload:<8} round {index + 1}: current {entry['current_cpu_us']:7.1f} µs ({entry['current_per_s']:6.0f}/s)"
        f"  baseline {entry['baseline_cpu_us']:7.1f} µs ({entry['baseline_per_s']:6.0f}/s)"
        f"  current/baseline {entry['ratio']:.3f}",
        flush=True,
    )


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    results = event_loop.run(run(args), args.event_loop)
    print(f"\ngateway CPU per request (or stream), current / {args.baseline}, median over rounds")
    for workload, rounds in results.items():
        ratios = [entry["ratio"] for entry in rounds]
        print(f"  {workload:<8} {statistics.median(ratios):.3f}  (rounds {min(ratios):.3f} .. {max(ratios):.3f})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gateway_ab", description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="git revision of this checkout to measure against")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per workload (default 5)")
    parser.add_argument("--duration", type=float, default=2.0, help="seconds measured per window (default 2)")
    parser.add_argument("--warmup", type=float, default=0.5, help="seconds of load before each window")
    parser.add_argument("--connections", type=int, default=64, help="connections in flight (default 64)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per short completion (default 16)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per stream (default 64)")
    parser.add_argument(
        "--event-loop", choices=("auto", "asyncio", "uvloop"), default="auto", help="event loop of every process"
    )
    return parser


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
