"""submit_request over the public wire contract, in JSON and msgpack, the way external clients send it."""

from __future__ import annotations

import asyncio
import json

import msgpack
import pytest
from nats.aio.client import Client as NATS

from handlers import HANDLERS
from service.coordinator.coordinator import Coordinator
from service.ops.settings import Settings
from tests.conftest import EngineFactory, make_settings
from tests.helpers import decode_reply, request, request_json, request_stream


def submit_subject(coordinator: Coordinator) -> str:
    return coordinator.subjects.coordinator("submit_request")


async def test_json_submission_gets_one_json_final(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    [engine] = await start_engines(1)
    reply = await request_json(
        nc,
        submit_subject(coordinator),
        {"prompt": "hello", "sampling_params": {"max_tokens": 7}, "client_request_id": "r-1", "unknown_key": [1, 2]},
    )
    timings = reply.pop("timings")  # the engine's, in seconds (docs/protocol.md, Timings)
    assert timings["cached_prompt_tokens"] == 0 and 0 <= timings["queued_s"] <= timings["ttft_s"]
    assert timings["decode_s"] >= 0 and len(timings) == 4
    assert reply == {
        "type": "final",
        "request_id": reply["request_id"],
        "client_request_id": "r-1",
        "engine_id": engine.engine_id,
        "generated_tokens": list(b"hellohe"),
        "generated_text": "hellohe",
        "finish_reason": "length",
        "epochs": [{"epoch": None, "start": 0, "end": 7}],
        "prompt_tokens": 5,
        "weight_versions": [{"version": None, "start": 0, "end": 7}],
    }


async def test_msgpack_submission_gets_msgpack_reply(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    await start_engines(1)
    msg = await nc.request(
        submit_subject(coordinator),
        msgpack.packb({"prompt": [5, 6], "client_request_id": 9, "sampling_params": {"max_tokens": 3}}),
        timeout=5,
    )
    assert msg.data[:1] != b"{"
    reply = msgpack.unpackb(msg.data)
    assert reply["type"] == "final"
    assert reply["client_request_id"] == 9
    assert reply["generated_tokens"] == [5, 6, 5]


async def test_stop_string_finishes_with_stop(coordinator: Coordinator, start_engines: EngineFactory, nc: NATS) -> None:
    await start_engines(1)
    reply = await request_json(
        nc, submit_subject(coordinator), {"prompt": "abcdef", "sampling_params": {"stop": ["cd"]}}
    )
    assert (reply["generated_text"], reply["finish_reason"]) == ("abcd", "stop")


async def test_stream_ends_with_final_then_one_empty_message(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    await start_engines(1)
    body = json.dumps({"prompt": "héllo", "stream": True, "sampling_params": {"max_tokens": 6}}).encode()
    messages = await request_stream(nc, submit_subject(coordinator), body)
    replies = [decode_reply(msg.data) for msg in messages[:-1]]
    assert messages[-1].data == b""
    *partials, final = replies
    assert [reply["type"] for reply in partials] == ["partial"] * 6
    assert final["type"] == "final" and final["finish_reason"] == "length"
    assert "".join(reply["text"] for reply in partials) == final["generated_text"] == "héllo"
    assert [token for reply in partials for token in reply["new_tokens"]] == final["generated_tokens"]
    assert {reply["request_id"] for reply in replies} == {final["request_id"]}


async def test_stream_interval_groups_tokens(
    settings: Settings, coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    await start_engines(1, stream_interval=4)
    body = json.dumps({"prompt": "abcdefghij", "stream": True, "sampling_params": {"max_tokens": 10}}).encode()
    messages = await request_stream(nc, submit_subject(coordinator), body)
    partials = [decode_reply(msg.data) for msg in messages[:-2]]
    assert [len(partial["new_tokens"]) for partial in partials] == [4, 4, 2]


async def test_non_streamed_request_gets_exactly_one_reply(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    await start_engines(1)
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(
        submit_subject(coordinator), b'{"prompt": "xy", "sampling_params": {"max_tokens": 4}}', reply=inbox
    )
    final = decode_reply((await sub.next_msg(timeout=5)).data)
    assert final["type"] == "final"
    # A second request through the same subscription and engine: anything extra for the first
    # would have been published before this one's reply.
    await request_json(nc, submit_subject(coordinator), {"prompt": "z", "sampling_params": {"max_tokens": 4}})
    await nc.flush()
    assert sub.pending_msgs == 0


async def test_reply_to_takes_precedence_over_nats_reply(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    await start_engines(1)
    nats_inbox, reply_to = nc.new_inbox(), "_INBOX.results.client-a"
    nats_sub, reply_sub = await nc.subscribe(nats_inbox), await nc.subscribe(reply_to)
    await nc.publish(
        submit_subject(coordinator), json.dumps({"prompt": "p", "reply_to": reply_to}).encode(), reply=nats_inbox
    )
    assert decode_reply((await reply_sub.next_msg(timeout=5)).data)["type"] == "final"
    await request_json(nc, submit_subject(coordinator), {"prompt": "barrier"})
    assert nats_sub.pending_msgs == 0


async def test_nats_pub_with_reply_to_and_nats_sub(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    """`nats sub _INBOX.results` in one terminal, `nats pub dpcoord.submit_request '{...reply_to...}'` in another."""
    await start_engines(1)
    sub = await nc.subscribe("_INBOX.results.manual")
    await nc.publish(
        submit_subject(coordinator), b'{"prompt": "hi", "stream": true, "reply_to": "_INBOX.results.manual"}'
    )
    replies = []
    while (msg := await sub.next_msg(timeout=5)).data:
        replies.append(decode_reply(msg.data))
    assert replies[-1]["type"] == "final" and replies[-1]["generated_text"] == "hi" * 8


async def test_submission_without_reply_subject_is_counted_not_run(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    [engine] = await start_engines(1)
    await nc.publish(submit_subject(coordinator), b'{"prompt": "lost"}')
    await request_json(nc, submit_subject(coordinator), {"prompt": "barrier"})  # same subscription, so handled after
    assert coordinator.counters["submit_without_reply"] == 1
    assert coordinator.counters["submitted"] == 1


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b'{"prompt": 42}', 400),
        (b'{"sampling_params": {}}', 400),
        (b"{truncated", 400),
        (msgpack.packb({"prompt": "x", "stream": "no"}), 400),
        (msgpack.packb(["not", "a", "map"]), 400),
        (b"\xc1\xff\x00", 400),
    ],
)
async def test_malformed_submissions_get_400_and_service_continues(
    body: bytes, code: int, coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    await start_engines(1)
    reply = await request(nc, submit_subject(coordinator), body)
    assert reply["type"] == "error" and reply["error"]["code"] == code and reply["error"]["message"]
    assert coordinator.counters[f"error_{code}"] == 1
    assert (await request_json(nc, submit_subject(coordinator), {"prompt": "ok"}))["type"] == "final"


async def test_error_reply_carries_client_request_id_and_ends_stream(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    await start_engines(1)
    body = json.dumps({"prompt": None, "stream": True, "client_request_id": "c7"}).encode()
    messages = await request_stream(nc, submit_subject(coordinator), body)
    assert [msg.data for msg in messages][-1] == b""
    error = decode_reply(messages[0].data)
    assert error["type"] == "error" and error["client_request_id"] == "c7" and error["error"]["code"] == 400


async def test_no_engine_gives_503_and_keeps_running(coordinator: Coordinator, nc: NATS) -> None:
    for _ in range(2):
        reply = await request_json(nc, submit_subject(coordinator), {"prompt": "x", "client_request_id": 1})
        assert reply["error"]["code"] == 503 and reply["client_request_id"] == 1


async def test_oversize_payload_gets_413_naming_the_limit(nats_url: str, nc: NATS) -> None:
    from engines.echo import EchoBackend
    from engines.runtime import EngineRuntime

    settings = make_settings(nats_url, max_payload_bytes=4096)
    async with Coordinator(settings, HANDLERS) as coordinator, EngineRuntime(settings, EchoBackend()):
        await coordinator.wait_for_engines(1)
        reply = await request_json(nc, submit_subject(coordinator), {"prompt": "x" * 5000})
        assert reply["error"]["code"] == 413 and "4096" in reply["error"]["message"]
        assert (await request_json(nc, submit_subject(coordinator), {"prompt": "x" * 3000}))["type"] == "final"


async def test_full_engines_and_queue_give_429(nats_url: str, nc: NATS) -> None:
    from engines.echo import EchoBackend
    from engines.runtime import EngineRuntime

    settings = make_settings(nats_url, max_inflight_per_engine=1, max_queued_requests=1)
    async with Coordinator(settings, HANDLERS) as coordinator, EngineRuntime(settings, EchoBackend(token_delay_ms=50)):
        await coordinator.wait_for_engines(1)
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        for client_request_id in ("routed", "held"):
            body = json.dumps(
                {"prompt": "slow", "client_request_id": client_request_id, "sampling_params": {"max_tokens": 3}}
            )
            await nc.publish(submit_subject(coordinator), body.encode(), reply=inbox)
        refused = await request_json(nc, submit_subject(coordinator), {"prompt": "x", "client_request_id": "third"})
        assert refused["error"]["code"] == 429 and refused["client_request_id"] == "third"
        finals = [decode_reply((await sub.next_msg(timeout=5)).data) for _ in range(2)]
        assert [final["client_request_id"] for final in finals] == ["routed", "held"]
        assert all(final["type"] == "final" for final in finals)


async def test_deadline_gives_504_and_late_engine_reply_is_dropped(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    await start_engines(1, token_delay_ms=100)
    body = {"prompt": "slow", "stream": True, "sampling_params": {"max_tokens": 50, "timeout_s": 0.3}}
    messages = await request_stream(nc, submit_subject(coordinator), json.dumps(body).encode())
    terminal = decode_reply(messages[-2].data)
    assert terminal["type"] == "error" and terminal["error"]["code"] == 504
    assert messages[-1].data == b""
    assert all(decode_reply(msg.data)["type"] == "partial" for msg in messages[:-2])
    assert len(coordinator.requests) == 0


async def test_anonymous_duplicate_in_flight_gets_409(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    await start_engines(1, token_delay_ms=50)
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    body = json.dumps({"prompt": "a", "client_request_id": 1, "sampling_params": {"max_tokens": 3}}).encode()
    await nc.publish(submit_subject(coordinator), body, reply=inbox)
    duplicate = await request(nc, submit_subject(coordinator), body)
    assert duplicate["error"]["code"] == 409
    assert decode_reply((await sub.next_msg(timeout=5)).data)["type"] == "final"


async def test_named_resubmission_in_flight_from_another_inbox_is_409_and_runs_once(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    """A copy from another inbox while the request runs gets 409 in progress (no inbox is left
    silent); once it ended, the same copy gets the cached result."""
    await start_engines(1, token_delay_ms=30)
    first_inbox = nc.new_inbox()
    first = await nc.subscribe(first_inbox)
    body = json.dumps(
        {"prompt": "a", "client_id": "c", "client_request_id": 1, "sampling_params": {"max_tokens": 3}}
    ).encode()
    await nc.publish(submit_subject(coordinator), body, reply=first_inbox)
    copy = decode_reply((await nc.request(submit_subject(coordinator), body, timeout=5)).data)
    assert copy["type"] == "error" and copy["error"]["code"] == 409 and "in progress" in copy["error"]["message"]
    final = decode_reply((await first.next_msg(timeout=5)).data)
    assert final["type"] == "final" and final["generated_text"] == "aaa"
    again = decode_reply((await nc.request(submit_subject(coordinator), body, timeout=5)).data)
    assert again == final
    assert (coordinator.counters["submitted"], coordinator.counters["replayed"]) == (1, 1)


async def test_named_resubmission_after_completion_replays_the_result(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    await start_engines(1)
    body = {
        "prompt": "once",
        "client_id": "c",
        "client_request_id": "k",
        "stream": True,
        "sampling_params": {"max_tokens": 4},
    }
    original = await request_stream(nc, submit_subject(coordinator), json.dumps(body).encode())
    replayed = await request_stream(nc, submit_subject(coordinator), json.dumps(body).encode())
    assert [msg.data for msg in replayed] == [original[-2].data, b""]
    assert (coordinator.counters["submitted"], coordinator.counters["replayed"]) == (1, 1)


async def test_request_ids_unique_across_coordinator_replicas(
    settings: Settings, coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    await start_engines(2)
    async with Coordinator(settings, HANDLERS) as second:
        await second.wait_for_engines(2)
        replies = await asyncio.gather(
            *(
                request_json(nc, submit_subject(coordinator), {"prompt": "r", "client_request_id": i})
                for i in range(200)
            )
        )
    assert sorted(reply["client_request_id"] for reply in replies) == list(range(200))
    assert len({reply["request_id"] for reply in replies}) == 200
    assert coordinator.counters["submitted"] > 0 and second.counters["submitted"] > 0
