"""Which asyncio event loop runs a dpcoord process.

uvloop, when installed (the ``fast`` extra), runs nats-py's per-message work measurably
faster than the default loop (see docs/performance.md); ``auto`` takes it when it is there.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Coroutine
from typing import Any, Literal, TypeVar

T = TypeVar("T")
EventLoopChoice = Literal["auto", "asyncio", "uvloop"]


def uvloop_available() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def resolve(choice: EventLoopChoice) -> Literal["asyncio", "uvloop"]:
    """The loop ``choice`` means here; ``uvloop`` without uvloop installed is an error a user can act on."""
    if choice == "asyncio":
        return "asyncio"
    if uvloop_available():
        return "uvloop"
    if choice == "uvloop":
        raise RuntimeError("event loop 'uvloop' requested but uvloop is not installed: pip install 'dpcoord[fast]'")
    return "asyncio"


def run(main: Coroutine[Any, Any, T], choice: EventLoopChoice = "auto") -> T:
    if resolve(choice) == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
