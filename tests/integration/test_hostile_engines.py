"""Engines that lie, flood, hang or pose as others, on a plain nats-server (the dev default,
where anyone may publish anything): what the coordinator itself must withstand. The same
attacks under per-engine NATS users are in tests/integration/test_security_identity.py.

Raw engine messages are built here by hand, subjects included, as an attacker sends them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import pytest
from nats.aio.client import Client as NATS

from service.coordinator.coordinator import Coordinator
from service.ops.settings import Settings
from service.protocol.codec import encode_msgpack
from service.protocol.membership import EngineDisconnect, EngineRegister, Heartbeat
from service.protocol.messages import Final
from service.protocol.routed import EngineReplyBatch, ReturnPath, RoutedReply
from tests.conftest import EngineFactory
from tests.helpers import decode_reply, engines_become, request, request_json


def plain(coordinator: Coordinator, header: str) -> str:
    """The coordinator subject of ``header``, where engines sent everything before they sent as themselves."""
    return f"{coordinator.subjects.prefix}.{header}"


def sent_by(coordinator: Coordinator, header: str, engine_id: str) -> str:
    return f"{coordinator.subjects.prefix}.{header}.{engine_id}"


async def register(nc: NATS, coordinator: Coordinator, engine_id: str, capacity: int = 256) -> dict[str, object]:
    """Register as ``engine_id`` on both subjects an engine could use; the coordinator's answer."""
    body = encode_msgpack(EngineRegister(engine_id, capacity))
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    for subject in (plain(coordinator, "register"), sent_by(coordinator, "register", engine_id)):
        await nc.publish(subject, body, reply=inbox)
    answer = await next_answer(sub)
    await sub.unsubscribe()
    return answer


async def next_answer(sub: object) -> dict[str, object]:
    """The next answer, past NATS's no-responders notices (empty) for a subject nobody serves."""
    while not (msg := await sub.next_msg(timeout=5)).data:  # type: ignore[attr-defined]
        pass
    return msgspec.msgpack.decode(msg.data)


@asynccontextmanager
async def heartbeating(nc: NATS, coordinator: Coordinator, engine_id: str, capacity: int = 256) -> AsyncIterator[None]:
    """An engine that registers and heartbeats (reporting no steps) and never answers anything."""
    await register(nc, coordinator, engine_id, capacity)

    async def beat() -> None:
        while True:
            body = encode_msgpack(Heartbeat(engine_id, 0, capacity, []))
            await nc.publish(plain(coordinator, "heartbeat"), body)
            await nc.publish(sent_by(coordinator, "heartbeat", engine_id), body)
            await asyncio.sleep(coordinator.settings.heartbeat_interval_s)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()


def forged_final(
    coordinator: Coordinator, request_id: str, reply_to: str, engine_id: str, text: str = "forged"
) -> bytes:
    return_path = ReturnPath(request_id, coordinator.id, reply_to, "json", False, None)
    body = msgspec.json.encode(Final(request_id, None, engine_id, [1], text, "length"))
    return encode_msgpack(EngineReplyBatch(engine_id, [RoutedReply(return_path, body)]))


async def publish_everywhere(
    nc: NATS, coordinator: Coordinator, header: str, body: bytes, engine_ids: list[str]
) -> None:
    """On the plain subject and as each of ``engine_ids``: wherever an attacker could try."""
    await nc.publish(plain(coordinator, header), body)
    for engine_id in engine_ids:
        await nc.publish(sent_by(coordinator, header, engine_id), body)
    await nc.flush()


# ------------------------------------------------------------ finding 1: ids that break subjects


async def test_engine_id_that_is_no_subject_token_is_refused_and_the_watchdog_lives(
    coordinator: Coordinator, nc: NATS
) -> None:
    """'gpu 0' made the abort subject unpublishable, which killed the silence watchdog: a
    SIGKILLed engine then stayed in the pool for good. Ids must be subject tokens."""
    for bad_id in ("gpu:0", "gpu\u00e9", "e" * 300):
        refused = await register(nc, coordinator, bad_id)
        assert refused["type"] == "error" and refused["error"]["code"] == 400, bad_id  # type: ignore[index]
        await publish_everywhere(nc, coordinator, "heartbeat", encode_msgpack(Heartbeat(bad_id)), [bad_id])
    await nc.publish(plain(coordinator, "register"), encode_msgpack(EngineRegister("gpu 0")), reply=nc.new_inbox())
    await nc.publish(plain(coordinator, "heartbeat"), encode_msgpack(Heartbeat("gpu 0")))
    await register(nc, coordinator, "mute")  # a valid engine that then goes silent
    assert len(coordinator.engines) == 1
    await engines_become(coordinator, 0, timeout_s=5)
    assert coordinator.counters["loop_errors_watchdog"] == 0


# ------------------------------------------------------------ finding 2: registration flood


async def test_registration_flood_is_capped_with_429_and_real_engines_stay(nats_url: str, nc: NATS) -> None:
    from engines.echo import EchoBackend
    from engines.runtime import EngineRuntime
    from handlers import HANDLERS
    from tests.conftest import make_settings

    settings = make_settings(nats_url, max_engines=20)
    async with Coordinator(settings, HANDLERS) as coordinator, EngineRuntime(settings, EchoBackend()) as real:
        await asyncio.wait_for(real.registered.wait(), 10)
        inbox = nc.new_inbox()
        answers = await nc.subscribe(inbox)
        for index in range(300):  # on both subjects an engine may register on, in turn
            engine_id = f"flood-{index}"
            subject = sent_by(coordinator, "register", engine_id) if index % 2 else plain(coordinator, "register")
            await nc.publish(subject, encode_msgpack(EngineRegister(engine_id)), reply=inbox)
        codes: list[int] = []
        while len(codes) < 300:
            answer = await next_answer(answers)
            codes.append(answer["error"]["code"] if answer.get("type") == "error" else 200)  # type: ignore[index]
        assert codes.count(200) == 19 and codes.count(429) == 281  # 19 and the real engine fill 20
        assert len(coordinator.engines) == 20 and coordinator.engines.get(real.engine_id) is not None
        await publish_everywhere(nc, coordinator, "heartbeat", encode_msgpack(Heartbeat("adopt-me")), ["adopt-me"])
        assert coordinator.engines.get("adopt-me") is None
        await engines_become(coordinator, 1, timeout_s=5)  # the silent flood is dropped; the real engine stays
        reply = await request_json(
            nc,
            coordinator.subjects.coordinator("submit_request"),
            {"prompt": "hi", "sampling_params": {"max_tokens": 2}},
        )
        assert reply["type"] == "final"


# ------------------------------------------------------------ finding 3: black holes


async def test_black_hole_engine_is_suspected_and_its_requests_run_elsewhere(nats_url: str, nc: NATS) -> None:
    """A fake engine that registers and heartbeats but never answers kept receiving work."""
    from engines.echo import EchoBackend
    from engines.runtime import EngineRuntime
    from handlers import HANDLERS
    from tests.conftest import make_settings

    settings = make_settings(nats_url, engine_progress_timeout_s=0.5, request_timeout_s=60)
    async with (
        Coordinator(settings, HANDLERS) as coordinator,
        heartbeating(nc, coordinator, "black-hole", capacity=1000),
    ):
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        submit = coordinator.subjects.coordinator("submit_request")
        for index in range(20):  # all to the black hole, alone in the pool
            body = {"prompt": f"p{index}", "sampling_params": {"max_tokens": 2}}
            await nc.publish(submit, json.dumps(body).encode(), reply=inbox)
        await request(nc, submit, b"{}")  # refused, on the same subject: once answered, the 20 were routed
        assert coordinator.engines.get("black-hole").load == 20  # type: ignore[union-attr]
        async with EngineRuntime(settings, EchoBackend()) as real:
            finals = [decode_reply((await sub.next_msg(timeout=10)).data) for _ in range(20)]
            assert all(final["type"] == "final" and final["engine_id"] == real.engine_id for final in finals)
            assert coordinator.counters["engines_suspected"] >= 1
            assert coordinator.engines.get("black-hole") is None  # its heartbeats do not bring it back
            # It answers (the abort it was sent, say): its next heartbeat takes it back.
            await publish_everywhere(
                nc,
                coordinator,
                "engine_reply",
                forged_final(coordinator, "gone", nc.new_inbox(), "black-hole"),
                ["black-hole"],
            )
            await engines_become(coordinator, 2, timeout_s=5)


async def test_a_busy_engine_with_long_requests_is_not_suspected(nats_url: str, nc: NATS) -> None:
    """No reply is due for seconds while a long request runs unstreamed: its steps are its progress."""
    from engines.echo import EchoBackend
    from engines.runtime import EngineRuntime
    from handlers import HANDLERS
    from tests.conftest import make_settings

    settings = make_settings(nats_url, engine_progress_timeout_s=0.5)
    async with (
        Coordinator(settings, HANDLERS) as coordinator,
        EngineRuntime(settings, EchoBackend(token_delay_ms=20)) as engine,
    ):
        await asyncio.wait_for(engine.registered.wait(), 10)
        body = {"prompt": "long", "sampling_params": {"max_tokens": 80}}  # about 1.6 s of steps
        final = await request_json(nc, coordinator.subjects.coordinator("submit_request"), body, timeout=10)
        assert final["type"] == "final" and len(final["generated_tokens"]) == 80
        assert coordinator.counters["engines_suspected"] == 0


# ------------------------------------------------------------ finding 4: engine identity


async def test_a_reply_counts_only_from_the_engine_its_request_was_routed_to(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    [engine] = await start_engines(1, token_delay_ms=100)
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    submit = coordinator.subjects.coordinator("submit_request")
    await nc.publish(submit, b'{"prompt": "real", "sampling_params": {"max_tokens": 4}}', reply=inbox)
    await request(nc, submit, b"{}")  # refused, on the same subject: once answered, the first was admitted
    [entry] = list(coordinator.requests)
    await register(nc, coordinator, "intruder")  # joins after the request went to the real engine
    request_id = entry.return_path.request_id
    # As itself, and claiming to be the engine the request went to, on every subject it could.
    await publish_everywhere(
        nc, coordinator, "engine_reply", forged_final(coordinator, request_id, inbox, "intruder"), ["intruder"]
    )
    await publish_everywhere(
        nc, coordinator, "engine_reply", forged_final(coordinator, request_id, inbox, engine.engine_id), ["intruder"]
    )
    final = decode_reply((await sub.next_msg(timeout=5)).data)
    assert final["generated_text"] == "real" and final["engine_id"] == engine.engine_id
    assert coordinator.counters["stale_engine_replies"] >= 1 and coordinator.counters["error_403"] >= 1


async def test_request_ids_cannot_be_guessed(coordinator: Coordinator, start_engines: EngineFactory, nc: NATS) -> None:
    """Ids were <coordinator_id>-<n>, and the coordinator id is in every connect_ack: a forged
    reply for <coordinator_id>-0 reached the victim."""
    [engine] = await start_engines(1, token_delay_ms=100)
    victim_inbox = nc.new_inbox()
    victim = await nc.subscribe(victim_inbox)
    await nc.publish(
        coordinator.subjects.coordinator("submit_request"),
        b'{"prompt": "mine", "sampling_params": {"max_tokens": 4}}',
        reply=victim_inbox,
    )
    await nc.flush()
    for guess in range(8):
        forged = forged_final(coordinator, f"{coordinator.id}-{guess}", victim_inbox, engine.engine_id)
        await publish_everywhere(nc, coordinator, "engine_reply", forged, [engine.engine_id])
    final = decode_reply((await victim.next_msg(timeout=5)).data)
    assert final["generated_text"] == "mine"
    request_id = final["request_id"]
    assert request_id.startswith(f"{coordinator.id}-") and len(request_id) - len(coordinator.id) - 1 == 24


async def test_an_orphan_naming_a_coordinator_never_seen_is_not_cached(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    """A forged orphan for a made-up coordinator poisoned the result cache: the next submission
    of that (client_id, client_request_id) got the forged answer without running."""
    await start_engines(1)
    attacker_inbox = nc.new_inbox()
    attacker = await nc.subscribe(attacker_inbox)
    return_path = ReturnPath("made-up-1", "made-up", attacker_inbox, "json", False, "victim-request", "victim")
    body = msgspec.json.encode(Final("made-up-1", "victim-request", "e", [1], "forged", "length"))
    batch = encode_msgpack(EngineReplyBatch("forger", [RoutedReply(return_path, body)]))
    await publish_everywhere(nc, coordinator, "engine_reply", batch, ["forger"])
    await attacker.next_msg(timeout=5)  # delivered once the coordinator has heard its peers: an orphan
    submit = {
        "prompt": "honest",
        "client_id": "victim",
        "client_request_id": "victim-request",
        "sampling_params": {"max_tokens": 6},
    }
    final = await request_json(nc, coordinator.subjects.coordinator("submit_request"), submit)
    assert final["generated_text"] == "honest"


async def test_disconnect_counts_only_from_the_engine_itself(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    [victim] = await start_engines(1)
    spoof = encode_msgpack(EngineDisconnect(victim.engine_id, "spoofed"))
    await publish_everywhere(nc, coordinator, "disconnect", spoof, ["intruder"])
    reply = await request_json(
        nc, coordinator.subjects.coordinator("submit_request"), {"prompt": "ok", "sampling_params": {"max_tokens": 2}}
    )
    assert reply["type"] == "final" and coordinator.engines.get(victim.engine_id) is not None
    assert coordinator.counters["error_403"] >= 1


@pytest.mark.parametrize("header", ["heartbeat", "register"])
async def test_an_engine_cannot_heartbeat_or_register_for_another(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS, header: str
) -> None:
    """A register in the victim's name would drop its work; a heartbeat could keep a dead engine alive."""
    [victim] = await start_engines(1, token_delay_ms=50)
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(
        coordinator.subjects.coordinator("submit_request"),
        b'{"prompt": "keep", "sampling_params": {"max_tokens": 6}}',
        reply=inbox,
    )
    await nc.flush()
    message = EngineRegister(victim.engine_id) if header == "register" else Heartbeat(victim.engine_id, active=[])
    await nc.publish(sent_by(coordinator, header, "intruder"), encode_msgpack(message), reply=nc.new_inbox())
    final = decode_reply((await sub.next_msg(timeout=5)).data)
    assert final["type"] == "final" and final["generated_text"] == "keepke"
    assert coordinator.counters["error_403"] == 1


def test_engine_and_coordinator_ids_in_settings_are_subject_tokens() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        Settings(engine_id="gpu 0")
    with pytest.raises(ValidationError):
        Settings(coordinator_id="c.1")
    with pytest.raises(ValidationError, match="max_id_bytes"):
        Settings(engine_id="e" * 300)
