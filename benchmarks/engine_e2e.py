"""The torch engine end to end: nats-server, a coordinator and engine processes, driven by the
client library with concurrent streamed requests, against the same engine in this process,
measured in the same run.

    python benchmarks/engine_e2e.py --device cuda --shape llama-1b [--routing-policy least_loaded]
    python benchmarks/engine_e2e.py --device cpu --shape tiny --requests 16 --prefix-tokens 64   # a CPU try

Rows:

- **in process**: ``--requests`` greedy requests (``--prompt-len`` tokens, ``--max-tokens``
  generated) through the backend in this process; then the process lets the device go;
- **end to end, one engine**: the same requests streamed through the coordinator to one
  engine process: tokens/s (and its ratio to in process), time to the first partial (p50),
  the engine process's CPU per generated token;
- **shared prefix, one engine and two**: ``--requests`` prompts sharing a ``--prefix-tokens``
  system prompt, each with ``--own-tokens`` of its own, through one engine, then two
  (``--routing-policy`` routes them): TTFT p50, tokens/s and the prefix-cache hit rate of the
  engines together (from their status, over the measured run). Two engines on one GPU share
  its compute, so their tokens/s says little; the hit rate says where the prefix landed.

Every engine gets the same ``--kv-cache-gb``, so that two fit on one device.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import torch
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from benchmarks.common import stop_processes
from benchmarks.engine_workloads import (
    greedy_requests,
    run_engine,
    shared_prefix_prompts,
)
from benchmarks.model_shapes import SHAPES, checkpoint
from benchmarks.proc_cpu import cpu_seconds
from engines.torch_backend.backend import TorchBackend
from engines.torch_backend.config import ModelConfig
from engines.torch_backend.options import TorchOptions
from engines.torch_backend.setup import resolve_device, resolve_dtype
from service.bus.server import EmbeddedNatsServer
from service.client import ClientError, DpcoordClient
from service.ops.settings import Settings
from service.protocol.errors import ErrorCode
from service.protocol.messages import Final, Partial
from service.protocol.subjects import Subjects


@dataclass
class StreamRun:
    generated: int
    wall: float
    first_partial: list[float]
    engine_cpu: float

    @property
    def rate(self) -> float:
        return self.generated / self.wall

    @property
    def ttft_ms(self) -> float:
        return 1000 * statistics.median(self.first_partial)


class Stack:
    """nats-server, one coordinator and ``engines`` torch engine processes."""

    def __init__(self, args: argparse.Namespace, model_dir: Path | None, engines: int) -> None:
        self.args, self.model_dir, self.engines = args, model_dir, engines
        self.prefix = f"e2e{uuid.uuid4().hex[:8]}"
        self.subjects = Subjects(self.prefix)
        self.engine_ids = [f"engine{index}" for index in range(engines)]
        self.server = EmbeddedNatsServer()
        self.children: dict[str, asyncio.subprocess.Process] = {}
        self.client: DpcoordClient | None = None

    async def __aenter__(self) -> Self:
        try:
            await self._start()
        except BaseException:
            await self._stop()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._stop()

    async def _start(self) -> None:
        self.server.start()
        env = dict(os.environ) | {
            "DPCOORD_NATS_URL": self.server.url,
            "DPCOORD_SUBJECT_PREFIX": self.prefix,
            "DPCOORD_LOG_LEVEL": "WARNING",
            "DPCOORD_HTTP_PORT": "0",
            "DPCOORD_ROUTING_POLICY": self.args.routing_policy,
            "DPCOORD_MAX_INFLIGHT_PER_ENGINE": str(self.args.requests),
            "DPCOORD_ENGINE_CAPACITY": str(self.args.requests),
            "DPCOORD_BACKEND": "torch",
            "DPCOORD_DEVICE": self.args.device,
            "DPCOORD_DTYPE": self.args.dtype,
            "DPCOORD_MAX_BATCH": str(self.args.requests),
            "DPCOORD_KV_CACHE_GB": str(self.args.kv_cache_gb),
            "DPCOORD_REQUIRE_FAST_PATH": str(self.args.require_fast_path).lower(),
        }
        if self.model_dir is not None:
            env["DPCOORD_MAX_CONTEXT"] = str(self.args.max_context)
        if self.args.threads is not None:
            env["DPCOORD_CPU_THREADS"] = str(self.args.threads)
        model = ["--model", str(self.model_dir)] if self.model_dir else []
        await self._spawn("coordinator", env, "coordinator")
        for engine_id in self.engine_ids:
            await self._spawn(engine_id, env | {"DPCOORD_ENGINE_ID": engine_id}, "engine", *model)
        self.client = await self._connect()
        for engine_id in self.engine_ids:
            await self._wait_registered(engine_id)

    async def _stop(self) -> None:
        if self.client is not None:
            await self.client.close()
        await stop_processes(self.children.values(), 30)
        self.server.stop()

    async def _connect(self) -> DpcoordClient:
        settings = Settings(nats_url=self.server.url, subject_prefix=self.prefix)
        deadline = time.monotonic() + self.args.start_timeout
        while True:
            try:
                return await DpcoordClient.connect(settings, timeout=10)
            except ClientError as exc:
                if exc.code != ErrorCode.NO_ENGINE or time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.2)  # the coordinator process is starting: nothing to await on

    async def _spawn(self, name: str, env: dict[str, str], *args: str) -> None:
        self.children[name] = await asyncio.create_subprocess_exec(sys.executable, "-m", "service", *args, env=env)

    async def status(self, engine_id: str) -> dict[str, object]:
        assert self.client is not None, "the stack is started"
        msg = await self.client.nc.request(self.subjects.status("engine", engine_id), b"{}", timeout=5)
        return json.loads(msg.data)

    async def path(self, engine_id: str) -> str:
        """The execution path an engine's status names."""
        return str((await self.status(engine_id)).get("execution_path"))

    async def _wait_registered(self, engine_id: str) -> None:
        """Loading a model (and on CUDA compiling and capturing graphs) takes a while: poll its status."""
        deadline = time.monotonic() + self.args.start_timeout
        while time.monotonic() < deadline:
            if self.children[engine_id].returncode is not None:
                raise RuntimeError(
                    f"{engine_id} exited with status {self.children[engine_id].returncode} (its log is above)"
                )
            try:
                if (await self.status(engine_id)).get("registered"):
                    return
            except (NoRespondersError, NatsTimeoutError):
                pass
            await asyncio.sleep(0.5)  # a process coming up: nothing to await on
        raise RuntimeError(f"{engine_id} did not register within {self.args.start_timeout} s")

    async def hits(self) -> tuple[int, int]:
        """Hit and queried tokens of all engines together."""
        hit = queried = 0
        for engine_id in self.engine_ids:
            cache = (await self.status(engine_id))["prefix_cache"]
            assert isinstance(cache, dict), "a torch engine's status has its prefix cache"
            hit, queried = hit + cache["hit_tokens"], queried + cache["queried_tokens"]
        return hit, queried

    async def stream_all(self, prompts: list[list[int]] | list[str], max_tokens: int) -> StreamRun:
        pids = [child.pid for name, child in self.children.items() if name != "coordinator"]
        cpu_before = sum(cpu_seconds(pid) for pid in pids)
        started = time.perf_counter()

        client = self.client
        assert client is not None, "the stack is started"

        async def one(prompt: list[int] | str) -> tuple[float, int]:
            first = 0.0
            async for reply in client.stream(
                prompt, max_tokens=max_tokens, temperature=0.0, timeout=self.args.request_timeout
            ):
                if isinstance(reply, Partial) and not first:
                    first = time.perf_counter() - started
                elif isinstance(reply, Final):
                    return first, len(reply.generated_tokens)
            raise RuntimeError("a stream ended without a final reply")

        results = await asyncio.gather(*(one(prompt) for prompt in prompts))
        wall = time.perf_counter() - started
        return StreamRun(
            sum(tokens for _, tokens in results),
            wall,
            [first for first, _ in results],
            sum(cpu_seconds(pid) for pid in pids) - cpu_before,
        )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--shape", default="llama-1b", choices=sorted(SHAPES))
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("/tmp/dpcoord-bench-models"))
    parser.add_argument("--max-context", type=int, default=2048)
    parser.add_argument("--kv-cache-gb", type=float, default=16.0, help="every engine's KV cache")
    parser.add_argument("--threads", type=int, default=None, help="CPU: torch threads per engine")
    parser.add_argument("--requests", type=int, default=256, help="concurrent streamed requests")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--own-tokens", type=int, default=32)
    parser.add_argument(
        "--require-fast-path", action="store_true", help="every engine's require_fast_path setting (CUDA)"
    )
    parser.add_argument("--no-shared-prefix", action="store_true", help="leave out the shared-prefix rows")
    parser.add_argument("--routing-policy", default="least_loaded", help="the coordinator's routing_policy setting")
    parser.add_argument("--start-timeout", type=float, default=300.0, help="seconds an engine may take to load")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    return parser.parse_args()


async def main() -> None:
    args = parse_args()
    device = resolve_device(args.device)
    shape = SHAPES[args.shape]
    config = shape or ModelConfig()
    model_dir = (
        None
        if shape is None
        else checkpoint(args.shape, args.checkpoint_dir, resolve_dtype(args.dtype, config, device), device)
    )
    prompts = [
        [(97 * i + 13 * k) % min(config.vocab_size, 32000) for k in range(args.prompt_len)]
        for i in range(args.requests)
    ]

    backend = TorchBackend(
        TorchOptions(
            device=args.device,
            dtype=args.dtype,
            cpu_threads=args.threads,
            max_batch=args.requests,
            max_context=args.max_context if model_dir else None,
            kv_cache_gb=args.kv_cache_gb,
            require_fast_path=args.require_fast_path,
        ),
        str(model_dir) if model_dir else None,
    )
    path = backend.execution_path().describe()
    await run_engine(backend, greedy_requests("warm", prompts[:4], 8))
    local = await run_engine(backend, greedy_requests("local", prompts, args.max_tokens))
    await backend.close()
    del backend
    if device.type == "cuda":
        torch.cuda.empty_cache()

    print(
        f"{args.shape} model on {device}; {args.requests} concurrent requests, {args.prompt_len}-token prompts, "
        f"{args.max_tokens} generated, greedy; routing policy {args.routing_policy}"
    )
    print(f"{'':44} {'tokens/s':>10} {'vs local':>9} {'TTFT p50 ms':>12} {'engine CPU ms/token':>20}   path")
    print(
        f"{'in process':44} {local.rate:10.0f} {'':>9} {local.ttft_ms:12.1f} "
        f"{1000 * local.cpu / local.generated:20.3f}   {path}"
    )
    async with Stack(args, model_dir, 1) as stack:
        await stack.stream_all(prompts[:4], 8)
        run = await stack.stream_all(prompts, args.max_tokens)
        print(
            f"{'end to end, one engine, streamed':44} {run.rate:10.0f} {run.rate / local.rate:8.2f}x {run.ttft_ms:12.1f} "
            f"{1000 * run.engine_cpu / run.generated:20.3f}   {await stack.path(stack.engine_ids[0])}"
        )
    if args.no_shared_prefix:
        return

    shared = shared_prefix_prompts(args.requests, args.prefix_tokens, args.own_tokens, config.vocab_size, seed=3)
    print(f"shared prefix: a {args.prefix_tokens}-token system prompt + {args.own_tokens} tokens of each's own")
    print(f"{'':44} {'tokens/s':>10} {'TTFT p50 ms':>12} {'hit rate':>9}")
    for engines in (1, 2):
        async with Stack(args, model_dir, engines) as stack:
            await stack.stream_all(
                shared_prefix_prompts(4, args.prefix_tokens, args.own_tokens, config.vocab_size, seed=4), 8
            )
            hit_before, queried_before = await stack.hits()
            run = await stack.stream_all(shared, args.max_tokens)
            hit, queried = await stack.hits()
            rate = (hit - hit_before) / (queried - queried_before) if queried > queried_before else 0.0
            print(
                f"{f'  {engines} engine(s), {args.routing_policy}':44} {run.rate:10.0f} {run.ttft_ms:12.1f} {rate:9.3f}"
            )


if __name__ == "__main__":
    asyncio.run(main())
