"""What only an image build would show, read from the Dockerfiles (no Docker engine here): the
engine image's base is a CUDA build of PyTorch, and each image runs as the non-root user that
the chart's pods run as.

What the images install, and that it starts, the rehearsal checks by installing it
(tests/rehearsal/test_images.py).
"""

from __future__ import annotations

import re

from tests.rehearsal.deployment import DOCKER, pods, render
from tests.rehearsal.dockerfile import parse


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
