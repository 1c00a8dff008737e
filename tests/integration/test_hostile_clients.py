"""Clients that are careless or hostile, on a plain nats-server: ownership of requests, where
replies may go, and bounded bytes, capacity and fairness. Each test reproduces one finding of
the probe (issue 11); the same under the example NATS config is in test_security_*.py.

On a plain server every connection may pick any inbox prefix, so the tests give each client its
own (``_INBOX_alice``, ``_INBOX_mallory``), as per-user NATS permissions would force them to.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import nats
import pytest
from nats.aio.client import Client as NATS

from engines.echo import EchoBackend
from engines.runtime import EngineRuntime
from handlers import HANDLERS
from service.coordinator.coordinator import Coordinator
from service.ops.settings import Settings
from service.protocol.codec import encode_msgpack
from service.protocol.messages import SubmitEnvelope
from service.protocol.routed import ReturnPath, RoutedRequest, RoutedRequestBatch
from tests.conftest import EngineFactory, make_settings
from tests.helpers import decode_reply, request, request_json


@pytest.fixture
async def alice(nats_url: str) -> AsyncIterator[NATS]:
    nc = await nats.connect(nats_url, inbox_prefix="_INBOX_alice")
    yield nc
    await nc.close()


@pytest.fixture
async def mallory(nats_url: str) -> AsyncIterator[NATS]:
    nc = await nats.connect(nats_url, inbox_prefix="_INBOX_mallory")
    yield nc
    await nc.close()


def submit(coordinator: Coordinator) -> str:
    return coordinator.subjects.coordinator("submit_request")


def body(prompt: str = "mine", max_tokens: int = 6, **fields: Any) -> bytes:
    return json.dumps({"prompt": prompt, "sampling_params": {"max_tokens": max_tokens}, **fields}).encode()


async def read_stream(sub: Any, timeout: float = 10) -> list[dict[str, Any]]:
    replies = []
    while (msg := await sub.next_msg(timeout=timeout)).data:
        replies.append(decode_reply(msg.data))
    return replies


# ------------------------------------------------------------ finding 5: ownership


async def test_resubmission_from_another_owner_is_refused_and_the_stream_stays(
    coordinator: Coordinator, start_engines: EngineFactory, alice: NATS, mallory: NATS
) -> None:
    """Resubmitting another client's (client_id, client_request_id) with stream moved the rest
    of its stream to the attacker, or replayed its cached result."""
    await start_engines(1, token_delay_ms=30)
    named = body("secret", 10, stream=True, client_id="alice", client_request_id="r1")
    inbox = alice.new_inbox()
    stream = await alice.subscribe(inbox)
    await alice.publish(submit(coordinator), named, reply=inbox)
    assert decode_reply((await stream.next_msg(timeout=5)).data)["type"] == "partial"
    stolen = await request(mallory, submit(coordinator), named)
    assert stolen["type"] == "error" and stolen["error"]["code"] == 403
    replies = await read_stream(stream)
    assert replies[-1]["type"] == "final" and replies[-1]["generated_text"] == "secretsecr"
    replayed = await request(mallory, submit(coordinator), named)  # the result is cached now
    assert replayed["type"] == "error" and replayed["error"]["code"] == 403
    mine_again = await request(alice, submit(coordinator), named)
    assert mine_again["type"] == "final" and mine_again["generated_text"] == "secretsecr"  # the owner still gets it


async def test_resubmission_with_another_body_is_409(
    coordinator: Coordinator, start_engines: EngineFactory, alice: NATS
) -> None:
    await start_engines(1)
    first = await request(alice, submit(coordinator), body("one", client_id="alice", client_request_id=7))
    assert first["generated_text"] == "oneone"
    reused = await request(alice, submit(coordinator), body("two", client_id="alice", client_request_id=7))
    assert reused["type"] == "error" and reused["error"]["code"] == 409
    again = await request(alice, submit(coordinator), body("one", client_id="alice", client_request_id=7))
    assert again == first  # the same submission is answered from the cache, never run twice


async def test_abort_from_another_owner_is_refused(
    coordinator: Coordinator, start_engines: EngineFactory, alice: NATS, mallory: NATS
) -> None:
    await start_engines(1, token_delay_ms=30)
    inbox = alice.new_inbox()
    sub = await alice.subscribe(inbox)
    await alice.publish(
        submit(coordinator), body("long", 20, stream=True, client_id="alice", client_request_id="r2"), reply=inbox
    )
    first = decode_reply((await sub.next_msg(timeout=5)).data)
    abort = coordinator.subjects.coordinator("abort_request")
    by_id = await request_json(mallory, abort, {"request_id": first["request_id"]})
    by_key = await request_json(mallory, abort, {"client_id": "alice", "client_request_id": "r2"})
    assert by_id["error"]["code"] == 403 and by_key["error"]["code"] == 403
    await mallory.publish(abort, json.dumps({"request_id": first["request_id"]}).encode())  # no reply subject: no owner
    await mallory.flush()
    replies = await read_stream(sub)
    assert replies[-1]["finish_reason"] == "length"
    await alice.publish(submit(coordinator), body("again", 200, client_id="alice", client_request_id="r3"), reply=inbox)
    ack = await request_json(alice, abort, {"client_id": "alice", "client_request_id": "r3"})
    assert ack["type"] == "ack"  # the owner may


async def test_shutdown_is_honoured_only_from_a_client_that_connected(
    coordinator: Coordinator, alice: NATS, mallory: NATS
) -> None:
    shutdown = coordinator.subjects.coordinator("shutdown")
    assert (await request_json(mallory, shutdown, {}))["error"]["code"] == 403
    assert (await request_json(alice, coordinator.subjects.coordinator("connect"), {}))["type"] == "connect_ack"
    assert (await request_json(mallory, shutdown, {}))["error"]["code"] == 403  # alice connected, not mallory
    assert (await request_json(alice, shutdown, {}))["signal"] == "shutdown"


# ------------------------------------------------------------ finding 6: reply_to


@pytest.mark.parametrize(
    "reply_to", ["billing.charge", "dpcoord.status.coordinator.c1", "_INBOX_admin.acks", "_INBOXevil.x", "_INBOX"]
)
async def test_reply_to_is_an_inbox_and_the_senders_own(
    coordinator: Coordinator, start_engines: EngineFactory, alice: NATS, nc: NATS, reply_to: str
) -> None:
    """The coordinator published a client's text onto subjects it chose: another user's inbox,
    billing.charge, dpcoord.status.*. A confused deputy."""
    await start_engines(1)
    victim = await nc.subscribe(reply_to)
    refused = await request(alice, submit(coordinator), body("x", reply_to=reply_to))
    assert refused["type"] == "error" and refused["error"]["code"] == 400 and reply_to in refused["error"]["message"]
    await request(alice, submit(coordinator), body("barrier"))
    assert victim.pending_msgs == 0


async def test_reply_subjects_outside_inboxes_are_dropped(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    await start_engines(1)
    elsewhere = await nc.subscribe("billing.charge")
    await nc.publish(submit(coordinator), body("x"), reply="billing.charge")
    await nc.publish(coordinator.subjects.coordinator("connect"), b"{}", reply="billing.charge")
    assert (await request(nc, submit(coordinator), body("barrier")))["type"] == "final"
    assert elsewhere.pending_msgs == 0 and coordinator.counters["unsafe_reply_subject"] == 2
    own = await nc.subscribe("_INBOX.mine")  # a reply_to under the sender's prefix, with no NATS reply: nats pub
    await nc.publish(submit(coordinator), body("mine", reply_to="_INBOX.mine"))
    assert decode_reply((await own.next_msg(timeout=5)).data)["generated_text"] == "minemi"


# ------------------------------------------------------------ finding 7: bytes


@pytest.mark.parametrize("field", ["client_request_id", "client_id", "reply_to"])
async def test_oversized_ids_are_refused_naming_the_cap(coordinator: Coordinator, nc: NATS, field: str) -> None:
    value = "_INBOX." + "x" * 300_000 if field == "reply_to" else "x" * 300_000
    fields: dict[str, Any] = {field: value, "client_id": "c"} if field != "client_id" else {field: value}
    refused = await request(nc, submit(coordinator), body(**fields))
    assert refused["error"]["code"] == 400 and "max_id_bytes (256)" in refused["error"]["message"]
    multibyte = "\u00e9" * 200  # 200 characters, 400 bytes
    refused = await request(nc, submit(coordinator), body(client_id="c", client_request_id=multibyte))
    assert refused["error"]["code"] == 400


async def test_engine_reply_batches_count_every_byte(nats_url: str, nc: NATS) -> None:
    """Reply sizes counted characters, not bytes, and not the whole return path: a batch went
    over max_payload and every reply in it was lost, its neighbours' included."""
    settings = make_settings(nats_url)
    async with EngineRuntime(settings, EchoBackend()) as engine:
        prefix = settings.subject_prefix
        replies = await nc.subscribe(f"{prefix}.engine_reply.>")
        plain = await nc.subscribe(f"{prefix}.engine_reply")
        await nc.flush()
        wide = "\U0001f642" * 60_000  # 60,000 characters, 240,000 bytes in UTF-8
        routed = [
            RoutedRequest(
                ReturnPath(f"wide-{index}", "c0", "_INBOX.x", "json", False, wide),
                b'{"prompt": "a", "sampling_params": {"max_tokens": 1}}',
            )
            for index in range(3)
        ]
        routed.append(
            RoutedRequest(
                ReturnPath("neighbour", "c0", "_INBOX.y", "json", False, "n"),
                b'{"prompt": "b", "sampling_params": {"max_tokens": 1}}',
            )
        )
        await nc.publish(
            engine.subjects.engine(engine.engine_id, "submit_request"), encode_msgpack(RoutedRequestBatch(routed))
        )
        seen: set[str] = set()

        async def collect() -> None:
            while "neighbour" not in seen or len(seen) < 4:
                for sub in (replies, plain):
                    try:
                        msg = await sub.next_msg(timeout=0.05)
                    except nats.errors.TimeoutError:
                        continue
                    seen.update(reply[0][0] for reply in msgpack.unpackb(msg.data)["replies"])

        await asyncio.wait_for(collect(), 10)
        assert engine.counters["replies_lost"] == 0


async def test_results_are_bounded_by_bytes_and_swept_by_time(nats_url: str, nc: NATS) -> None:
    settings = make_settings(nats_url, result_cache_bytes=100_000, result_ttl_s=0.5)
    async with Coordinator(settings, HANDLERS) as coordinator, EngineRuntime(settings, EchoBackend()):
        await coordinator.wait_for_engines(1)
        for index in range(20):
            long_reply = body("p", 10_000, client_id="c", client_request_id=index)  # a 10,000-character text
            final = await request(nc, submit(coordinator), long_reply)
            assert final["type"] == "final"
        assert 0 < len(coordinator.results) < 20 and coordinator.results.bytes <= 100_000
        stored_at = time.monotonic()
        # The coordinator sweeps just before each heartbeat it sends: once a beat comes after the
        # results expired, they are gone, though nothing new was stored.
        beats = await nc.subscribe(coordinator.subjects.coordinator("coordinator_heartbeat"))
        while time.monotonic() - stored_at < settings.result_ttl_s + 0.1:
            await beats.next_msg(timeout=5)
        await beats.next_msg(timeout=5)
        assert len(coordinator.results) == 0 and coordinator.results.bytes == 0


# ------------------------------------------------------------ finding 8: capacity and fairness


@pytest.mark.parametrize(
    ("sampling", "complaint"),
    [
        ({"timeout_s": 1e300}, "max_request_timeout_s"),
        ({"max_tokens": 10**12}, "max_tokens"),
    ],
)
async def test_huge_deadlines_and_token_counts_are_400(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS, sampling: dict[str, float], complaint: str
) -> None:
    await start_engines(1)
    reply = await request_json(nc, submit(coordinator), {"prompt": "x", "sampling_params": sampling})
    assert reply["type"] == "error" and reply["error"]["code"] == 400 and complaint in reply["error"]["message"]


async def test_infinite_or_nan_deadline_is_400_not_500(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    await start_engines(1)
    for timeout_s in (math.inf, math.nan):
        plain = msgpack.packb({"prompt": "x", "sampling_params": {"timeout_s": timeout_s}})
        enveloped = encode_msgpack(SubmitEnvelope(1, msgpack.packb({"prompt": "x"}), timeout_s=timeout_s))
        for submission in (plain, enveloped):
            reply = await request(nc, submit(coordinator), submission)
            assert reply["type"] == "error" and reply["error"]["code"] == 400, (timeout_s, reply)
    assert coordinator.counters["error_500"] == 0


async def test_max_tokens_beyond_the_engine_context_is_400_from_the_engine(
    coordinator: Coordinator, settings: Settings, nc: NATS
) -> None:
    async with EngineRuntime(settings, EchoBackend(max_context=64)):
        await coordinator.wait_for_engines(1)
        inner = msgpack.packb({"prompt": "x", "sampling_params": {"max_tokens": 65}})
        too_many = await request(nc, submit(coordinator), encode_msgpack(SubmitEnvelope(1, inner)))
    assert too_many["error"]["code"] == 400 and "context of 64 tokens" in too_many["error"]["message"]


async def test_queue_is_bounded_by_bytes(nats_url: str, nc: NATS) -> None:
    settings = make_settings(nats_url, max_queued_bytes=1_000_000)
    async with Coordinator(settings, HANDLERS) as coordinator, EngineRuntime(settings, EchoBackend()):
        await coordinator.wait_for_engines(1)
        await request_json(nc, coordinator.subjects.coordinator("pause"), {})
        inbox = nc.new_inbox()
        held = await nc.subscribe(inbox)
        big = body("p" * 99_000, 1)
        for _ in range(10):
            await nc.publish(submit(coordinator), big, reply=inbox)
        refused = await request(nc, submit(coordinator), big)
        assert refused["error"]["code"] == 429 and "bytes" in refused["error"]["message"]
        assert coordinator.queued == 10
        await request_json(nc, coordinator.subjects.coordinator("unpause"), {})
        finals = [decode_reply((await held.next_msg(timeout=10)).data) for _ in range(10)]
        assert all(final["type"] == "final" for final in finals)


async def test_a_client_holds_no_more_than_its_share_while_others_wait(
    nats_url: str, alice: NATS, mallory: NATS
) -> None:
    """520 requests of one client held every engine slot; requests of others waited behind them."""
    settings = make_settings(nats_url, max_inflight_per_engine=4, max_client_share=0.5)
    async with Coordinator(settings, HANDLERS) as coordinator, EngineRuntime(settings, EchoBackend(token_delay_ms=20)):
        await coordinator.wait_for_engines(1)
        order: list[str] = []
        done = asyncio.Event()

        async def on_reply(msg: Any) -> None:
            order.append(msg.subject.split(".")[0])
            if len(order) == 22:
                done.set()

        await mallory.subscribe("_INBOX_mallory.flood", cb=on_reply)
        await alice.subscribe("_INBOX_alice.fair", cb=on_reply)
        await mallory.flush()
        await alice.flush()
        for index in range(20):
            hog = body(f"hog{index}", 5, reply_to="_INBOX_mallory.flood")
            await mallory.publish(submit(coordinator), hog, reply="_INBOX_mallory.flood")
        await mallory.flush()
        for index in range(2):
            fair = body(f"fair{index}", 5, reply_to="_INBOX_alice.fair")
            await alice.publish(submit(coordinator), fair, reply="_INBOX_alice.fair")
        await asyncio.wait_for(done.wait(), 20)
        fair_done_at = max(position for position, owner in enumerate(order) if owner == "_INBOX_alice")
        assert fair_done_at < 8, order  # served as soon as slots freed, not behind 20 floods


# ------------------------------------------------------------ finding 9: malformed input


async def test_deep_nesting_is_400_per_request_and_spares_its_batch_neighbours(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    """A body nested 10^5 deep raised RecursionError: no reply, tracebacks, and inside an envelope
    the engine dropped every request after it in the batch and it was routed again and again."""
    await start_engines(1)
    nested = b'{"prompt": "x", "junk": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    plain = await request(nc, submit(coordinator), nested)
    assert plain["error"]["code"] == 400 and "nested too deeply" in plain["error"]["message"]
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    good = msgpack.packb({"prompt": "ok", "sampling_params": {"max_tokens": 2}})
    for index, inner in enumerate([good, nested, good, good]):
        await nc.publish(
            submit(coordinator), encode_msgpack(SubmitEnvelope(1, inner, client_request_id=index)), reply=inbox
        )
    replies = {
        reply["client_request_id"]: reply
        for reply in [decode_reply((await sub.next_msg(timeout=5)).data) for _ in range(4)]
    }
    assert replies[1]["type"] == "error" and replies[1]["error"]["code"] == 400
    assert all(replies[index]["type"] == "final" for index in (0, 2, 3))
    assert coordinator.counters["error_500"] == 0 and coordinator.counters["redispatched"] == 0


@pytest.mark.parametrize(
    ("stop", "complaint"),
    [
        (["s"] * 17, "max_stop_strings (16)"),
        (["x" * 257], "max_stop_string_bytes (256)"),
        (["\u00e9" * 129], "max_stop_string_bytes"),
    ],
)
async def test_stop_strings_are_capped(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS, stop: list[str], complaint: str
) -> None:
    await start_engines(1)
    reply = await request_json(nc, submit(coordinator), {"prompt": "x", "sampling_params": {"stop": stop}})
    assert reply["error"]["code"] == 400 and complaint in reply["error"]["message"]


@pytest.mark.parametrize("field", ["prompt", "client_request_id", "seed"])
async def test_integers_beyond_64_bits_are_400_and_spare_their_neighbours(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS, field: str
) -> None:
    """A token id of 10^29 was accepted; such an integer cannot travel in msgpack at all."""
    await start_engines(1)
    huge = 10**29
    fields: dict[str, Any] = {"prompt": [huge]} if field == "prompt" else {"prompt": "x"}
    if field == "client_request_id":
        fields["client_request_id"] = huge
    if field == "seed":
        fields["sampling_params"] = {"seed": huge}
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(submit(coordinator), json.dumps(fields).encode(), reply=inbox)
    await nc.publish(submit(coordinator), body("neighbour", 2), reply=inbox)
    replies = [decode_reply((await sub.next_msg(timeout=5)).data) for _ in range(2)]
    assert sorted(reply["type"] for reply in replies) == ["error", "final"]
    [error] = [reply for reply in replies if reply["type"] == "error"]
    assert error["error"]["code"] == 400


def test_new_limits_have_sane_defaults() -> None:
    settings = Settings()
    assert settings.max_id_bytes == 256 and settings.max_request_timeout_s == 3600
    assert settings.max_stop_strings == 16 and 0 < settings.max_client_share <= 1
