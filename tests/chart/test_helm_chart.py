"""The Helm chart, offline: lint, render with default and non-default values, check the
rendered objects against the code they run (probe paths, settings, subjects), and run the
NATS users and permissions it renders on a real nats-server.

helm-python-sdk bundles Helm v4 as a library, so no helm binary or cluster is needed. The
nats sub-chart is declared but not fetched here (no network), so renders cover this chart's
own templates; ``test_bundled_nats_values_point_at_the_rendered_auth`` checks the values
handed to the sub-chart.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helm_python import Chart, HelmValuesError, lint, values_from_yaml

from service.ops.http_endpoints import HEALTH_PATH, METRICS_PATH, READY_PATH
from service.ops.settings import Settings
from tests.chart.contract import CHART, DERIVED_SETTINGS, settings_schema, valued_settings
from tests.chart.render import Manifest, render_objects

RELEASE = "rel"
NAMESPACE = "llm"
NON_DEFAULT_VALUES = CHART / "ci" / "external-nats-values.yaml"


@pytest.fixture(scope="module")
def chart() -> Iterator[Chart]:
    with Chart.load(CHART) as loaded:
        yield loaded


def non_default_values() -> dict[str, Any]:
    return values_from_yaml(NON_DEFAULT_VALUES.read_text())


def render(chart: Chart, values: dict[str, Any] | None = None, release: str = RELEASE) -> list[Manifest]:
    """Every object the chart renders, parsed."""
    return render_objects(chart, values or {}, release, NAMESPACE)


def only(objects: list[Manifest], kind: str, component: str | None = None) -> Manifest:
    found = [
        obj
        for obj in objects
        if obj["kind"] == kind
        and (component is None or obj["metadata"]["labels"].get("app.kubernetes.io/component") == component)
    ]
    assert len(found) == 1, f"expected one {kind} {component or ''}, found {len(found)}"
    return found[0]


# Every workload the default values render, as (kind, component).
WORKLOADS = (("Deployment", "coordinator"), ("StatefulSet", "engine"), ("Deployment", "gateway"))


def container(workload: Manifest) -> Manifest:
    [main] = workload["spec"]["template"]["spec"]["containers"]
    return main


def env_of(workload: Manifest, objects: list[Manifest]) -> dict[str, Any]:
    """The container's environment: the ConfigMaps it loads, then its own env entries."""
    env: dict[str, Any] = {}
    main = container(workload)
    for source in main.get("envFrom", []):
        config_map = next(
            obj
            for obj in objects
            if obj["kind"] == "ConfigMap" and obj["metadata"]["name"] == source["configMapRef"]["name"]
        )
        env.update(config_map["data"])
    for entry in main.get("env", []):
        env[entry["name"]] = entry.get("value", entry.get("valueFrom"))
    return env


def setting_env_names() -> set[str]:
    return {f"DPCOORD_{name.upper()}" for name in Settings.model_fields}


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


# ---------------------------------------------------------------- lint and render


def test_chart_lints_clean(tmp_path: Path) -> None:
    """The only finding allowed is the nats dependency that `helm dependency update` fetches."""
    for values in ({}, non_default_values()):
        report = lint(CHART, values, strict=False)
        assert report["errors"] == []
        findings = [m for m in report["messages"] if m["severity"] >= 2]
        assert [m["error"] for m in findings] == ["chart directory is missing these dependencies: nats"]


def test_default_render_kinds_and_names(chart: Chart) -> None:
    objects = render(chart)
    kinds = sorted((obj["kind"], obj["metadata"]["name"]) for obj in objects)
    assert kinds == [
        ("ConfigMap", "rel-dpcoord-settings"),
        ("Deployment", "rel-dpcoord-coordinator"),
        ("Deployment", "rel-dpcoord-gateway"),
        ("PodDisruptionBudget", "rel-dpcoord-coordinator"),
        ("Secret", "rel-dpcoord-nats-auth"),
        ("Secret", "rel-dpcoord-nats-credentials"),
        ("Service", "rel-dpcoord-coordinator"),
        ("Service", "rel-dpcoord-engine"),
        ("Service", "rel-dpcoord-gateway"),
        ("StatefulSet", "rel-dpcoord-engine"),
    ]
    assert only(objects, "Deployment", "coordinator")["spec"]["replicas"] == 2
    assert only(objects, "StatefulSet")["spec"]["replicas"] == 2


def test_non_default_render(chart: Chart) -> None:
    """External NATS with credentials, four engines, a ServiceMonitor."""
    objects = render(chart, non_default_values())
    kinds = sorted(obj["kind"] for obj in objects)
    assert kinds == [
        "ConfigMap",
        "Deployment",
        "Deployment",
        "PodDisruptionBudget",
        "Service",
        "Service",
        "Service",
        "ServiceMonitor",
        "StatefulSet",
    ]  # no NATS secrets of its own: the credentials Secret is the operator's
    engines = only(objects, "StatefulSet")
    assert engines["spec"]["replicas"] == 4
    assert only(objects, "Deployment", "coordinator")["spec"]["replicas"] == 3
    for workload, component in ((only(objects, "Deployment", "coordinator"), "coordinator"), (engines, "engine")):
        env = env_of(workload, objects)
        assert env["DPCOORD_NATS_URL"] == "tls://nats.messaging.svc:4222"
        assert env["DPCOORD_NATS_USER"] == {"secretKeyRef": {"name": "dpcoord-nats-users", "key": f"{component}-user"}}
        assert env["DPCOORD_NATS_PASSWORD"] == {
            "secretKeyRef": {"name": "dpcoord-nats-users", "key": f"{component}-password"}
        }
        pod = workload["spec"]["template"]["spec"]
        assert {"name": "nats-tls", "secret": {"secretName": "nats-ca", "defaultMode": 0o440}} in pod["volumes"]
    pod = engines["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert "podAntiAffinity" in pod["affinity"]
    assert {"name": "model", "hostPath": {"path": "/mnt/models", "type": "Directory"}} in pod["volumes"]
    assert container(engines)["args"] == ["engine", "--model", "/models/llama-3-8b"]
    monitor = only(objects, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["endpoints"] == [
        {"port": "http", "path": METRICS_PATH, "interval": "15s", "scrapeTimeout": "10s"}
    ]


@pytest.mark.parametrize("values", [{}, "non-default"], ids=["default", "non-default"])
def test_labels_and_selectors_match(chart: Chart, values: dict[str, Any] | str) -> None:
    objects = render(chart, non_default_values() if values == "non-default" else {})
    workloads = {
        component: only(objects, kind, component)
        for kind, component in (("Deployment", "coordinator"), ("StatefulSet", "engine"))
    }
    pod_labels = {component: w["spec"]["template"]["metadata"]["labels"] for component, w in workloads.items()}
    for component, workload in workloads.items():
        assert matches(workload["spec"]["selector"]["matchLabels"], pod_labels[component])
        service = only(objects, "Service", component)
        selected = [c for c, labels in pod_labels.items() if matches(service["spec"]["selector"], labels)]
        assert selected == [component], f"Service {service['metadata']['name']} selects {selected}"
    engines = workloads["engine"]
    engine_service = only(objects, "Service", "engine")
    assert engines["spec"]["serviceName"] == engine_service["metadata"]["name"]
    assert engine_service["spec"]["clusterIP"] == "None"
    pdb = only(objects, "PodDisruptionBudget")
    assert [c for c, labels in pod_labels.items() if matches(pdb["spec"]["selector"]["matchLabels"], labels)] == [
        "coordinator"
    ]
    for obj in objects:
        assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    monitors = [obj for obj in objects if obj["kind"] == "ServiceMonitor"]
    for monitor in monitors:
        services = [obj for obj in objects if obj["kind"] == "Service"]
        assert all(matches(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"]) for s in services)


@pytest.mark.parametrize("values", [{}, "non-default"], ids=["default", "non-default"])
def test_probes_use_the_served_endpoints_on_the_http_port(chart: Chart, values: dict[str, Any] | str) -> None:
    chosen = non_default_values() if values == "non-default" else {}
    objects = render(chart, chosen)
    port = chart.merge_values(chosen)["settings"]["http_port"]
    expected = {
        "coordinator": {"livenessProbe": HEALTH_PATH, "readinessProbe": READY_PATH},
        "engine": {"startupProbe": HEALTH_PATH, "livenessProbe": HEALTH_PATH, "readinessProbe": READY_PATH},
    }
    for kind, component in (("Deployment", "coordinator"), ("StatefulSet", "engine")):
        main = container(only(objects, kind, component))
        probes = {name: main[name]["httpGet"] for name in expected[component]}
        assert {name: probe["path"] for name, probe in probes.items()} == expected[component]
        assert {probe["port"] for probe in probes.values()} == {"http"}
        assert main["ports"] == [{"name": "http", "containerPort": port, "protocol": "TCP"}]
        assert env_of(only(objects, kind, component), objects)["DPCOORD_HTTP_PORT"] == str(port)
        assert only(objects, "Service", component)["spec"]["ports"][0]["port"] == port


def test_engines_get_gpus_shm_and_the_model(chart: Chart) -> None:
    objects = render(chart)
    engines = only(objects, "StatefulSet")
    resources = container(engines)["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1
    assert resources["requests"]["nvidia.com/gpu"] == 1
    pod = engines["spec"]["template"]["spec"]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "dpcoord-models", "readOnly": True}
    mounts = {mount["name"]: mount["mountPath"] for mount in container(engines)["volumeMounts"]}
    assert mounts["dshm"] == "/dev/shm"
    assert container(engines)["args"] == ["engine", "--model", "/models/model"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]

    cpu_only = only(render(chart, {"engines": {"gpus": 0, "model": {"source": "none"}}}), "StatefulSet")
    assert "nvidia.com/gpu" not in container(cpu_only)["resources"]["limits"]
    assert container(cpu_only)["args"] == ["engine"]


def test_pods_run_as_non_root_on_a_read_only_root(chart: Chart) -> None:
    objects = render(chart)
    for kind, component in WORKLOADS:
        workload = only(objects, kind, component)
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["automountServiceAccountToken"] is False
        security = container(workload)["securityContext"]
        assert security["readOnlyRootFilesystem"] is True
        assert security["allowPrivilegeEscalation"] is False
        assert security["capabilities"] == {"drop": ["ALL"]}
        assert {"name": "tmp", "mountPath": "/tmp"} in container(workload)["volumeMounts"]


def test_notes_show_nats_request_from_nats_box(chart: Chart) -> None:
    notes = chart.render({}, name=RELEASE, namespace=NAMESPACE)["dpcoord/templates/NOTES.txt"]
    assert "exec -it deploy/rel-nats-box -- \\\n    nats request --user client" in notes
    assert 'dpcoord.submit_request \'{"prompt": "Hello"' in notes
    external = chart.render(non_default_values(), name=RELEASE, namespace=NAMESPACE)["dpcoord/templates/NOTES.txt"]
    assert "--image=natsio/nats-box -- \\\n    nats request -s tls://nats.messaging.svc:4222" in external
    assert "prod.llm.submit_request" in external


# ---------------------------------------------------------------- values schema


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"coordinator": {"replicas": "two"}}, "/coordinator/replicas"),
        ({"coordinator": {"replicas": 0}}, "/coordinator/replicas"),
        ({"engines": {"replicas": 1.5}}, "/engines/replicas"),
        ({"engines": {"gpus": -1}}, "/engines/gpus"),
        ({"engines": {"gpus": "1"}}, "/engines/gpus"),
        ({"engines": {"model": {"source": "s3"}}}, "/engines/model/source"),
        ({"nats": {"enabled": "yes"}}, "/nats/enabled"),
        ({"nats": {"enabled": False}}, "/externalNats/url"),
        ({"nats": {"enabled": False}, "externalNats": {"url": "http://nats:4222"}}, "/externalNats/url"),
        ({"externalNats": {"url": 4222}}, "/externalNats/url"),
        ({"externalNats": {"credentialsSecret": ["a"]}}, "/externalNats/credentialsSecret"),
        ({"externalNats": {"auth": "kerberos"}}, "/externalNats/auth"),
        ({"serviceMonitor": {"enabled": "true"}}, "/serviceMonitor/enabled"),
        ({"settings": {"routing_policy": "fastest"}}, "/settings/routing_policy"),
        ({"settings": {"max_payload_bytes": 12.5}}, "/settings/max_payload_bytes"),
        ({"settings": {"request_timeout_s": 0}}, "/settings/request_timeout_s"),
        ({"settings": {"subject_prefix": "a b"}}, "/settings/subject_prefix"),
        ({"settings": {"not_a_setting": 1}}, "not_a_setting"),
        ({"surprise": True}, "surprise"),
    ],
)
def test_schema_rejects_wrong_values(chart: Chart, values: dict[str, Any], complaint: str) -> None:
    with pytest.raises(HelmValuesError, match=re.escape(complaint)):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


def test_schema_accepts_the_documented_values(chart: Chart) -> None:
    chart.validate_schema(chart.merge_values({}))
    chart.validate_schema(chart.merge_values(non_default_values()))


# ---------------------------------------------------------------- drift: settings <-> values


def test_every_setting_has_a_value_and_every_value_is_a_setting(chart: Chart) -> None:
    values = set(chart.values["settings"])
    wanted = set(valued_settings())
    missing = {name: Settings.model_fields[name].default for name in wanted - values}
    assert not missing, f"add to helm/dpcoord/values.yaml under settings: {missing}"
    assert not values - wanted, f"not settings (or set per pod by the chart): {values - wanted}"
    assert not set(DERIVED_SETTINGS) - set(Settings.model_fields), "DERIVED_SETTINGS names a field that is gone"


def test_schema_of_each_setting_is_the_models() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["settings"]
    expected = settings_schema()
    assert schema == expected, (
        "values.schema.json's settings block differs from the settings model; replace it with the output of "
        "`python -m tests.chart.contract`"
    )


@pytest.mark.parametrize("values", [{}, "non-default"], ids=["default", "non-default"])
def test_configmap_env_names_are_settings_and_parse(
    chart: Chart, values: dict[str, Any] | str, monkeypatch: pytest.MonkeyPatch
) -> None:
    chosen = non_default_values() if values == "non-default" else {}
    objects = render(chart, chosen)
    data = only(objects, "ConfigMap")["data"]
    settings_values = chart.merge_values(chosen)["settings"]
    assert set(data) == {f"DPCOORD_{name.upper()}" for name, value in settings_values.items() if value is not None}
    for kind, component in WORKLOADS:
        dpcoord_env = {name for name in env_of(only(objects, kind, component), objects) if name.startswith("DPCOORD_")}
        assert dpcoord_env <= setting_env_names(), dpcoord_env - setting_env_names()
    for name, value in data.items():
        monkeypatch.setenv(name, value)
    parsed = Settings()  # the services read exactly this environment
    for name, value in settings_values.items():
        if value is not None:
            assert getattr(parsed, name) == value, name


@pytest.mark.parametrize("auth", ["userPassword", "token", "creds", "nkey"])
def test_settings_set_per_pod_are_set(chart: Chart, auth: str) -> None:
    """DERIVED_SETTINGS are real: each reaches the pods' environment in some configuration."""
    values = {
        "nats": {"enabled": False},
        "externalNats": {"url": "nats://n:4222", "credentialsSecret": "s", "auth": auth},
    }
    objects = render(chart, values)
    per_auth = {
        "userPassword": {"DPCOORD_NATS_USER", "DPCOORD_NATS_PASSWORD"},
        "token": {"DPCOORD_NATS_TOKEN"},
        "creds": {"DPCOORD_NATS_CREDS_FILE"},
        "nkey": {"DPCOORD_NATS_NKEY_SEED_FILE"},
    }
    for kind, component in WORKLOADS:
        env = env_of(only(objects, kind, component), objects)
        assert {"DPCOORD_NATS_URL"} | per_auth[auth] <= env.keys()
        assert not (set().union(*per_auth.values()) - per_auth[auth]) & env.keys()
        assert "DPCOORD_COORDINATOR_ID" not in env
    engine_env = env_of(only(objects, "StatefulSet"), objects)
    assert engine_env["DPCOORD_ENGINE_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}  # the rank's pod name
    for kind, role in WORKLOADS:
        # The role's inbox prefix, which docs/nats-server.example.conf lets that role subscribe to.
        assert env_of(only(objects, kind, role), objects)["DPCOORD_NATS_INBOX_PREFIX"] == f"_INBOX_{role}"
    covered = {name.removeprefix("DPCOORD_").lower() for names in per_auth.values() for name in names}
    # gateway_api_key_file: tests/chart/test_helm_gateway.py
    assert covered | {"nats_url", "nats_inbox_prefix", "coordinator_id", "engine_id", "gateway_api_key_file"} == set(
        DERIVED_SETTINGS
    )


def test_default_settings_are_valid_settings(chart: Chart) -> None:
    Settings(**{name: value for name, value in chart.values["settings"].items() if value is not None})


# Values documented by one README row each rather than key by key.
_DOCUMENTED_WHOLE = {
    "settings",
    "resources",
    "podSecurityContext",
    "securityContext",
    "livenessProbe",
    "readinessProbe",
    "startupProbe",
    "podAnnotations",
    "podLabels",
    "nodeSelector",
    "affinity",
    "labels",
    "passwords",
    "merge",
    "patch",
}


def value_paths(node: Any, path: str = "") -> Iterator[str]:
    if isinstance(node, dict) and node and path.rpartition(".")[2] not in _DOCUMENTED_WHOLE:
        for key, child in node.items():
            yield from value_paths(child, f"{path}.{key}" if path else key)
    else:
        yield path


def test_readme_documents_every_value(chart: Chart) -> None:
    readme = (CHART / "README.md").read_text()
    undocumented = [path for path in value_paths(chart.values) if f"| `{path}` |" not in readme]
    assert not undocumented, f"add rows to helm/dpcoord/README.md for {undocumented}"
