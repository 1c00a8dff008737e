"""A monotonic clock the coordinator's time-keeping data structures read, set by the test."""

from __future__ import annotations

import time

import pytest


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(time, "monotonic", fake)
    return fake


class Later:
    """``time.monotonic`` as the modules of peers, pool and fleet read it, moved forward by
    ``offset`` seconds (a replica that has been up a while, an engine silent for long): the
    event loop keeps the real clock."""

    def __init__(self) -> None:
        self.offset = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds


@pytest.fixture
def later(monkeypatch: pytest.MonkeyPatch) -> Later:
    from service.coordinator import fleet, peers, pool

    shifted = Later()
    for module in (peers, pool, fleet):
        monkeypatch.setattr(module, "time", shifted)
    return shifted
