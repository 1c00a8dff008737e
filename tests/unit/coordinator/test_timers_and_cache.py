"""CoarseTimers (request deadlines) and ResultCache (named clients' results): the cheap
structures on the coordinator's hot path keep the semantics of what they replaced."""

from __future__ import annotations

import asyncio

import pytest

from service.coordinator import results as result_cache
from service.coordinator.requests import ClientKey
from service.coordinator.results import ENTRY_OVERHEAD, ResultCache
from service.coordinator.timers import CoarseTimer, CoarseTimers


async def test_coarse_timer_fires_never_early_and_at_most_one_resolution_late() -> None:
    timers = CoarseTimers(resolution_s=0.02)
    loop = asyncio.get_running_loop()
    fired = loop.create_future()
    armed_at = loop.time()
    timers.call_later(0.05, lambda: fired.set_result(loop.time()))
    fired_at = await asyncio.wait_for(fired, 2)
    assert 0.05 <= fired_at - armed_at
    assert fired_at - armed_at < 0.05 + 0.02 + 0.5  # one resolution late at most, plus slack for a busy machine
    assert len(timers) == 0


async def test_cancelled_timers_do_not_fire_even_from_a_callback_of_the_same_slot() -> None:
    timers = CoarseTimers(resolution_s=0.05)
    loop = asyncio.get_running_loop()
    fired: list[str] = []
    done = loop.create_future()
    handles: dict[str, CoarseTimer] = {}

    def fire_and_cancel_the_rest(name: str) -> None:
        fired.append(name)
        for handle in handles.values():
            handle.cancel()

    # Same delay, so one slot: whichever runs first cancels the others.
    for name in ("a", "b", "c"):
        handles[name] = timers.call_later(0.01, fire_and_cancel_the_rest, name)
    timers.call_later(0.01, fired.append, "cancelled beforehand").cancel()
    timers.call_later(0.2, done.set_result, None)
    await asyncio.wait_for(done, 2)
    assert len(fired) == 1 and fired[0] in "abc"


def test_resolution_must_be_positive() -> None:
    with pytest.raises(ValueError):
        CoarseTimers(resolution_s=0)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(result_cache.time, "monotonic", fake)
    return fake


OWNER = "_INBOX"
MiB = 1 << 20


def body_of(cache: ResultCache, key: ClientKey) -> bytes | None:
    """The cached reply's bytes, or None where nothing is cached."""
    hit = cache.get(key)
    return None if hit is None else hit.body


def test_result_is_returned_until_its_ttl_then_never(clock: _Clock) -> None:
    cache = ResultCache(ttl_s=60, max_entries=10, max_bytes=MiB)
    cache.put(("c", 1), b"one", OWNER, None)
    clock.now += 59.9
    assert body_of(cache, ("c", 1)) == b"one"
    clock.now += 0.1
    assert cache.get(("c", 1)) is None


def test_expired_results_are_swept_on_a_later_put(clock: _Clock) -> None:
    cache = ResultCache(ttl_s=60, max_entries=1000, max_bytes=MiB)
    for index in range(100):
        cache.put(("c", index), b"x", OWNER, None)
    clock.now += 61
    cache.put(("c", "new"), b"y", OWNER, None)
    assert len(cache) == 1


def test_storing_again_renews_an_entry(clock: _Clock) -> None:
    cache = ResultCache(ttl_s=60, max_entries=2, max_bytes=MiB)
    cache.put(("c", 1), b"first", OWNER, None)
    clock.now += 30
    cache.put(("c", 2), b"two", OWNER, None)
    cache.put(("c", 1), b"again", OWNER, None)
    cache.put(("c", 3), b"three", OWNER, None)  # over the bound: the oldest, now 2, goes
    assert cache.get(("c", 2)) is None
    assert body_of(cache, ("c", 1)) == b"again"
    clock.now += 45
    assert body_of(cache, ("c", 1)) == b"again"


def test_cache_size_is_bounded_and_zero_disables_it(clock: _Clock) -> None:
    cache = ResultCache(ttl_s=60, max_entries=3, max_bytes=MiB)
    for index in range(10):
        cache.put(("c", index), b"x", OWNER, None)
    assert len(cache) == 3 and cache.get(("c", 9)) is not None and cache.get(("c", 6)) is None
    disabled = ResultCache(ttl_s=60, max_entries=0, max_bytes=MiB)
    disabled.put(("c", 1), b"x", OWNER, None)
    assert disabled.get(("c", 1)) is None and len(disabled) == 0


def test_cache_is_bounded_by_bytes_and_an_entry_over_the_bound_is_not_kept(clock: _Clock) -> None:
    cache = ResultCache(ttl_s=60, max_entries=1000, max_bytes=10_000, max_id_bytes=16)
    entry = 2000 + 3 * 16 + ENTRY_OVERHEAD  # the reply, and an allowance for key, owner and digest
    for index in range(10):
        cache.put(("c", index), b"x" * 2000, OWNER, b"body")
    assert len(cache) == 10_000 // entry and cache.bytes == len(cache) * entry
    assert cache.get(("c", 9)) is not None and cache.get(("c", 5)) is None
    cache.put(("c", "huge"), b"x" * 20_000, OWNER, None)
    assert cache.get(("c", "huge")) is None and len(cache) == 10_000 // entry
    cache.put(("c", 9), b"x" * 20_000, OWNER, None)  # a newer result too big to keep: the older one goes too
    assert cache.get(("c", 9)) is None and cache.bytes == len(cache) * entry


def test_expired_results_are_swept_by_time_without_a_put(clock: _Clock) -> None:
    cache = ResultCache(ttl_s=60, max_entries=1000, max_bytes=MiB)
    for index in range(100):
        cache.put(("c", index), b"x" * 100, OWNER, b"body")
    clock.now += 61
    cache.sweep()
    assert len(cache) == 0 and cache.bytes == 0
