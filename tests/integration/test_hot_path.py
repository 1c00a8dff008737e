"""The coordinator's fast paths: the client library's envelope (routed without decoding the
body), routed requests batched per engine, replies batched per client, and the wire decoder
that tells envelopes from plain bodies. Plain JSON and msgpack bodies are covered by test_submit.py and friends."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgpack
import msgspec
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from benchmarks.doc_engines import DocEngineFleet
from handlers import HANDLERS
from service.bus.connection import flush_subscriptions
from service.coordinator.coordinator import Coordinator
from service.coordinator.metrics import CoordinatorCollector
from service.protocol.codec import Encoding, PayloadDecoder, encode_msgpack
from service.protocol.errors import WireError
from service.protocol.messages import SamplingParams, SubmitEnvelope, SubmitRequest
from service.protocol.reply_batches import BATCH_TOKEN, batch_decoder
from service.protocol.routed import RoutedRequestBatch
from tests.conftest import EngineFactory, make_settings
from tests.helpers import request_stream


def submit_subject(coordinator: Coordinator) -> str:
    return coordinator.subjects.coordinator("submit_request")


def envelope(body: bytes, **fields: object) -> bytes:
    return encode_msgpack(SubmitEnvelope(1, body, **fields))  # type: ignore[arg-type]


def inner(prompt: object, max_tokens: int = 3, **fields: object) -> bytes:
    return msgpack.packb({"prompt": prompt, "sampling_params": {"max_tokens": max_tokens}, **fields})


async def test_envelope_is_routed_and_answered_in_msgpack(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    [engine] = await start_engines(1)
    body = envelope(inner([7, 8]), client_request_id="e-1", client_id="lib")
    msg = await nc.request(submit_subject(coordinator), body, timeout=5)
    reply = msgpack.unpackb(msg.data)
    assert (reply["type"], reply["client_request_id"], reply["engine_id"]) == ("final", "e-1", engine.engine_id)
    assert reply["generated_tokens"] == [7, 8, 7]


async def test_streamed_envelope_ends_with_final_then_empty(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    await start_engines(1)
    body = envelope(inner("abcd", max_tokens=4, stream=True), stream=True, client_request_id=3)
    messages = await request_stream(nc, submit_subject(coordinator), body)
    replies = [msgpack.unpackb(m.data) for m in messages[:-1]]
    assert [r["type"] for r in replies] == ["partial"] * 4 + ["final"]
    assert "".join(r["text"] for r in replies[:-1]) == "abcd"
    assert messages[-1].data == b""


async def test_envelope_body_is_validated_by_the_engine(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    """The coordinator does not decode an envelope's body: a bad prompt is refused by the
    engine, whose error (unlike a coordinator refusal) carries the request_id it was routed under."""
    await start_engines(1)
    body = envelope(msgpack.packb({"prompt": {"not": "a prompt"}}), client_request_id="bad-1")
    reply = msgpack.unpackb((await nc.request(submit_subject(coordinator), body, timeout=5)).data)
    assert reply["type"] == "error" and reply["error"]["code"] == 400
    assert reply["client_request_id"] == "bad-1"
    assert reply["request_id"].startswith(coordinator.id)
    assert coordinator.counters["submitted"] == 1


@pytest.mark.parametrize(
    "bad",
    [
        msgpack.packb([2, b"{}", False, "bad-2"]),  # unknown envelope version
        msgpack.packb([1, "not bytes", False, "bad-2"]),
        msgpack.packb([1]),
    ],
)
async def test_malformed_envelope_gets_400_from_the_coordinator(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS, bad: bytes
) -> None:
    await start_engines(1)
    reply = msgpack.unpackb((await nc.request(submit_subject(coordinator), bad, timeout=5)).data)
    assert reply["type"] == "error" and reply["error"]["code"] == 400
    assert "request_id" not in reply
    if len(msgpack.unpackb(bad)) >= 4:
        assert reply["client_request_id"] == "bad-2"


async def test_envelope_reply_to_and_stream_are_honoured_on_refusal(coordinator: Coordinator, nc: NATS) -> None:
    """No engine (once the start-up grace is over): 503 goes to the envelope's reply_to,
    followed by the stream's empty message."""
    sub = await nc.subscribe("_INBOX.results.envelope")
    await nc.flush()
    await nc.publish(
        submit_subject(coordinator),
        envelope(inner("x"), stream=True, client_request_id=5, reply_to="_INBOX.results.envelope"),
    )
    error, empty = await sub.next_msg(timeout=5), await sub.next_msg(timeout=5)
    assert msgpack.unpackb(error.data)["error"]["code"] == 503
    assert empty.data == b""


async def test_requests_arriving_together_reach_the_engine_in_few_messages(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    [engine] = await start_engines(1)
    routed: list[int] = []

    async def spy(msg: Msg) -> None:
        routed.append(len(msgspec.msgpack.decode(msg.data, type=RoutedRequestBatch).requests))

    await nc.subscribe(coordinator.subjects.engine(engine.engine_id, "submit_request"), cb=spy)
    await flush_subscriptions(nc)
    count = 64
    inbox = nc.new_inbox()
    sub = await nc.subscribe(f"{inbox}.*")
    for index in range(count):  # one flush: they reach the coordinator in one or a few reads
        await nc.publish(submit_subject(coordinator), inner([index + 1], max_tokens=1), reply=f"{inbox}.{index}")
    finals = [msgpack.unpackb((await sub.next_msg(timeout=10)).data) for _ in range(count)]
    assert sorted(reply["generated_tokens"][0] for reply in finals) == list(range(1, count + 1))
    assert sum(routed) == count
    assert len(routed) < count / 4, f"{count} requests took {len(routed)} routed messages"


@pytest.mark.parametrize("slack", [0, 8])
async def test_batching_survives_a_large_fleet(nats_url: str, nc: NATS, slack: int) -> None:
    """64 requests arriving together over 50 idle engines: with a load slack they reach the
    engines in a few messages instead of one per engine, and /metrics says how many."""
    settings = make_settings(nats_url, routing_load_slack=slack)
    async with Coordinator(settings, HANDLERS) as coordinator:
        fleet = DocEngineFleet(nc, settings.subject_prefix, [f"doc-{index}" for index in range(50)])
        await fleet.start()
        await fleet.register()
        routed: list[int] = []

        async def spy(msg: Msg) -> None:
            routed.append(len(msgspec.msgpack.decode(msg.data, type=RoutedRequestBatch).requests))

        await nc.subscribe(coordinator.subjects.engine("*", "submit_request"), cb=spy)
        await flush_subscriptions(nc)
        count = 64
        inbox = nc.new_inbox()
        sub = await nc.subscribe(f"{inbox}.*")
        for index in range(count):  # one flush: they reach the coordinator in one or a few reads
            await nc.publish(submit_subject(coordinator), inner([index + 1], max_tokens=1), reply=f"{inbox}.{index}")
        finals = [msgpack.unpackb((await sub.next_msg(timeout=10)).data) for _ in range(count)]
        assert all(final["type"] == "final" for final in finals)
        assert sum(routed) == count
        if slack:
            assert len(routed) < count / 4, f"{count} requests took {len(routed)} routed messages"
            assert max(routed) <= slack + 1
        else:
            assert len(routed) >= 50
        families = {family.name: family for family in CoordinatorCollector(coordinator).collect()}
        assert families["dpcoord_routed_messages"].samples[0].value == len(routed)
        assert families["dpcoord_routed_requests"].samples[0].value == count
        assert families["dpcoord_requests_per_routed_message"].samples[0].value == pytest.approx(count / len(routed))
        await fleet.leave()


async def test_large_requests_are_split_across_routed_messages(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    [engine] = await start_engines(1)
    sizes: list[int] = []

    async def spy(msg: Msg) -> None:
        sizes.append(len(msg.data))

    await nc.subscribe(coordinator.subjects.engine(engine.engine_id, "submit_request"), cb=spy)
    prompt = "p" * (nc.max_payload // 3)
    results = await asyncio.gather(
        *(
            nc.request(
                submit_subject(coordinator),
                json.dumps({"prompt": prompt, "sampling_params": {"max_tokens": 1}}).encode(),
                timeout=10,
            )
            for _ in range(5)
        )
    )
    assert all(json.loads(msg.data)["type"] == "final" for msg in results)
    assert len(sizes) >= 3 and max(sizes) <= nc.max_payload


async def test_request_that_cannot_fit_once_routed_gets_413(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    await start_engines(1)
    prefix, suffix = b'{"prompt": "', b'"}'
    body = prefix + b"x" * (nc.max_payload - len(prefix) - len(suffix) - 8) + suffix
    reply = json.loads((await nc.request(submit_subject(coordinator), body, timeout=10)).data)
    assert reply["type"] == "error" and reply["error"]["code"] == 413
    assert "once routed" in reply["error"]["message"]


# ---------------------------------------------------------------- the decoder that tells them apart

_decoder = PayloadDecoder(SubmitRequest | SubmitEnvelope)


def test_decoder_tells_envelopes_from_plain_bodies() -> None:
    plain = encode_msgpack(SubmitRequest([1, 2], SamplingParams(max_tokens=2)))
    assert isinstance(_decoder.decode(plain, Encoding.MSGPACK), SubmitRequest)
    assert isinstance(_decoder.decode(b'{"prompt": "hi"}', Encoding.JSON), SubmitRequest)
    wrapped = _decoder.decode(envelope(plain, stream=True, client_request_id=4, timeout_s=2.5), Encoding.MSGPACK)
    assert wrapped == SubmitEnvelope(1, plain, True, 4, None, None, 2.5)


def test_envelope_ignores_trailing_fields_of_newer_clients() -> None:
    """Elements past the last this release knows are ignored, whatever the envelope's length."""

    def with_future_fields(envelope: SubmitEnvelope) -> bytes:
        return msgpack.packb([*msgpack.unpackb(encode_msgpack(envelope)), "future", 42])

    plain = SubmitEnvelope(1, b"{}", True, 9, "c")
    assert _decoder.decode(with_future_fields(plain), Encoding.MSGPACK) == plain
    with_model = SubmitEnvelope(
        1, b"{}", True, 9, "c", model="m", prefix_hashes=[7], resubmission=True, batched_replies=True, logprobs=True,
        session_id="s", group_id="g", held_notices=True,
    )  # fmt: skip
    assert _decoder.decode(with_future_fields(with_model), Encoding.MSGPACK) == with_model


def test_envelope_carries_at_most_16_prefix_hashes() -> None:
    fields = [1, b"{}", False, 1, None, None, None, None]
    assert _decoder.decode(msgpack.packb([*fields, list(range(16))]), Encoding.MSGPACK).prefix_hashes == list(range(16))
    with pytest.raises(WireError) as caught:
        _decoder.decode(msgpack.packb([*fields, list(range(17))]), Encoding.MSGPACK)
    assert caught.value.code == 400 and "length <= 16 - at `$[8]`" in caught.value.message


def test_envelope_reply_to_must_be_a_publishable_subject() -> None:
    with pytest.raises(WireError) as caught:
        _decoder.decode(msgpack.packb([1, b"{}", False, 1, None, "results.>"]), Encoding.MSGPACK)
    assert caught.value.code == 400


def test_json_array_is_not_an_envelope() -> None:
    with pytest.raises(WireError) as caught:
        _decoder.decode(b'[1, "{}"]', Encoding.MSGPACK)
    assert caught.value.code == 400


def test_decoder_rejects_unions_it_cannot_tell_apart() -> None:
    with pytest.raises(TypeError):
        PayloadDecoder(SubmitRequest | SamplingParams)


async def test_a_client_that_reads_reply_batches_gets_every_stream_exact_in_fewer_messages(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    await start_engines(1)
    count, tokens = 32, 8
    inbox = nc.new_inbox()
    sub = await nc.subscribe(f"{inbox}.*")
    for index in range(count):  # published together: the engine steps them together
        body = envelope(inner([index + 1] * 2, max_tokens=tokens, stream=True), stream=True, batched_replies=True)
        await nc.publish(submit_subject(coordinator), body, reply=f"{inbox}.{index}")
    replies: dict[str, list[bytes]] = {str(index): [] for index in range(count)}
    messages = batches = 0
    while any(not got or got[-1] != b"" for got in replies.values()):
        msg = await sub.next_msg(timeout=10)
        messages += 1
        token = msg.subject.rpartition(".")[2]
        if token == BATCH_TOKEN:
            batches += 1
            for pair_token, body in batch_decoder.decode(msg.data):
                replies[pair_token.decode()].append(body)
        else:
            replies[token].append(msg.data)
    for key, got in replies.items():
        decoded: list[Any] = [msgpack.unpackb(body) if body else None for body in got]
        *partials, final, end = decoded
        assert end is None and final["type"] == "final" and final["generated_tokens"] == [int(key) + 1] * tokens
        assert [token for partial in partials for token in partial["new_tokens"]] == final["generated_tokens"]
    total = sum(len(got) for got in replies.values())
    assert batches > 0 and messages < total / 4, f"{total} replies took {messages} messages ({batches} batches)"
