"""How long ``update_weights`` takes on one engine, against reading the same files, in one run.

A random checkpoint of the chosen shape (default Llama-3.2-1B, bf16: 2.47 GB) is written once,
a torch engine is built from it on the CPU, and then, alternately:

- **read**: every byte of the checkpoint's files read into one reused buffer (the floor: what
  any update must at least do);
- **update**: what an engine does for ``update_weights``, split into its parts: check every
  tensor's name, shape and dtype and read the tensors into host memory (``stage``), digest the
  files (``digest``), and copy them into the running model (``swap``).

Each is timed with the files in the page cache (``warm``, as right after a trainer wrote them)
and after dropping this checkpoint's pages from it (``cold``: ``posix_fadvise(DONTNEED)`` on
its files only, so the rest of a shared machine is left alone). The median of ``--repeat``
rounds counts, and the ratio to the read in the same state is printed. With ``--through-nats``
the same engine also joins a coordinator on an embedded nats-server, and the time from
``client.update_weights`` to its ``Ack`` (prepare and commit on the engine, the shared record
written) is measured too.

Run: ``python -m benchmarks.weight_update`` (``--shape tiny`` checks the benchmark itself;
``--keep`` keeps the checkpoint, otherwise its directory is deleted at the end).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.model_shapes import SHAPES, checkpoint, weight_bytes
from engines.torch_backend.backend import TorchBackend
from engines.torch_backend.options import TorchOptions
from service.protocol.checkpoint import checkpoint_digest, checkpoint_files

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
READ_CHUNK = 64 * 1024 * 1024


def drop_from_page_cache(files: list[Path]) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_files(files: list[Path], buffer: bytearray) -> int:
    view = memoryview(buffer)
    total = 0
    for path in files:
        with path.open("rb", buffering=0) as handle:
            while count := handle.readinto(view):
                total += count
    return total


def update(backend: TorchBackend, path: Path) -> dict[str, float]:
    """The engine's update, part by part (engines/weight_updates.py runs the same calls)."""
    started = time.perf_counter()
    staged = backend.stage_weights(path)
    staged_at = time.perf_counter()
    checkpoint_digest(checkpoint_files(path))
    digested_at = time.perf_counter()
    asyncio.run(backend.swap_weights(staged))
    swapped_at = time.perf_counter()
    del staged
    return {
        "stage": staged_at - started,
        "digest": digested_at - staged_at,
        "swap": swapped_at - digested_at,
        "update": swapped_at - started,
    }


async def through_nats(backend: TorchBackend, path: Path, rounds: int) -> list[float]:
    """Seconds from ``update_weights`` to its ``Ack``, through nats-server and a coordinator."""
    from engines.runtime import EngineRuntime
    from handlers import HANDLERS
    from service.bus.server import EmbeddedNatsServer
    from service.client import DpcoordClient
    from service.coordinator.coordinator import Coordinator
    from service.ops.settings import Settings

    timings = []
    with EmbeddedNatsServer(jetstream=True) as server:
        settings = Settings(nats_url=server.url, subject_prefix="weightbench", long_control_timeout_s=3600.0)
        async with Coordinator(settings, HANDLERS) as coordinator, EngineRuntime(settings, backend) as engine:
            await coordinator.wait_for_engines(1)
            await engine.registered.wait()
            async with await DpcoordClient.connect(settings) as client:
                await client.pause()
                for round_ in range(rounds):
                    started = time.perf_counter()
                    await client.update_weights(str(path), round_ + 1, timeout=3600.0)
                    timings.append(time.perf_counter() - started)
                await client.unpause()
    return timings


def median(samples: list[float]) -> float:
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-1b", choices=[name for name in SHAPES if name != "default"])
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    parser.add_argument("--dir", type=Path, default=None, help="where the checkpoint goes (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint directory")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--through-nats", action="store_true", help="also time update_weights to its Ack")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    root = args.dir or Path(tempfile.mkdtemp(prefix="dpcoord-weights-"))
    try:
        return _run(args, root)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def _run(args: argparse.Namespace, root: Path) -> int:
    dtype = _DTYPES[args.dtype]
    started = time.perf_counter()
    path = checkpoint(args.shape, root, dtype, torch.device("cpu"))
    files = checkpoint_files(path)
    size = sum(file.stat().st_size for file in files)
    print(
        f"checkpoint {path}: {size / 1e9:.2f} GB in {len(files)} files ({time.perf_counter() - started:.1f} s to write)"
    )
    options = TorchOptions(device="cpu", dtype=args.dtype, max_context=256, kv_cache_gb=0.01, max_batch=4)
    backend = TorchBackend(options, str(path))
    print(
        f"engine model: {weight_bytes(backend.model) / 1e9:.2f} GB of {args.dtype} parameters, {torch.get_num_threads()} threads"
    )
    buffer = bytearray(READ_CHUNK)
    samples: dict[str, dict[str, list[float]]] = {"warm": {}, "cold": {}}

    def settle(state: str) -> None:
        """Put the checkpoint's pages in the state the next measurement starts from."""
        if state == "cold":
            drop_from_page_cache(files)
        else:
            read_files(files, buffer)

    for _ in range(args.repeat):
        for state in ("cold", "warm"):
            settle(state)
            read_started = time.perf_counter()
            read_files(files, buffer)
            samples[state].setdefault("read", []).append(time.perf_counter() - read_started)
            settle(state)
            for part, seconds in update(backend, path).items():
                samples[state].setdefault(part, []).append(seconds)
    print(f"median of {args.repeat} rounds, seconds (GB/s of checkpoint); update = stage + digest + swap")
    print(f"{'':6}{'read':>16}{'stage':>16}{'digest':>16}{'swap':>16}{'update':>16}{'update/read':>13}")
    for state, parts in samples.items():
        cells = [
            f"{median(parts[part]):7.2f} ({size / median(parts[part]) / 1e9:5.2f})"
            for part in ("read", "stage", "digest", "swap", "update")
        ]
        ratio = median(parts["update"]) / median(parts["read"])
        print(f"{state:6}" + "".join(f"{cell:>16}" for cell in cells) + f"{ratio:13.2f}")
    if args.through_nats:
        timings = asyncio.run(through_nats(backend, path, args.repeat))
        warm_read = median(samples["warm"]["read"])
        print(
            f"update_weights to its Ack through nats-server and a coordinator (warm): median {median(timings):.2f} s "
            f"over {len(timings)}, {median(timings) / warm_read:.2f} x the warm read"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
