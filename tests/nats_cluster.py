"""A three-node NATS cluster with JetStream, as containers of the NATS image on a Docker network of
its own, so that a JetStream bucket really gets three replicas and a node can be stopped under it.

The nodes route to each other by container name on that network; each publishes its client port
on 127.0.0.1 only and advertises nothing (``--no_advertise``), so clients here use exactly the
URLs given and no traffic leaves the loopback. Everything is removed on exit.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import docker
from docker.models.containers import Container

from tests.docker_env import NATS_IMAGE

CLIENT_PORT = "4222/tcp"
READY_LOG = b"Server is ready"
LEADER_LOG = b"metadata leader"  # JetStream answers once the cluster elected its meta leader


@dataclass
class Cluster:
    client: docker.DockerClient
    nodes: list[Container]

    def url(self, index: int) -> str:
        self.nodes[index].reload()
        [binding] = self.nodes[index].attrs["NetworkSettings"]["Ports"][CLIENT_PORT]
        return f"nats://127.0.0.1:{binding['HostPort']}"

    @property
    def urls(self) -> str:
        """Every node's URL, comma separated, as settings.nats_url takes them."""
        return ",".join(self.url(index) for index in range(len(self.nodes)))

    def stop(self, index: int) -> None:
        self.nodes[index].stop(timeout=10)


def _wait_for(node: Container, text: bytes) -> None:
    """Follow the node's log until a line holds ``text`` (the test's timeout bounds it)."""
    for line in node.logs(stream=True, follow=True):
        if text in line:
            return
    raise AssertionError(f"{node.name} exited before it logged {text!r}:\n{node.logs().decode()}")


@contextmanager
def nats_cluster(client: docker.DockerClient, size: int = 3) -> Iterator[Cluster]:
    run = f"dpcoord-cluster-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    network = client.networks.create(run, driver="bridge")
    names = [f"{run}-n{index}" for index in range(size)]
    routes = ",".join(f"nats://{name}:6222" for name in names)
    nodes: list[Container] = []
    try:
        for name in names:
            nodes.append(
                # A None host port is a free one; the stubs allow only an int there.
                client.containers.run(  # type: ignore[call-overload]
                    NATS_IMAGE,
                    ["-js", "-sd", "/data", "-n", name, "--cluster_name", run, "--cluster", "nats://0.0.0.0:6222"]
                    + ["--routes", routes, "--no_advertise=true"],
                    name=name,
                    network=network.name,
                    ports={CLIENT_PORT: ("127.0.0.1", None)},
                    detach=True,
                )
            )
        for node in nodes:
            _wait_for(node, READY_LOG)
        _wait_for(nodes[0], LEADER_LOG)
        yield Cluster(client, nodes)
    finally:
        for node in nodes:
            node.remove(force=True)
        network.remove()
