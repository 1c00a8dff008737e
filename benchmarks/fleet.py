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

Run: ``dpcoord bench --simulated-engines 2,100,1000,3000`` (or ``python -m benchmarks.fleet``);
``--help`` lists the knobs.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from benchmarks.coordinator import RESULTS_DIR, machine, percentile
from benchmarks.load import Target, pipelined
from benchmarks.offered_load import offer
from benchmarks.proc_cpu import cpu_seconds
from benchmarks.progress import Progress
from service.bus.server import EmbeddedNatsServer
from service.ops import event_loop
from service.protocol.codec import encode_msgpack
from service.protocol.messages import SamplingParams, SubmitEnvelope, SubmitRequest
from service.protocol.prefix import prefix_hashes
from service.protocol.subjects import Header, Subjects

COORDINATOR_ID = "fleetbench"
UNKNOWN = -1  # engines lost, when a saturated coordinator did not answer its status after any window


@dataclass(frozen=True, slots=True)
class Goal:
    name: str
    engines: int
    bound: float
    at_most: bool

    def met(self, value: float) -> bool:
        return value <= self.bound if self.at_most else value >= self.bound


# Against the smallest fleet of the run (2 engines by default).
RATIO_GOALS = (
    Goal("coordinator CPU per request vs 2 engines", 1000, 1.2, at_most=True),
    Goal("coordinator CPU per request vs 2 engines", 3000, 1.5, at_most=True),
    Goal("throughput vs 2 engines", 1000, 0.95, at_most=False),
)
REGISTRATION_CPU_GOAL = Goal("coordinator CPU to register the fleet (s)", 3000, 0.1, at_most=True)
IDLE_GOAL = Goal("idle coordinator CPU with the fleet heartbeating (% of a core)", 3000, 5.0, at_most=True)


@dataclass(slots=True)
class FleetResult:
    """One fleet: registration and idle figures, and medians over the rounds of load windows."""

    policy: str
    engines: int
    registration_s: float
    registration_cpu_s: float
    idle_core_pct: float
    offered_per_s: float
    achieved_per_s: float
    p50_ms: float
    p99_ms: float
    cpu_us_per_request: float
    coordinator_core_pct: float
    requests_per_routed_message: float
    others_cores: float  # CPU of every other process on the machine over the load windows, in cores
    sent: int  # sums over the rounds
    lost: int
    duplicated: int
    errors: int
    engines_lost: int  # most engines missing from the coordinator's pool after a window (removed for silence); UNKNOWN if it never answered
    log_lines: int
    cpu_ratio: float = float("nan")  # median over rounds of CPU per request / the smallest fleet's in that round
    rate_ratio: float = float("nan")  # same, of the achieved rate


class Workload:
    """Envelopes with unique client_request_ids over one short body, each with the prefix
    hashes of one of 8 shared system prompts plus its own tail (64 tails, reused)."""

    def __init__(self, seed: int = 1) -> None:
        rng = random.Random(seed)
        self._body = encode_msgpack(SubmitRequest(list(range(1, 11)), SamplingParams(max_tokens=1)))
        systems = [[rng.randrange(32000) for _ in range(1024)] for _ in range(8)]
        self._hashes = [
            prefix_hashes(systems[index % 8] + [rng.randrange(32000) for _ in range(32)]) for index in range(64)
        ]
        self._client_id = f"fleet-{uuid.uuid4().hex[:8]}"

    def __call__(self, number: int) -> bytes:
        hashes = self._hashes[number % len(self._hashes)]
        return encode_msgpack(SubmitEnvelope(1, self._body, False, number, self._client_id, None, None, None, hashes))


@dataclass(slots=True)
class RunningFleet:
    """A coordinator and its engines, up for the whole of one policy's rounds."""

    policy: str
    engines: int
    subjects: Subjects
    coordinator: asyncio.subprocess.Process
    host: asyncio.subprocess.Process
    log_path: Path
    registration_s: float = 0.0
    registration_cpu_s: float = 0.0
    idle_core_pct: float = 0.0
    windows: list[dict[str, float]] = field(default_factory=list)


class FleetBench:
    def __init__(self, args: argparse.Namespace, nats_url: str, nats_pid: int | None, log_dir: Path) -> None:
        self.args = args
        self.nats_url = nats_url
        self.nats_pid = nats_pid
        self.log_dir = log_dir
        self.workload = Workload()
        self._numbers = itertools.count()  # request numbers: unique client_request_ids across every window
        self._nc: NATS | None = None

    @property
    def nc(self) -> NATS:
        if self._nc is None:
            raise RuntimeError("not connected")
        return self._nc

    async def __aenter__(self) -> FleetBench:
        self._nc = await nats.connect(self.nats_url, name="fleet-bench-client", pending_size=64 * 1024 * 1024)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.nc.close()

    # ------------------------------------------------------------ processes

    async def start(self, policy: str, engines: int) -> RunningFleet:
        """A coordinator, then ``engines`` engines; registration is measured on the way."""
        subjects = Subjects(f"fleet{uuid.uuid4().hex[:8]}")
        log_path = self.log_dir / f"coordinator-{policy}-{engines}.log"
        coordinator = await self._coordinator(policy, subjects, log_path)
        cpu_before = cpu_seconds(coordinator.pid)
        host = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "benchmarks.doc_engines",
            "--nats-url",
            self.nats_url,
            "--prefix",
            subjects.prefix,
            "--count",
            str(engines),
            "--id-prefix",
            "sim-",
            stdout=asyncio.subprocess.PIPE,
        )
        fleet = RunningFleet(policy, engines, subjects, coordinator, host, log_path)
        fleet.registration_s = await _registered(host)
        fleet.registration_cpu_s = cpu_seconds(coordinator.pid) - cpu_before
        status = await self._status(fleet)
        known = len(status["engines"]) if status is not None else 0
        if known != engines:
            raise RuntimeError(f"the coordinator knows {known} engines, not {engines}")
        return fleet

    async def _coordinator(self, policy: str, subjects: Subjects, log_path: Path) -> asyncio.subprocess.Process:
        env = dict(os.environ)
        env.update(
            {
                "DPCOORD_NATS_URL": self.nats_url,
                "DPCOORD_SUBJECT_PREFIX": subjects.prefix,
                "DPCOORD_COORDINATOR_ID": COORDINATOR_ID,
                "DPCOORD_ROUTING_POLICY": policy,
                "DPCOORD_LOG_LEVEL": "INFO",
                "DPCOORD_EVENT_LOOP": self.args.event_loop,
                "DPCOORD_HTTP_PORT": "0",
            }
        )
        source = self.args.coordinator_source
        if source is not None:
            env["PYTHONPATH"] = str(source.resolve())
        with log_path.open("w") as log_file:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "service",
                "coordinator",
                env=env,
                stderr=log_file,
                cwd=source,
            )
        status = subjects.status("coordinator", COORDINATOR_ID)
        for _ in range(600):
            if process.returncode is not None:
                raise RuntimeError(f"the coordinator exited with {process.returncode}; see {log_path}")
            try:
                await self.nc.request(status, b"", timeout=1.0)
                return process
            except (NoRespondersError, NatsTimeoutError):
                await asyncio.sleep(0.05)  # waiting for a process to come up: nothing to await on
        raise RuntimeError(f"the coordinator did not come up in 30 s; see {log_path}")

    async def _status(self, fleet: RunningFleet) -> dict[str, Any] | None:
        """The coordinator's status; None when a saturated coordinator did not answer in 10 s."""
        try:
            msg = await self.nc.request(fleet.subjects.status("coordinator", COORDINATOR_ID), b"", timeout=10.0)
        except NatsTimeoutError:
            return None
        return json.loads(msg.data)

    @staticmethod
    async def stop(fleet: RunningFleet) -> None:
        for process in (fleet.host, fleet.coordinator):
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), 30)
            except TimeoutError:
                process.kill()
                await process.wait()

    # ------------------------------------------------------------ measurements

    def _body(self) -> bytes:
        return self.workload(next(self._numbers))

    async def closed_loop_rate(self, fleet: RunningFleet) -> float:
        """Requests/s of the whole machine with ``inflight`` requests outstanding: the reference rate."""
        target = Target(fleet.subjects.coordinator(Header.SUBMIT_REQUEST), self._body)
        window = await pipelined(self.nc, target, self.args.inflight, self.args.warmup, self.args.duration, {})
        return window.rate

    async def measure_idle(self, fleets: list[RunningFleet]) -> None:
        """Each coordinator's CPU with its engines heartbeating and no requests, all at once."""
        await asyncio.sleep(2.0)  # every engine heartbeating by now; nothing to await on
        before = [cpu_seconds(fleet.coordinator.pid) for fleet in fleets]
        await asyncio.sleep(self.args.idle)
        for fleet, start in zip(fleets, before, strict=True):
            fleet.idle_core_pct = (cpu_seconds(fleet.coordinator.pid) - start) / self.args.idle * 100

    async def load_window(self, fleet: RunningFleet, rate: float) -> None:
        before_status = await self._status(fleet)
        before = before_status["counters"] if before_status is not None else {}
        watch = {"coordinator": fleet.coordinator.pid, "engines": fleet.host.pid, "client": os.getpid()}
        if self.nats_pid is not None:
            watch["nats_server"] = self.nats_pid
        load = await offer(
            self.nc,
            fleet.subjects.coordinator(Header.SUBMIT_REQUEST),
            lambda _: self._body(),
            rate,
            self.args.warmup,
            self.args.duration,
            watch,
        )
        status = await self._status(fleet)
        after = status["counters"] if status is not None and before_status is not None else {}
        messages = after.get("routed_messages", 0) - before.get("routed_messages", 0)
        routed = after.get("routed_requests", 0) - before.get("routed_requests", 0)
        latencies = sorted(load.latencies_us)
        fleet.windows.append(
            {
                "achieved_per_s": load.achieved_per_s,
                "p50_ms": percentile(latencies, 50) / 1000,
                "p99_ms": percentile(latencies, 99) / 1000,
                "cpu_us_per_request": load.cpu_us_per_request("coordinator"),
                "coordinator_core_pct": load.cpu_s["coordinator"] / load.window_s * 100,
                "requests_per_routed_message": routed / messages if messages else float("nan"),
                "others_cores": max(0.0, (load.machine_busy_s - sum(load.cpu_s.values())) / load.window_s),
                "sent": load.sent,
                "lost": load.lost,
                "duplicated": load.duplicated,
                "errors": load.errors,
                "engines_lost": fleet.engines - len(status["engines"]) if status is not None else UNKNOWN,
            }
        )


async def _registered(host: asyncio.subprocess.Process) -> float:
    """Seconds the engine process took to register its engines, as it reports them."""
    if host.stdout is None:
        raise RuntimeError("the engine process has no stdout pipe")
    line = (await asyncio.wait_for(host.stdout.readline(), 300)).decode().split()
    if not line or line[0] != "registered":
        raise RuntimeError(f"the engine process said {line!r} instead of registering")
    return float(line[2])


def summarise(fleets: list[RunningFleet], rate: float) -> list[FleetResult]:
    """Medians over rounds per fleet, and per-round ratios to the smallest fleet's window."""
    base = min(fleets, key=lambda fleet: fleet.engines)
    results = []
    for fleet in fleets:
        windows = fleet.windows

        def median(key: str, of: list[dict[str, float]] = windows) -> float:
            return statistics.median(window[key] for window in of)

        def ratio(key: str, fleet: RunningFleet = fleet) -> float:
            return statistics.median(
                mine[key] / theirs[key] for mine, theirs in zip(fleet.windows, base.windows, strict=True)
            )

        results.append(
            FleetResult(
                policy=fleet.policy,
                engines=fleet.engines,
                registration_s=fleet.registration_s,
                registration_cpu_s=fleet.registration_cpu_s,
                idle_core_pct=fleet.idle_core_pct,
                offered_per_s=rate,
                achieved_per_s=median("achieved_per_s"),
                p50_ms=median("p50_ms"),
                p99_ms=median("p99_ms"),
                cpu_us_per_request=median("cpu_us_per_request"),
                coordinator_core_pct=median("coordinator_core_pct"),
                requests_per_routed_message=median("requests_per_routed_message"),
                others_cores=median("others_cores"),
                sent=sum(int(w["sent"]) for w in windows),
                lost=sum(int(w["lost"]) for w in windows),
                duplicated=sum(int(w["duplicated"]) for w in windows),
                errors=sum(int(w["errors"]) for w in windows),
                engines_lost=max(int(w["engines_lost"]) for w in windows),
                log_lines=len(fleet.log_path.read_text().splitlines()),
                cpu_ratio=ratio("cpu_us_per_request"),
                rate_ratio=ratio("achieved_per_s"),
            )
        )
    return results


# ---------------------------------------------------------------- report


def judge(results: list[FleetResult]) -> list[dict[str, Any]]:
    """Each target per policy: value, bound, met, and the facts that explain a miss."""
    verdicts: list[dict[str, Any]] = []
    for policy in dict.fromkeys(result.policy for result in results):
        rows = {result.engines: result for result in results if result.policy == policy}
        base = rows[min(rows)]
        for goal in RATIO_GOALS:
            row = rows.get(goal.engines)
            if row is None or row is base:
                continue
            cpu = "CPU" in goal.name
            value = row.cpu_ratio if cpu else row.rate_ratio
            why = (
                f"{base.cpu_us_per_request:.1f} -> {row.cpu_us_per_request:.1f} us/request; requests per routed message "
                f"{base.requests_per_routed_message:.1f} -> {row.requests_per_routed_message:.1f}"
                if cpu
                else f"{base.achieved_per_s:,.0f} -> {row.achieved_per_s:,.0f} req/s of {row.offered_per_s:,.0f} offered; "
                f"coordinator at {row.coordinator_core_pct:.0f}% of a core; other processes {row.others_cores:.2f} cores; "
                f"{row.engines_lost} engines removed for silence"
            )
            verdicts.append(
                _verdict(policy, goal, f"{goal.name} ({goal.engines} / {base.engines} engines)", value, why)
            )
        for goal, field_name in ((REGISTRATION_CPU_GOAL, "registration_cpu_s"), (IDLE_GOAL, "idle_core_pct")):
            row = rows.get(goal.engines)
            if row is not None:
                why = f"registration took {row.registration_s:.2f} s wall; {row.log_lines} coordinator log lines in the run"
                verdicts.append(
                    _verdict(policy, goal, f"{goal.name}, {goal.engines} engines", getattr(row, field_name), why)
                )
    return verdicts


def _verdict(policy: str, goal: Goal, name: str, value: float, why: str) -> dict[str, Any]:
    return {
        "policy": policy,
        "name": name,
        "value": value,
        "bound": goal.bound,
        "at_most": goal.at_most,
        "met": goal.met(value),
        "why": why,
    }


def print_report(
    results: list[FleetResult], verdicts: list[dict[str, Any]], header: str, out: Any = sys.stdout
) -> None:
    out.write(f"\n{header}\n")
    columns = (
        "policy       engines  achieved/s   p50 ms   p99 ms  coord us/req  coord %core  req/msg  "
        "reg s  reg CPU s  idle %core  lost  dup  errors  engines lost  log lines  others (cores)\n"
    )
    out.write(columns)
    for r in results:
        out.write(
            f"{r.policy:<12} {r.engines:>7}  {r.achieved_per_s:>10,.0f}  {r.p50_ms:>7.2f}  {r.p99_ms:>7.2f}  "
            f"{r.cpu_us_per_request:>12.1f}  {r.coordinator_core_pct:>11.0f}  {r.requests_per_routed_message:>7.1f}  "
            f"{r.registration_s:>5.2f}  {r.registration_cpu_s:>9.2f}  {r.idle_core_pct:>10.1f}  {r.lost:>4}  {r.duplicated:>3}  "
            f"{r.errors:>6}  {r.engines_lost if r.engines_lost != UNKNOWN else '?':>12}  {r.log_lines:>9}  {r.others_cores:>14.2f}\n"
        )
    out.write("\ntargets (within this run)\n")
    for v in verdicts:
        sign = "<=" if v["at_most"] else ">="
        verdict = "met" if v["met"] else f"MISSED by {abs(v['value'] / v['bound'] - 1) * 100:.0f}%"
        out.write(f"  {v['policy']:<12} {v['name']:<72} {v['value']:8.3f} (target {sign} {v['bound']:g})  {verdict}\n")
        if not v["met"]:
            out.write(f"  {'':<12} why: {v['why']}\n")


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
        help="routing policies, each over every fleet size (default least_loaded; also p2c, round_robin, prefix)",
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
