"""Gateway benchmark: OpenAI HTTP requests through ``dpcoord gateway`` against the same requests
sent with the client library directly, measured in one run.

Path measured: HTTP client -> gateway -> coordinator -> echo engine -> coordinator -> gateway ->
HTTP client, each its own process; the baseline is the client library in the benchmark process
on the same coordinator and engines. Three workloads, each both ways:

- sequential short completions (prompt "Hello", 16 tokens, not streamed): latency p50 / p99,
  and the p50 the gateway adds;
- pipelined short completions (``--connections`` in flight): requests/s, p50 / p99 under load,
  and the gateway's CPU per request;
- streamed completions of 64 tokens (``--streams`` in flight, one SSE event per token):
  streams/s and the gateway's CPU per stream;
- the pipelined load against a bare ASGI "hello" app under the same server
  (benchmarks/hello_asgi.py): the gateway's CPU per request as a multiple of the bare app's,
  and the gateway's CPU per SSE event (a stream's CPU less a request's, over its tokens);
- the pipelined load against the "relay" app (benchmarks/hello_asgi.py): "hello" with one request
  through the client library in between, the least a gateway on this server and this client
  library can spend (``relay_vs_hello_cpu_per_request`` is the floor under the ratio above, and
  ``gateway_vs_relay_cpu_per_request`` what the gateway's OpenAI work adds to it);
- the same "hello" app paced at the gateway's last measured request rate
  (``pipelined_hello_paced``): an event-loop server's CPU per request depends on its request
  rate (at a low rate each request pays its own wake-ups and system calls; at a high one they
  are shared), and the bare app unpaced answers several times the gateway's rate, so
  ``gateway_vs_hello_at_gateway_rate`` compares the two at the same rate. It is reported beside
  the issue's target figure, not instead of it.

Rounds are interleaved and flip order; each figure is the median over rounds. The HTTP load
generator (benchmarks/http_load.py) and the client library share the benchmark process and the
machine's cores with what they measure, as on any 2-core machine.

Run: ``dpcoord bench --gateway`` (or ``python -m benchmarks.gateway``); ``--help`` lists the knobs.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, machine
from benchmarks.gateway_figures import figures, summarise
from benchmarks.gateway_measure import PROMPT, Measure
from benchmarks.gateway_report import print_report
from benchmarks.progress import Progress
from benchmarks.stack import BenchStack, StackConfig
from service.bus.server import free_port
from service.client import DpcoordClient
from service.ops import event_loop
from service.ops.settings import Settings
from service.protocol.codec import encode_msgpack
from service.protocol.messages import SamplingParams, SubmitRequest


async def run(args: argparse.Namespace) -> dict[str, Any]:
    config = StackConfig(args.nats_url, args.engines, args.event_loop, args.tokens)
    probe = encode_msgpack(SubmitRequest(PROMPT, SamplingParams(max_tokens=1)))
    async with BenchStack(config) as stack:
        await stack.start_dpcoord(probe)
        port = free_port()
        await stack.start_gateway(port)
        hello_port, relay_port = free_port(), free_port()
        await stack.start_hello(hello_port)
        await stack.start_hello(relay_port, relay=True)
        settings = Settings.model_validate({"nats_url": stack.nats_url, "subject_prefix": config.prefix})
        async with await DpcoordClient.connect(settings) as client:
            measure = Measure(args, stack, client, port, hello_port, relay_port)
            steps = [step for step in measure.steps() if not args.only or step[0].split("_")[0] in args.only]
            progress = Progress(len(steps) * args.rounds)
            rounds: list[dict[str, Any]] = []
            for index in range(args.rounds):
                ordered = steps if index % 2 == 0 else list(reversed(steps))
                measured: dict[str, dict[str, Any]] = {}
                for name, step in ordered:
                    progress.step(f"round {index + 1}/{args.rounds} {name}")
                    measured[name] = await step()
                rounds.append({"measured": measured, "figures": figures(measured, args.tokens)})
                progress.note(" ".join(f"{key}={value:.4g}" for key, value in rounds[-1]["figures"].items()))
            progress.done()
    return {
        "benchmark": "gateway",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(),
        "event_loop": event_loop.resolve(args.event_loop),
        "config": vars(args),
        "rounds": rounds,
        "summary": summarise(rounds),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats-url", default=None, help="use this NATS server instead of an embedded one")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every measurement (default 3)")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds measured per throughput step (default 3)")
    parser.add_argument("--warmup", type=float, default=0.5, help="seconds of load before each measured window")
    parser.add_argument(
        "--sequential-count", type=int, default=1000, help="requests per sequential step (default 1000)"
    )
    parser.add_argument("--connections", type=int, default=64, help="non-streamed requests in flight (default 64)")
    parser.add_argument("--streams", type=int, default=64, help="streams in flight (default 64)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per short completion (default 16)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per streamed completion (default 64)")
    parser.add_argument("--engines", type=int, default=1, help="echo engine processes (default 1)")
    parser.add_argument(
        "--event-loop",
        choices=("auto", "asyncio", "uvloop"),
        default="auto",
        help="event loop of every process (default auto)",
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=("sequential", "pipelined", "streaming"),
        help="run only this workload (repeatable)",
    )
    parser.add_argument("--quick", action="store_true", help="1 round of 1 s: a smoke run, too noisy to judge targets")
    parser.add_argument(
        "--output", type=Path, default=None, help="JSON results path (default benchmarks/results/gateway-<time>.json)"
    )


def main(args: argparse.Namespace) -> int:
    if args.quick:
        args.rounds, args.duration, args.warmup, args.sequential_count = 1, 1.0, 0.3, 200
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    results = event_loop.run(run(args), args.event_loop)
    print_report(results["summary"])
    output = args.output or RESULTS_DIR / f"gateway-{time.strftime('%Y%m%d-%H%M%S')}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2, default=str))
    print(f"\nresults: {output}")
    return 0


def build_parser(prog: str = "python -m benchmarks.gateway") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    add_arguments(parser)
    return parser


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
