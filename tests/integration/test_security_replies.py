"""The confused deputy: a client or an engine names a reply subject, and the coordinator, which
may publish more widely than either, must not turn its reply into a control signal.

Under docs/nats-server.example.conf the coordinator drops or refuses (400) a reply onto a
subject dpcoord serves, from a client's reply subject or reply_to and from an engine's route for
an orphaned reply; and which reply subjects it accepts at all.
"""

from __future__ import annotations

import msgspec
import pytest

from handlers import HANDLERS
from service.bus.connection import flush_subscriptions
from service.bus.server import EmbeddedNatsServer
from service.coordinator.coordinator import Coordinator
from service.protocol.messages import Final
from service.protocol.routed import EngineReplyBatch, ReturnPath, RoutedReply
from service.protocol.state import CoordinatorState
from service.protocol.subjects import Subjects
from tests.helpers import decode_reply
from tests.security_helpers import PREFIX, Fleet, assert_still_running, connected, role_settings

# ------------------------------------------------------------ confused deputy


async def test_coordinator_refuses_to_reply_onto_dpcoord_subjects(fleet: Fleet) -> None:
    """A client may publish to connect and submit_request only, but the coordinator replies with
    broader rights: a reply subject of dpcoord.pause or dpcoord.engines.stop would turn its reply
    into a control signal. It drops such messages, and answers such a reply_to with 400."""
    async with connected(role_settings(fleet.url, "client")) as (nc, violations):
        await nc.publish("dpcoord.connect", b"{}", reply="dpcoord.pause")
        await nc.publish("dpcoord.submit_request", b'{"prompt": "x"}', reply="dpcoord.engines.stop")
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish("dpcoord.submit_request", b'{"prompt": "x", "reply_to": "dpcoord.engines.stop"}', reply=inbox)
        refused = decode_reply((await sub.next_msg(timeout=5)).data)
        # Same subject, same subscription, handled in order: once this is answered, so were the above.
        await nc.publish("dpcoord.connect", b"{}", reply=inbox)
        ack = decode_reply((await sub.next_msg(timeout=5)).data)
        assert violations.errors == []
    assert refused["type"] == "error" and refused["error"]["code"] == 400
    assert "dpcoord.engines.stop" in refused["error"]["message"]
    assert ack["type"] == "connect_ack"
    assert fleet.coordinator.counters["unsafe_reply_subject"] == 2
    await assert_still_running(fleet)


async def test_coordinator_refuses_to_deliver_onto_dpcoord_subjects_for_an_engine(
    secured_nats: EmbeddedNatsServer,
) -> None:
    """A reply whose coordinator is gone (an orphan) is delivered by a survivor along the route
    the engine sends with it. A compromised engine that sends an orphan routed to
    dpcoord.engines.stop (which the coordinator may publish to) must not get it broadcast."""
    url, subjects = secured_nats.url, Subjects(PREFIX)
    async with Coordinator(role_settings(url, "coordinator"), HANDLERS) as coordinator:
        async with connected(role_settings(url, "engine")) as (engine, violations):
            broadcasts = await engine.subscribe(subjects.broadcast("stop"))
            # A reply subject the engine connection reads too, so the coordinator's publishes
            # reach one connection in the order they were made.
            observed = await engine.subscribe("_INBOX_engine.observed")
            await flush_subscriptions(engine)
            replies = []
            for request_id, reply_to in (("gone-0", subjects.broadcast("stop")), ("gone-1", "_INBOX_engine.observed")):
                return_path = ReturnPath(request_id, "gone", reply_to, "msgpack", False, None)
                final = Final(request_id, None, "rogue", [1], "x", "length")
                replies.append(RoutedReply(return_path, msgspec.msgpack.encode(final), 0))
            batch = EngineReplyBatch("rogue", replies)
            await engine.publish(subjects.sent_by("engine_reply", "rogue"), msgspec.msgpack.encode(batch))
            # Delivered once the coordinator has heard its peers (a heartbeat timeout), in order.
            delivered = decode_reply((await observed.next_msg(timeout=10)).data)
            assert broadcasts.pending_msgs == 0
            assert violations.errors == []
        assert delivered["request_id"] == "gone-1"
        assert coordinator.counters["unsafe_reply_subject"] == 1
        assert coordinator.state is CoordinatorState.RUNNING


@pytest.mark.parametrize(
    ("subject", "allowed"),
    [
        ("_INBOX.abc.1", True),
        ("results.manual", True),
        ("dpcoord.results.client-a", True),
        ("dpcoordx.pause", True),
        ("dpcoord.pause", False),
        ("dpcoord.coordinator_heartbeat", False),
        ("dpcoord.anything_new", False),
        ("dpcoord", False),
        ("dpcoord.engines.stop", False),
        ("dpcoord.engine.e1.submit_request", False),
        ("dpcoord.engine_reply.e1", False),
        ("dpcoord.register.e1", False),
        ("$SYS.REQ.SERVER.PING", False),
        ("$JS.API.STREAM.DELETE.x", False),
        ("$KV.dpcoord_control.dpcoord", False),  # the shared control state
        ("a.*.b", False),
        ("a.>", False),
        ("a..b", False),
        ("a b", False),
        ("", False),
    ],
)
def test_reply_subjects_the_coordinator_accepts(subject: str, allowed: bool) -> None:
    assert (Subjects(PREFIX).reply_problem(subject) is None) is allowed
