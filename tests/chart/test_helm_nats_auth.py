"""The NATS users and permissions the chart renders, run on a real nats-server.

The chart's auth.conf is laid out as the nats chart lays it out in its pod (its config at
/etc/nats-config/nats.conf including ``nats.config.merge.$include``, our Secret mounted where
``nats.container.patch`` puts it), so the include path is checked too. Then a coordinator and
an engine run with the chart's coordinator and engine credentials, a client may submit but not
pause, and only the admin may pause and list the services.
"""

from __future__ import annotations

import asyncio
import base64
import json
import posixpath
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import pytest
from helm_python import Chart
from nats.aio.client import Client as NATS

from engines.echo import EchoBackend
from engines.observability import engine_observability
from engines.runtime import EngineRuntime
from handlers import HANDLERS
from service.bus.server import EmbeddedNatsServer
from service.coordinator.coordinator import Coordinator
from service.coordinator.observability import coordinator_observability
from service.ops.settings import Settings
from service.protocol.state import CoordinatorState
from service.protocol.subjects import CONTROL_HEADERS, ENGINE_HEADERS, PROFILER_HEADERS, Header
from tests.chart.contract import CHART
from tests.chart.test_helm_chart import RELEASE, render
from tests.helpers import request_json
from tests.integration.test_observability import collect_replies

NATS_CONFIG_DIR = "/etc/nats-config"  # where the nats chart mounts nats.conf in its pod
USERS = ("coordinator", "engine", "client", "gateway", "admin")


@dataclass(frozen=True)
class RenderedAuth:
    auth_conf: str
    passwords: dict[str, str]
    include: str  # as nats.conf says it
    mount_path: str  # where the nats container sees our Secret


def rendered_auth(values: dict[str, Any]) -> RenderedAuth:
    with Chart.load(CHART) as chart:
        objects = render(chart, values)
        nats_values = chart.merge_values(values)["nats"]
    secrets = {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == "Secret"}
    auth_secret = secrets[f"{RELEASE}-dpcoord-nats-auth"]
    credentials = secrets.get(f"{RELEASE}-dpcoord-nats-credentials", {"data": {}})["data"]
    passwords = {
        user: base64.b64decode(credentials[f"{user}-password"]).decode()
        for user in USERS
        if f"{user}-password" in credentials
    }
    [mount] = [patch["value"] for patch in nats_values["container"]["patch"] if patch["path"] == "/volumeMounts/-"]
    [volume] = [patch["value"] for patch in nats_values["podTemplate"]["patch"] if patch["path"] == "/spec/volumes/-"]
    assert volume["name"] == mount["name"]
    # The sub-chart templates the Secret's name in its own context, where only the release is known.
    secret_name = volume["secret"]["secretName"]["$tplYaml"].replace("{{ .Release.Name }}", RELEASE)
    assert secret_name == auth_secret["metadata"]["name"]
    return RenderedAuth(
        auth_secret["stringData"]["auth.conf"],
        passwords,
        nats_values["config"]["merge"]["$include"],
        mount["mountPath"],
    )


def start_server(auth: RenderedAuth, root: Path) -> EmbeddedNatsServer:
    """A nats-server (to start) with nats.conf and the auth Secret where they are in the NATS pod, under ``root``."""
    secret_dir = root / auth.mount_path.lstrip("/")
    secret_dir.mkdir(parents=True)
    (secret_dir / "auth.conf").write_text(auth.auth_conf)
    config_dir = root / NATS_CONFIG_DIR.lstrip("/")
    config_dir.mkdir(parents=True)
    (config_dir / "nats.conf").write_text(f"include {auth.include}\n")
    assert posixpath.normpath(posixpath.join(NATS_CONFIG_DIR, auth.include)) == f"{auth.mount_path}/auth.conf"
    return EmbeddedNatsServer(extra_args=("-c", str(config_dir / "nats.conf")))


def permissions(auth_conf: str) -> dict[str, dict[str, Any]]:
    body = auth_conf.split("authorization:", 1)[1]
    return {user["user"]: user["permissions"] for user in json.loads(body)["users"]}


def subjects(headers: set[Header] | frozenset[Header]) -> set[str]:
    return {f"dpcoord.{header}" for header in headers}


# Who sends each header. A new header fails this test until it is given to a user here and in
# templates/nats-auth.yaml.
SIGNALS = CONTROL_HEADERS | PROFILER_HEADERS | {Header.SHUTDOWN, Header.UPDATE_WEIGHTS}
BETWEEN_COORDINATORS = {
    Header.COORDINATOR_HEARTBEAT,
    Header.FORWARD_SUBMISSION,
    Header.FORWARD_ABORT,
    Header.ARBITER_SUBMISSION,
    Header.ARBITER_CLAIMS,
    Header.FORWARD_HOLD,
}
FROM_ENGINES = set(ENGINE_HEADERS)
FROM_CLIENTS = {Header.CONNECT, Header.SUBMIT_REQUEST, Header.ABORT_REQUEST, Header.HOLD_REQUEST, Header.LIST_MODELS}


def test_permissions_follow_the_protocols_subjects() -> None:
    assert SIGNALS | BETWEEN_COORDINATORS | FROM_ENGINES | FROM_CLIENTS == set(Header)
    rules = permissions(rendered_auth({}).auth_conf)
    # And a named submission to the replica arbitrating its id (service/protocol/arbiter.py).
    assert set(rules["client"]["publish"]["allow"]) == subjects(FROM_CLIENTS) | {"dpcoord.submit_request.*"}
    # Engines send on dpcoord.<header>.<engine_id>; one shared user may send as any engine.
    assert set(rules["engine"]["publish"]["allow"]) == {f"{subject}.*" for subject in subjects(FROM_ENGINES)}
    coordinator = rules["coordinator"]["publish"]
    assert "deny" not in coordinator  # an allow list: everything else is refused
    assert {subject for subject in coordinator["allow"] if subject.startswith("dpcoord.")} == {
        "dpcoord.engine.*.*",
        "dpcoord.engines.*",
        "dpcoord.coordinator_heartbeat",
        "dpcoord.forward_submission.*",  # to one replica: only coordinators may forward
        "dpcoord.forward_abort.*",
        "dpcoord.arbiter_submission.*",  # a copy handed to its id's arbiter, believed as sent
        "dpcoord.arbiter_claims.*",
        "dpcoord.forward_hold.*",
    }
    # Replies into inboxes only: the clients' and admin's, and the pods'.
    inboxes = {subject for subject in coordinator["allow"] if subject.startswith("_INBOX")}
    assert inboxes == {"_INBOX.>", "_INBOX_coordinator.>", "_INBOX_engine.>", "_INBOX_gateway.>"}
    jetstream = [subject for subject in coordinator["allow"] if subject.startswith("$")]
    assert jetstream and all("dpcoord_control" in subject for subject in jetstream)  # its own bucket only
    assert rules["admin"]["publish"]["allow"] == ["dpcoord.>", "$SRV.>"]
    # Each pod replies on its role's inbox prefix (the chart sets it per pod), which no client may read.
    for role in ("coordinator", "engine"):
        role_inboxes = [subject for subject in rules[role]["subscribe"]["allow"] if subject.startswith("_INBOX")]
        assert role_inboxes == [f"_INBOX_{role}.>"]
    # Clients may watch the replicas' heartbeats, to resubmit the requests of one that died.
    assert rules["client"]["subscribe"]["allow"] == ["_INBOX.>", "dpcoord.coordinator_heartbeat"]
    # The gateway is a client with its own reply inbox, which other clients cannot read.
    assert rules["gateway"]["publish"] == rules["client"]["publish"]
    assert rules["gateway"]["subscribe"]["allow"] == ["_INBOX_gateway.>", "dpcoord.coordinator_heartbeat"]


class Connection:
    """A nats-py client that keeps the server's asynchronous errors (permission violations)."""

    def __init__(self) -> None:
        self.nc = NATS()
        self.errors: asyncio.Queue[Exception] = asyncio.Queue()

    async def connect(self, url: str, user: str, password: str) -> NATS:
        async def on_error(exc: Exception) -> None:
            await self.errors.put(exc)

        await self.nc.connect(url, user=user, password=password, error_cb=on_error, allow_reconnect=False)
        return self.nc

    async def refused(self, subject: str) -> str:
        """Publish where this user may not; the server's complaint, lower-cased."""
        await self.nc.publish(subject, b"{}")
        error = await asyncio.wait_for(self.errors.get(), 5)
        return str(error).lower()


def as_pod(settings: Settings, role: str, auth: RenderedAuth) -> Settings:
    """A pod's NATS settings as the chart sets them: its role's credentials and reply-inbox prefix."""
    return settings.model_copy(
        update={"nats_user": role, "nats_password": auth.passwords[role], "nats_inbox_prefix": f"_INBOX_{role}"}
    )


@pytest.fixture
async def secured(tmp_path: Path) -> AsyncIterator[tuple[str, RenderedAuth, Coordinator, EngineRuntime]]:
    auth = rendered_auth({})
    with start_server(auth, tmp_path) as server:
        base = Settings(nats_url=server.url, heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0, control_timeout_s=2.0)
        coordinator = Coordinator(as_pod(base, "coordinator", auth), HANDLERS)
        engine = EngineRuntime(as_pod(base, "engine", auth), EchoBackend())
        async with coordinator:
            coordinator_obs = coordinator_observability(coordinator, "127.0.0.1", None)
            await coordinator_obs.start(coordinator.nc)
            async with engine:
                engine_obs = engine_observability(engine, "127.0.0.1", None)
                await engine_obs.start(engine.nc)
                await coordinator.wait_for_engines(1)
                await engine.registered.wait()
                yield server.url, auth, coordinator, engine
                await engine_obs.stop()
            await coordinator_obs.stop()


@pytest.fixture
async def connect() -> AsyncIterator[Any]:
    opened: list[Connection] = []

    async def open_as(url: str, user: str, password: str) -> Connection:
        connection = Connection()
        await connection.connect(url, user, password)
        opened.append(connection)
        return connection

    yield open_as
    for connection in opened:
        await connection.nc.close()


async def test_client_submits_but_cannot_pause(secured: Any, connect: Any) -> None:
    url, auth, coordinator, _ = secured
    client = await connect(url, "client", auth.passwords["client"])
    reply = await request_json(
        client.nc, "dpcoord.submit_request", {"prompt": "hi", "sampling_params": {"max_tokens": 2}}
    )
    assert reply["type"] == "final" and reply["generated_text"] == "hi"
    models = await request_json(client.nc, "dpcoord.list_models", {})  # what the gateway, a client, asks
    assert models["type"] == "models"
    for forbidden in (
        "dpcoord.pause",
        "dpcoord.shutdown",
        "dpcoord.start_cuda_profiler",
        "dpcoord.register",
        "$SRV.PING",
    ):
        assert f'permissions violation for publish to "{forbidden.lower()}"' in await client.refused(forbidden)
    assert coordinator.state is CoordinatorState.RUNNING


async def test_only_admin_pauses_and_lists_services(secured: Any, connect: Any) -> None:
    url, auth, coordinator, engine = secured
    admin = await connect(url, "admin", auth.passwords["admin"])
    ack = await request_json(admin.nc, "dpcoord.pause", {})
    assert ack == {"type": "ack", "signal": "pause", "state": "paused", "revision": 2}
    assert coordinator.state is CoordinatorState.PAUSED
    assert (await request_json(admin.nc, "dpcoord.unpause", {}))["state"] == "running"
    services = await collect_replies(admin.nc, "$SRV.PING", {coordinator.id, engine.engine_id})
    assert {reply["name"] for reply in services.values()} == {"dpcoord-coordinator", "dpcoord-engine"}


async def test_only_coordinators_reach_the_control_state(secured: Any, connect: Any) -> None:
    url, auth, coordinator, _ = secured
    assert coordinator.shared.shared  # the chart's NATS has JetStream and the coordinator its bucket
    for user in ("client", "engine", "admin"):
        connection = await connect(url, user, auth.passwords[user])
        for forbidden in ("$KV.dpcoord_control.dpcoord", "$JS.API.STREAM.PURGE.KV_dpcoord_control"):
            assert f'permissions violation for publish to "{forbidden.lower()}"' in await connection.refused(forbidden)
    coordinator_user = await connect(url, "coordinator", auth.passwords["coordinator"])
    for forbidden in ("$KV.other_control.other", "$JS.API.STREAM.DELETE.KV_dpcoord_control"):
        assert f'permissions violation for publish to "{forbidden.lower()}"' in await coordinator_user.refused(
            forbidden
        )
    assert coordinator.state is CoordinatorState.RUNNING and coordinator.shared.revision == 1


async def test_engines_and_coordinators_stay_in_their_lanes(secured: Any, connect: Any) -> None:
    url, auth, _, _ = secured
    engine_user = await connect(url, "engine", auth.passwords["engine"])
    for forbidden in ("dpcoord.submit_request", "dpcoord.pause", "dpcoord.engines.stop"):
        assert f'permissions violation for publish to "{forbidden.lower()}"' in await engine_user.refused(forbidden)
    coordinator_user = await connect(url, "coordinator", auth.passwords["coordinator"])
    for forbidden in ("dpcoord.shutdown", "dpcoord.submit_request", "dpcoord.engine_reply.e1", "billing.charge"):
        assert f'permissions violation for publish to "{forbidden.lower()}"' in await coordinator_user.refused(
            forbidden
        )


async def test_wrong_password_is_refused(secured: Any) -> None:
    url, _, _, _ = secured
    with pytest.raises(nats.errors.Error, match="[Aa]uthorization"):
        await nats.connect(url, user="client", password="guess", allow_reconnect=False, max_reconnect_attempts=0)


async def test_auth_off_leaves_nats_open(tmp_path: Path) -> None:
    auth = rendered_auth({"natsAuth": {"enabled": False}})
    assert auth.passwords == {} and "authorization" not in auth.auth_conf.replace("# dpcoord: NATS authentication", "")
    with start_server(auth, tmp_path) as server:
        nc = await nats.connect(server.url)
        await nc.close()


def test_given_passwords_are_used() -> None:
    auth = rendered_auth({"natsAuth": {"passwords": {"client": "let-me-in"}}})
    assert auth.passwords["client"] == "let-me-in"
    assert len(auth.passwords["admin"]) == 32
    assert sorted(permissions(auth.auth_conf)) == sorted(USERS)
    assert "let-me-in" not in auth.auth_conf  # the server gets bcrypt hashes only
