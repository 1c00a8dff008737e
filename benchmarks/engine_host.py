"""Host time per decode step of the torch engine, with the model replaced by a same-shaped no-op:
what Python adds to every step, which on a GPU decides whether the device waits.

    python -m benchmarks.engine_host [--baseline 363a512] [--batches 1 16 64 256] [--rounds 3] [--logprobs 5]

Each figure comes from a fresh process running the backend of one tree (this checkout, and
with ``--baseline REV`` that revision extracted with ``git archive`` into a temporary
directory, as ``benchmarks/instructions.py`` does), ``--rounds`` times, trees interleaved,
best round kept. In that process, ``batch`` requests decode together on the CPU device with
one torch thread and steps overlapped as on CUDA; once every request is decoding, ``--steps``
steps are timed. The test doubles, the same for both trees:

- **the model** is a no-op of the real one's shape: it returns preset logits ``[B, vocab]``
  (the default model's 256-token byte vocabulary), so nothing of the forward pass is timed;
- **the graphs** are the tree's own ``DecodeGraphs`` with nothing captured: each decode step
  builds its ``GraphInputs``, stages them into the static buffers (``load``) and "replays" a
  graph that does nothing, so the host side of a CUDA graph step is what runs, as on a GPU.

Figures per step, on the thread that launches the steps, then in all:

- **exposed**: wall and CPU time of collecting step n (its tokens written in, finished requests
  out) and launching step n + 1 (scheduling, inputs, the graph replay and the sampler). In the
  baseline, which launches step n + 1 right after collecting step n, that is the window in
  which the device has nothing queued: it finished step n and waits for n + 1. This checkout
  launches step n + 1 before it collects step n (the overlap scheduler), so the device computes
  step n + 1 while the host collects step n and launches step n + 2; the figure is kept as the
  same work, comparable across trees, and on a device the wait is what of the **loop** exceeds
  the device's step. Everything else (detokenising, replies) runs while a step computes;
- **loop**: wall and CPU time of the launching thread's whole step, replies included where
  they are encoded on it. The device waits whenever this exceeds its own step time;
- **CPU**: process CPU time per step, every thread included: the host work in all.

Wall times count waiting for a core on a shared machine; CPU times do not (nor waiting for
the GIL), so they are the steadier figures here.

``--logprobs K`` adds a column: this checkout with every request asking for its tokens'
log-probabilities and K alternatives (computed from the no-op model's logits, copied to the host,
put on each output and into each partial), and the ratio of its figures to this checkout's
without.

After each step the replies are built as the engine runtime builds them: each output recorded
in its ``ActiveRequest`` (``engines/replies.py``), a partial per token and a final per finished
request encoded, and the batch encoded as one ``EngineReplyBatch`` (publishing on NATS is not
included); a tree with the engine's request table runs its own ``RequestTable.record_step``
(``engines/requests.py``), an older tree a copy of its runtime's loop (``Replies``). The driver
places that work as each tree's runtime does with steps launched ahead: the baseline runtime
encodes between steps, on the critical path (``inline``); this checkout's
runtime encodes right after the step too, but the next step is then already launched on the
device (``Backend.launches_ahead``), so it is off the critical path. ``--emit thread`` encodes
this checkout's replies on a second thread while the next step runs instead, as its runtime
does for backends that do not launch ahead; here that cost the launching thread more than it
saved, the two threads taking turns with the GIL.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, cast

PROMPT_TOKENS = 32
WARMUP_STEPS = 8


def drive(batch: int, steps: int, emit: str, logprobs: int | None = None) -> dict[str, float]:
    """In the driver process: the figures of one tree (the one on ``PYTHONPATH``), its requests
    asking for ``logprobs`` alternatives (None: no logprobs)."""
    max_tokens = WARMUP_STEPS + steps + 4
    backend = decoding_backend(batch, max_tokens)
    replies = Replies(backend)
    replies.add_greedy(batch, max_tokens, logprobs)
    work: queue.Queue[list[Any] | None] = queue.Queue()

    def emitter() -> None:
        while (outputs := work.get()) is not None:
            replies.encode(outputs)

    thread = threading.Thread(target=emitter, daemon=True)
    thread.start()
    for _ in range(WARMUP_STEPS):
        replies.encode(backend._step())
    # The phases object of the tree: its step phases, or the backend itself in trees from before
    # the backend composed them (it inherited them then).
    window = Stopwatch(getattr(backend, "steps", backend), ("_collect", "_launch"))
    wall_started, thread_started, cpu_started = time.perf_counter(), time.thread_time(), time.process_time()
    for _ in range(steps):
        outputs = backend._step()
        if emit == "thread":
            work.put(outputs)
        else:
            replies.encode(outputs)
    loop, loop_cpu = time.perf_counter() - wall_started, time.thread_time() - thread_started
    work.put(None)
    thread.join()
    cpu = time.process_time() - cpu_started
    return {
        "exposed_us": 1e6 * window.wall / steps,
        "exposed_cpu_us": 1e6 * window.cpu / steps,
        "loop_us": 1e6 * loop / steps,
        "loop_cpu_us": 1e6 * loop_cpu / steps,
        "cpu_us": 1e6 * cpu / steps,
    }


class Stopwatch:
    """Benchmark instrumentation: wraps the named methods of one object (instance attributes
    shadow them) and sums their wall and thread CPU time."""

    def __init__(self, target: object, names: tuple[str, ...]) -> None:
        self.wall = self.cpu = 0.0
        for name in names:
            setattr(target, name, self._timed(getattr(target, name)))

    def _timed(self, method: Any) -> Any:
        def timed(*args: Any) -> Any:
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return method(*args)
            finally:
                self.wall += time.perf_counter() - wall
                self.cpu += time.thread_time() - cpu

        return timed


def decoding_backend(batch: int, max_tokens: int) -> Any:
    """The tree's TorchBackend on CPU with the test doubles, with room for ``batch`` requests of
    :data:`PROMPT_TOKENS` plus ``max_tokens`` (:meth:`Replies.add_greedy` adds them)."""
    import torch

    from engines.torch_backend.backend import TorchBackend
    from engines.torch_backend.cuda_graphs import DecodeGraphs
    from engines.torch_backend.kernels import EAGER, Kernels
    from engines.torch_backend.options import TorchOptions

    class NoOpModel(torch.nn.Module):
        """Test double: the model's interface and output shape, no computation."""

        def __init__(self, config: Any, rows: int) -> None:
            super().__init__()
            self.config = config  # the real model's (the decode graphs read it)
            self.logits = torch.zeros(rows, config.vocab_size)
            self.logits[:, ord("a")] = 1.0  # greedy picks "a": text to detokenise, never EOS
            self.kernels = Kernels(EAGER.rms_norm, EAGER.rotate_, EAGER.silu_mul, lambda q, *_: q)

        def forward(self, batch: Any, rotary: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
            return self.logits[: batch.last_token_index.shape[0]]

    class NoGraph:
        def replay(self) -> None:
            return None

    class HostOnlyGraphs(DecodeGraphs):
        """Test double: the tree's decode graphs with nothing captured; replay does the host work."""

        def _capture(self) -> None:
            for size in self.buckets:
                self._graphs[size] = NoGraph()  # type: ignore[assignment]
                self._logits[size] = cast(NoOpModel, self._model).logits[:size]

    backend = TorchBackend(
        TorchOptions(
            device="cpu",
            cpu_threads=1,
            max_batch=batch,
            max_context=PROMPT_TOKENS + max_tokens + 1,
            kv_cache_gb=max(0.02, batch * (PROMPT_TOKENS + max_tokens + 16) * 32 * 1024 / 16 / 2**30),
            overlap_steps=True,
        )
    )
    model: Any = NoOpModel(backend.config, batch)  # the test double, typed as the model it stands for
    pages = -(-backend.max_context // backend.options.kv_block_size)
    runner = getattr(backend, "runner", None)
    if runner is not None:  # the model runner owns the model, the cache and the graphs
        runner.model = model
        assert runner.kv_cache is not None
        runner._graphs = HostOnlyGraphs(
            model, runner.rotary, runner.kv_cache, batch, pages, backend.options.kv_block_size
        )
    else:  # a tree from before the model runner, whose backend held them
        before: Any = backend
        before.model = model
        before._graphs = HostOnlyGraphs(
            model, before._rotary, before._kv_cache, batch, pages, before.options.kv_block_size
        )
    return backend


class Replies:
    """The runtime's reply building for one stream of steps, without the publish: every request
    streamed, one partial per token. A tree with a request table runs its own
    ``RequestTable.record_step`` (engines/requests.py) over a publisher that encodes each batch
    and sends nothing; a tree from before it runs this copy of its
    ``EngineRuntime._publish_outputs``."""

    def __init__(self, backend: Any) -> None:
        from engines.replies import ActiveRequest, ReplyPublisher
        from service.bus.direct import DirectClient
        from service.protocol.codec import Encoding, encode_msgpack
        from service.protocol.routed import EngineReplyBatch, ReturnPath, RoutedRequest
        from service.protocol.subjects import Subjects

        self._backend = backend
        self._active: dict[str, Any] = {}
        self._path = lambda request_id: ReturnPath(
            request_id, "c-bench", f"_INBOX.bench.{request_id}", Encoding.MSGPACK.value, True, request_id
        )
        self._new = lambda request_id: ActiveRequest(self._path(request_id), Encoding.MSGPACK)
        self._batch = lambda replies: encode_msgpack(EngineReplyBatch("bench", replies))
        self._routed = lambda request_id: RoutedRequest(self._path(request_id), b"")
        self._encoding = Encoding.MSGPACK
        try:
            from engines.requests import RequestTable
        except ImportError:  # a tree from before the request table
            self._table: Any = None
            return

        batch = self._batch

        class EncodeOnly(ReplyPublisher):
            """Benchmark double: encodes each batch as the publisher would send it, sends nothing."""

            async def publish(self, header: Any, replies: list[Any], remember: bool = True) -> None:
                if replies:
                    batch(replies)

        publisher = EncodeOnly("bench", DirectClient(), Subjects("bench"), Counter())
        self._table = RequestTable("bench", backend, publisher, Counter(), stream_interval=1)

    def add_greedy(self, batch: int, max_tokens: int, logprobs: int | None = None) -> None:
        """``batch`` greedy requests of :data:`PROMPT_TOKENS` tokens, in the backend (and the table)."""
        from engines.backend import GenerationRequest

        asked: dict[str, Any] = {} if logprobs is None else {"logprobs": logprobs}
        for index in range(batch):
            prompt = [(31 * index + k) % 200 + 32 for k in range(PROMPT_TOKENS)]
            request = GenerationRequest(f"r{index}", prompt, max_tokens=max_tokens, temperature=0.0, **asked)
            if self._table is None:
                self._backend.add(request)
            else:
                self._table.start(self._routed(request.request_id), self._encoding, request, None)

    def encode(self, outputs: list[Any]) -> None:
        if self._table is not None:
            step = self._table.record_step(outputs, 1, None)
            try:  # nothing in it awaits (the publisher sends nothing): it runs to the end at once
                step.send(None)
            except StopIteration:
                return
            raise RuntimeError("record_step awaited something")
        partials, finals = [], []
        for output in outputs:
            active = self._active.get(output.request_id)
            if active is None:
                active = self._active[output.request_id] = self._new(output.request_id)
            active.record(output, 1)
            partials.append(active.partial())
            if output.finish_reason is not None:
                finals.append(active.final("bench", output.finish_reason))
                del self._active[output.request_id]
        self._batch(partials)
        if finals:
            self._batch(finals)


def measure(tree: Path, batch: int, steps: int, emit: str, logprobs: int | None = None) -> dict[str, float]:
    env = dict(os.environ) | {"PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    # -P: the script's directory stays off the path; the tree's packages come from PYTHONPATH alone.
    command = [sys.executable, "-P", str(Path(__file__).resolve()), "--driver", str(batch), str(steps), emit]
    if logprobs is not None:
        command.append(str(logprobs))
    done = subprocess.run(command, env=env, cwd=tree, check=True, capture_output=True, text=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main(args: argparse.Namespace) -> None:
    current = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="dpcoord-engine-host-") as temp:
        trees: dict[str, tuple[Path, str, int | None]] = {"current": (current, args.emit, None)}
        if args.baseline:
            # Here, not at the top: the driver processes import only the tree they measure.
            from benchmarks.common import extract

            trees[args.baseline] = (extract(args.baseline, Path(temp) / "baseline"), "inline", None)
        with_logprobs = f"logprobs {args.logprobs}"
        if args.logprobs is not None:
            trees[with_logprobs] = (current, args.emit, args.logprobs)
        print(
            f"host time per decode step, no-op model, CPU, 1 torch thread; best of {args.rounds} rounds; "
            "µs wall / CPU (exposed: collect + launch; loop: the launching thread's whole step; CPU: all threads)"
        )
        header = f"{'batch':>6}" + "".join(f" {f'{name} exposed':>20} {'loop':>15} {'CPU':>7}" for name in trees)
        if args.baseline:
            header += f" {'exposed CPU ratio':>18} {'loop CPU ratio':>15}"
        if args.logprobs is not None:
            header += f" {'logprobs/none loop CPU':>23} {'CPU':>6}"
        print(header, flush=True)
        for batch in args.batches:
            steps = max(40, min(1800, args.steps // batch))  # within the default model's 2,048 positions
            best: dict[str, dict[str, float]] = {}
            for _ in range(args.rounds):
                for name, (tree, emit, logprobs) in trees.items():
                    figures = measure(tree, batch, steps, emit, logprobs)
                    kept = best.setdefault(name, figures)
                    best[name] = {key: min(kept[key], value) for key, value in figures.items()}
            line = f"{batch:6d}"
            for name in trees:
                f = best[name]
                line += (
                    f" {f['exposed_us']:12.0f} /{f['exposed_cpu_us']:6.0f}"
                    f" {f['loop_us']:7.0f} /{f['loop_cpu_us']:6.0f} {f['cpu_us']:7.0f}"
                )
            if args.baseline:
                base, now = best[args.baseline], best["current"]
                line += (
                    f" {now['exposed_cpu_us'] / base['exposed_cpu_us']:17.2f}x"
                    f" {now['loop_cpu_us'] / base['loop_cpu_us']:14.2f}x"
                )
            if args.logprobs is not None:
                plain, asked = best["current"], best[with_logprobs]
                line += (
                    f" {asked['loop_cpu_us'] / plain['loop_cpu_us']:22.2f}x {asked['cpu_us'] / plain['cpu_us']:5.2f}x"
                )
            print(line, flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default=None, help="git revision of this checkout to measure alongside")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument(
        "--steps", type=int, default=1600, help="decode steps timed at batch 1 (fewer at larger, at least 40)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--emit", choices=["inline", "thread"], default="inline", help="where this checkout's replies are encoded"
    )
    parser.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="K",
        help="also measure this checkout with every request asking for logprobs with K alternatives",
    )
    return parser


if __name__ == "__main__":
    if len(sys.argv) in (5, 6) and sys.argv[1] == "--driver":
        asked = int(sys.argv[5]) if len(sys.argv) == 6 else None
        print(json.dumps(drive(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], asked)))
    else:
        main(build_parser().parse_args())
