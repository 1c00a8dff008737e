"""What each role may do under docs/nats-server.example.conf: nats-server runs with the example
config itself, a coordinator and an echo engine log in as their users, and NATS refuses what a
role may not publish or subscribe to.

A refused publish is observed the way a program sees it: NATS reports a permissions violation
to the connection's error callback. Covers clients (no control, no posing as an engine, no
reading others' replies), the gateway user, the client library's fast 403, the admin, the
engine and the coordinator, and who may reach the shared control state in JetStream.
"""

from __future__ import annotations

import asyncio

import msgpack
import nats.errors
import pytest

from service.client import ClientError, DpcoordClient
from service.protocol.messages import Final
from service.protocol.state import CoordinatorState
from service.protocol.subjects import Subjects
from tests.security_helpers import PREFIX, Fleet, assert_still_running, connected, role_settings

# ------------------------------------------------------------ roles under the example config


async def test_client_submits_and_streams(fleet: Fleet) -> None:
    async with await DpcoordClient.connect(role_settings(fleet.url, "client")) as client:
        final = await client.submit("hello", max_tokens=3)
        assert (final.generated_text, final.finish_reason) == ("hel", "length")
        replies = [reply async for reply in client.stream("abc", max_tokens=2)]
    assert isinstance(replies[-1], Final) and replies[-1].generated_text == "ab"


@pytest.mark.parametrize(
    "subject",
    [
        "dpcoord.pause",
        "dpcoord.stop",
        "dpcoord.shutdown",
        "dpcoord.start_cuda_profiler",
        "dpcoord.engines.pause",  # straight to the engines, around the coordinator
        "dpcoord.register",
        "dpcoord.engine_reply",
    ],
)
async def test_client_cannot_send_control_or_pose_as_an_engine(fleet: Fleet, subject: str) -> None:
    async with connected(role_settings(fleet.url, "client")) as (nc, violations):
        await nc.publish(subject, msgpack.packb({}), reply=nc.new_inbox())
        await violations.wait_for("publish", subject)
    await assert_still_running(fleet)


async def test_client_cannot_send_to_an_engine_directly(fleet: Fleet) -> None:
    subject = Subjects(PREFIX).engine(fleet.engine.engine_id, "submit_request")
    async with connected(role_settings(fleet.url, "client")) as (nc, violations):
        await nc.publish(subject, b"\x92\x90\xc4\x00")
        await violations.wait_for("publish", subject)
    assert fleet.engine.load == 0


async def test_client_cannot_read_replies_meant_for_others(fleet: Fleet) -> None:
    async with connected(role_settings(fleet.url, "client")) as (nc, violations):
        for subject in ("_INBOX_admin.>", "_INBOX.>", "dpcoord.>"):
            await nc.subscribe(subject)
            await violations.wait_for("subscription", subject)


async def test_the_gateway_user_is_a_client_whose_replies_no_client_reads(fleet: Fleet) -> None:
    async with await DpcoordClient.connect(role_settings(fleet.url, "gateway")) as gateway:
        assert (await gateway.submit("ok", max_tokens=2)).generated_text == "ok"
        assert [model.name for model in (await gateway.list_models()).models] == ["dpcoord-echo"]
        with pytest.raises(ClientError) as paused:
            await asyncio.wait_for(gateway.pause(timeout=60), 10)
        assert paused.value.code == 403
    async with connected(role_settings(fleet.url, "client")) as (nc, violations):
        await nc.subscribe("_INBOX_gateway.>")
        await violations.wait_for("subscription", "_INBOX_gateway.>")


async def test_client_library_fails_fast_with_403(fleet: Fleet) -> None:
    async with await DpcoordClient.connect(role_settings(fleet.url, "client")) as client:
        # A refused call raises at once; the outer bound only catches a call that waits for its timeout.
        with pytest.raises(ClientError) as paused:
            await asyncio.wait_for(client.pause(timeout=60), 10)
        assert paused.value.code == 403 and "dpcoord.pause" in paused.value.message
        with pytest.raises(ClientError) as shutdown:
            await asyncio.wait_for(client.shutdown(timeout=60), 10)
        assert shutdown.value.code == 403 and "dpcoord.shutdown" in shutdown.value.message
        # The connection is still good for what the client may do.
        assert (await client.submit("ok", max_tokens=2)).generated_text == "ok"
    await assert_still_running(fleet)


async def test_admin_can_pause_and_unpause(fleet: Fleet) -> None:
    async with await DpcoordClient.connect(role_settings(fleet.url, "admin")) as admin:
        assert (await admin.pause()).state == "paused"
        assert fleet.coordinator.state is CoordinatorState.PAUSED and fleet.engine.paused
        assert (await admin.unpause()).state == "running"
        assert (await admin.submit("admin", max_tokens=5)).generated_text == "admin"
    assert fleet.coordinator.state is CoordinatorState.RUNNING and not fleet.engine.paused


@pytest.mark.parametrize(
    "subject", ["dpcoord.pause", "dpcoord.shutdown", "dpcoord.engines.stop", "dpcoord.submit_request"]
)
async def test_engine_cannot_send_control_or_submit(fleet: Fleet, subject: str) -> None:
    async with connected(role_settings(fleet.url, "engine")) as (nc, violations):
        await nc.publish(subject, msgpack.packb({}), reply=nc.new_inbox())
        await violations.wait_for("publish", subject)
    await assert_still_running(fleet)


async def test_engine_user_gets_403_from_the_client_library(fleet: Fleet) -> None:
    with pytest.raises(ClientError) as connect:
        await asyncio.wait_for(DpcoordClient.connect(role_settings(fleet.url, "engine"), timeout=60), 10)
    assert connect.value.code == 403 and "dpcoord.connect" in connect.value.message


@pytest.mark.parametrize(
    "subject",
    [
        "dpcoord.pause",
        "dpcoord.register",
        "dpcoord.engine_reply",
        "dpcoord.engine_reply.e1",
        "dpcoord.heartbeat.e1",
        "$SYS.REQ.SERVER.PING",
        # Replies go only to inboxes: nothing else, whatever a client names.
        "billing.charge",
        "_INBOX.elsewhere",
        "dpcoord.status.coordinator.c1",
    ],
)
async def test_coordinator_cannot_forge_client_admin_or_engine_messages(fleet: Fleet, subject: str) -> None:
    async with connected(role_settings(fleet.url, "coordinator")) as (nc, violations):
        await nc.publish(subject, b"{}")
        await violations.wait_for("publish", subject)
    await assert_still_running(fleet)


# ------------------------------------------------------------ the shared control state

BUCKET_SUBJECTS = ["$KV.dpcoord_control.dpcoord", "$JS.API.STREAM.PURGE.KV_dpcoord_control"]  # write, wipe


@pytest.mark.parametrize("role", ["client", "engine", "admin"])
@pytest.mark.parametrize("subject", BUCKET_SUBJECTS)
async def test_only_coordinators_reach_the_control_state(fleet: Fleet, role: str, subject: str) -> None:
    assert fleet.coordinator.shared.shared  # the example config gives the coordinator its bucket
    revision = fleet.coordinator.shared.revision
    async with connected(role_settings(fleet.url, role)) as (nc, violations):
        await nc.publish(subject, b'{"state": "paused"}', reply=nc.new_inbox())
        await violations.wait_for("publish", subject)
    await assert_still_running(fleet)
    assert fleet.coordinator.shared.revision == revision


async def test_a_client_cannot_write_the_bucket_through_jetstream(fleet: Fleet) -> None:
    """What `nats kv put dpcoord_control dpcoord ...` does, as the client user: refused."""
    async with connected(role_settings(fleet.url, "client")) as (nc, _):
        with pytest.raises(nats.errors.Error):
            kv = await nc.jetstream(timeout=1.0).key_value("dpcoord_control")
            await kv.put("dpcoord", b'{"state": "paused"}')
    await assert_still_running(fleet)


@pytest.mark.parametrize(
    "subject",
    [
        "$KV.other_control.other",
        "$JS.API.STREAM.INFO.KV_other_control",
        "$JS.API.STREAM.DELETE.KV_dpcoord_control",
        "$JS.API.STREAM.PURGE.KV_dpcoord_control",
    ],
)
async def test_coordinator_reaches_its_bucket_only(fleet: Fleet, subject: str) -> None:
    async with connected(role_settings(fleet.url, "coordinator")) as (nc, violations):
        await nc.publish(subject, b"{}")
        await violations.wait_for("publish", subject)
