"""The images: what the Dockerfiles say (the engine image's base is a CUDA build of PyTorch, each
image runs as the non-root user that the chart's pods run as), and, where a Docker engine holds
the images of `make images`, what the built images hold (skipped without them, outside CI).

The rehearsal runs the images as the chart's pods (tests/rehearsal/containers.py, test_deployment.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import docker
import pytest
from docker.errors import BuildError

from tests.docker_env import COORDINATOR_IMAGE, ENGINE_IMAGE, GATEWAY_IMAGE, TORCH_CPU_BASE, images_or_skip
from tests.rehearsal.deployment import DOCKER, ROOT, pods, render
from tests.rehearsal.dockerfile import parse
from tests.rehearsal.test_images import PROBE, TORCH_STACK


def test_engine_image_is_cuda_pytorch() -> None:
    final = parse(DOCKER / "engine.Dockerfile").final
    assert re.fullmatch(r"pytorch/pytorch:[\d.]+-cuda[\d.]+-cudnn\d+-(runtime|devel)", final.base), final.base


def test_each_image_runs_as_its_pods_non_root_user() -> None:
    for pod in pods(render({}, "rel", "llm")):
        user, _, group = (parse(pod.dockerfile).final.user or "root").partition(":")
        assert user not in ("0", "root"), f"{pod.dockerfile.name} runs as root"
        security = pod.spec["securityContext"]
        assert (security["runAsUser"], security["runAsGroup"]) == (int(user), int(group or user)), pod.name
        assert security["runAsNonRoot"] is True


# ---------------------------------------------------------------- the built images (`make images`)

TORCH_PROBE = "import importlib.util as u; print(u.find_spec('torch') is not None)"


def _run(client: docker.DockerClient, image: str, *argv: str, entrypoint: str | None = None) -> str:
    """A command in a fresh container of ``image`` with no network; its output (removed after)."""
    output = client.containers.run(image, list(argv), entrypoint=entrypoint, network_mode="none", remove=True)
    return bytes(output).decode().strip()


@pytest.fixture(scope="module")
def client() -> Iterator[docker.DockerClient]:
    client = images_or_skip()
    yield client
    client.close()


def test_each_built_image_runs_as_the_user_its_dockerfile_names(client: docker.DockerClient) -> None:
    for image, dockerfile in (
        (COORDINATOR_IMAGE, "coordinator"),
        (GATEWAY_IMAGE, "gateway"),
        (ENGINE_IMAGE, "engine"),
    ):
        config = client.images.get(image).attrs["Config"]
        final = parse(DOCKER / f"{dockerfile}.Dockerfile").final
        assert (config["User"], config["Entrypoint"], config["Cmd"]) == (final.user, final.entrypoint, final.cmd)
        assert _run(client, image, "-c", "import os; print(os.getuid(), os.getgid())", entrypoint="python") == (
            "10001 10001"
        )


def test_the_coordinator_and_gateway_images_hold_no_torch_the_engine_image_cpu_torch(
    client: docker.DockerClient,
) -> None:
    assert _run(client, COORDINATOR_IMAGE, "-c", TORCH_PROBE, entrypoint="python") == "False"
    assert _run(client, GATEWAY_IMAGE, "-c", TORCH_PROBE, entrypoint="python") == "False"
    version = _run(
        client, ENGINE_IMAGE, "-c", "import torch; print(torch.__version__, torch.version.cuda)", entrypoint="python"
    )
    assert version.endswith("+cpu None"), version
    assert _run(client, COORDINATOR_IMAGE, "coordinator", "--help").startswith("usage: dpcoord coordinator")


def test_the_coordinator_image_imports_every_module_and_loads_no_torch(client: docker.DockerClient) -> None:
    found = json.loads(_run(client, COORDINATOR_IMAGE, "-c", PROBE, entrypoint="python"))
    assert "dpcoord" in found["distributions"] and "uvloop" in found["distributions"]  # the fast extra
    assert not [name for name in found["distributions"] if name.startswith(TORCH_STACK)]
    assert found["loaded"] == []


def test_the_engine_dockerfile_refuses_a_cpu_base_when_cuda_is_required(client: docker.DockerClient) -> None:
    """The CUDA check is the build argument REQUIRE_CUDA (1 by default): on the CPU base it fails."""
    with pytest.raises(BuildError) as failed:
        client.images.build(
            path=str(ROOT),
            dockerfile="docker/engine.Dockerfile",
            buildargs={"BASE_IMAGE": TORCH_CPU_BASE},
            network_mode="host",
            rm=True,
            forcerm=True,
        )
    log = "".join(str(chunk.get("stream", "")) + str(chunk.get("error", "")) for chunk in failed.value.build_log)
    assert "the base image torch is not the build REQUIRE_CUDA asks for" in log, log
