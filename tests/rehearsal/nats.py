"""The NATS a rendered deployment talks to, as nats-server processes.

Bundled (``nats.enabled``): the nats sub-chart is not fetched here, so its server is configured
from the values this chart hands it, laid out as that chart lays out its pod: ``nats.conf`` in
/etc/nats-config with ``config.merge`` (our auth.conf ``include``), the auth Secret mounted
where ``container.patch`` mounts it, JetStream with a store folder when
``config.jetstream.enabled``, and ``config.cluster.replicas`` routed servers when
``config.cluster.enabled``.

External (``nats.enabled: false``): the operator's server, from docs/nats-server.example.conf,
with the passwords the operator put in the credentials Secret the chart names.
"""

from __future__ import annotations

import json
import posixpath
import secrets
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.bus.server import EmbeddedNatsServer, free_port
from tests.chart.render import Manifest
from tests.rehearsal import overrides
from tests.rehearsal.deployment import ROOT, Rendered, secret_data

NATS_CONFIG_DIR = "/etc/nats-config"  # where the nats chart mounts nats.conf in its pod
USERS = ("coordinator", "engine", "client", "gateway", "admin")


@dataclass(frozen=True)
class Nats:
    urls: list[str]
    passwords: dict[str, str]  # user -> password, for the people (client, admin) and the pods
    inbox_prefixes: dict[str, str]  # user -> the reply-inbox prefix its permissions allow
    operator_objects: tuple[Manifest, ...]  # Secrets the operator made (external NATS)

    @property
    def url(self) -> str:
        return self.urls[0]


def _conf_value(value: Any) -> str:
    return json.dumps(value)


def _pod_path(root: Path, path: str) -> Path:
    return root / path.lstrip("/")


def _patched(patches: list[Manifest], path: str) -> Manifest:
    [value] = [patch["value"] for patch in patches if patch["op"] == "add" and patch["path"] == path]
    return dict(value)


def _bundled_config(rendered: Rendered, root: Path, index: int, cluster_ports: list[int]) -> Path:
    """nats.conf and the auth Secret of NATS pod ``index``, under ``root``."""
    values = rendered.values["nats"]
    mount = _patched(values["container"]["patch"], "/volumeMounts/-")
    volume = _patched(values["podTemplate"]["patch"], "/spec/volumes/-")
    assert volume["name"] == mount["name"]
    # The sub-chart templates the Secret's name in its own context, where only the release is known.
    secret_name = volume["secret"]["secretName"]["$tplYaml"].replace("{{ .Release.Name }}", rendered.release)
    secret_dir = _pod_path(root, mount["mountPath"])
    secret_dir.mkdir(parents=True)
    for key, text in secret_data(rendered.find("Secret", secret_name)).items():
        (secret_dir / key).write_text(text)

    config = values["config"]
    assert "patch" not in config, "nats.config.patch is not rehearsed (tests/rehearsal/nats.py)"
    name = f"{rendered.release}-nats"
    lines = [f"server_name: {name}-{index}"]
    for key, value in config.get("merge", {}).items():
        if key == "$include":
            assert posixpath.normpath(posixpath.join(NATS_CONFIG_DIR, value)).startswith(mount["mountPath"] + "/")
            lines.append(f"include {value}")
        else:
            lines.append(f"{key}: {_conf_value(value)}")
    if config["jetstream"]["enabled"]:
        store = _pod_path(root, config["jetstream"].get("fileStore", {}).get("dir", "/data"))
        lines.append(f"jetstream {{ store_dir: {_conf_value(str(store))} }}")
    if config["cluster"]["enabled"]:
        listen = f"{overrides.NATS_LISTEN_HOST}:{cluster_ports[index]}"
        routes = [f"nats://{overrides.NATS_LISTEN_HOST}:{port}" for port in cluster_ports]
        lines.append(f"cluster {{ name: {name}, listen: {_conf_value(listen)}, routes: {_conf_value(routes)} }}")
    config_file = _pod_path(root, NATS_CONFIG_DIR) / "nats.conf"
    config_file.parent.mkdir(parents=True)
    config_file.write_text("\n".join(lines) + "\n")
    return config_file


@contextmanager
def bundled_nats(rendered: Rendered, folder: Path) -> Iterator[Nats]:
    config = rendered.values["nats"]["config"]
    size = int(config["cluster"]["replicas"]) if config["cluster"]["enabled"] else 1
    cluster_ports = [free_port() for _ in range(size)]
    credentials = {}
    if rendered.values["natsAuth"]["enabled"]:
        secret = rendered.find("Secret", f"{rendered.release}-dpcoord-nats-credentials")
        credentials = {user: secret_data(secret)[f"{user}-password"] for user in USERS}
    with ExitStack() as stack:
        servers = [
            EmbeddedNatsServer(  # JetStream as the rendered config says, not the embedded default
                extra_args=("-c", str(_bundled_config(rendered, folder / f"nats-{index}", index, cluster_ports))),
                jetstream=False,
            )
            for index in range(size)
        ]
        for server in servers:
            stack.enter_context(server)
        # People use the nats CLI's default inbox, as NOTES.txt's `nats request` does; the pods set their own.
        yield Nats([server.url for server in servers], credentials, dict.fromkeys(USERS, "_INBOX"), ())


@contextmanager
def external_nats(rendered: Rendered, folder: Path) -> Iterator[Nats]:
    """The operator's server (docs/nats-server.example.conf) and the credentials Secret the chart names."""
    passwords = {user: secrets.token_hex(16) for user in USERS}
    external = rendered.values["externalNats"]
    assert external["auth"] == "userPassword", "the rehearsal's operator makes a userPassword Secret"
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": external["credentialsSecret"]},
        "stringData": {
            key: value
            for user in overrides.EXTERNAL_SECRET_USERS
            for key, value in ((f"{user}-user", user), (f"{user}-password", passwords[user]))
        },
    }
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "nats.conf"
    # The example reads the passwords from variables; defined ahead of it, as its environment would.
    variables = "".join(
        f"NATS_PASSWORD_{user.upper()}: {_conf_value(password)}\n" for user, password in passwords.items()
    )
    config.write_text(variables + (ROOT / overrides.EXTERNAL_NATS_CONFIG).read_text())
    with EmbeddedNatsServer(extra_args=("-c", str(config))) as server:
        # docs/security.md: each role replies on its own inbox prefix, _INBOX_<role>.
        yield Nats([server.url], passwords, {user: f"_INBOX_{user}" for user in USERS}, (secret,))
