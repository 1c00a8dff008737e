"""``dpcoord submit`` and ``dpcoord control``: one call of the client library each, with the
command's timeouts kept and its waiting shown.

Timeouts: the NATS connection gets ``nats_connect_timeout_s`` per server in ``nats_url`` (then one
line naming the URL, exit 1: the client library's :class:`NatsUnreachable`); everything after it
shares ``--timeout``. A control signal waits, unless ``--timeout`` says otherwise, as long as the
coordinator may take to answer it (:func:`control_wait_s`), with a spinner on a terminal and a
line otherwise; when no answer came, it says so in one line with the state the coordinator's
record holds, since the signal may still be taking effect.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from collections.abc import Callable
from typing import Any

import msgspec
from nats.errors import Error as NatsError

from service.cli import terminal
from service.cli.logprobs import logprob_lines
from service.client import DpcoordClient
from service.ops.services_api import CoordinatorStatus
from service.ops.settings import Settings
from service.protocol.messages import Ack, Final, Held, Partial
from service.protocol.subjects import Header

log = logging.getLogger(__name__)

CONTROL_COMMANDS: dict[str, Header] = {
    "pause": Header.PAUSE,
    "unpause": Header.UNPAUSE,
    "suspend": Header.SUSPEND,
    "resume": Header.RESUME,
    "stop": Header.STOP,
    "epoch": Header.SET_GENERATION_EPOCH,
    "profile-start": Header.START_CUDA_PROFILER,
    "profile-stop": Header.STOP_CUDA_PROFILER,
    "shutdown": Header.SHUTDOWN,
    "update-weights": Header.UPDATE_WEIGHTS,
}
CONTROL_WAIT_FLOOR_S = 30.0  # the least a control signal is waited for without --timeout
CONTROL_WAIT_MARGIN_S = 10.0  # beyond the coordinator's own limits: the replies' way back
STATUS_TIMEOUT_S = 2.0  # for the coordinator's state, read when a control signal had no answer


class CommandFailed(Exception):
    """What a command has to say when it fails: one line, no traceback (exit 1)."""


def control_wait_s(header: Header, mode: str | None, settings: Settings) -> float:
    """How long the coordinator may take to answer ``header``, by the limits these settings hold
    (the coordinator's when this command shares its environment) plus a margin, and never less
    than 30 s: writing the shared record (``control_timeout_s``), then every engine's
    confirmation (``control_timeout_s``; ``long_control_timeout_s`` for a drain pause, and for
    each of the two phases of a weight update)."""
    engines_s = settings.control_timeout_s
    if header is Header.UPDATE_WEIGHTS:
        engines_s = 2 * settings.long_control_timeout_s
    elif header is Header.PAUSE and mode == "drain":
        engines_s = settings.long_control_timeout_s
    return max(CONTROL_WAIT_FLOOR_S, settings.control_timeout_s + engines_s + CONTROL_WAIT_MARGIN_S)


def _print_json(message: msgspec.Struct, shown: Callable[[str], str] = str) -> None:
    print(shown(msgspec.json.encode(message).decode()))


def _print_final(final: Final, shown: Callable[[str], str]) -> None:
    """The final's JSON (its logprob fields included); on a terminal, a line per token's logprobs after it."""
    _print_json(final, shown)
    if sys.stdout.isatty():
        for line in logprob_lines(final, shown):
            print(line)


class _Deadline:
    """What is left of one timeout shared by the steps of a command."""

    def __init__(self, timeout_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._end = self._loop.time() + timeout_s

    def left(self) -> float:
        return max(0.001, self._end - self._loop.time())


async def submit(settings: Settings, args: argparse.Namespace) -> int:
    sampling: dict[str, Any] = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
        "stop": args.stop,
        "logprobs": args.logprobs,
        "prompt_logprobs": args.prompt_logprobs,
        "logprobs_mode": args.logprobs_mode,
    }
    shown = terminal.shown_on(sys.stdout, raw=args.raw)
    deadline = _Deadline(args.timeout)
    try:
        async with await DpcoordClient.connect(settings, timeout=deadline.left()) as client:
            if not args.stream:
                async with terminal.Spinner(sys.stderr, "waiting for the reply") as spinner:
                    final = await client.submit(
                        args.prompt,
                        timeout=deadline.left(),
                        on_held=lambda held: spinner.say(held_line(held)),
                        **sampling,
                    )
                _print_final(final, shown)
                return 0
            async for reply in client.stream(args.prompt, timeout=deadline.left(), on_held=_say_held, **sampling):
                if isinstance(reply, Partial):
                    print(shown(reply.text), end="", flush=True)
                else:
                    print()
                    _print_final(reply, shown)
    except TimeoutError:
        raise CommandFailed(f"no reply within {args.timeout:g} s (--timeout)") from None
    return 0


def held_line(held: Held) -> str:
    """What ``submit`` says of a submission the coordinator holds: ``held: the fleet is paused``."""
    return f"held: the fleet is {held.state}"


def _say_held(held: Held) -> None:
    sys.stderr.write(f"{held_line(held)}\n")
    sys.stderr.flush()


def _control_header(args: argparse.Namespace) -> tuple[Header, int | None]:
    """The signal and its epoch, or SystemExit naming what the arguments lack."""
    header = CONTROL_COMMANDS[args.signal]
    epoch = None
    if header is Header.SET_GENERATION_EPOCH:
        try:
            epoch = int(args.epoch)
        except (TypeError, ValueError):
            raise SystemExit("dpcoord control epoch needs an integer: dpcoord control epoch 3") from None
    if header is Header.UPDATE_WEIGHTS and (args.epoch is None or args.weight_version is None):
        raise SystemExit(
            "dpcoord control update-weights needs a directory and a version: update-weights DIR --version 3"
        )
    if args.mode is not None and header is not Header.PAUSE:
        raise SystemExit("--mode applies to 'dpcoord control pause' only")
    return header, epoch


async def control(settings: Settings, args: argparse.Namespace) -> int:
    header, epoch = _control_header(args)
    wait_s = args.timeout if args.timeout is not None else control_wait_s(header, args.mode, settings)
    deadline = _Deadline(wait_s)
    what = f"{args.signal}{f' --mode {args.mode}' if args.mode else ''}"
    waiting = f"dpcoord control {what}: waiting for the engines to confirm (up to {wait_s:.0f} s)"
    async with await DpcoordClient.connect(settings, timeout=deadline.left()) as client:
        try:
            # A wait no longer than the line's delay ends in an answer or a timeout's line instead.
            waits_long = wait_s > terminal.WAITING_LINE_AFTER_S
            async with terminal.Waiting(sys.stderr, waiting) if waits_long else contextlib.nullcontext():
                ack = await _send(client, header, epoch, args, deadline.left())
        except TimeoutError:
            state = await _recorded_state(client)
            raise CommandFailed(
                f"{what}: no answer within {wait_s:.0f} s; the signal may still be taking effect "
                f"(the coordinator's record: {state}). Wait longer with --timeout SECONDS."
            ) from None
    _print_json(ack)
    return 0


async def _send(client: DpcoordClient, header: Header, epoch: int | None, args: argparse.Namespace, wait: float) -> Ack:
    if header is Header.SHUTDOWN:
        return await client.shutdown(timeout=wait)
    if header is Header.UPDATE_WEIGHTS:
        version: str | int = int(args.weight_version) if args.weight_version.isdigit() else args.weight_version
        return await client.update_weights(args.epoch, version, timeout=wait)
    return await client.control(header, epoch=epoch, timeout=wait, mode=args.mode)


async def coordinator_status(client: DpcoordClient) -> CoordinatorStatus | None:
    """The status of the coordinator ``client`` shook hands with; None when it does not answer."""
    subject = client.subjects.status("coordinator", client.coordinator_id)
    try:
        reply = await client.nc.request(subject, b"", timeout=STATUS_TIMEOUT_S)
    except NatsError as exc:
        log.debug("coordinator status not read: %s", exc)
        return None
    return msgspec.json.decode(reply.data, type=CoordinatorStatus)


async def _recorded_state(client: DpcoordClient) -> str:
    status = await coordinator_status(client)
    if status is None:
        return "unknown, its coordinator did not answer"
    return f"state '{status.state}' at revision {status.revision}"
