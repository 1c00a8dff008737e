"""The fleets of the fleet-size benchmark: starting a coordinator and its simulated engines,
stopping them, and measuring registration, idle CPU, the closed-loop rate and load windows."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from benchmarks.common import percentile, stop_processes
from benchmarks.fleet_workload import Workload
from benchmarks.load import Target, pipelined
from benchmarks.offered_load import offer
from benchmarks.proc_cpu import cpu_seconds
from service.protocol.subjects import Header, Subjects

COORDINATOR_ID = "fleetbench"
UNKNOWN = -1  # engines lost, when a saturated coordinator did not answer its status after any window


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
        self.workload = Workload(real_prompts=args.cached_prompts > 0)
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
            "--cached-prompts",
            str(self.args.cached_prompts),
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
        for process in (fleet.host, fleet.coordinator):  # the engines first, one after the other
            await stop_processes([process], 30)

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
        kv_events = after.get("kv_events", 0) - before.get("kv_events", 0)
        latencies = sorted(load.latencies_us)
        fleet.windows.append(
            {
                "achieved_per_s": load.achieved_per_s,
                "p50_ms": percentile(latencies, 50) / 1000,
                "p99_ms": percentile(latencies, 99) / 1000,
                "cpu_us_per_request": load.cpu_us_per_request("coordinator"),
                "coordinator_core_pct": load.cpu_s["coordinator"] / load.window_s * 100,
                "requests_per_routed_message": routed / messages if messages else float("nan"),
                "kv_events_per_request": kv_events / routed if routed else 0.0,
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
