"""The chart's gateway: its Deployment and Service run `dpcoord gateway` as the NATS `gateway` user
(the client's permissions) with probes on the endpoints it serves; the optional Ingress, autoscaler and API keys render as
configured; the values schema holds them to sane values."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from helm_python import Chart, HelmRenderError, HelmValuesError, lint

from service.ops.settings import Settings
from tests.chart.contract import CHART
from tests.chart.test_helm_chart import NAMESPACE, RELEASE, container, env_of, matches, only, render

GATEWAY_ONLY = {"coordinator", "engine"}


@pytest.fixture(scope="module")
def chart() -> Iterator[Chart]:
    with Chart.load(CHART) as loaded:
        yield loaded


def gateway_objects(objects: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return sorted(
        (obj["kind"], obj["metadata"]["name"])
        for obj in objects
        if obj["metadata"]["labels"].get("app.kubernetes.io/component") == "gateway"
    )


def test_the_gateway_runs_as_its_nats_user_with_probes_on_its_port(chart: Chart) -> None:
    objects = render(chart)
    assert gateway_objects(objects) == [("Deployment", "rel-dpcoord-gateway"), ("Service", "rel-dpcoord-gateway")]
    deployment = only(objects, "Deployment", "gateway")
    main = container(deployment)
    port = Settings.model_fields["gateway_port"].default
    assert main["args"] == ["gateway"] and main["image"] == f"dpcoord/gateway:{chart.metadata['appVersion']}"
    assert main["ports"] == [{"name": "http", "containerPort": port, "protocol": "TCP"}]
    assert main["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert main["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    env = env_of(deployment, objects)
    assert env["DPCOORD_GATEWAY_PORT"] == str(port)
    assert env["DPCOORD_NATS_USER"] == {"secretKeyRef": {"name": "rel-dpcoord-nats-credentials", "key": "gateway-user"}}
    assert env["DPCOORD_NATS_PASSWORD"] == {
        "secretKeyRef": {"name": "rel-dpcoord-nats-credentials", "key": "gateway-password"}
    }
    assert env["DPCOORD_NATS_INBOX_PREFIX"] == "_INBOX_gateway"
    assert "DPCOORD_GATEWAY_API_KEY_FILE" not in env
    assert deployment["spec"]["replicas"] == 2
    service = only(objects, "Service", "gateway")
    assert service["spec"]["ports"] == [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}]
    pods = {
        c: w["spec"]["template"]["metadata"]["labels"]
        for c, w in (
            ("coordinator", only(objects, "Deployment", "coordinator")),
            ("engine", only(objects, "StatefulSet")),
            ("gateway", deployment),
        )
    }
    assert [c for c, labels in pods.items() if matches(service["spec"]["selector"], labels)] == ["gateway"]
    assert matches(deployment["spec"]["selector"]["matchLabels"], pods["gateway"])
    notes = chart.render({}, name=RELEASE, namespace=NAMESPACE)["dpcoord/templates/NOTES.txt"]
    assert f"port-forward svc/rel-dpcoord-gateway {port}" in notes and f"localhost:{port}/v1/completions" in notes


def test_external_nats_gives_the_gateway_its_credentials(chart: Chart) -> None:
    values = {
        "nats": {"enabled": False},
        "externalNats": {"url": "nats://n:4222", "credentialsSecret": "s", "auth": "creds"},
    }
    objects = render(chart, values)
    deployment = only(objects, "Deployment", "gateway")
    assert env_of(deployment, objects)["DPCOORD_NATS_CREDS_FILE"] == "/etc/dpcoord/nats-credentials/gateway.creds"
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    assert {"name": "nats-credentials", "secret": {"secretName": "s", "defaultMode": 0o440}} in volumes


def test_api_keys_come_from_a_mounted_secret(chart: Chart) -> None:
    objects = render(chart, {"gateway": {"apiKeys": {"existingSecret": "llm-keys", "key": "keys.txt"}}})
    deployment = only(objects, "Deployment", "gateway")
    assert env_of(deployment, objects)["DPCOORD_GATEWAY_API_KEY_FILE"] == "/etc/dpcoord/gateway-api-keys/keys.txt"
    assert {"name": "api-keys", "mountPath": "/etc/dpcoord/gateway-api-keys", "readOnly": True} in container(
        deployment
    )["volumeMounts"]
    assert {"name": "api-keys", "secret": {"secretName": "llm-keys", "defaultMode": 0o440}} in (
        deployment["spec"]["template"]["spec"]["volumes"]
    )
    notes = chart.render({"gateway": {"apiKeys": {"existingSecret": "llm-keys"}}}, name=RELEASE, namespace=NAMESPACE)
    assert "Authorization: Bearer $API_KEY" in notes["dpcoord/templates/NOTES.txt"]


def test_ingress_and_autoscaler(chart: Chart) -> None:
    values = {
        "gateway": {
            "ingress": {
                "enabled": True,
                "className": "nginx",
                "annotations": {"a": "b"},
                "hosts": [{"host": "llm.corp", "paths": [{"path": "/v1", "pathType": "Prefix"}]}],
                "tls": [{"secretName": "llm-tls", "hosts": ["llm.corp"]}],
            },
            "autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 7, "targetCPUUtilizationPercentage": 60},
        }
    }
    assert lint(CHART, values, strict=False)["errors"] == []
    objects = render(chart, values)
    assert [kind for kind, _ in gateway_objects(objects)] == [
        "Deployment",
        "HorizontalPodAutoscaler",
        "Ingress",
        "Service",
    ]
    ingress = only(objects, "Ingress", "gateway")
    assert ingress["spec"]["ingressClassName"] == "nginx" and ingress["metadata"]["annotations"] == {"a": "b"}
    assert ingress["spec"]["tls"] == [{"secretName": "llm-tls", "hosts": ["llm.corp"]}]
    [rule] = ingress["spec"]["rules"]
    assert rule["host"] == "llm.corp"
    assert rule["http"]["paths"] == [
        {
            "path": "/v1",
            "pathType": "Prefix",
            "backend": {"service": {"name": "rel-dpcoord-gateway", "port": {"name": "http"}}},
        }
    ]
    autoscaler = only(objects, "HorizontalPodAutoscaler", "gateway")
    assert autoscaler["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "rel-dpcoord-gateway",
    }
    assert (autoscaler["spec"]["minReplicas"], autoscaler["spec"]["maxReplicas"]) == (3, 7)
    assert autoscaler["spec"]["metrics"][0]["resource"]["target"] == {"type": "Utilization", "averageUtilization": 60}
    assert "replicas" not in only(objects, "Deployment", "gateway")["spec"]  # the autoscaler owns it
    notes = chart.render(values, name=RELEASE, namespace=NAMESPACE)["dpcoord/templates/NOTES.txt"]
    assert "https://llm.corp/v1" in notes


def test_without_the_gateway_nothing_of_it_renders(chart: Chart) -> None:
    assert gateway_objects(render(chart, {"gateway": {"enabled": False}})) == []


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"gateway": {"replicas": 0}}, "/gateway/replicas"),
        ({"gateway": {"enabled": "yes"}}, "/gateway/enabled"),
        (
            {"gateway": {"ingress": {"hosts": [{"host": "h", "paths": [{"path": "v1"}]}]}}},
            "/gateway/ingress/hosts/0/paths/0/path",
        ),
        (
            {"gateway": {"autoscaling": {"targetCPUUtilizationPercentage": 150}}},
            "/gateway/autoscaling/targetCPUUtilizationPercentage",
        ),
        ({"gateway": {"apiKeys": {"secret": "x"}}}, "secret"),
        ({"settings": {"gateway_port": 70000}}, "/settings/gateway_port"),
    ],
)
def test_schema_rejects_wrong_gateway_values(chart: Chart, values: dict[str, Any], complaint: str) -> None:
    with pytest.raises(HelmValuesError, match=re.escape(complaint)):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


def test_an_autoscaler_with_max_below_min_fails_to_render(chart: Chart) -> None:
    with pytest.raises(HelmRenderError, match="maxReplicas must be at least"):
        chart.render(
            {"gateway": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}},
            name=RELEASE,
            namespace=NAMESPACE,
        )
