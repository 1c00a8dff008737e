"""The chart's pods, read from its rendered objects: what the kubelet would start.

Each replica of each Deployment and StatefulSet whose image is built from ``docker/`` becomes a
``Pod``: its container's command and args, its environment (``envFrom`` ConfigMaps and Secrets,
then ``env`` with ``value``, ``configMapKeyRef``, ``secretKeyRef`` and ``fieldRef``), its
volumes, probes, ports and grace period. A field the rehearsal does not know fails loudly.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helm_python import Chart

from tests.chart.contract import CHART
from tests.chart.render import Manifest, render_objects

ROOT = CHART.parents[1]
DOCKER = ROOT / "docker"
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


@dataclass(frozen=True)
class Rendered:
    values: dict[str, Any]  # the merged values
    objects: list[Manifest]
    release: str
    namespace: str

    def find(self, kind: str, name: str) -> Manifest:
        found = [obj for obj in self.objects if obj["kind"] == kind and obj["metadata"]["name"] == name]
        assert found, f"the chart renders no {kind} {name}"
        return found[0]


def render(values: dict[str, Any], release: str, namespace: str) -> Rendered:
    with Chart.load(CHART) as chart:
        return Rendered(
            chart.merge_values(values), render_objects(chart, values, release, namespace), release, namespace
        )


def secret_data(secret: Manifest) -> dict[str, str]:
    """A Secret's keys as the pod sees them: ``data`` base64-decoded, ``stringData`` as written."""
    data = {key: base64.b64decode(value).decode() for key, value in secret.get("data", {}).items()}
    return data | dict(secret.get("stringData", {}))


@dataclass(frozen=True)
class Pod:
    name: str
    workload: Manifest
    rendered: Rendered
    extra_objects: tuple[Manifest, ...]  # what the operator made: Secrets the chart only names

    @property
    def spec(self) -> Manifest:
        return self.workload["spec"]["template"]["spec"]

    @property
    def container(self) -> Manifest:
        [main] = self.spec["containers"]
        return main

    @property
    def component(self) -> str:
        return str(self.workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"])

    @property
    def dockerfile(self) -> Path:
        """The Dockerfile of the container's image: ``<registry>/<name>:<tag>`` is docker/<name>.Dockerfile."""
        repository = self.container["image"].rsplit(":", 1)[0]
        path = DOCKER / f"{repository.rsplit('/', 1)[-1]}.Dockerfile"
        assert path.exists(), f"{self.name}: image {self.container['image']} has no {path.relative_to(ROOT)}"
        return path

    @property
    def grace_s(self) -> float:
        return float(self.spec.get("terminationGracePeriodSeconds", 30))

    def probes(self) -> dict[str, Manifest]:
        return {name: self.container[name] for name in PROBES if name in self.container}

    def container_port(self, port: int | str) -> int:
        """A probe's port, by number or by the container port's name."""
        if isinstance(port, int):
            return port
        [found] = [entry["containerPort"] for entry in self.container.get("ports", []) if entry.get("name") == port]
        return int(found)

    def _object(self, kind: str, name: str) -> Manifest:
        for obj in (*self.extra_objects, *self.rendered.objects):
            if obj["kind"] == kind and obj["metadata"]["name"] == name:
                return obj
        raise AssertionError(f"{self.name}: {kind} {name} is neither rendered nor made by the operator")

    def _key(self, kind: str, ref: Manifest) -> str:
        obj = self._object(kind, ref["name"])
        data = secret_data(obj) if kind == "Secret" else obj.get("data", {})
        assert ref["key"] in data, f"{self.name}: {kind} {ref['name']} has no key {ref['key']}"
        return str(data[ref["key"]])

    def _field(self, path: str) -> str:
        fields = {
            "metadata.name": self.name,
            "metadata.namespace": self.rendered.namespace,
            "status.podIP": "127.0.0.1",
        }
        assert path in fields, f"{self.name}: fieldRef {path} is not rehearsed (tests/rehearsal/deployment.py)"
        return fields[path]

    def env(self) -> dict[str, str]:
        """The container's environment as Kubernetes builds it (without the image's own ENV)."""
        env: dict[str, str] = {}
        for source in self.container.get("envFrom", []):
            prefix = source.get("prefix", "")
            if "configMapRef" in source:
                data = self._object("ConfigMap", source["configMapRef"]["name"]).get("data", {})
            else:
                data = secret_data(self._object("Secret", source["secretRef"]["name"]))
            env |= {prefix + key: str(value) for key, value in data.items()}
        for entry in self.container.get("env", []):
            if "value" in entry:
                value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), str(entry["value"]))
            elif "configMapKeyRef" in entry["valueFrom"]:
                value = self._key("ConfigMap", entry["valueFrom"]["configMapKeyRef"])
            elif "secretKeyRef" in entry["valueFrom"]:
                value = self._key("Secret", entry["valueFrom"]["secretKeyRef"])
            elif "fieldRef" in entry["valueFrom"]:
                value = self._field(entry["valueFrom"]["fieldRef"]["fieldPath"])
            else:
                raise AssertionError(f"{self.name}: env {entry['name']}: {entry['valueFrom']} is not rehearsed")
            env[entry["name"]] = value
        return env

    def volume_files(self, name: str) -> dict[str, str] | None:
        """A volume's files (Secret, ConfigMap), or None for an empty folder (emptyDir)."""
        [volume] = [volume for volume in self.spec.get("volumes", []) if volume["name"] == name]
        if "emptyDir" in volume:
            return None
        if "secret" in volume:
            data = secret_data(self._object("Secret", volume["secret"]["secretName"]))
        elif "configMap" in volume:
            data = dict(self._object("ConfigMap", volume["configMap"]["name"]).get("data", {}))
        else:
            raise AssertionError(f"{self.name}: volume {volume} is not rehearsed")
        items = volume.get("secret", volume.get("configMap", {})).get("items")
        return {item["path"]: data[item["key"]] for item in items} if items else data


def pods(rendered: Rendered, extra_objects: tuple[Manifest, ...] = ()) -> list[Pod]:
    """Every pod of the chart's workloads built from docker/, StatefulSet pods named by ordinal."""
    found = []
    for workload in rendered.objects:
        kind, name = workload["kind"], workload["metadata"]["name"]
        if kind not in ("Deployment", "StatefulSet"):
            continue
        replicas = int(workload["spec"].get("replicas", 1))
        for index in range(replicas):
            pod_name = f"{name}-{index}" if kind == "StatefulSet" else f"{name}-rehearsal-{index}"
            found.append(Pod(pod_name, workload, rendered, extra_objects))
    return found
