"""How dpcoord authenticates to NATS, through the DPCOORD_NATS_* settings: token, nkey, creds
file (accounts and JWTs signed here) and TLS (mutual, server name, handshake-first), each with
a fleet that serves and a stranger that is refused; the settings that refuse an ambiguous
choice and how they map onto nats-py's options; and how refused publishes are matched to the
subject NATS reports.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

import nats.errors
import nkeys
import pytest
from nats.aio.client import Client as NATS
from pydantic import ValidationError

from service.bus.connection import connect_options
from service.bus.refusals import PublishRefusals
from service.bus.server import EmbeddedNatsServer
from service.client import ClientError, DpcoordClient
from service.ops.settings import Settings
from service.protocol.state import CoordinatorState
from tests.conftest import make_settings
from tests.nats_jwt import Operator
from tests.security_helpers import EXAMPLE_CONFIG, PREFIX, role_settings, running_fleet

TLS_NAME = "nats.dpcoord.test"  # the only name in the test server certificate


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
