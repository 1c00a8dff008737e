"""The Docker engine the tests may use, and the images `make images` puts in it.

A test that needs a container asks ``images_or_skip()``: it skips where no engine answers or an
image is missing (a laptop without Docker, or `make images` not run), except in CI (``CI=true``),
where conftest's ``pytest_sessionstart`` has already stopped the run in that case.
"""

from __future__ import annotations

import functools
import os

import docker
import pytest
from docker.errors import DockerException, ImageNotFound

NATS_IMAGE = os.environ.get("DPCOORD_TEST_NATS_IMAGE", "dpcoord/nats:local")
COORDINATOR_IMAGE = "dpcoord/coordinator:local"
GATEWAY_IMAGE = "dpcoord/gateway:local"
ENGINE_IMAGE = "dpcoord/engine:local-cpu"
TORCH_CPU_BASE = "dpcoord/torch-cpu:2.13.0"  # the engine's CPU base (docker/local/bases.sh)
IMAGES = (COORDINATOR_IMAGE, GATEWAY_IMAGE, ENGINE_IMAGE, NATS_IMAGE, TORCH_CPU_BASE)


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def docker_client() -> docker.DockerClient | None:
    """A client of a Docker engine that answers, or None."""
    try:
        client = docker.from_env(timeout=30)
        client.ping()
    except DockerException:
        return None
    return client


@functools.cache
def missing() -> str:
    """Why the containers cannot run here ("" when they can): no engine, or the images it lacks."""
    client = docker_client()
    if client is None:
        return "no Docker engine answers"
    try:
        absent = []
        for image in IMAGES:
            try:
                client.images.get(image)
            except ImageNotFound:
                absent.append(image)
    finally:
        client.close()
    return f"Docker answers but lacks {', '.join(absent)}: run `make images`" if absent else ""


def images_or_skip() -> docker.DockerClient:
    """A Docker client with every image of IMAGES present, or the test skips saying why."""
    if missing():
        pytest.skip(missing())
    client = docker_client()
    assert client is not None, "the Docker engine stopped answering during the run"
    return client
