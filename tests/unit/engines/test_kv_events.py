"""KV events of the engine runtime on a recording bus, without NATS: the published set and its
numbering (engines/kv_prefixes.py), the job that publishes after each step and answers
``kv_snapshot`` (engines/runtime_kv.py), the step loop calling it, registration and heartbeats
carrying ``kv_sequence``, and the echo backend's simulated prefix cache (engines/echo_cache.py)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from engines.backend import CacheChanges, PromptPrefix
from engines.echo import EchoBackend
from engines.echo_cache import SimulatedPrefixCache
from engines.kv_prefixes import PublishedPrefixes
from engines.runtime_intake import RequestIntake
from engines.runtime_kv import KvPublisher
from engines.runtime_membership import Membership
from engines.runtime_steps import StepLoop
from service.bus.registry import Incoming
from service.protocol.codec import Encoding, encode_msgpack
from service.protocol.kv_events import HeldPrefix, KvEvents, KvSnapshot
from service.protocol.membership import EngineRegister, Heartbeat, RegisterAck
from service.protocol.messages import Empty
from service.protocol.prefix import prompt_prefixes
from service.protocol.routed import RoutedRequestBatch
from service.protocol.subjects import Header
from tests.unit.engines.wiring import ENGINE_ID, Floor, build

PROMPT = list(range(100, 164))  # 64 tokens: prefixes of 1, 2 and 4 blocks


def events(floor: Floor) -> list[KvEvents]:
    subject = floor.core.subjects.sent_by(Header.KV_EVENTS, ENGINE_ID)
    return [sent.decode(KvEvents) for sent in floor.bus.on(subject)]


def held(prompt: list[int] | str) -> list[HeldPrefix]:
    return [HeldPrefix(prefix_hash, blocks) for prefix_hash, blocks in prompt_prefixes(prompt)]


async def start(floor: Floor, prompt: list[int] | str, max_tokens: int = 2) -> None:
    """Route a request here through the intake, which gives the backend the prompt's prefixes."""
    routed = floor.routed(max_tokens=max_tokens)
    body = msgspec.json.encode({"prompt": prompt, "sampling_params": {"max_tokens": max_tokens}})
    routed = msgspec.structs.replace(routed, body=body)
    await RequestIntake(floor.core, floor.requests, floor.control).start_batch(
        Incoming(Header.SUBMIT_REQUEST, None, Encoding.MSGPACK, b""), RoutedRequestBatch([routed])
    )


# ------------------------------------------------------------ the published set


def test_events_are_numbered_from_one_and_only_when_something_changed() -> None:
    published = PublishedPrefixes(ENGINE_ID)
    assert published.events(CacheChanges([], [], 0)) is None and published.sequence == 0
    first = published.events(CacheChanges([(1, 1), (2, 2)], [], 32))
    assert first == KvEvents(ENGINE_ID, 1, [HeldPrefix(1, 1), HeldPrefix(2, 2)], [], 32)
    assert published.events(CacheChanges([], [], 32)) is None  # nothing new
    second = published.events(CacheChanges([], [], 0))  # only the queued tokens changed
    assert second is not None and (second.sequence, second.stored, second.evicted) == (2, [], [])
    third = published.events(CacheChanges([(1, 1), (3, 4)], [2, 9], 0))  # 1 held already, 9 never was
    assert third == KvEvents(ENGINE_ID, 3, [HeldPrefix(3, 4)], [2], 0)
    assert published.sequence == 3 and len(published) == 2


def test_a_prefix_evicted_and_stored_again_in_one_step_is_held_and_stored_last() -> None:
    published = PublishedPrefixes(ENGINE_ID)
    published.events(CacheChanges([(1, 1), (2, 2)], [], 0))
    again = published.events(CacheChanges([(1, 1)], [1], 0))
    assert again is not None and (again.evicted, again.stored) == ([1], [HeldPrefix(1, 1)])
    assert published.snapshot(10).held == [HeldPrefix(2, 2), HeldPrefix(1, 1)]  # least recently stored first


def test_a_snapshot_is_the_state_after_the_published_events_leaving_out_the_oldest() -> None:
    published = PublishedPrefixes(ENGINE_ID)
    published.events(CacheChanges([(index, 1) for index in range(10)], [], 5))
    published.events(CacheChanges([], [3], 5))
    snapshot = published.snapshot(4)
    assert snapshot == KvSnapshot(ENGINE_ID, 2, [HeldPrefix(index, 1) for index in range(6, 10)], 5)
    assert len(published.snapshot(100).held) == 9


# ------------------------------------------------------------ the job, on the echo backend


async def test_the_first_step_of_a_prompt_stores_its_prefixes_once_and_queued_tokens_follow() -> None:
    floor = build()
    job = KvPublisher(floor.core, PublishedPrefixes(ENGINE_ID))
    await start(floor, PROMPT)
    await start(floor, PROMPT)
    await job.publish()  # nothing stepped yet: both prompts wait, none served by the cache
    await floor.backend.step()
    await job.publish()  # both prefilled: the prefixes are held, nothing waits
    await floor.backend.step()
    await job.publish()  # nothing changed: no message
    assert events(floor) == [
        KvEvents(ENGINE_ID, 1, [], [], 2 * len(PROMPT)),
        KvEvents(ENGINE_ID, 2, held(PROMPT), [], 0),
    ]
    await start(floor, [*PROMPT, *range(16)])  # 5 blocks, the first 4 of them held
    await job.publish()
    assert events(floor)[-1] == KvEvents(ENGINE_ID, 3, [], [], 16)


async def test_text_prompts_are_hashed_as_submitted_and_the_cache_keeps_the_last_prompts() -> None:
    backend = EchoBackend(cached_prompts=2)
    floor = build(backend)
    job = KvPublisher(floor.core, PublishedPrefixes(ENGINE_ID))
    texts = ["a" * 64, "b" * 128, "c" * 64]
    for text in texts:
        await start(floor, text, max_tokens=1)
        await backend.step()
        await job.publish()
    stored = [event.stored for event in events(floor)]
    assert stored == [held(text) for text in texts]
    assert events(floor)[-1].evicted == [prefix.prefix_hash for prefix in held(texts[0])]  # the oldest left


async def test_kv_snapshot_answers_what_the_published_events_hold() -> None:
    floor = build()
    published = PublishedPrefixes(ENGINE_ID)
    job = KvPublisher(floor.core, published)
    await start(floor, PROMPT)
    await floor.backend.step()
    await job.publish()
    await start(floor, list(range(16)))  # not stepped: not in the snapshot, but queued
    await job.publish()
    await job.snapshot(Incoming("kv_snapshot", "_INBOX.c1.1", Encoding.MSGPACK, encode_msgpack(Empty())), Empty())
    [answer] = floor.bus.on("_INBOX.c1.1")
    assert answer.decode(KvSnapshot) == KvSnapshot(ENGINE_ID, 2, held(PROMPT), 16)


async def test_a_snapshot_stays_under_max_payload() -> None:
    floor = build(max_payload=2048)
    published = PublishedPrefixes(ENGINE_ID)
    published.events(CacheChanges([(2**64 - 1 - index, 2**20) for index in range(500)], [], 0))
    await KvPublisher(floor.core, published).snapshot(Incoming("kv_snapshot", "r", Encoding.MSGPACK, b""), Empty())
    [answer] = floor.bus.on("r")
    assert len(answer.body) <= 2048 and answer.decode(KvSnapshot).held[-1] == HeldPrefix(2**64 - 500, 2**20)


async def test_nothing_is_asked_of_the_backend_while_disconnected_so_no_change_is_lost() -> None:
    floor = build()
    job = KvPublisher(floor.core, PublishedPrefixes(ENGINE_ID))
    await start(floor, PROMPT)
    await floor.backend.step()
    floor.core.connected.clear()
    await job.publish()
    floor.core.connected.set()
    await job.publish()
    assert [event.stored for event in events(floor)] == [held(PROMPT)]


async def test_a_failed_publish_is_counted_and_its_number_used() -> None:
    floor = build()
    published = PublishedPrefixes(ENGINE_ID)
    job = KvPublisher(floor.core, published)
    floor.bus.refusals[floor.core.subjects.sent_by(Header.KV_EVENTS, ENGINE_ID)] = OSError("gone")
    await start(floor, PROMPT)
    await job.publish()
    assert floor.core.counters["kv_events_failed"] == 1 and published.sequence == 1 and events(floor) == []


async def test_the_step_loop_publishes_after_each_step_and_when_it_goes_idle() -> None:
    floor = build()
    calls: list[int] = []

    async def after_step() -> None:
        calls.append(steps.steps)

    steps = StepLoop(floor.core, floor.requests, floor.control, floor.weights, after_step)
    await start(floor, PROMPT, max_tokens=2)
    await steps.step_once()
    await steps.step_once()
    await steps.step_once()  # no work left: idle
    assert calls == [1, 2, 2]


# ------------------------------------------------------------ membership


async def test_registration_and_heartbeats_carry_the_number_read_as_each_is_sent() -> None:
    floor = build()
    subject = floor.core.subjects.sent_by(Header.REGISTER, ENGINE_ID)
    floor.bus.responders[subject] = lambda _: [encode_msgpack(RegisterAck("c1", "running", None))]
    published = PublishedPrefixes(ENGINE_ID)
    job = Membership(
        floor.core,
        floor.requests,
        floor.control,
        floor.weights,
        "m",
        lambda: 0,
        kv_sequence=lambda: published.sequence,
    )
    await asyncio.wait_for(job.register(), 5)
    published.events(CacheChanges([(1, 1)], [], 0))
    task = asyncio.ensure_future(job.heartbeat_once())
    await asyncio.sleep(0)
    task.cancel()
    [register] = [sent.decode(EngineRegister) for sent in floor.bus.on(subject)]
    [beat] = [sent.decode(Heartbeat) for sent in floor.bus.on(floor.core.subjects.sent_by(Header.HEARTBEAT, ENGINE_ID))]
    assert (register.kv_sequence, beat.kv_sequence) == (0, 1)


# ------------------------------------------------------------ the simulated cache


def prefixes(*hashes: int) -> list[PromptPrefix]:
    return [PromptPrefix(prefix_hash, 1 << index, 16 << index) for index, prefix_hash in enumerate(hashes)]


def test_prompts_sharing_a_prefix_keep_it_until_the_last_of_them_leaves() -> None:
    cache = SimulatedPrefixCache(2)
    cache.prefilled(prefixes(1, 2))
    cache.prefilled(prefixes(1, 3))
    assert cache.drain() == ([(1, 1), (2, 2), (3, 2)], [])
    cache.prefilled(prefixes(4))  # the prompt [1, 2] leaves; 1 stays with [1, 3]
    assert cache.drain() == ([(4, 1)], [2])
    cache.prefilled(prefixes(1, 3))  # used again: the most recent
    cache.prefilled(prefixes(5))  # [4] leaves
    assert cache.drain() == ([(5, 1)], [4])
    assert cache.served_tokens(prefixes(1, 3, 9), 100) == 32 and cache.served_tokens(prefixes(7), 100) == 0
    assert cache.served_tokens([PromptPrefix(1, 1, None)], 70) == 70  # a text prompt: the whole of it


def test_a_prefix_that_came_and_went_between_drains_is_not_reported() -> None:
    cache = SimulatedPrefixCache(1)
    cache.prefilled(prefixes(1))
    cache.prefilled(prefixes(2))
    assert cache.drain() == ([(2, 1)], [])
    cache.prefilled(prefixes(1))
    cache.prefilled(prefixes(2))
    assert cache.drain() == ([], [])


def test_an_echo_backend_without_a_cache_publishes_nothing() -> None:
    backend = EchoBackend(cached_prompts=0)
    assert not backend.publishes_kv_events
    with pytest.raises(NotImplementedError):
        backend.cache_changes()
