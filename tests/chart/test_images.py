"""The container images, read rather than built (no Docker engine here): the coordinator image
installs nothing that pulls torch, the coordinator's code does not import it, and both images
build from files in the repository as a non-root user."""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import subprocess
import sys
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.helpers import REPO_ROOT

COORDINATOR = REPO_ROOT / "docker" / "coordinator.Dockerfile"
ENGINE = REPO_ROOT / "docker" / "engine.Dockerfile"
TORCH_STACK = {"torch", "triton"}  # and every nvidia-* CUDA wheel


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def pip_install_targets(dockerfile: Path) -> list[str]:
    """What each ``pip install`` in a RUN installs (its non-option arguments)."""
    targets = []
    for instruction, arguments in instructions(dockerfile):
        if instruction != "RUN":
            continue
        command: list[str] = []
        for word in [*shlex.split(arguments), "&&"]:
            if word not in ("&&", ";", "||"):
                command.append(word)
                continue
            if "pip" in {Path(part).name for part in command} and "install" in command:
                after = command[command.index("install") + 1:]
                targets += [part for part in after if not part.startswith("-")]
            command = []
    return targets


def project_requirements(extras: set[str]) -> list[Requirement]:
    """dpcoord's own requirements (from pyproject.toml, what an image build installs) for ``extras``."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(text) for text in project["dependencies"]]
    for extra in extras:
        requirements += [Requirement(text) for text in project["optional-dependencies"][extra]]
    return requirements


def closure(requirements: list[Requirement]) -> set[str]:
    """Every distribution those requirements pull in, resolved through what this environment installed."""
    seen: set[str] = set()
    pending = [(requirement, "") for requirement in requirements]
    while pending:
        requirement, extra = pending.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(requirement.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            declared = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # only needed on another platform; nothing it pulls is installed here either
        for text in declared:
            child = Requirement(text)
            for wanted_extra in requirement.extras or {""}:
                pending.append((child, wanted_extra))
    return seen


def torch_stack(distributions: set[str]) -> set[str]:
    return {name for name in distributions if name in TORCH_STACK or name.startswith("nvidia-")}


def test_coordinator_image_installs_the_package_without_the_engine_extra() -> None:
    assert pip_install_targets(COORDINATOR) == [".[fast]"]  # uvloop (docs/performance.md), no torch


def test_coordinator_requirements_exclude_torch() -> None:
    installed = closure(project_requirements(extras=set()))
    assert "nats-py" in installed and "prometheus-client" in installed
    assert not torch_stack(installed), f"the coordinator image would install {torch_stack(installed)}"
    # The same resolution does see torch where it is asked for: the engine image's install set.
    assert "torch" in closure(project_requirements(extras={"engine"}))


def test_coordinator_code_does_not_import_torch() -> None:
    """Import every module of service/ and handlers/ (what `dpcoord coordinator` may load) in a fresh interpreter."""
    probe = (
        "import importlib, pkgutil, sys\n"
        "import service, handlers\n"
        "for package in (service, handlers):\n"
        "    for module in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):\n"
        "        if not module.name.endswith('__main__'):\n"
        "            importlib.import_module(module.name)\n"
        "importlib.import_module('service.coordinator.observability')\n"
        "print(sorted(name for name in sys.modules if name.split('.')[0] in ('torch', 'triton')))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_engine_image_is_cuda_pytorch_with_the_engine_extra() -> None:
    steps = instructions(ENGINE)
    [base] = [arguments for instruction, arguments in steps if instruction == "ARG" and arguments.startswith("BASE_IMAGE=")]
    assert re.fullmatch(r"BASE_IMAGE=pytorch/pytorch:[\d.]+-cuda[\d.]+-cudnn\d+-(runtime|devel)", base)
    assert ("FROM", "${BASE_IMAGE}") in steps
    assert pip_install_targets(ENGINE) == [".[engine,fast]"]


@pytest.mark.parametrize("dockerfile", [COORDINATOR, ENGINE], ids=["coordinator", "engine"])
def test_images_build_from_the_repository_as_non_root(dockerfile: Path) -> None:
    steps = instructions(dockerfile)
    ignored = [line.strip() for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    for instruction, arguments in steps:
        if instruction == "COPY" and not arguments.startswith("--from"):
            *sources, _ = arguments.split()
            for source in sources:
                assert (REPO_ROOT / source).exists(), f"{dockerfile.name} copies {source}, which the repository lacks"
                assert not any(fnmatch(source, pattern) for pattern in ignored), f"{source} is in .dockerignore"
    [user] = [arguments for instruction, arguments in steps if instruction == "USER"]
    assert user.split(":")[0] not in {"0", "root"}
    assert steps[-1][0] == "CMD" and ("ENTRYPOINT", '["dpcoord"]') in steps
