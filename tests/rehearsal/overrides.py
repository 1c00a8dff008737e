"""Every way the rehearsal departs from the images and the chart, each with why.

This is the one place: the code that builds the images' environments and starts the pods takes
these values from here, and the comments say why. A new departure goes here or nowhere. How a
pod's volumes become folders of its own is pods.py's docstring; what the rehearsal cannot do at
all (build the images, the pods' user and read-only root, GPUs, TLS) is tests/rehearsal/__init__.py's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# ---------------------------------------------------------------- images

# What a base image already holds, as a pip requirement: installed here once into a layer that
# the image's interpreter sees (a .pth file), so the image's own `pip install` finds it there.
# pytorch/pytorch ships a CUDA torch; its stand-in is the CPU wheel on this machine's disk.
BASE_IMAGE_PACKAGES: dict[str, tuple[str, ...]] = {"pytorch/pytorch": ("torch==2.13.0",)}


@dataclass(frozen=True)
class SkippedCommand:
    """A RUN command the rehearsal does not replay: ``pattern`` matches the command line."""

    pattern: str
    why: str

    def matches(self, argv: tuple[str, ...]) -> bool:
        return re.search(self.pattern, " ".join(argv)) is not None


SKIPPED_COMMANDS = (
    SkippedCommand(r"^useradd ", "processes run as the test's user; the image's user is checked against the chart"),
    SkippedCommand(
        r"^python -c .*torch\.version\.cuda",
        "the engine image's CUDA torch checks: the CPU wheel stands in for the base image's torch, and the "
        "rehearsal checks instead that the engine extra kept the base layer's torch",
    ),
)

# ---------------------------------------------------------------- pods

# Engines run the echo backend: this machine has no model weights and no GPU.
ENGINE_ENV = {"DPCOORD_BACKEND": "echo"}
# ...so the model argument goes (the echo backend refuses one), and with it the model volume.
ENGINE_ARGS_DROPPED = ("--model",)
ENGINE_VOLUMES_EMPTY = ("model",)


# The setting of the port a pod's probes and Service target: the gateway serves its probes on
# its own port, every other component on http_port.
PORT_ENV = {"gateway": "DPCOORD_GATEWAY_PORT"}
DEFAULT_PORT_ENV = "DPCOORD_HTTP_PORT"


def port_env(component: str) -> str:
    return PORT_ENV.get(component, DEFAULT_PORT_ENV)


def pod_env(nats_url: str, http_port: int, component: str) -> dict[str, str]:
    """What every pod's environment gets instead of the rendered value."""
    return {
        # The rendered URL names a Kubernetes Service; here the server listens on 127.0.0.1.
        "DPCOORD_NATS_URL": nats_url,
        # Pods share one network namespace here: each listens on a free port, and its probes'
        # named port is mapped to it (the rendered containerPort is checked against the setting).
        port_env(component): str(http_port),
    }


# ---------------------------------------------------------------- containers (containers.py)

# The images: the local builds of `make images`, by Dockerfile, not the chart's registry names.
# The engine's is the CPU variant (no GPU here).
LOCAL_IMAGES = {
    "coordinator.Dockerfile": "dpcoord/coordinator:local",
    "gateway.Dockerfile": "dpcoord/gateway:local",
    "engine.Dockerfile": "dpcoord/engine:local-cpu",
}

# The containers share the host's network (the NATS servers here listen on 127.0.0.1), so each
# listens on 127.0.0.1, not the rendered 0.0.0.0: no traffic leaves the loopback.
CONTAINER_LISTEN_HOST = "127.0.0.1"
CONTAINER_ENV = {
    "coordinator": {"DPCOORD_HTTP_HOST": CONTAINER_LISTEN_HOST},
    "engine": {"DPCOORD_HTTP_HOST": CONTAINER_LISTEN_HOST},
    "gateway": {"DPCOORD_GATEWAY_HOST": CONTAINER_LISTEN_HOST},
}

# ---------------------------------------------------------------- NATS

# The nats sub-chart is not fetched (no network here): its server is a nats-server started from
# the values this chart hands it (auth.conf include, JetStream, cluster size), on 127.0.0.1 and
# free ports rather than 0.0.0.0:4222, with JetStream's store in a temporary folder.
NATS_LISTEN_HOST = "127.0.0.1"

# ---------------------------------------------------------------- external NATS

# With nats.enabled=false the chart renders no NATS at all: the operator's server and Secret are
# made by the rehearsal, the server from docs/nats-server.example.conf (the documented
# configuration of an external NATS), the Secret as helm/dpcoord/README.md says to create it.
EXTERNAL_NATS_CONFIG = "docs/nats-server.example.conf"
EXTERNAL_SECRET_USERS = ("coordinator", "engine", "gateway")
