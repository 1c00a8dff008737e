"""The images' Python environments, installed from their build contexts, run as the images run
them: the coordinator's starts and holds no torch, the engine's keeps its base image's torch.

These replay the Dockerfiles without Docker, for machines without it: where Docker holds the
built images, tests/chart/test_images.py checks the images themselves and these skip."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.docker_env import missing
from tests.rehearsal.deployment import DOCKER
from tests.rehearsal.image_env import ImageEnvironment, base_layer
from tests.rehearsal.overrides import BASE_IMAGE_PACKAGES

pytestmark = [
    pytest.mark.rehearsal,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not missing(), reason="Docker holds the built images: tests/chart/test_images.py checks them"),
]

COORDINATOR = DOCKER / "coordinator.Dockerfile"
ENGINE = DOCKER / "engine.Dockerfile"
GATEWAY = DOCKER / "gateway.Dockerfile"
TORCH_STACK = ("torch", "triton", "nvidia-")

# Imports every module of service/ and handlers/ (what `dpcoord coordinator` may load; not
# service.gateway, which needs the gateway extra of its own image), then prints the distributions
# installed and whichever modules of torch and benchmarks got loaded.
PROBE = """
import importlib, importlib.metadata, json, pkgutil, sys
import service, handlers
for package in (service, handlers):
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):
        if not module.name.endswith('__main__') and not module.name.startswith('service.gateway'):
            importlib.import_module(module.name)
print(json.dumps({
    "distributions": sorted(d.metadata["Name"].lower() for d in importlib.metadata.distributions()),
    "loaded": sorted(name for name in sys.modules if name.split('.')[0] in ('torch', 'triton', 'benchmarks')),
}))
"""


def run_in(image: ImageEnvironment, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """A command in the image's environment only (its ENV and PATH, nothing of this test's)."""
    return subprocess.run(
        argv, env=image.process_env(), cwd=image.root, capture_output=True, text=True, timeout=timeout
    )


def test_the_coordinator_image_starts(images: dict[Path, ImageEnvironment]) -> None:
    image = images[COORDINATOR]
    command = [*image.dockerfile.final.entrypoint, *image.dockerfile.final.cmd]
    assert command == ["dpcoord", "coordinator"]
    helped = run_in(image, [*command, "--help"])
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("usage: dpcoord coordinator")
    # The benchmarks are not in the image: the subcommand says so instead of failing to import.
    bench = run_in(image, ["dpcoord", "bench", "--help"])
    assert (bench.returncode, bench.stdout) == (2, ""), bench.stderr
    assert "benchmarks.coordinator is not installed here" in bench.stderr


def test_the_coordinator_image_holds_no_torch_and_imports_every_module(images: dict[Path, ImageEnvironment]) -> None:
    image = images[COORDINATOR]
    probe = run_in(image, [str(image.python()), "-c", PROBE])
    assert probe.returncode == 0, probe.stderr
    found = json.loads(probe.stdout)
    assert "dpcoord" in found["distributions"] and "uvloop" in found["distributions"]  # the fast extra
    assert not [name for name in found["distributions"] if name.startswith(TORCH_STACK)]
    assert found["loaded"] == []


def test_the_gateway_image_starts_without_torch(images: dict[Path, ImageEnvironment]) -> None:
    image = images[GATEWAY]
    assert image.dockerfile.final.entrypoint == ["dpcoord"] and image.dockerfile.final.cmd == ["gateway"]
    helped = run_in(image, ["dpcoord", "gateway", "--help"])
    assert helped.returncode == 0, helped.stderr
    probe = run_in(
        image,
        [str(image.python()), "-c", "import service.gateway.server, importlib.util as u; print(u.find_spec('torch'))"],
    )
    assert (probe.returncode, probe.stdout.strip()) == (0, "None"), probe.stderr


def test_the_engine_image_keeps_its_base_images_torch(images: dict[Path, ImageEnvironment]) -> None:
    image = images[ENGINE]
    assert image.dockerfile.final.entrypoint == ["dpcoord"] and image.dockerfile.final.cmd == ["engine"]
    helped = run_in(image, ["dpcoord", "engine", "--help"])
    assert helped.returncode == 0, helped.stderr
    # The engine extra is installed, and pip kept the torch it found rather than fetching one.
    probe = run_in(image, [str(image.python()), "-c", "import tokenizers, safetensors, torch; print(torch.__file__)"])
    assert probe.returncode == 0, probe.stderr
    base = base_layer(BASE_IMAGE_PACKAGES[image.dockerfile.final.base.rsplit(":", 1)[0]])
    assert Path(probe.stdout.strip()).is_relative_to(base), (
        f"the engine extra replaced the base image's torch: {probe.stdout}"
    )
