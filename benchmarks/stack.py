"""The processes a benchmark measures: nats-server, the raw baseline peers, a coordinator and
echo engines, each its own process, so the client in the benchmark process is measured
against them exactly as a real client would be."""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from benchmarks.common import stop_processes
from benchmarks.http_load import wait_listening
from benchmarks.raw_peers import Subjects as RawSubjects
from service.bus.server import EmbeddedNatsServer
from service.protocol.messages import ErrorReply, Final, Partial, Reply
from service.protocol.subjects import Header, Subjects

_reply_decoder = msgspec.msgpack.Decoder(Reply)


@dataclass(slots=True)
class StackConfig:
    nats_url: str | None
    engines: int
    event_loop: str
    tokens: int
    prefix: str = field(default_factory=lambda: f"bench{uuid.uuid4().hex[:8]}")
    replicas: int = 1  # coordinator processes: "coordinator", then "coordinator1", "coordinator2", ...


class BenchStack:
    """Starts everything on ``__aenter__`` and stops it (SIGTERM, then kill) on ``__aexit__``."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.subjects = Subjects(config.prefix)
        self.raw = RawSubjects(config.prefix)
        self.server: EmbeddedNatsServer | None = None
        self.nats_url = config.nats_url or ""
        self.pids: dict[str, int] = {}
        self._children: list[asyncio.subprocess.Process] = []
        self._nc: NATS | None = None

    async def __aenter__(self) -> BenchStack:
        self.pids["client"] = os.getpid()
        if not self.config.nats_url:
            self.server = EmbeddedNatsServer().start()
            self.nats_url = self.server.url
            if self.server.pid is not None:
                self.pids["nats_server"] = self.server.pid
        self._nc = await nats.connect(self.nats_url, name="bench-client")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._nc is not None:
            await self._nc.close()
        await stop_processes(self._children, 10)
        if self.server is not None:
            self.server.close()

    async def _spawn(self, name: str, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        child = await asyncio.create_subprocess_exec(sys.executable, *args, env=env, cwd=cwd)
        self._children.append(child)
        self.pids[name] = child.pid

    # ------------------------------------------------------------ dpcoord

    def _dpcoord_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "DPCOORD_NATS_URL": self.nats_url,
                "DPCOORD_SUBJECT_PREFIX": self.config.prefix,
                "DPCOORD_LOG_LEVEL": "WARNING",
                "DPCOORD_EVENT_LOOP": self.config.event_loop,
                "DPCOORD_BACKEND": "echo",
                "DPCOORD_HTTP_PORT": "0",  # no health/metrics listeners: several processes share this host
            }
        )
        return env

    async def start_dpcoord(self, probe: bytes, timeout_s: float = 30.0) -> None:
        """The coordinator replicas and the engines, ready once every engine has answered a request."""
        env = self._dpcoord_env()
        for name in self.coordinator_names:
            await self._spawn(name, "-m", "service", "coordinator", env=env | {"DPCOORD_COORDINATOR_ID": name})
        for index in range(self.config.engines):
            await self._spawn(f"engine{index}", "-m", "service", "engine", env=env)
        seen: set[str] = set()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_children()
            reply = await self._try(self.subjects.coordinator(Header.SUBMIT_REQUEST), probe)
            if isinstance(reply, Final) and reply.engine_id:
                seen.add(reply.engine_id)
                if len(seen) >= self.config.engines:
                    return
            elif reply is None or (isinstance(reply, ErrorReply) and reply.error.code == 503):
                await asyncio.sleep(0.05)  # waiting for a process to come up: nothing to await on
            else:
                raise RuntimeError(f"dpcoord answered the probe with {reply!r}")
        raise RuntimeError(f"dpcoord did not come up with {self.config.engines} engines in {timeout_s:g} s")

    @property
    def coordinator_names(self) -> list[str]:
        return ["coordinator", *(f"coordinator{index}" for index in range(1, self.config.replicas))]

    async def start_gateway(self, port: int, name: str = "gateway", tree: Path | None = None) -> None:
        """The HTTP gateway on 127.0.0.1:``port``, ready once its /readyz answers 200; with ``tree``,
        that tree's code (benchmarks/common.py's ``extract``) instead of this checkout's."""
        env = self._dpcoord_env() | {"DPCOORD_GATEWAY_HOST": "127.0.0.1", "DPCOORD_GATEWAY_PORT": str(port)}
        if tree is not None:
            env["PYTHONPATH"] = str(tree)  # and the process runs in it: ``-m service`` finds it first
        await self._spawn(name, "-m", "service", "gateway", env=env, cwd=tree)
        for _ in range(600):
            self._check_children()
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET /readyz HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
                status = (await reader.readline()).split()[1:2]
                writer.close()
                if status == [b"200"]:
                    return
            except OSError:
                pass
            await asyncio.sleep(0.05)  # waiting for a process to come up: nothing to await on
        raise RuntimeError("the gateway was not ready in 30 s")

    async def start_hello(self, port: int, relay: bool = False) -> None:
        """A bare ASGI baseline (benchmarks/hello_asgi.py) on 127.0.0.1:``port``, once it answers:
        ``hello``, or (``relay``) ``relay`` under the name "relay"."""
        name, flags = ("relay", ["--relay"]) if relay else ("hello", [])
        await self._spawn(name, "-m", "benchmarks.hello_asgi", str(port), *flags, env=self._dpcoord_env())
        await wait_listening(port, self._check_children, 30.0, f"the {name} app")

    def _check_children(self) -> None:
        children = [name for name in self.pids if name not in ("client", "nats_server")]
        for name, child in zip(children, self._children, strict=True):
            if child.returncode is not None:
                raise RuntimeError(f"{name} exited with status {child.returncode} while starting (its log is above)")

    async def _try(self, subject: str, body: bytes) -> Reply | None:
        try:
            msg = await self.nc.request(subject, body, timeout=2.0)
        except (NoRespondersError, NatsTimeoutError):
            return None
        return _reply_decoder.decode(msg.data)

    async def reply_sizes(self, body: bytes, stream_body: bytes) -> tuple[int, int]:
        """Sizes of a real final and a real streamed partial, so the raw peers send the same bytes."""
        msg = await self.nc.request(self.subjects.coordinator(Header.SUBMIT_REQUEST), body, timeout=5.0)
        final_size = len(msg.data)
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        await self.nc.publish(self.subjects.coordinator(Header.SUBMIT_REQUEST), stream_body, reply=inbox)
        partial_size = 0
        while True:
            msg = await sub.next_msg(timeout=5.0)
            if not msg.data:
                break
            if isinstance(_reply_decoder.decode(msg.data), Partial):
                partial_size = max(partial_size, len(msg.data))
        await sub.unsubscribe()
        return final_size, partial_size

    # ------------------------------------------------------------ raw peers

    async def start_raw(self, reply_bytes: int, partial_bytes: int) -> None:
        common = [
            "--nats-url",
            self.nats_url,
            "--prefix",
            self.config.prefix,
            "--event-loop",
            self.config.event_loop,
            "--reply-bytes",
            str(reply_bytes),
            "--partial-bytes",
            str(partial_bytes),
            "--tokens",
            str(self.config.tokens),
        ]
        for role in ("echo", "relay", "stream_source", "stream_relay"):
            await self._spawn(f"raw_{role}", "-m", "benchmarks.raw_peers", role, *common)
        for subject in (self.raw.echo, self.raw.relay):
            await self._wait_answered(subject)
        await self._wait_stream()

    async def _wait_answered(self, subject: str) -> None:
        for _ in range(600):
            self._check_children()
            try:
                await self.nc.request(subject, b"{}", timeout=2.0)
                return
            except (NoRespondersError, NatsTimeoutError):
                await asyncio.sleep(0.05)  # waiting for a process to come up: nothing to await on
        raise RuntimeError(f"nothing answered on {subject} in 30 s")

    async def _wait_stream(self) -> None:
        """The stream source and relay are both up once one stream arrives whole."""
        for _ in range(600):
            inbox = self.nc.new_inbox()
            sub = await self.nc.subscribe(inbox)
            await self.nc.publish(self.raw.stream, b"{}", reply=inbox)
            try:
                while (await sub.next_msg(timeout=0.2)).data:
                    pass
                return
            except NatsTimeoutError:
                continue
            finally:
                await sub.unsubscribe()
        raise RuntimeError("the raw stream peers did not come up in 120 s")

    @property
    def nc(self) -> NATS:
        if self._nc is None:
            raise RuntimeError("bench stack is not started")
        return self._nc
