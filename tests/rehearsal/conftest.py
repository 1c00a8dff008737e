"""Fixtures of the rehearsal: a running deployment per chart configuration (one per test module
and variant), its pods as containers of the built images where Docker holds them (containers.py),
else as processes of the images' environments (built once a session, cached across runs)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.docker_env import docker_client, missing
from tests.rehearsal.containers import PodContainer, remove_leftovers
from tests.rehearsal.deployment import DOCKER, Pod
from tests.rehearsal.image_env import ImageEnvironment, image_environment
from tests.rehearsal.pods import PodProcess, RunningPod
from tests.rehearsal.running import Deployment, PodFactory, running

RELEASE = "rel"
NAMESPACE = "llm"
VARIANTS: dict[str, dict[str, Any]] = {
    "bundled-nats": {},
    "external-nats": {
        "nats": {"enabled": False},
        "externalNats": {
            "url": "nats://nats.messaging.svc:4222",
            "credentialsSecret": "dpcoord-nats-users",
            "auth": "userPassword",
        },
    },
}


@pytest.fixture(scope="session")
def images() -> dict[Path, ImageEnvironment]:
    """Every image of docker/, by Dockerfile, built in parallel."""
    dockerfiles = sorted(DOCKER.glob("*.Dockerfile"))
    with ThreadPoolExecutor(len(dockerfiles)) as pool:
        return dict(zip(dockerfiles, pool.map(image_environment, dockerfiles), strict=True))


@pytest.fixture(scope="session")
def make_pod(request: pytest.FixtureRequest) -> Iterator[PodFactory]:
    """Pods as containers when Docker holds the images, else as processes (the images' environments)."""
    if missing():
        images: dict[Path, ImageEnvironment] = request.getfixturevalue("images")

        def as_process(pod: Pod, folder: Path, nats_url: str) -> RunningPod:
            return PodProcess(pod, images[pod.dockerfile], folder, nats_url)

        yield as_process
        return
    client = docker_client()
    assert client is not None, "the Docker engine stopped answering"
    remove_leftovers(client)

    def as_container(pod: Pod, folder: Path, nats_url: str) -> RunningPod:
        return PodContainer(client, pod, folder, nats_url)

    yield as_container
    client.close()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def deployment(
    request: pytest.FixtureRequest, make_pod: PodFactory, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    with running(VARIANTS[request.param], RELEASE, NAMESPACE, make_pod, tmp_path_factory.mktemp(request.param)) as up:
        yield up
