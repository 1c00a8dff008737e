"""One round's workloads of the gateway benchmark: sequential, pipelined and streamed
completions through the gateway, the bare "hello" and "relay" apps, or the client library
directly, each measured for latency, rate and the CPU of every process."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from benchmarks.common import percentile
from benchmarks.http_load import Connection, Pipelined, post, sequential
from benchmarks.proc_cpu import cpu_seconds
from benchmarks.stack import BenchStack
from service.client import DpcoordClient

MODEL = "dpcoord-echo"
PROMPT = "Hello"


class Measure:
    """Runs one workload for one round and returns its figures."""

    def __init__(
        self,
        args: argparse.Namespace,
        stack: BenchStack,
        client: DpcoordClient,
        port: int,
        hello_port: int,
        relay_port: int,
    ) -> None:
        self.args = args
        self.stack = stack
        self.client = client
        self.port = port
        self.hello_port = hello_port
        self.relay_port = relay_port
        self.completion = post(
            "127.0.0.1",
            "/v1/completions",
            json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": args.max_tokens}).encode(),
        )
        self.stream = post(
            "127.0.0.1",
            "/v1/completions",
            json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": args.tokens, "stream": True}).encode(),
        )
        self.gateway_rate = 0.0  # requests/s of the last pipelined_gateway step: the paced hello's rate
        self.watch = {
            name: pid
            for name, pid in stack.pids.items()
            if name in ("client", "gateway", "hello", "relay", "coordinator", "engine0", "nats_server")
        }

    def steps(self) -> list[tuple[str, Callable[[], Awaitable[dict[str, Any]]]]]:
        return [
            ("sequential_client", lambda: self._sequential_client()),
            ("sequential_gateway", lambda: self._sequential_gateway()),
            ("pipelined_client", lambda: self._window(self._client_load(stream=False))),
            ("pipelined_gateway", lambda: self._pipelined_gateway()),
            ("pipelined_hello", lambda: self._window(self._http_load(stream=False, port=self.hello_port))),
            ("pipelined_hello_paced", lambda: self._paced_hello()),
            ("pipelined_relay", lambda: self._window(self._http_load(stream=False, port=self.relay_port))),
            ("streaming_client", lambda: self._window(self._client_load(stream=True))),
            ("streaming_gateway", lambda: self._window(self._http_load(stream=True))),
        ]

    async def _sequential_client(self) -> dict[str, Any]:
        latencies = []
        for _ in range(self.args.sequential_count):
            started = time.perf_counter_ns()
            await self.client.submit(PROMPT, model=MODEL, max_tokens=self.args.max_tokens)
            latencies.append((time.perf_counter_ns() - started) / 1000)
        return _latency(latencies, 0)

    async def _sequential_gateway(self) -> dict[str, Any]:
        connection = await Connection.open("127.0.0.1", self.port)
        try:
            latencies, errors = await sequential(connection, self.completion, self.args.sequential_count, stream=False)
        finally:
            connection.close()
        return _latency(latencies, errors)

    def _client_load(self, stream: bool) -> Any:
        return _ClientLoad(
            self.client,
            stream,
            self.args.streams if stream else self.args.connections,
            self.args.tokens if stream else self.args.max_tokens,
        )

    def _http_load(self, stream: bool, port: int | None = None, rate: float | None = None) -> Pipelined:
        raw = self.stream if stream else self.completion
        connections = self.args.streams if stream else self.args.connections
        return Pipelined("127.0.0.1", port or self.port, raw, connections, stream, rate)

    async def _pipelined_gateway(self) -> dict[str, Any]:
        result = await self._window(self._http_load(stream=False))
        self.gateway_rate = result["per_s"]
        return result

    async def _paced_hello(self) -> dict[str, Any]:
        if not self.gateway_rate:  # the first round runs the gateway's step before this one
            await self._pipelined_gateway()
        return await self._window(self._http_load(stream=False, port=self.hello_port, rate=self.gateway_rate))

    async def _window(self, load: Any) -> dict[str, Any]:
        stop = asyncio.Event()
        running = asyncio.ensure_future(load.run_until(stop))
        try:
            await asyncio.sleep(self.args.warmup)
            load.record(True)
            done_before, errors_before = load.completed, load.errors
            cpu_before = {name: cpu_seconds(pid) for name, pid in self.watch.items()}
            started = time.perf_counter()
            await asyncio.sleep(self.args.duration)
            seconds = time.perf_counter() - started
            completed, errors = load.completed - done_before, load.errors - errors_before
            cpu = {name: cpu_seconds(pid) - cpu_before[name] for name, pid in self.watch.items()}
            load.record(False)
        finally:
            stop.set()
            await running
        result = _latency(load.latencies, errors)
        result.update(
            per_s=completed / seconds,
            completed=completed,
            cpu_us_per={name: used / completed * 1e6 if completed else float("nan") for name, used in cpu.items()},
        )
        return result


class _ClientLoad:
    """The client library under the same load shape as :class:`Pipelined`."""

    def __init__(self, client: DpcoordClient, stream: bool, inflight: int, max_tokens: int) -> None:
        self._client, self._stream, self._inflight, self._max_tokens = client, stream, inflight, max_tokens
        self.completed = 0
        self.errors = 0
        self.latencies: list[float] = []
        self._recording = False

    def record(self, on: bool) -> None:
        self._recording = on

    async def run_until(self, stop: asyncio.Event) -> None:
        async def worker() -> None:
            while not stop.is_set():
                started = time.perf_counter_ns()
                if self._stream:
                    async for _ in self._client.stream(PROMPT, model=MODEL, max_tokens=self._max_tokens):
                        pass
                else:
                    await self._client.submit(PROMPT, model=MODEL, max_tokens=self._max_tokens)
                self.completed += 1
                if self._recording:
                    self.latencies.append((time.perf_counter_ns() - started) / 1000)

        await asyncio.gather(*(worker() for _ in range(self._inflight)))


def _latency(latencies: list[float], errors: int) -> dict[str, Any]:
    ordered = sorted(latencies)
    return {
        "p50_us": percentile(ordered, 50),
        "p99_us": percentile(ordered, 99),
        "count": len(ordered),
        "errors": errors,
    }
