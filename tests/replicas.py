"""Coordinator replicas as separate ``dpcoord coordinator`` processes, the way a Deployment runs
them, observed through their NATS Services API status endpoints and the shared bucket."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from benchmarks.common import stop_processes
from service.coordinator.shared_state import bucket_name
from service.ops.settings import Settings
from service.protocol.state import ControlRecord
from service.protocol.subjects import Subjects
from tests.helpers import REPO_ROOT

Status = dict[str, Any]


def child_env(settings: Settings, **extra: str) -> dict[str, str]:
    """The environment of a ``dpcoord`` child process on the test's NATS server and prefix,
    with the test's heartbeat, control, request and reconnect timings, logging warnings only."""
    return dict(
        os.environ,
        DPCOORD_NATS_URL=settings.nats_url,
        DPCOORD_SUBJECT_PREFIX=settings.subject_prefix,
        DPCOORD_HEARTBEAT_INTERVAL_S=str(settings.heartbeat_interval_s),
        DPCOORD_HEARTBEAT_TIMEOUT_S=str(settings.heartbeat_timeout_s),
        DPCOORD_CONTROL_TIMEOUT_S=str(settings.control_timeout_s),
        DPCOORD_REQUEST_TIMEOUT_S=str(settings.request_timeout_s),
        DPCOORD_RECONNECT_GRACE_S=str(settings.reconnect_grace_s),
        DPCOORD_LOG_LEVEL="WARNING",
        **extra,
    )


class ReplicaSet:
    """Replicas by id; ``close`` stops those still running."""

    def __init__(self, settings: Settings, nc: NATS) -> None:
        self.settings = settings
        self.nc = nc
        self.subjects = Subjects(settings.subject_prefix)
        self.processes: dict[str, asyncio.subprocess.Process] = {}
        self.logs: dict[str, list[str]] = {}
        self._readers: dict[str, asyncio.Task[None]] = {}

    async def spawn(self, coordinator_id: str) -> asyncio.subprocess.Process:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "service",
            "coordinator",
            env=child_env(self.settings, DPCOORD_COORDINATOR_ID=coordinator_id),
            cwd=REPO_ROOT,
            stderr=asyncio.subprocess.PIPE,
        )
        self.processes[coordinator_id] = process
        self.logs[coordinator_id] = []
        self._readers[coordinator_id] = asyncio.create_task(self._read_log(coordinator_id, process))
        return process

    async def _read_log(self, coordinator_id: str, process: asyncio.subprocess.Process) -> None:
        """Keep each replica's standard error (echoed, so pytest shows it with a failure)."""
        assert process.stderr is not None  # spawned with a pipe
        async for line in process.stderr:
            text = line.decode(errors="replace").rstrip()
            self.logs[coordinator_id].append(text)
            print(f"[{coordinator_id}] {text}", file=sys.stderr)

    async def start(self, *ids: str, timeout_s: float = 30.0) -> None:
        """Start replicas together and return once each answers its status request."""
        for coordinator_id in ids:
            await self.spawn(coordinator_id)
        await asyncio.gather(*(self.ready(coordinator_id, timeout_s) for coordinator_id in ids))

    async def ready(self, coordinator_id: str, timeout_s: float = 30.0) -> Status:
        async def answered() -> Status:
            while True:
                process = self.processes[coordinator_id]
                if process.returncode is not None:
                    raise AssertionError(f"replica {coordinator_id} exited with {process.returncode}")
                try:
                    return await self.status(coordinator_id)
                except (NoRespondersError, NatsTimeoutError):
                    await asyncio.sleep(0.05)

        return await asyncio.wait_for(answered(), timeout_s)

    async def status(self, coordinator_id: str) -> Status:
        msg = await self.nc.request(self.subjects.status("coordinator", coordinator_id), b"", timeout=2.0)
        status: Status = json.loads(msg.data)
        return status

    async def statuses(self) -> dict[str, Status]:
        alive = [coordinator_id for coordinator_id, process in self.processes.items() if process.returncode is None]
        answers = await asyncio.gather(*(self.status(coordinator_id) for coordinator_id in alive))
        return dict(zip(alive, answers, strict=True))

    async def wait_for(self, condition: Callable[[dict[str, Status]], bool], timeout_s: float) -> dict[str, Status]:
        """Poll every live replica's status until ``condition`` holds of them all."""

        async def holds() -> dict[str, Status]:
            while True:  # remote state: nothing to wait on but the next answer
                statuses = await self.statuses()
                if condition(statuses):
                    return statuses
                await asyncio.sleep(0.02)

        return await asyncio.wait_for(holds(), timeout_s)

    async def all_report(self, timeout_s: float, **fields: object) -> dict[str, Status]:
        """Every live replica's status shows ``fields`` (state=..., epoch=...)."""
        return await self.wait_for(
            lambda statuses: all(all(status[k] == v for k, v in fields.items()) for status in statuses.values()),
            timeout_s,
        )

    def kill(self, coordinator_id: str) -> None:
        self.processes[coordinator_id].send_signal(signal.SIGKILL)

    async def exited(self, coordinator_id: str, timeout_s: float = 15.0) -> tuple[int, str]:
        """The exit status and standard error of a replica that stops."""
        status = await asyncio.wait_for(self.processes[coordinator_id].wait(), timeout_s)
        await asyncio.wait_for(self._readers[coordinator_id], timeout_s)
        return status, "\n".join(self.logs[coordinator_id])

    async def close(self) -> None:
        await stop_processes(self.processes.values(), 15)
        await asyncio.gather(*self._readers.values(), return_exceptions=True)

    # ------------------------------------------------------------ the bucket, read directly

    async def record(self) -> tuple[ControlRecord, int]:
        kv = await self.nc.jetstream().key_value(bucket_name(self.settings.subject_prefix))
        entry = await kv.get(self.settings.subject_prefix)
        return msgspec.json.decode(entry.value or b"", type=ControlRecord), entry.revision or 0

    async def history(self) -> list[tuple[int, ControlRecord]]:
        kv = await self.nc.jetstream().key_value(bucket_name(self.settings.subject_prefix))
        entries = await kv.history(self.settings.subject_prefix)
        return [(entry.revision or 0, msgspec.json.decode(entry.value or b"", type=ControlRecord)) for entry in entries]


class EngineSet:
    """Echo engines as ``dpcoord engine --backend echo`` processes, by id, so a test can SIGKILL
    one (a lost engine: no disconnect); ``close`` stops those still running."""

    def __init__(self, settings: Settings, token_delay_ms: float) -> None:
        self.settings = settings
        self.token_delay_ms = token_delay_ms
        self.processes: dict[str, asyncio.subprocess.Process] = {}

    async def spawn(self, *engine_ids: str) -> None:
        for engine_id in engine_ids:
            env = child_env(
                self.settings,
                DPCOORD_ENGINE_ID=engine_id,
                DPCOORD_BACKEND="echo",
                DPCOORD_TOKEN_DELAY_MS=str(self.token_delay_ms),
            )
            self.processes[engine_id] = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "service", "engine", env=env, cwd=REPO_ROOT
            )

    def kill(self, engine_id: str) -> None:
        self.processes[engine_id].send_signal(signal.SIGKILL)

    async def close(self) -> None:
        await stop_processes(self.processes.values(), 15)
