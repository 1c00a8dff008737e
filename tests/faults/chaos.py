"""The chaos stack, as an operator runs it: one nats-server with JetStream and a store directory
(restarted with its store on the same port), coordinator replicas as ``dpcoord coordinator``
processes, echo engines as ``dpcoord engine --backend echo`` processes at 5 ms a token (sixteen
tokens a partial: :data:`STREAM_INTERVAL`), and one ``dpcoord gateway`` process; the clients
are the official ``openai`` SDK.

The stack is synchronous to build and tear down (a module-scoped fixture owns it across the
tests' event loops); what waits on the services (:meth:`ChaosStack.heal`) is async and opens
its own NATS connection in the caller's loop. Each child writes its standard error to a file
in the stack's directory (``log_tail`` shows a child's last lines in a failure message).

Fault injection is what an operator's tools do: SIGKILL of a replica or an engine, and a
restart of nats-server. A replica that is restarted comes back under a new id, as a
Deployment's replacement pod gets a new random id.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections import Counter
from itertools import count
from pathlib import Path
from typing import IO, Any

import nats
from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError

from service.bus.server import EmbeddedNatsServer, free_port
from service.ops.settings import Settings
from service.protocol.subjects import Subjects
from tests.conftest import make_settings
from tests.gateway_helpers import http
from tests.helpers import REPO_ROOT
from tests.replicas import child_env

TOKEN_DELAY_MS = 5
# Tokens per streamed partial. Streams of a few hundred tokens last seconds on an engine, as a
# model's do, so a fault meets requests mid-generation; sixteen tokens a partial keep the chunks
# few enough for the clients on two cores to read 1,000 streams in the suite's time.
STREAM_INTERVAL = 16
MODEL = "dpcoord-echo"
STOP_WITHIN_S = 3.0
# Short failure detection, so a fault costs seconds: replicas and engines beat every 0.3 s.
CHAOS_SETTINGS: dict[str, object] = {
    "heartbeat_interval_s": 0.3,
    "heartbeat_timeout_s": 1.5,
    "request_timeout_s": 30.0,
    "reconnect_grace_s": 1.0,
    "control_timeout_s": 3.0,
}


def echo_text(prompt: str, max_tokens: int) -> str:
    """What the echo engine must generate for an ASCII text prompt (engines/echo.py): the prompt's
    UTF-8 bytes are its tokens, the n-th generated token is prompt token ``n mod len(prompt)``,
    and it stops after ``max_tokens`` (the prompts here hold no stop string)."""
    assert prompt.isascii(), "echo_text handles ASCII prompts only: one token, one character"
    return "".join(prompt[n % len(prompt)] for n in range(max_tokens))


def expected_text(content: str, max_tokens: int) -> str:
    """What the echo engine must stream for one user message: the plain chat rendering
    (engines/chat_template.py) ``user: <content>\\nassistant:``, echoed."""
    return echo_text(f"user: {content}\nassistant:", max_tokens)


class _Child:
    """One child process and the file its standard error goes to."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log: IO[bytes] = self.log_path.open("wb")
        self.process = subprocess.Popen(command, env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=self._log)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def terminate(self) -> None:
        if self.alive:
            self.process.send_signal(signal.SIGTERM)

    def reap(self, timeout_s: float) -> None:
        """Wait for the child to exit, SIGKILL it after ``timeout_s``, and close its log."""
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


ECHO_ENGINE = ("--backend", "echo", "--token-delay-ms", str(TOKEN_DELAY_MS))


class ChaosStack:
    """``replicas`` coordinators, ``engines`` engines (``dpcoord engine`` with ``engine_args``:
    echo engines at 5 ms a token unless told) and a gateway on a private nats-server."""

    def __init__(
        self, log_dir: Path, replicas: int = 3, engines: int = 3, engine_args: tuple[str, ...] = ECHO_ENGINE
    ) -> None:
        self.log_dir = log_dir
        self.want_replicas = replicas
        self.want_engines = engines
        self.engine_args = engine_args
        self.nats = EmbeddedNatsServer()
        self.settings: Settings = make_settings(self.nats.url, **CHAOS_SETTINGS)
        self.subjects = Subjects(self.settings.subject_prefix)
        self.gateway_port = free_port()
        self.replicas: dict[str, _Child] = {}
        self.engines: dict[str, _Child] = {}
        self.gateway: _Child | None = None
        self._serial = count()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}/v1"

    # ------------------------------------------------------------ processes

    def _spawn(self, name: str, *args: str, **env: str) -> _Child:
        return _Child(name, [sys.executable, "-m", "service", *args], child_env(self.settings, **env), self.log_dir)

    def start(self) -> ChaosStack:
        self.nats.start()
        for _ in range(self.want_replicas):
            self.start_replica()
        for _ in range(self.want_engines):
            self.start_engine()
        self.gateway = self._spawn(
            "gateway", "gateway", DPCOORD_GATEWAY_HOST="127.0.0.1", DPCOORD_GATEWAY_PORT=str(self.gateway_port)
        )
        return self

    def start_replica(self) -> str:
        coordinator_id = f"r{next(self._serial)}"
        self.replicas[coordinator_id] = self._spawn(
            coordinator_id, "coordinator", DPCOORD_COORDINATOR_ID=coordinator_id
        )
        return coordinator_id

    def start_engine(self) -> str:
        engine_id = f"e{next(self._serial)}"
        self.engines[engine_id] = self._spawn(
            engine_id,
            "engine",
            *self.engine_args,
            DPCOORD_ENGINE_ID=engine_id,
            DPCOORD_STREAM_INTERVAL=str(STREAM_INTERVAL),
        )
        return engine_id

    def live(self, children: dict[str, _Child]) -> list[str]:
        return [name for name, child in children.items() if child.alive]

    def kill_replica(self, coordinator_id: str) -> None:
        self.replicas[coordinator_id].kill()

    def kill_engine(self, engine_id: str) -> None:
        self.engines[engine_id].kill()

    async def restart_nats(self) -> None:
        """Stop nats-server and start it again on its port with its JetStream store."""
        await asyncio.to_thread(self.nats.restart)

    def close(self) -> None:
        """SIGTERM every child at once, then SIGKILL what is left after a few seconds: the
        gateway would otherwise give streams still running (a leaked abort's) its full grace."""
        children = [*([self.gateway] if self.gateway else []), *self.engines.values(), *self.replicas.values()]
        for child in children:
            child.terminate()
        give_up = time.monotonic() + STOP_WITHIN_S
        for child in children:
            child.reap(max(0.0, give_up - time.monotonic()))
        self.nats.close()

    def logs(self) -> str:
        children = [*self.replicas.values(), *self.engines.values(), *([self.gateway] if self.gateway else [])]
        return "\n".join(f"--- {child.name}:\n{child.log_tail()}" for child in children)

    # ------------------------------------------------------------ observing

    async def connect(self) -> NATS:
        return await nats.connect(self.settings.nats_url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)

    async def status(self, nc: NATS, role: str, instance_id: str) -> dict[str, Any]:
        msg = await nc.request(self.subjects.status(role, instance_id), b"", timeout=2.0)
        status: dict[str, Any] = json.loads(msg.data)
        return status

    async def engine_loads(self, nc: NATS) -> dict[str, int]:
        """Each live engine's ``active_requests``, from its NATS Services API status."""
        engine_ids = self.live(self.engines)
        statuses = await asyncio.gather(*(self.status(nc, "engine", engine_id) for engine_id in engine_ids))
        return {engine_id: status["active_requests"] for engine_id, status in zip(engine_ids, statuses, strict=True)}

    async def replica_counters(self) -> Counter[str]:
        """The live replicas' counters, summed (a killed replica's are gone with it)."""
        nc = await self.connect()
        try:
            summed: Counter[str] = Counter()
            for coordinator_id in self.live(self.replicas):
                try:
                    summed.update((await self.status(nc, "coordinator", coordinator_id))["counters"])
                except (NatsError, TimeoutError):
                    continue  # a replica still starting: its counters are all 0
            return summed
        finally:
            await nc.close()

    async def heal(self, timeout_s: float = 45.0) -> None:
        """Bring the stack back to its full size (new replicas and engines for dead ones) and
        wait until every replica answers and lists exactly the live engines, no engine is busy,
        and the gateway is ready."""
        if not self.nats.pid:
            self.nats.start()
        while len(self.live(self.replicas)) < self.want_replicas:
            self.start_replica()
        while len(self.live(self.engines)) < self.want_engines:
            self.start_engine()
        assert self.gateway is not None, "heal() of a stack not started"
        assert self.gateway.alive, f"the gateway exited:\n{self.gateway.log_tail()}"
        nc = await self.connect()
        try:
            await asyncio.wait_for(self._settled(nc), timeout_s)
        except TimeoutError:
            raise AssertionError(f"the stack did not settle within {timeout_s} s:\n{self.logs()}") from None
        finally:
            await nc.close()

    async def _settled(self, nc: NATS) -> None:
        while True:  # remote state: nothing to wait on but the next answers
            if await self._is_settled(nc):
                return
            await asyncio.sleep(0.1)

    async def _is_settled(self, nc: NATS) -> bool:
        engines = set(self.live(self.engines))
        try:
            statuses = [await self.status(nc, "coordinator", rid) for rid in self.live(self.replicas)]
            loads = await self.engine_loads(nc)
            ready = await http(self.gateway_port, "GET", "/readyz")
        except (NatsError, OSError, TimeoutError):
            return False
        listed = all({engine["engine_id"] for engine in status["engines"]} == engines for status in statuses)
        return listed and not any(loads.values()) and ready.status == 200
