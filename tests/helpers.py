"""What external clients send, reproduced with nats-py: `nats request`, `nats pub`, and
`nats request --replies 0 --wait-for-empty` for streams."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import msgpack
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from service.coordinator.coordinator import Coordinator

REPO_ROOT = Path(__file__).resolve().parents[1]


def decode_reply(data: bytes) -> dict[str, Any]:
    """Decode a reply the way a client would: JSON if it starts with '{', else msgpack."""
    if data[:1] == b"{":
        return json.loads(data)
    return msgpack.unpackb(data)


async def request(nc: NATS, subject: str, body: bytes, timeout: float = 5.0) -> dict[str, Any]:
    """`nats request SUBJECT BODY`: one reply."""
    msg = await nc.request(subject, body, timeout=timeout)
    return decode_reply(msg.data)


async def request_json(nc: NATS, subject: str, payload: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
    return await request(nc, subject, json.dumps(payload).encode(), timeout)


async def request_msgpack(nc: NATS, subject: str, payload: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
    return await request(nc, subject, msgpack.packb(payload), timeout)


async def request_stream(nc: NATS, subject: str, body: bytes, timeout: float = 10.0) -> list[Msg]:
    """`nats request --replies 0 --wait-for-empty`: every reply up to and including the empty one."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        await nc.publish(subject, body, reply=inbox)
        messages = []
        while True:
            msg = await sub.next_msg(timeout=timeout)
            messages.append(msg)
            if not msg.data:
                return messages
    finally:
        await sub.unsubscribe()


async def engines_become(coordinator: Coordinator, count: int, timeout_s: float = 5.0) -> None:
    """Wait until the coordinator knows exactly ``count`` engines (``wait_for_engines`` waits for at least)."""

    async def reached() -> None:
        while len(coordinator.engines) != count:
            coordinator.engines_changed.clear()
            await coordinator.engines_changed.wait()

    await asyncio.wait_for(reached(), timeout_s)


def read_up_banner(stdout: Iterable[str]) -> list[str]:
    """The lines `dpcoord up` prints up to and including its Ctrl-C hint, once the stack is ready."""
    lines = []
    for line in stdout:
        lines.append(line)
        if line.startswith("Ctrl-C"):
            return lines
    raise AssertionError(f"dpcoord up ended before it was ready: {lines}")


def new_shell_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` as a new terminal has it: no DPCOORD_ variables, the virtual environment not activated."""
    venv_bin = Path(sys.executable).parent.resolve()
    shell = {key: value for key, value in env.items() if not key.startswith("DPCOORD_")}
    shell["PATH"] = os.pathsep.join(
        entry for entry in env["PATH"].split(os.pathsep) if Path(entry).resolve() != venv_bin
    )
    return shell


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll in-process state that has no event of its own (counters, peer clocks, engine load)
    until ``condition`` holds; TimeoutError after ``timeout_s``."""

    async def holds() -> None:
        while True:
            if condition():
                return
            await asyncio.sleep(0.02)

    await asyncio.wait_for(holds(), timeout_s)
