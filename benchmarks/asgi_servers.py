"""Which ASGI server for the gateway: the bare "hello" app (benchmarks/hello_asgi.py) under each
candidate, the same pipelined load against each, in one run, rounds interleaved.

Candidates: uvicorn with the gateway's bounded protocol (service/gateway/edge.py, what the
gateway runs), stock uvicorn (httptools), Hypercorn (h11, uvloop worker) and Granian (Rust, one
worker). Figures: requests/s and server CPU per request (the server's process tree), and each as
a ratio to the gateway's server. Hypercorn and Granian are not dpcoord dependencies: install
them to compare (``pip install hypercorn granian``); a missing one is skipped.

Run: ``python -m benchmarks.asgi_servers [--rounds 3] [--duration 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.http_load import Pipelined, post, wait_listening
from benchmarks.proc_cpu import cpu_seconds
from service.bus.server import free_port

SERVERS: dict[str, tuple[str | None, list[str]]] = {
    # name: (module that must be importable, command after the Python executable; {port} filled in)
    "uvicorn+edge (the gateway's)": (None, ["-m", "benchmarks.hello_asgi", "{port}"]),
    "uvicorn (stock httptools)": (
        None,
        [
            "-m",
            "uvicorn",
            "benchmarks.hello_asgi:hello",
            "--port",
            "{port}",
            "--http",
            "httptools",
            "--loop",
            "uvloop",
            "--no-access-log",
            "--log-level",
            "warning",
        ],
    ),
    "hypercorn (uvloop)": (
        "hypercorn",
        [
            "-m",
            "hypercorn",
            "benchmarks.hello_asgi:hello",
            "--bind",
            "127.0.0.1:{port}",
            "--worker-class",
            "uvloop",
            "--log-level",
            "warning",
        ],
    ),
    "granian (1 worker)": (
        "granian",
        [
            "-m",
            "granian",
            "--interface",
            "asgi",
            "--port",
            "{port}",
            "--workers",
            "1",
            "--loop",
            "uvloop",
            "--log-level",
            "warning",
            "--no-access-log",
            "benchmarks.hello_asgi:hello",
        ],
    ),
}


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid`` and every descendant (Granian serves from a child process)."""
    total = cpu_seconds(pid)
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            total += tree_cpu_seconds(int(child))
    return total


async def _serving(port: int, process: asyncio.subprocess.Process) -> None:
    def check() -> None:
        if process.returncode is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")

    await wait_listening(port, check, 15.0, "the server")


async def measure(command: list[str], args: argparse.Namespace) -> dict[str, float]:
    port = free_port()
    argv = [part.replace("{port}", str(port)) for part in command]
    process = await asyncio.create_subprocess_exec(sys.executable, *argv, env=dict(os.environ))
    try:
        await _serving(port, process)
        raw = post("127.0.0.1", "/v1/completions", b'{"model": "m", "prompt": "Hello", "max_tokens": 16}')
        load = Pipelined("127.0.0.1", port, raw, args.connections, stream=False)
        stop = asyncio.Event()
        running = asyncio.ensure_future(load.run_until(stop))
        await asyncio.sleep(args.warmup)
        done, cpu, started = load.completed, tree_cpu_seconds(process.pid), time.perf_counter()
        await asyncio.sleep(args.duration)
        completed = load.completed - done
        used, seconds = tree_cpu_seconds(process.pid) - cpu, time.perf_counter() - started
        stop.set()
        await running
        return {"per_s": completed / seconds, "cpu_us": used / completed * 1e6, "errors": float(load.errors)}
    finally:
        process.terminate()
        await process.wait()


async def run(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    available = {
        name: command
        for name, (module, command) in SERVERS.items()
        if module is None or importlib.util.find_spec(module) is not None
    }
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in available}
    for index in range(args.rounds):
        names = list(available) if index % 2 == 0 else list(reversed(available))
        for name in names:
            rounds[name].append(await measure(available[name], args))
    return {
        name: {key: statistics.median(entry[key] for entry in entries) for key in entries[0]}
        for name, entries in rounds.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.asgi_servers", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--connections", type=int, default=64)
    args = parser.parse_args()
    results = asyncio.run(run(args))
    base = results["uvicorn+edge (the gateway's)"]
    print(f"{'server':<30} {'req/s':>8} {'CPU us/req':>11} {'req/s ratio':>12} {'CPU ratio':>10}")
    for name, entry in results.items():
        print(
            f"{name:<30} {entry['per_s']:8.0f} {entry['cpu_us']:11.1f} {entry['per_s'] / base['per_s']:12.2f} "
            f"{entry['cpu_us'] / base['cpu_us']:10.2f}{'  ERRORS' if entry['errors'] else ''}"
        )
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
