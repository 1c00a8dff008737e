"""Pods as containers: each rendered pod run from its image (``make images``) as the kubelet runs it.

What Kubernetes takes from the pod spec, the container gets here: the container's ``command``
(the entrypoint) and ``args`` (else the image's own), the rendered environment (no path rewriting:
the mounts are real), ``runAsUser``/``runAsGroup``, ``--read-only`` for ``readOnlyRootFilesystem``,
the dropped capabilities, ``no-new-privileges`` for ``allowPrivilegeEscalation: false``, the
default seccomp profile (``RuntimeDefault``), each ``emptyDir`` as a tmpfs (a Memory one at
/dev/shm as the shm size), each Secret and ConfigMap volume as its files, mounted read-only.
Probes are HTTP GETs as the kubelet sends them; ``terminate`` is ``docker stop -t
<terminationGracePeriodSeconds>`` (SIGTERM, then SIGKILL past the grace period).

Departures (tests/rehearsal/overrides.py): the images are the local builds (``LOCAL_IMAGES``);
the pods share the host's network, so each listens on 127.0.0.1 and a port of its own, and no
traffic leaves the loopback; the engines run the echo backend.

Every container carries the label ``LABEL`` with this run's id, and ``remove_leftovers`` removes
those of runs that died before their teardown.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import docker
from docker.errors import NotFound
from docker.models.containers import Container

from service.bus.server import free_port
from tests.chart.render import Manifest
from tests.rehearsal import overrides
from tests.rehearsal.deployment import Pod
from tests.rehearsal.pods import ENGINE_COMPONENT, ProbeAnswer, http_probe, pod_argv

LABEL = "org.dpcoord.rehearsal"
RUN_ID = f"{os.uname().nodename}-{os.getpid()}"


def remove_leftovers(client: docker.DockerClient) -> None:
    """Remove the rehearsal containers of runs on this host whose test process is gone."""
    for container in client.containers.list(all=True, filters={"label": LABEL}):
        run = container.labels.get(LABEL, "")
        host, _, pid = run.rpartition("-")
        if host == os.uname().nodename and pid.isdigit() and not Path(f"/proc/{pid}").exists():
            container.remove(force=True)


class PodContainer:
    """One pod's container: created by ``start``, removed by ``kill``."""

    def __init__(self, client: docker.DockerClient, pod: Pod, folder: Path, nats_url: str) -> None:
        self.client = client
        self.pod = pod
        self.folder = folder
        self.image = overrides.LOCAL_IMAGES[pod.dockerfile.name]
        self.rendered_env = pod.env()
        self.http_port = free_port()
        env = dict(self.rendered_env)
        env |= overrides.pod_env(nats_url, self.http_port, pod.component)
        env |= overrides.CONTAINER_ENV[pod.component]
        if pod.component == ENGINE_COMPONENT:
            env |= overrides.ENGINE_ENV
        self.env = env | {"HOSTNAME": pod.name}
        config = client.images.get(self.image).attrs["Config"]
        self.argv = pod_argv(pod, list(config["Entrypoint"] or []), list(config["Cmd"] or []), self.env)
        self.container: Container | None = None
        self.started_at = 0.0

    def _volumes(self) -> tuple[dict[str, dict[str, str]], dict[str, str], str | None]:
        """(bind mounts, tmpfs mounts, shm size) for the container's volumeMounts."""
        binds: dict[str, dict[str, str]] = {}
        tmpfs: dict[str, str] = {}
        shm_size = None
        volumes = {volume["name"]: volume for volume in self.pod.spec.get("volumes", [])}
        for mount in self.pod.container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            path = mount["mountPath"]
            if "emptyDir" in volume:
                if path == "/dev/shm":
                    shm_size = _bytes(volume["emptyDir"].get("sizeLimit", "64Mi"))
                else:
                    # An emptyDir is writable by the pod's user (fsGroup); 1777 stands in for that.
                    tmpfs[path] = "rw,exec,nosuid,nodev,mode=1777"
                continue
            host = self.folder / "volumes" / mount["name"]
            host.mkdir(parents=True, exist_ok=True)
            host.chmod(0o755)
            if not (self.pod.component == ENGINE_COMPONENT and mount["name"] in overrides.ENGINE_VOLUMES_EMPTY):
                for relative, text in (self.pod.volume_files(mount["name"]) or {}).items():
                    (host / relative).parent.mkdir(parents=True, exist_ok=True)
                    (host / relative).write_text(text)
                    (host / relative).chmod(0o644)  # a Secret volume's defaultMode
            readonly = mount.get("readOnly", False) or "secret" in volume or "configMap" in volume
            binds[str(host)] = {"bind": path, "mode": "ro" if readonly else "rw"}
        return binds, tmpfs, shm_size

    def start(self) -> None:
        security = self.pod.spec.get("securityContext", {})
        container_security: Manifest = self.pod.container.get("securityContext", {})
        binds, tmpfs, shm_size = self._volumes()
        options = []
        if container_security.get("allowPrivilegeEscalation") is False:
            options.append("no-new-privileges")
        profile = security.get("seccompProfile", {}).get("type", "RuntimeDefault")
        assert profile == "RuntimeDefault", f"{self.pod.name}: seccomp {profile} is not rehearsed"
        user = f"{security['runAsUser']}:{security.get('runAsGroup', security['runAsUser'])}"
        self.container = self.client.containers.run(
            self.image,
            self.argv[1:],
            entrypoint=self.argv[:1],
            environment=self.env,
            user=user,
            group_add=[str(security["fsGroup"])] if "fsGroup" in security else None,
            read_only=bool(container_security.get("readOnlyRootFilesystem")),
            cap_drop=container_security.get("capabilities", {}).get("drop"),
            cap_add=container_security.get("capabilities", {}).get("add"),
            security_opt=options,
            volumes=binds,
            tmpfs=tmpfs,
            shm_size=shm_size,
            network_mode="host",
            name=f"dpcoord-rehearsal-{RUN_ID}-{self.pod.name}",
            labels={LABEL: RUN_ID},
            detach=True,
        )
        self.started_at = time.monotonic()

    def exec(self, argv: list[str]) -> str:
        """``docker exec``: a command in the running container, as its user; its output."""
        assert self.container is not None
        code, output = self.container.exec_run(argv)
        assert isinstance(output, bytes)  # not streamed
        text = output.decode(errors="replace").strip()
        assert code == 0, f"{self.pod.name}: {argv} exited {code}: {text}"
        return text

    def log_tail(self, lines: int = 40) -> str:
        text = ""
        if self.container is not None:
            try:
                text = bytes(self.container.logs(tail=lines)).decode(errors="replace")
            except NotFound:
                text = "(removed)"
        return f"--- {self.pod.name} ({self.image}): {' '.join(self.argv)}\n{text}"

    def probe(self, name: str) -> ProbeAnswer:
        """One GET of probe ``name``, with the probe's timeout."""
        return http_probe(self.pod, self.rendered_env, self.http_port, name, overrides.CONTAINER_LISTEN_HOST)

    @property
    def returncode(self) -> int | None:
        assert self.container is not None
        self.container.reload()
        state = self.container.attrs["State"]
        return None if state["Running"] else int(state["ExitCode"])

    def terminate(self) -> tuple[int, float]:
        """``docker stop -t <grace>``: ``(exit status, seconds to exit)``."""
        assert self.container is not None
        began = time.monotonic()
        self.container.stop(timeout=int(self.pod.grace_s))
        code = int(self.container.wait(timeout=self.pod.grace_s + 30)["StatusCode"])
        return code, time.monotonic() - began

    def kill(self) -> None:
        """Remove it now, running or not (the fixture's teardown)."""
        if self.container is not None:
            try:
                self.container.remove(force=True)
            except NotFound:
                pass


def _bytes(quantity: str) -> str:
    """A Kubernetes quantity (8Gi, 512Mi) as Docker's size string."""
    match = re.fullmatch(r"(\d+)([KMGT]i)?", quantity)
    assert match, f"size {quantity} is not rehearsed"
    return match.group(1) + {"Ki": "k", "Mi": "m", "Gi": "g", "Ti": "t", None: "b"}[match.group(2)]
