"""Fixtures of the rehearsal: the images' environments (built once a session, cached across
runs) and a running deployment per chart configuration (one per test module and variant)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.rehearsal.deployment import DOCKER
from tests.rehearsal.image_env import ImageEnvironment, image_environment
from tests.rehearsal.running import Deployment, running

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


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def deployment(
    request: pytest.FixtureRequest, images: dict[Path, ImageEnvironment], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    with running(VARIANTS[request.param], RELEASE, NAMESPACE, images, tmp_path_factory.mktemp(request.param)) as up:
        yield up
