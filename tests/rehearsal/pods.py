"""Pods as processes: each container started as the kubelet would start it in its image.

The process gets the image's ``ENTRYPOINT``/``CMD`` (overridden by the container's ``command``/
``args``), the image's ``ENV``, ``HOSTNAME`` and the container's rendered environment, then the
overrides of tests/rehearsal/overrides.py, and nothing of this test's own environment. Each
volume is a folder of the pod's own (Secrets and ConfigMaps written out as files), and a path
in the environment that lies under a mount points into that folder. Probes are HTTP GETs as
the kubelet sends them, to the port the probe names.
"""

from __future__ import annotations

import http.client
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Protocol

from service.bus.server import free_port
from tests.rehearsal import overrides
from tests.rehearsal.deployment import Pod
from tests.rehearsal.image_env import ImageEnvironment

ENGINE_COMPONENT = "engine"


@dataclass(frozen=True)
class ProbeAnswer:
    status: int | None  # None: no answer (refused, timed out)
    seconds: float
    detail: str

    @property
    def ok(self) -> bool:
        """The kubelet's rule for httpGet: 200 <= status < 400."""
        return self.status is not None and 200 <= self.status < 400


def pod_argv(pod: Pod, entrypoint: list[str], cmd: list[str], env: dict[str, str]) -> list[str]:
    """The container's argv: ``command`` (else the image's entrypoint) and ``args`` (else the image's
    CMD), with ``$(VAR)`` expanded from ``env``, as the kubelet builds it."""
    container = pod.container
    if "command" in container:
        argv = [*container["command"], *container.get("args", [])]
    else:
        argv = [*entrypoint, *container.get("args", cmd)]
    if pod.component == ENGINE_COMPONENT:
        for dropped in overrides.ENGINE_ARGS_DROPPED:
            if dropped in argv:
                at = argv.index(dropped)
                del argv[at : at + 2]
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), word) for word in argv]


class RunningPod(Protocol):
    """What the rehearsal's checks use of a running pod: a process (PodProcess) or a container
    (containers.PodContainer)."""

    pod: Pod
    started_at: float
    http_port: int  # where its probes (and, for the gateway, its API) answer on 127.0.0.1

    @property
    def returncode(self) -> int | None: ...

    def start(self) -> None: ...

    def probe(self, name: str) -> ProbeAnswer: ...

    def terminate(self) -> tuple[int, float]: ...

    def kill(self) -> None: ...

    def log_tail(self, lines: int = 40) -> str: ...


class PodProcess:
    """One pod's container, running."""

    def __init__(self, pod: Pod, image: ImageEnvironment, folder: Path, nats_url: str) -> None:
        self.pod = pod
        self.image = image
        self.folder = folder
        self.rendered_env = pod.env()
        self.http_port = free_port()
        self.mounts = self._mount_volumes()
        env = image.process_env() | {"HOSTNAME": pod.name}
        env |= {name: self._in_pod(value) for name, value in self.rendered_env.items()}
        env |= overrides.pod_env(nats_url, self.http_port, pod.component)
        if pod.component == ENGINE_COMPONENT:
            env |= overrides.ENGINE_ENV
        self.env = env
        final = image.dockerfile.final
        self.argv = pod_argv(pod, final.entrypoint, final.cmd, env)
        self.log_path = folder / "container.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0

    def _mount_volumes(self) -> dict[str, Path]:
        """mountPath -> the pod's folder for that volume."""
        mounts = {}
        for mount in self.pod.container.get("volumeMounts", []):
            volume_dir = self.folder / "volumes" / mount["name"]
            volume_dir.mkdir(parents=True, exist_ok=True)
            if mount["name"] not in overrides.ENGINE_VOLUMES_EMPTY or self.pod.component != ENGINE_COMPONENT:
                for relative, text in (self.pod.volume_files(mount["name"]) or {}).items():
                    (volume_dir / relative).write_text(text)
            mounts[mount["mountPath"]] = volume_dir
        return mounts

    def _in_pod(self, value: str) -> str:
        """A value naming a path under a mount, pointed into the pod's folder for it."""
        for mount_path, host in self.mounts.items():
            if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
                return str(host / PurePosixPath(value).relative_to(mount_path))
        return value

    def start(self) -> None:
        workdir = self.folder / "workdir"
        workdir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.argv, env=self.env, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.started_at = time.monotonic()

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return f"--- {self.pod.name}: {' '.join(self.argv)}\n" + "\n".join(text.splitlines()[-lines:])

    def probe(self, name: str) -> ProbeAnswer:
        """One GET of probe ``name``, with the probe's timeout."""
        return http_probe(self.pod, self.rendered_env, self.http_port, name, "127.0.0.1")

    @property
    def returncode(self) -> int | None:
        assert self.process is not None
        return self.process.poll()

    def terminate(self) -> tuple[int, float]:
        """SIGTERM, as the kubelet sends it; ``(exit status, seconds to exit)``, killed past the grace period."""
        assert self.process is not None
        began = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout=self.pod.grace_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        return code, time.monotonic() - began

    def kill(self) -> None:
        """Stop it now, if it still runs (the fixture's teardown)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def http_probe(pod: Pod, rendered_env: dict[str, str], http_port: int, name: str, host: str) -> ProbeAnswer:
    """One GET of the pod's rendered probe ``name``, with the probe's timeout, as the kubelet
    sends it (a pod run as a process or as a container). It lands on ``host:http_port``, where
    the process listens, once the probe's port is checked to be the one the pod's rendered
    environment tells it to listen on."""
    spec = pod.probes()[name]
    get = spec["httpGet"]
    port = pod.container_port(get["port"])
    rendered = int(rendered_env[overrides.port_env(pod.component)])
    assert port == rendered, f"{pod.name}: the probe targets port {port}, the process listens on {rendered}"
    assert get.get("scheme", "HTTP") == "HTTP", f"{pod.name}: {name} scheme {get['scheme']} is not rehearsed"
    connection = http.client.HTTPConnection(host, http_port, timeout=float(spec.get("timeoutSeconds", 1)))
    began = time.monotonic()
    try:
        connection.request("GET", get["path"])
        response = connection.getresponse()
        return ProbeAnswer(response.status, time.monotonic() - began, response.read().decode(errors="replace"))
    except OSError as exc:
        return ProbeAnswer(None, time.monotonic() - began, repr(exc))
    finally:
        connection.close()
