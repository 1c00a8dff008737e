"""Access control: nats-server runs with docs/nats-server.example.conf itself, a coordinator and
an echo engine log in as their users, and NATS refuses what a role may not do.

A refused publish is observed the way a program sees it: NATS reports a permissions violation
to the connection's error callback. Also: token, nkey, creds file (JWTs signed here) and TLS
(mutual, server name, handshake-first) authentication through the DPCOORD_NATS_* settings,
the coordinator's refusal to reply onto subjects dpcoord serves, and the client library's
fast 403.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import msgpack
import msgspec
import nats.errors
import nkeys
import pytest
from nats.aio.client import Client as NATS
from pydantic import ValidationError

from engines.echo import EchoBackend
from engines.runtime import EngineRuntime
from handlers import HANDLERS
from service.bus.connection import connect_nats, connect_options, flush_subscriptions
from service.bus.refusals import PublishRefusals
from service.bus.server import EmbeddedNatsServer
from service.client import ClientError, DpcoordClient
from service.coordinator.coordinator import Coordinator
from service.ops.settings import Settings
from service.protocol.messages import EngineReplyBatch, Final, ReturnPath, RoutedReply
from service.protocol.state import CoordinatorState
from service.protocol.subjects import Subjects
from tests.conftest import make_settings
from tests.helpers import REPO_ROOT, decode_reply
from tests.nats_jwt import Operator

EXAMPLE_CONFIG = REPO_ROOT / "docs" / "nats-server.example.conf"
PREFIX = "dpcoord"  # the prefix the example config grants
ROLES = ("coordinator", "engine", "admin", "client", "gateway")
PASSWORDS = {role: f"{role}-test-password" for role in ROLES}
# What the server is given: bcrypt hashes for two roles (bcrypt.hashpw(password, bcrypt.gensalt(10))),
# plain text for the others; the example config takes either.
SERVER_PASSWORDS = {
    "coordinator": PASSWORDS["coordinator"],
    "engine": PASSWORDS["engine"],
    "admin": "$2b$10$b4IP.sYixzbnCkcZShVCCe9IvdHbsXLorwyrtMlxYnJXGBXYApoNW",
    "client": "$2b$10$BIkP7aobPsVsTMWwkPZsUOwNgpkHUQKf9lJh8WUl1uuCCjVq002iS",
    "gateway": PASSWORDS["gateway"],
}
TLS_NAME = "nats.dpcoord.test"  # the only name in the test server certificate


def role_settings(nats_url: str, role: str, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "subject_prefix": PREFIX,
        "nats_user": role,
        "nats_password": PASSWORDS[role],
        "nats_inbox_prefix": f"_INBOX_{role}",
    }
    values.update(overrides)
    return make_settings(nats_url, **values)


class Violations:
    """Permissions violations NATS reported to one connection's error callback."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self._changed = asyncio.Event()

    async def record(self, exc: Exception) -> None:
        self.errors.append(str(exc).lower())
        self._changed.set()

    async def wait_for(self, operation: str, subject: str, timeout: float = 5.0) -> None:
        needle = f'permissions violation for {operation} to "{subject.lower()}"'

        async def seen() -> None:
            while not any(needle in error for error in self.errors):
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(seen(), timeout)


@asynccontextmanager
async def connected(settings: Settings) -> AsyncIterator[tuple[NATS, Violations]]:
    """A raw connection made from settings, the way dpcoord connects, with its violations."""
    violations = Violations()
    nc = await connect_nats(settings, name="security-probe", on_error=violations.record)
    try:
        yield nc, violations
    finally:
        await nc.close()


async def refused_connection(settings: Settings) -> BaseException:
    """Connect once, without retrying, and return why it failed."""
    nc = NATS()
    options = connect_options(settings, "security-probe", nc, None, None)
    options.update(allow_reconnect=False, max_reconnect_attempts=0)
    try:
        await nc.connect(**options)
    except Exception as exc:
        return exc
    await nc.close()
    raise AssertionError("the connection was accepted")


@pytest.fixture
def server_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # NATS reads an environment variable as a config value: quoted, as the config file says.
    for role, password in SERVER_PASSWORDS.items():
        monkeypatch.setenv(f"NATS_PASSWORD_{role.upper()}", f'"{password}"')


@pytest.fixture
def secured_nats(server_env: None) -> Iterator[EmbeddedNatsServer]:
    with EmbeddedNatsServer(extra_args=("-c", str(EXAMPLE_CONFIG))) as server:
        yield server


@dataclass
class Fleet:
    url: str
    coordinator: Coordinator
    engine: EngineRuntime


@asynccontextmanager
async def running_fleet(
    coordinator_settings: Settings, engine_settings: Settings, url: str, token_delay_ms: float = 0.0
) -> AsyncIterator[Fleet]:
    async with Coordinator(coordinator_settings, HANDLERS) as coordinator:
        engine = EngineRuntime(engine_settings, EchoBackend(token_delay_ms=token_delay_ms))
        await engine.start()
        try:
            await asyncio.wait_for(engine.registered.wait(), 10)
            yield Fleet(url, coordinator, engine)
        finally:
            await engine.stop()


@pytest.fixture
async def fleet(secured_nats: EmbeddedNatsServer, caplog: pytest.LogCaptureFixture) -> AsyncIterator[Fleet]:
    url = secured_nats.url
    async with running_fleet(role_settings(url, "coordinator"), role_settings(url, "engine"), url) as running:
        yield running
    # The example config must allow everything the coordinator and engine do themselves:
    # registering, heartbeats, routing, broadcasts and their confirmations, replies.
    records = [*caplog.get_records("setup"), *caplog.get_records("call"), *caplog.records]
    refused = [
        record.getMessage()
        for record in records
        if "permissions violation" in record.getMessage()
        and ("(dpcoord-coordinator-" in record.getMessage() or "(dpcoord-engine-" in record.getMessage())
    ]
    assert refused == []


async def assert_still_running(fleet: Fleet) -> None:
    """A round trip through the coordinator, then its state: nothing paused the fleet."""
    async with await DpcoordClient.connect(role_settings(fleet.url, "client")) as client:
        final = await client.submit("still here", max_tokens=2)
    assert final.finish_reason == "length"
    assert fleet.coordinator.state is CoordinatorState.RUNNING
    assert not fleet.engine.paused
    assert len(fleet.coordinator.engines) == 1


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


# ------------------------------------------------------------ other ways to authenticate


async def test_token_authentication() -> None:
    token = "dpcoord-test-token"
    with EmbeddedNatsServer(extra_args=("--auth", token)) as server:
        settings = make_settings(server.url, nats_token=token)
        async with running_fleet(settings, settings, server.url):
            async with await DpcoordClient.connect(settings) as client:
                assert (await client.submit("tok", max_tokens=3)).generated_text == "tok"
        wrong = await refused_connection(make_settings(server.url, nats_token="wrong"))
        missing = await refused_connection(make_settings(server.url))
    assert "authorization violation" in str(wrong).lower()
    assert "authorization violation" in str(missing).lower()


async def test_nkey_authentication(tmp_path: Path) -> None:
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    public_key = nkeys.from_seed(bytearray(seed)).public_key.decode()
    seed_file = tmp_path / "dpcoord.nk"
    seed_file.write_bytes(seed)
    stranger_file = tmp_path / "stranger.nk"
    stranger_file.write_bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
    config = tmp_path / "nkeys.conf"
    config.write_text(f'authorization {{ users = [ {{ nkey: "{public_key}" }} ] }}\n')
    with EmbeddedNatsServer(extra_args=("-c", str(config))) as server:
        settings = make_settings(server.url, nats_nkey_seed_file=str(seed_file))
        async with running_fleet(settings, settings, server.url):
            async with await DpcoordClient.connect(settings) as client:
                assert (await client.submit("nkey", max_tokens=4)).generated_text == "nkey"
        stranger = await refused_connection(make_settings(server.url, nats_nkey_seed_file=str(stranger_file)))
    assert "authorization violation" in str(stranger).lower()


async def test_creds_file_authentication(tmp_path: Path) -> None:
    """Accounts and JWTs: a user's permissions travel in its JWT, signed by the account."""
    operator = Operator(tmp_path)
    client_permissions = {
        "pub": {"allow": ["dpcoord.connect", "dpcoord.submit_request", "dpcoord.abort_request"]},
        "sub": {"allow": ["_INBOX_client.>"]},
    }
    # May shake hands and nothing else: its submissions are refused.
    watcher_permissions = {"pub": {"allow": ["dpcoord.connect"]}, "sub": {"allow": ["_INBOX_watcher.>"]}}
    # JetStream in operator mode needs a system account; this test is about authentication, so
    # its one coordinator runs without shared state.
    with EmbeddedNatsServer(extra_args=("-c", str(operator.server_config())), jetstream=False) as server:
        fleet_settings = make_settings(server.url, subject_prefix=PREFIX, nats_creds_file=str(operator.user("fleet")))
        client_settings = make_settings(
            server.url,
            subject_prefix=PREFIX,
            nats_inbox_prefix="_INBOX_client",
            nats_creds_file=str(operator.user("client", client_permissions)),
        )
        watcher_settings = make_settings(
            server.url,
            subject_prefix=PREFIX,
            nats_inbox_prefix="_INBOX_watcher",
            nats_creds_file=str(operator.user("watcher", watcher_permissions)),
        )
        async with running_fleet(fleet_settings, fleet_settings, server.url) as fleet:
            async with await DpcoordClient.connect(client_settings) as client:
                assert (await client.submit("jwt", max_tokens=3)).generated_text == "jwt"
                with pytest.raises(ClientError) as paused:
                    await asyncio.wait_for(client.pause(timeout=60), 10)
            assert paused.value.code == 403
            async with await DpcoordClient.connect(watcher_settings) as watcher:
                with pytest.raises(ClientError) as submitted:
                    await asyncio.wait_for(watcher.submit("no", timeout=60), 10)
                with pytest.raises(ClientError) as streamed:
                    await asyncio.wait_for(anext(watcher.stream("no", timeout=60)), 10)
            assert submitted.value.code == streamed.value.code == 403
            assert "dpcoord.submit_request" in streamed.value.message
            assert fleet.coordinator.state is CoordinatorState.RUNNING
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        stranger = await refused_connection(
            make_settings(server.url, nats_creds_file=str(Operator(elsewhere).user("stranger")))
        )
    assert "authorization violation" in str(stranger).lower()


@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    """A throwaway CA, a server certificate for TLS_NAME only, and a client certificate."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make test certificates")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    ca, ca_key = tmp_path / "ca.pem", tmp_path / "ca.key"
    _openssl(
        "req",
        "-x509",
        *ec,
        "-keyout",
        str(ca_key),
        "-out",
        str(ca),
        "-days",
        "2",
        "-subj",
        "/CN=dpcoord test CA",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    )

    def issue(name: str, extensions: str) -> tuple[Path, Path]:
        key, csr, cert, ext = (tmp_path / f"{name}.{suffix}" for suffix in ("key", "csr", "pem", "ext"))
        ext.write_text(extensions + "basicConstraints=CA:FALSE\nauthorityKeyIdentifier=keyid,issuer\n")
        _openssl("req", *ec, "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")
        _openssl(
            "x509",
            "-req",
            "-in",
            str(csr),
            "-CA",
            str(ca),
            "-CAkey",
            str(ca_key),
            "-CAcreateserial",
            "-out",
            str(cert),
            "-days",
            "2",
            "-extfile",
            str(ext),
        )
        return cert, key

    server_cert, server_key = issue(TLS_NAME, f"subjectAltName=DNS:{TLS_NAME}\nextendedKeyUsage=serverAuth\n")
    client_cert, client_key = issue("dpcoord-client", "extendedKeyUsage=clientAuth\n")
    return Pki(ca, server_cert, server_key, client_cert, client_key)


def tls_settings(pki: Pki) -> dict[str, object]:
    return {
        "nats_tls_ca_file": str(pki.ca),
        "nats_tls_cert_file": str(pki.client_cert),
        "nats_tls_key_file": str(pki.client_key),
        "nats_tls_hostname": TLS_NAME,
    }


async def test_mutual_tls_with_the_example_users(server_env: None, pki: Pki) -> None:
    tls_flags = (
        "--tlsverify",
        "--tlscert",
        str(pki.server_cert),
        "--tlskey",
        str(pki.server_key),
        "--tlscacert",
        str(pki.ca),
    )
    with EmbeddedNatsServer(extra_args=("-c", str(EXAMPLE_CONFIG), *tls_flags)) as server:
        url, tls = server.url, tls_settings(pki)
        async with running_fleet(role_settings(url, "coordinator", **tls), role_settings(url, "engine", **tls), url):
            async with await DpcoordClient.connect(role_settings(url, "client", **tls)) as client:
                assert (await client.submit("tls", max_tokens=3)).generated_text == "tls"
        no_client_cert = await refused_connection(
            role_settings(url, "client", nats_tls_ca_file=str(pki.ca), nats_tls_hostname=TLS_NAME)
        )
        wrong_name = await refused_connection(role_settings(url, "client", **{**tls, "nats_tls_hostname": None}))
        no_ca = await refused_connection(role_settings(url, "client", **{**tls, "nats_tls_ca_file": None}))
    assert isinstance(no_client_cert, OSError)  # the server ends the handshake without a client certificate
    assert isinstance(wrong_name, ssl.SSLCertVerificationError) and "127.0.0.1" in str(wrong_name)
    assert isinstance(no_ca, ssl.SSLCertVerificationError) and "issuer" in str(no_ca)


async def test_tls_handshake_first(server_env: None, pki: Pki, tmp_path: Path) -> None:
    config = tmp_path / "tls-first.conf"
    config.write_text(
        f'include "{os.path.relpath(EXAMPLE_CONFIG, tmp_path)}"\n'
        f'tls {{ cert_file: "{pki.server_cert}", key_file: "{pki.server_key}", ca_file: "{pki.ca}", '
        "verify: true, handshake_first: true }\n"
    )
    with EmbeddedNatsServer(extra_args=("-c", str(config))) as server:
        url, tls = server.url, {**tls_settings(pki), "nats_tls_handshake_first": True}
        async with running_fleet(role_settings(url, "coordinator", **tls), role_settings(url, "engine", **tls), url):
            async with await DpcoordClient.connect(role_settings(url, "admin", **tls)) as admin:
                assert (await admin.pause()).state == "paused"
                assert (await admin.unpause()).state == "running"
        # A client that waits for the server's greeting first gets none: TLS must come first.
        late = await refused_connection(
            role_settings(url, "client", **{**tls_settings(pki), "nats_connect_timeout_s": 1.0})
        )
    assert isinstance(late, TimeoutError)


# ------------------------------------------------------------ settings


@pytest.mark.parametrize(
    ("overrides", "complaint"),
    [
        ({"nats_user": "u", "nats_password": "p", "nats_token": "t"}, "not nats_user and nats_token"),
        ({"nats_token": "t", "nats_creds_file": "x.creds"}, "not nats_token and nats_creds_file"),
        ({"nats_password": "p"}, "nats_password is set without nats_user"),
        ({"nats_user": "u"}, "nats_user is set without nats_password"),
        ({"nats_tls_key_file": "k.pem"}, "nats_tls_key_file is set without nats_tls_cert_file"),
    ],
)
def test_settings_refuse_ambiguous_authentication(overrides: dict[str, str], complaint: str) -> None:
    with pytest.raises(ValidationError, match=complaint):
        Settings(**overrides)  # type: ignore[arg-type]


def test_settings_map_onto_nats_options() -> None:
    nc = NATS()
    creds = connect_options(
        Settings(nats_creds_file="/etc/dpcoord/user.creds", nats_inbox_prefix="_INBOX_a"), "x", nc, None, None
    )
    assert creds["user_credentials"] == "/etc/dpcoord/user.creds" and creds["inbox_prefix"] == "_INBOX_a"
    nkey = connect_options(Settings(nats_nkey_seed_file="/etc/dpcoord/user.nk"), "x", nc, None, None)
    assert nkey["nkeys_seed"] == "/etc/dpcoord/user.nk" and "user" not in nkey and "token" not in nkey
    tls = connect_options(
        Settings(nats_tls_hostname="nats.example", nats_tls_handshake_first=True), "x", nc, None, None
    )
    assert tls["tls_hostname"] == "nats.example" and tls["tls_handshake_first"] is True and "tls" not in tls


async def test_refusals_match_the_subject_nats_lowercases() -> None:
    refusals, told = PublishRefusals(), []
    with refusals.watch("Fleet.pause", lambda message: told.append(("pause", message))):
        with refusals.watch("fleet.unpause", lambda message: told.append(("unpause", message))):
            await refusals.on_error(nats.errors.Error('nats: permissions violation for publish to "fleet.pause"'))
            await refusals.on_error(nats.errors.Error("nats: unrelated error"))
    assert [watch for watch, _ in told] == ["pause"] and "fleet.pause" in told[0][1]
    await refusals.on_error(nats.errors.Error('nats: permissions violation for subscription to "_inbox.x.*"'))
    assert len(told) == 1  # nobody watches any more
