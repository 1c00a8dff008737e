"""The processes of the cache-aware routing benchmark: nats-server, torch engines on CPU with
prefix caching (the random model), and one coordinator at a time, whose routing policy changes
between runs while the engines stay up (a new coordinator adopts them from their heartbeats, as
a replica that restarts does)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from benchmarks.common import stop_processes
from benchmarks.proc_cpu import cpu_seconds
from service.bus.server import EmbeddedNatsServer
from service.protocol.subjects import Subjects

COORDINATOR_ID = "cachebench"


class CacheFleet:
    """``engines`` torch engines (``engine_env``: their settings) and a coordinator, started by
    :meth:`coordinator`; ``__aexit__`` stops every process."""

    def __init__(
        self, engines: int, engine_env: dict[str, str], coordinator_env: dict[str, str], log_dir: Path
    ) -> None:
        self.engine_ids = [f"cache{index}" for index in range(engines)]
        self.subjects = Subjects(f"cache{uuid.uuid4().hex[:8]}")
        self._engine_env = engine_env
        self._coordinator_env = coordinator_env
        self._log_dir = log_dir
        self._server: EmbeddedNatsServer | None = None
        self._engines: list[asyncio.subprocess.Process] = []
        self._coordinator: asyncio.subprocess.Process | None = None
        self._nc: NATS | None = None
        self.policy = ""
        self.url = ""

    @property
    def nc(self) -> NATS:
        if self._nc is None:
            raise RuntimeError("the fleet is not started")
        return self._nc

    async def __aenter__(self) -> CacheFleet:
        self._server = EmbeddedNatsServer().start()
        self.url = self._server.url
        self._nc = await nats.connect(self.url, name="cache-bench")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._stop_coordinator()
        await stop_processes(self._engines, 30)
        if self._nc is not None:
            await self._nc.close()
        if self._server is not None:
            self._server.stop()

    def _env(self, extra: dict[str, str]) -> dict[str, str]:
        return (
            dict(os.environ)
            | {
                "DPCOORD_NATS_URL": self.url,
                "DPCOORD_SUBJECT_PREFIX": self.subjects.prefix,
                "DPCOORD_HTTP_PORT": "0",
                "DPCOORD_LOG_LEVEL": "WARNING",
            }
            | extra
        )

    async def coordinator(self, policy: str, restart: bool = False) -> float:
        """Stop the running coordinator and start one with ``policy``; returns once it knows every
        engine (and, for ``cache_aware``, asked each for its snapshot), or with ``restart`` as soon as
        it answers, as clients meet a replica that restarts: the seconds that took."""
        await self._stop_coordinator()
        started = time.monotonic()
        env = self._env(
            self._coordinator_env | {"DPCOORD_ROUTING_POLICY": policy, "DPCOORD_COORDINATOR_ID": COORDINATOR_ID}
        )
        log = (self._log_dir / f"coordinator-{policy}{'-restart' if restart else ''}.log").open("a")
        self._coordinator = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "service", "coordinator", env=env, stderr=log
        )
        self.policy = policy
        if not self._engines:
            for engine_id in self.engine_ids:
                engine_log = (self._log_dir / f"{engine_id}.log").open("a")
                self._engines.append(
                    await asyncio.create_subprocess_exec(
                        sys.executable,
                        "-m",
                        "service",
                        "engine",
                        env=self._env(self._engine_env | {"DPCOORD_ENGINE_ID": engine_id}),
                        stderr=engine_log,
                    )
                )
        while True:
            status = await self.status("coordinator", COORDINATOR_ID)
            known = len(status["engines"]) if status else 0
            snapshots = status["counters"].get("kv_snapshots_asked", 0) if status else 0
            if (status and restart) or (
                known == len(self.engine_ids) and (policy != "cache_aware" or snapshots >= known)
            ):
                return time.monotonic() - started
            self._check()
            await asyncio.sleep(0.05)  # waiting for processes to come up: nothing to await on

    async def status(self, role: str, instance_id: str) -> dict[str, Any] | None:
        try:
            msg = await self.nc.request(self.subjects.status(role, instance_id), b"", timeout=5.0)
        except (NoRespondersError, NatsTimeoutError):
            return None
        return json.loads(msg.data)

    async def prefix_cache(self) -> dict[str, tuple[int, int]]:
        """Each engine's prefix-cache counters: ``(queried_tokens, hit_tokens)`` since it started."""
        counters = {}
        for engine_id in self.engine_ids:
            status = await self.status("engine", engine_id)
            if status is None or status["prefix_cache"] is None:
                raise RuntimeError(f"engine {engine_id} did not report its prefix cache")
            cache = status["prefix_cache"]
            counters[engine_id] = (cache["queried_tokens"], cache["hit_tokens"])
        return counters

    def engine_cpu_s(self) -> float:
        """CPU seconds the engine processes have used so far, together."""
        return sum(cpu_seconds(process.pid) for process in self._engines)

    def _check(self) -> None:
        for process in [*self._engines, *([self._coordinator] if self._coordinator else [])]:
            if process.returncode is not None:
                raise RuntimeError(f"a process exited with {process.returncode}; see {self._log_dir}")

    async def _stop_coordinator(self) -> None:
        if self._coordinator is not None:
            await stop_processes([self._coordinator], 30)
            self._coordinator = None
