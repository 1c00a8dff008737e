"""The parts ``dpcoord up`` runs, watched: the first to exit stops the stack, named with why.

A part that exits with code 0 was asked to stop: by ``dpcoord control stop`` or ``shutdown``
(an engine leaves once it confirmed the stop, every coordinator leaves on a shutdown) or by a
SIGTERM sent to it. ``up`` says so and stops the rest, exit 0; any other exit is a failure,
reported with the part's last log lines, exit 1.

Each part is a child process started with ``PR_SET_PDEATHSIG`` (service/ops/children.py), so none
outlives ``up`` even when it is SIGKILLed. A part's standard error is copied line by line to
``up``'s own (every process still logs to this command's stderr) and its last lines are kept, so
that when it exits ``up`` can say which part it was, with what code, and what it logged last.
:meth:`Parts.stop` ends them all within :data:`STOP_TIMEOUT_S`: SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from service.bus.server import EmbeddedNatsServer
from service.ops.children import die_with_parent

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 5.0  # seconds a part gets to stop after SIGTERM before it is killed
TAIL_LINES = 12  # log lines kept per part, shown when it exits
NATS_POLL_S = 0.25  # how often the embedded nats-server (not an asyncio child) is checked


@dataclass
class Part:
    name: str
    process: asyncio.subprocess.Process
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    _awaited: list[tuple[str, asyncio.Future[str]]] = field(default_factory=list)

    def logged(self, text: str) -> asyncio.Future[str]:
        """The first line containing ``text`` that this part logs after this call (make it
        right after :meth:`Parts.start`); never done if the part exits first."""
        line: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._awaited.append((text, line))
        return line

    def read(self, line: str) -> None:
        self.tail.append(line)
        for text, awaited in self._awaited:
            if text in line and not awaited.done():
                awaited.set_result(line)


@dataclass(frozen=True)
class Exit:
    """A part that exited while the stack was meant to run, and why."""

    name: str
    code: int | None
    tail: Sequence[str]
    hint: str = ""
    stops_when_asked: bool = True  # exit 0 means asked to stop; not so for NATS, which the stack cannot lose

    @property
    def asked(self) -> bool:
        """Whether the part was asked to stop (exit 0), rather than failed."""
        return self.code == 0 and self.stops_when_asked

    def report(self) -> str:
        if self.asked:
            return (
                f"dpcoord up: the {self.name} stopped, as it was asked to (dpcoord control stop or shutdown, "
                "or a SIGTERM). Stopping the rest.\n"
            )
        code = f"code {self.code}" if self.code is not None else "an unknown status"
        lines = "".join(f"   | {line}\n" for line in self.tail) or "   (it logged nothing)\n"
        hint = f"{self.hint}\n" if self.hint else ""
        return f"dpcoord up: the {self.name} exited with {code}; its last log lines:\n{lines}{hint}Stopping the rest.\n"


class Parts:
    """The child processes of one stack, and the first of them to exit."""

    def __init__(self) -> None:
        self._parts: list[Part] = []
        self._copies: list[asyncio.Task[None]] = []
        self.exited: asyncio.Future[Exit] = asyncio.get_running_loop().create_future()

    async def start(self, name: str, args: Sequence[str], env: dict[str, str]) -> Part:
        process = await asyncio.create_subprocess_exec(
            *args, env=env, stderr=asyncio.subprocess.PIPE, preexec_fn=die_with_parent
        )
        part = Part(name, process)
        self._parts.append(part)
        self._copies.append(asyncio.ensure_future(self._watch(part)))
        return part

    def watch_nats(self, server: EmbeddedNatsServer) -> asyncio.Task[None]:
        async def poll() -> None:
            while (code := server.exit_code()) is None:  # noqa: ASYNC110 (a Popen child has nothing to await)
                await asyncio.sleep(NATS_POLL_S)
            tail = list(server.log_tail)[-TAIL_LINES:]
            self._exited(Exit("NATS server (embedded nats-server)", code, tail, stops_when_asked=False))

        task = asyncio.ensure_future(poll())
        self._copies.append(task)
        return task

    async def _watch(self, part: Part) -> None:
        stream = part.process.stderr
        if stream is not None:
            async for raw in stream:
                sys.stderr.buffer.write(raw)
                sys.stderr.buffer.flush()
                part.read(raw.decode("utf-8", "replace").rstrip())
        code = await part.process.wait()
        self._exited(Exit(part.name, code, list(part.tail), _hint(part)))

    def _exited(self, ended: Exit) -> None:
        if not self.exited.done():
            self.exited.set_result(ended)

    async def stop(self) -> None:
        """SIGTERM every part still running, SIGKILL those not gone within STOP_TIMEOUT_S, and
        name any that failed on its way out (an exit code above 0; a part that was already
        leaving by itself, past its signal handlers, ends by the SIGTERM, which is no failure);
        safe twice."""
        running = [part for part in self._parts if part.process.returncode is None]
        for part in running:
            part.process.send_signal(signal.SIGTERM)
        if running:
            waits = [asyncio.ensure_future(part.process.wait()) for part in running]
            _, late = await asyncio.wait(waits, timeout=STOP_TIMEOUT_S)
            for part in running:
                if part.process.returncode is None:
                    log.warning("dpcoord up: the %s did not stop within %.0f s; killed", part.name, STOP_TIMEOUT_S)
                    part.process.kill()
                elif part.process.returncode > 0:  # < 0: ended by the SIGTERM itself, once past its own handlers
                    log.warning(
                        "dpcoord up: the %s exited with code %d while stopping; its log above says why",
                        part.name,
                        part.process.returncode,
                    )
            for waiting in late:
                await waiting
        for copy in self._copies:
            copy.cancel()
        await asyncio.gather(*self._copies, return_exceptions=True)


GATEWAY_EXTRA_HINT = (
    "The gateway needs the `gateway` extra: pip install 'dpcoord[gateway]' (or run dpcoord up --no-gateway)."
)


def _hint(part: Part) -> str:
    if part.name == "gateway" and any("ModuleNotFoundError" in line for line in part.tail):
        return GATEWAY_EXTRA_HINT
    if part.name == "gateway" and any("cannot listen on" in line for line in part.tail):
        return "Give the gateway another port (--gateway-port PORT), or run dpcoord up --no-gateway."
    return ""
