"""Coordinator (or engine) instructions per request, counted by callgrind: the steady twin of
the coordinator benchmark's CPU figures, which a small shared machine scatters by ±20 %.

The real stack runs (nats-server, one echo engine, the coordinator, each its own process)
under a fixed load: bursts of ``BURST`` submissions, each burst awaited in full. Only the
measured process (``--process``, the coordinator by default) runs under callgrind. Its
counters are zeroed after a warm-up and dumped after the measured bursts, so the count is the
whole process's (nats-py, asyncio, dpcoord) for exactly those requests; two runs of one tree
agree to about 0.2 %. The echo engine's count is its runtime's: the echo backend does next to
nothing.

With ``--baseline REV`` the same is measured, in the same run, for another revision of this
checkout (extracted with ``git archive``), and the ratios are printed: how a change moved
the coordinator's CPU per request (``dpcoord bench --instructions --baseline main``). The
client is this checkout's in both; the wire contract is the same. Needs valgrind, with
callgrind_control (``apt install valgrind``).

Three workloads: ``plain``, msgpack bodies of 10 tokens as `nats pub` sends them; ``envelope``,
the client library's envelope of a named client (its idempotency bookkeeping and reply batches
included); ``long``, the envelope around a 10,000-token prompt. On request (``--kinds``),
``shared``: the envelope sent to the subject every replica shares, as a raw named client does.

With ``--replicas N`` the stack runs N coordinator replicas, each under callgrind, and their
counts add up (engine replies reach every replica). The envelopes then go as the client library
sends them: each to the replica arbitrating its id (``submit_request.<id>``), once every replica
says in its status that it is settled; to a tree whose replicas do not arbitrate, to the subject
they share.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from benchmarks.common import extract
from benchmarks.coordinator_bodies import long_prompt
from benchmarks.stack import BenchStack, StackConfig
from service.protocol.arbiter import ArbiterTable
from service.protocol.codec import encode_msgpack
from service.protocol.messages import SamplingParams, SubmitEnvelope, SubmitRequest
from service.protocol.reply_batches import BATCH_TOKEN, batch_decoder
from service.protocol.subjects import Header

BURST = 256
WARMUP_BURSTS = 4
KINDS = ("plain", "envelope", "long")
# Measured when asked (--kinds): the envelope of a named client that does not address the
# arbiter of its ids (a raw client's named submission): with several replicas, most are handed over.
EXTRA_KINDS = ("shared",)
# Under callgrind a process runs some 50 times slower: it must not seem silent or stalled.
SLOW_PEER = {
    "DPCOORD_HEARTBEAT_TIMEOUT_S": "120",
    "DPCOORD_HEARTBEAT_INTERVAL_S": "5",
    "DPCOORD_ENGINE_PROGRESS_TIMEOUT_S": "600",
}
PROCESSES = {"coordinator": "coordinator", "engine": "engine0"}  # --process -> the stack's name for it (every replica)
DUMP_TRIGGER = "measured"


def bodies(kind: str, count: int) -> list[bytes]:
    """``count`` submissions of ``kind``, each named by its own ``client_request_id`` where named."""
    if kind == "plain":
        body = encode_msgpack(SubmitRequest(list(range(1, 11)), SamplingParams(max_tokens=8)))
        return [body] * count
    prompt = long_prompt(10_000) if kind == "long" else list(range(1, 11))  # "shared": the envelope
    inner = encode_msgpack(SubmitRequest(prompt, SamplingParams(max_tokens=8)))
    # As the client library sends them: reading reply batches (coordinators before them ignore it).
    return [
        encode_msgpack(SubmitEnvelope(1, inner, False, index, "bench", batched_replies=True)) for index in range(count)
    ]


def read_summary(dump: str) -> int:
    """The instructions a callgrind dump counted (its ``summary:`` line)."""
    for line in dump.splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise ValueError("no summary line in the callgrind dump")


class CallgrindStack(BenchStack):
    """A bench stack whose coordinators and engine run the code of ``tree``, the processes that
    ``measured`` names (every coordinator replica, or the engine) under callgrind, each writing
    ``<out_prefix>-<name>.out``."""

    def __init__(self, config: StackConfig, tree: Path, out_prefix: Path, measured: str) -> None:
        super().__init__(config)
        self.tree = tree
        self.out_prefix = out_prefix
        self.measured = measured

    def _dpcoord_env(self) -> dict[str, str]:
        return super()._dpcoord_env() | {"PYTHONPATH": str(self.tree), "PYTHONHASHSEED": "0"} | SLOW_PEER

    def measured_names(self) -> list[str]:
        return self.coordinator_names if self.measured == "coordinator" else [self.measured]

    def out_file(self, name: str) -> Path:
        return self.out_prefix.with_name(f"{self.out_prefix.name}-{name}.out")

    async def _spawn(self, name: str, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        command = [sys.executable, *args]
        if name in self.measured_names():
            out = self.out_file(name)
            command = ["valgrind", "--tool=callgrind", "--quiet", f"--callgrind-out-file={out}", *command]
        # The working directory comes first on the path of `python -m`: it must be the tree's.
        child = await asyncio.create_subprocess_exec(*command, env=env, cwd=cwd or self.tree)
        self._children.append(child)
        self.pids[name] = child.pid


async def callgrind_control(*args: str) -> None:
    process = await asyncio.create_subprocess_exec(
        "callgrind_control", *args, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    _, stderr = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"callgrind_control {' '.join(args)} failed: {stderr.decode(errors='replace')}")


@dataclass(slots=True)
class Count:
    kind: str
    tree: str
    instructions_per_request: float


async def measure(
    kind: str, requests: int, tree: Path, label: str, work_dir: Path, measured: str, replicas: int = 1
) -> Count:
    out_prefix = work_dir / f"callgrind-{label}-{kind}"
    config = StackConfig(None, 1, "auto", 8, replicas=replicas)
    stack = CallgrindStack(config, tree, out_prefix, measured)
    async with stack:
        # Python starts some 50 times slower under callgrind.
        await stack.start_dpcoord(encode_msgpack(SubmitRequest([1], SamplingParams(max_tokens=1))), timeout_s=600)
        table = await arbiters(stack)
        nc = stack.nc
        subject = stack.subjects.coordinator(Header.SUBMIT_REQUEST)
        inbox = nc.new_inbox()
        answered = asyncio.Semaphore(0)

        async def on_reply(msg: Msg) -> None:
            batched = msg.subject.endswith(f".{BATCH_TOKEN}")  # a reply batch (the envelope workloads)
            for _ in batch_decoder.decode(msg.data) if batched else (msg,):
                answered.release()

        await nc.subscribe(f"{inbox}.*", cb=on_reply)
        payloads = bodies(kind, requests + WARMUP_BURSTS * BURST)
        # As the client library sends them: a named one to its id's arbiter, where replicas arbitrate.
        targets = [subject] * len(payloads)
        if table is not None and kind in ("envelope", "long"):
            targets = [
                stack.subjects.addressed_to(Header.SUBMIT_REQUEST, table.of("bench", index))
                for index in range(len(payloads))
            ]
        numbers = itertools.count()

        async def burst() -> None:
            for _ in range(BURST):
                number = next(numbers)
                await nc.publish(targets[number], payloads[number], reply=f"{inbox}.{number}")
            for _ in range(BURST):
                await asyncio.wait_for(answered.acquire(), 300)

        for _ in range(WARMUP_BURSTS):
            await burst()
        names = stack.measured_names()
        for name in names:
            await callgrind_control("--zero", str(stack.pids[name]))
        for _ in range(requests // BURST):
            await burst()
        for name in names:
            await callgrind_control(f"--dump={DUMP_TRIGGER}", str(stack.pids[name]))
        files = [stack.out_file(name) for name in names]
    total = sum(measured_dump(work_dir, out_file) for out_file in files)
    return Count(kind, label, total / (requests // BURST * BURST))


def measured_dump(work_dir: Path, out_file: Path) -> int:
    """The instructions of the measured window in ``out_file``'s dumps."""
    for dump in sorted(work_dir.glob(f"{out_file.name}.*")):
        text = dump.read_text(errors="replace")
        if f"Trigger: Client Request: {DUMP_TRIGGER}" in text or f"Trigger: dump {DUMP_TRIGGER}" in text:
            return read_summary(text)
    raise RuntimeError(f"no callgrind dump of the measured window for {out_file.name} in {work_dir}")


async def arbiters(stack: CallgrindStack) -> ArbiterTable | None:
    """The replicas' arbitration, read from their status once every one is settled with all of
    them; None for coordinators that do not arbitrate (a baseline before it, or one replica)."""
    if stack.config.replicas == 1:
        return None
    nc = stack.nc
    names = stack.coordinator_names
    for _ in range(600):  # under callgrind a status takes seconds: nothing to wait on but the next answers
        statuses = []
        for name in names:
            try:
                msg = await nc.request(stack.subjects.status("coordinator", name), b"", timeout=30)
            except (NoRespondersError, NatsTimeoutError):
                break
            statuses.append(json.loads(msg.data))
        else:
            if not all("arbiters" in status for status in statuses):
                return None
            if all(status["settled"] and set(status["arbiters"]) == set(names) for status in statuses):
                return ArbiterTable(names)
        await asyncio.sleep(1.0)
    raise RuntimeError("the replicas did not settle")


async def run(args: argparse.Namespace) -> list[tuple[Count, Count | None]]:
    current = Path(__file__).resolve().parents[1]
    results: list[tuple[Count, Count | None]] = []
    with tempfile.TemporaryDirectory(prefix="dpcoord-instructions-") as temp:
        work_dir = Path(temp)
        baseline = extract(args.baseline, work_dir / "baseline") if args.baseline else None
        for kind in args.kinds:
            requests = args.requests // 4 if kind == "long" else args.requests
            measured = PROCESSES[args.process]
            jobs = [measure(kind, requests, current, "current", work_dir, measured, args.replicas)]
            if baseline is not None:
                jobs.append(measure(kind, requests, baseline, "baseline", work_dir, measured, args.replicas))
            counts = await asyncio.gather(*jobs)  # both trees at once: the two cores, one each
            results.append((counts[0], counts[1] if len(counts) > 1 else None))
    return results


def print_report(
    results: list[tuple[Count, Count | None]], baseline: str | None, process: str, replicas: int = 1
) -> None:
    fleet = f", {replicas} coordinator replicas summed" if replicas > 1 and process == "coordinator" else ""
    print(f"{process} instructions per request (callgrind, bursts of {BURST}{fleet})")
    for current, base in results:
        line = f"  {current.kind:9} current {current.instructions_per_request:12,.0f}"
        if base is not None:
            ratio = current.instructions_per_request / base.instructions_per_request
            line += f"   {baseline} {base.instructions_per_request:12,.0f}   current_vs_baseline={ratio:.3f}"
        print(line)


def main(args: argparse.Namespace) -> int:
    missing = [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]
    if missing:
        print(f"dpcoord bench --instructions needs {' and '.join(missing)} (apt install valgrind)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("DPCOORD_LOG_LEVEL", "WARNING")
    print_report(asyncio.run(run(args)), args.baseline, args.process, args.replicas)
    return 0


def kinds(text: str) -> list[str]:
    chosen = text.split(",")
    unknown = [kind for kind in chosen if kind not in KINDS + EXTRA_KINDS]
    if unknown:
        choices = ", ".join(KINDS + EXTRA_KINDS)
        raise argparse.ArgumentTypeError(f"unknown workload {', '.join(unknown)} (choose from {choices})")
    return chosen


def request_count(text: str) -> int:
    """At least four bursts, so that ``long`` (a quarter of them) measures one."""
    count = int(text)
    if count < 4 * BURST:
        raise argparse.ArgumentTypeError(f"at least {4 * BURST} requests")
    return count


def build_parser(prog: str = "python -m benchmarks.instructions") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=None, help="git revision of this checkout to measure alongside")
    parser.add_argument(
        "--process", choices=sorted(PROCESSES), default="coordinator", help="the process counted (default coordinator)"
    )
    parser.add_argument(
        "--kinds",
        type=kinds,
        default=list(KINDS),
        help="comma-separated: plain,envelope,long (the default), shared (named envelopes to the shared subject)",
    )
    parser.add_argument(
        "--requests", type=request_count, default=8192, help="requests measured per workload (a quarter of it for long)"
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="coordinator replicas (default 1); with more, every replica runs under callgrind and their counts add up",
    )
    return parser


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
