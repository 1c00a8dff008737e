"""Who owns a request, and which engine a message is from, under the example NATS configs.

docs/nats-server.example.conf (one user per role, each with its own inbox prefix) for owners
and reply subjects; docs/nats-server.per-engine.example.conf (one user per engine) for engine
identity. Each test is one finding of issue 11 in the set-up where NATS permissions hold.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest

from engines.echo import EchoBackend
from engines.runtime import EngineRuntime
from handlers import HANDLERS
from service.bus.connection import flush_subscriptions
from service.bus.server import EmbeddedNatsServer
from service.client import ClientError, DpcoordClient
from service.coordinator.coordinator import Coordinator
from service.protocol.codec import encode_msgpack
from service.protocol.membership import EngineDisconnect, Heartbeat
from service.protocol.messages import Final
from service.protocol.routed import EngineReplyBatch, ReturnPath, RoutedReply
from tests.conftest import make_settings
from tests.helpers import REPO_ROOT, decode_reply
from tests.nats_jwt import Operator
from tests.security_helpers import (
    PASSWORDS,
    SERVER_PASSWORDS,
    Fleet,
    connected,
    role_settings,
    running_fleet,
    secured_nats,  # noqa: F401  (a fixture)
    server_env,  # noqa: F401  (a fixture)
)

PER_ENGINE_CONFIG = REPO_ROOT / "docs" / "nats-server.per-engine.example.conf"
ENGINES = ("engine-0", "engine-1")
ENGINE_PASSWORDS = {engine: f"{engine}-test-password" for engine in ENGINES}


@pytest.fixture
async def slow_fleet(secured_nats: EmbeddedNatsServer) -> AsyncIterator[Fleet]:  # noqa: F811
    url = secured_nats.url
    async with running_fleet(
        role_settings(url, "coordinator"), role_settings(url, "engine"), url, token_delay_ms=30
    ) as fleet:
        yield fleet


# ------------------------------------------------------------ owners (finding 5) and reply_to (finding 6)


async def test_another_user_can_neither_take_over_nor_abort_a_request(slow_fleet: Fleet) -> None:
    """The admin user (another inbox prefix than the client's) resubmits and aborts the client's
    request: 403 both, and the client's stream runs to its end."""
    url = slow_fleet.url
    async with await DpcoordClient.connect(role_settings(url, "client")) as client:
        stream = client.stream("private", max_tokens=12, client_request_id="mine")
        first = await anext(stream)
        async with connected(role_settings(url, "admin")) as (admin, violations):
            resubmit = {"prompt": "private", "stream": True, "client_id": client.client_id, "client_request_id": "mine"}
            stolen = decode_reply(
                (await admin.request("dpcoord.submit_request", json.dumps(resubmit).encode(), timeout=5)).data
            )
            by_id = {"request_id": first.request_id}
            aborted = decode_reply(
                (await admin.request("dpcoord.abort_request", json.dumps(by_id).encode(), timeout=5)).data
            )
            assert violations.errors == []
        replies = [first, *[reply async for reply in stream]]
    assert stolen["error"]["code"] == 403 and aborted["error"]["code"] == 403
    assert isinstance(replies[-1], Final) and replies[-1].generated_text == "privatepriva"


async def test_reply_to_under_another_users_inbox_is_refused(slow_fleet: Fleet) -> None:
    """A client named _INBOX_admin.acks, which it may not use, and the coordinator published its text there."""
    url = slow_fleet.url
    async with connected(role_settings(url, "admin")) as (admin, _):
        acks = await admin.subscribe("_INBOX_admin.acks")
        await flush_subscriptions(admin)
        async with connected(role_settings(url, "client")) as (client, violations):
            for reply_to in ("_INBOX_admin.acks", "billing.charge", "dpcoord.status.coordinator.x"):
                body = json.dumps({"prompt": "injected", "reply_to": reply_to}).encode()
                refused = decode_reply((await client.request("dpcoord.submit_request", body, timeout=5)).data)
                assert refused["error"]["code"] == 400 and reply_to in refused["error"]["message"]
            body = json.dumps(
                {"prompt": "mine", "reply_to": "_INBOX_client.results", "sampling_params": {"max_tokens": 2}}
            ).encode()
            results = await client.subscribe("_INBOX_client.results")
            await client.publish("dpcoord.submit_request", body, reply=client.new_inbox())
            assert decode_reply((await results.next_msg(timeout=5)).data)["generated_text"] == "mi"
            assert violations.errors == []
        await admin.flush()
        assert acks.pending_msgs == 0


async def test_shutdown_needs_a_client_that_connected(secured_nats: EmbeddedNatsServer) -> None:  # noqa: F811
    url = secured_nats.url
    async with running_fleet(role_settings(url, "coordinator"), role_settings(url, "engine"), url) as fleet:
        async with connected(role_settings(url, "admin")) as (admin, _):
            refused = decode_reply((await admin.request("dpcoord.shutdown", b"{}", timeout=5)).data)
        assert refused["error"]["code"] == 403 and fleet.coordinator.counters["error_403"] == 1
        async with await DpcoordClient.connect(role_settings(url, "admin")) as known:
            assert (await known.shutdown()).signal == "shutdown"
        await asyncio.wait_for(fleet.coordinator.run_until_stopped(), 5)


# ------------------------------------------------------------ engine identity (finding 4), one NATS user per engine


@pytest.fixture
def per_engine_nats(monkeypatch: pytest.MonkeyPatch) -> Iterator[EmbeddedNatsServer]:
    for role, password in SERVER_PASSWORDS.items():
        monkeypatch.setenv(f"NATS_PASSWORD_{role.upper()}", f'"{password}"')
    for engine, password in ENGINE_PASSWORDS.items():
        monkeypatch.setenv(f"NATS_PASSWORD_{engine.upper().replace('-', '_')}", f'"{password}"')
    with EmbeddedNatsServer(extra_args=("-c", str(PER_ENGINE_CONFIG))) as server:
        yield server


def engine_settings(url: str, engine: str) -> object:
    return role_settings(url, "engine", nats_user=engine, nats_password=ENGINE_PASSWORDS[engine], engine_id=engine)


async def test_each_engine_user_speaks_only_as_itself(per_engine_nats: EmbeddedNatsServer) -> None:
    url = per_engine_nats.url
    async with Coordinator(role_settings(url, "coordinator"), HANDLERS) as coordinator:
        honest = EngineRuntime(engine_settings(url, "engine-0"), EchoBackend(token_delay_ms=30))  # type: ignore[arg-type]
        async with honest:
            await asyncio.wait_for(honest.registered.wait(), 10)
            async with connected(engine_settings(url, "engine-1")) as (rogue, violations):  # type: ignore[arg-type]
                # As engine-0, on any subject: NATS refuses.
                for header in ("engine_reply", "disconnect", "heartbeat", "register"):
                    await rogue.publish(f"dpcoord.{header}.engine-0", b"\x80")
                    await violations.wait_for("publish", f"dpcoord.{header}.engine-0")
                await rogue.publish("dpcoord.disconnect", b"\x80")
                await violations.wait_for("publish", "dpcoord.disconnect")
                await rogue.subscribe("dpcoord.engine.engine-0.*")  # engine-0's requests are not its to read
                await violations.wait_for("subscription", "dpcoord.engine.engine-0.*")
                async with await DpcoordClient.connect(role_settings(url, "client")) as client:
                    stream = client.stream("honest", max_tokens=10)
                    first = await anext(stream)
                    # As itself, in engine-0's name or for engine-0's request: the coordinator refuses.
                    route = ReturnPath(first.request_id, coordinator.id, "_INBOX_client.x", "msgpack", False, None)
                    forged = RoutedReply(
                        route,
                        msgspec.msgpack.encode(Final(first.request_id, None, "engine-1", [1], "forged", "length")),
                    )
                    for claimed in ("engine-0", "engine-1"):
                        await rogue.publish(
                            "dpcoord.engine_reply.engine-1", encode_msgpack(EngineReplyBatch(claimed, [forged]))
                        )
                    await rogue.publish(
                        "dpcoord.disconnect.engine-1", encode_msgpack(EngineDisconnect("engine-0", "spoofed"))
                    )
                    await rogue.publish("dpcoord.heartbeat.engine-1", encode_msgpack(Heartbeat("engine-0")))
                    replies = [first, *[reply async for reply in stream]]
            assert isinstance(replies[-1], Final) and replies[-1].generated_text == "honesthone"
            assert coordinator.engines.get("engine-0") is not None
            assert coordinator.counters["error_403"] == 3 and coordinator.counters["stale_engine_replies"] == 1


async def test_per_engine_users_serve_requests(per_engine_nats: EmbeddedNatsServer) -> None:
    url = per_engine_nats.url
    async with Coordinator(role_settings(url, "coordinator"), HANDLERS) as coordinator:
        engines = [EngineRuntime(engine_settings(url, engine), EchoBackend()) for engine in ENGINES]  # type: ignore[arg-type]
        for engine in engines:
            await engine.start()
        try:
            await coordinator.wait_for_engines(2)
            async with await DpcoordClient.connect(role_settings(url, "client")) as client:
                finals = [await client.submit(f"p{index}", max_tokens=2) for index in range(4)]
            assert {final.engine_id for final in finals} == set(ENGINES)
        finally:
            for engine in engines:
                await engine.stop()


def test_per_engine_config_keeps_the_other_roles_of_the_example() -> None:
    text = PER_ENGINE_CONFIG.read_text()
    assert 'include "nats-server.example.conf"' in text
    for role in ("coordinator", "admin", "client"):
        assert f"{{user: {role}, password: $NATS_PASSWORD_{role.upper()}, permissions: ${role.upper()}}}" in text
    assert PASSWORDS.keys() >= {"coordinator", "admin", "client"}


async def test_client_error_is_raised_for_403(slow_fleet: Fleet) -> None:
    """The client library's view of a refused resubmission."""
    async with await DpcoordClient.connect(role_settings(slow_fleet.url, "client")) as owner:
        final = await owner.submit("owned", max_tokens=2, client_request_id="x")
    async with await DpcoordClient.connect(role_settings(slow_fleet.url, "admin"), client_id=owner.client_id) as other:
        with pytest.raises(ClientError) as refused:
            await other.submit("owned", max_tokens=2, client_request_id="x", timeout=5)
    assert final.generated_text == "ow" and refused.value.code == 403


def engine_template() -> dict[str, object]:
    """One permission template for every engine user of an account (a scoped signing key's):
    NATS puts each user's JWT name, its engine id, where the template says {{name()}}."""
    sent = [
        f"dpcoord.{header}.{{{{name()}}}}"
        for header in ("register", "heartbeat", "engine_reply", "engine_reply_partial", "disconnect")
    ]
    return {
        "pub": {"allow": sent},
        "sub": {"allow": ["dpcoord.engine.{{name()}}.*", "dpcoord.engines.*", "_INBOX_engine.>"]},
        "resp": {"max": 1, "ttl": 0},
    }


async def test_jwt_name_templates_let_each_engine_speak_only_as_itself(tmp_path: Path) -> None:
    operator = Operator(tmp_path)
    operator.scope("engine", engine_template())
    # JetStream in operator mode needs a system account; this is about engine identity, so without it.
    with EmbeddedNatsServer(extra_args=("-c", str(operator.server_config())), jetstream=False) as server:
        fleet = make_settings(server.url, subject_prefix="dpcoord", nats_creds_file=str(operator.user("fleet")))
        engines = {
            engine_id: make_settings(
                server.url,
                subject_prefix="dpcoord",
                engine_id=engine_id,
                nats_inbox_prefix="_INBOX_engine",
                nats_creds_file=str(operator.scoped_user(engine_id, "engine")),
            )
            for engine_id in ("engine-7", "engine-8")
        }
        async with (
            Coordinator(fleet, HANDLERS) as coordinator,
            EngineRuntime(engines["engine-7"], EchoBackend()) as engine,
        ):
            await asyncio.wait_for(engine.registered.wait(), 10)
            async with await DpcoordClient.connect(fleet) as client:
                assert (await client.submit("jwt", max_tokens=3)).engine_id == "engine-7"
            async with connected(engines["engine-8"]) as (rogue, violations):
                await rogue.publish("dpcoord.disconnect.engine-7", encode_msgpack(EngineDisconnect("engine-7")))
                await violations.wait_for("publish", "dpcoord.disconnect.engine-7")
                await rogue.subscribe("dpcoord.engine.engine-7.*")
                await violations.wait_for("subscription", "dpcoord.engine.engine-7.*")
            assert coordinator.engines.get("engine-7") is not None
