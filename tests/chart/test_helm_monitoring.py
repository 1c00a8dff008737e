"""The chart's monitoring: a Grafana dashboard in a ConfigMap for Grafana's sidecar, PrometheusRule
alerts, and a KEDA ScaledObject for the engines. Each is off by default and turned on by a value;
each renders valid against its schema (tests/chart/schemas, with Helm's validator), points at the
objects it watches, and takes its thresholds from values. What their PromQL reads is held to the
services' live /metrics by tests/integration/test_monitoring_queries.py."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helm_python import Chart, HelmRenderError, HelmValuesError, lint

from tests.chart.contract import CHART
from tests.chart.crd_schemas import validate
from tests.chart.monitoring import DASHBOARD_KEY, MONITORING_VALUES, dashboard_of, queries
from tests.chart.promql import reads
from tests.chart.render import Manifest
from tests.chart.test_helm_chart import NAMESPACE, only, render

ALERTS = {
    "DpcoordNoEngineRegistered",
    "DpcoordEngineMissingHeartbeats",
    "DpcoordHighErrorRate",
    "DpcoordQueueFilling",
    "DpcoordMixedWeightVersions",
}
# What issue 35 asked the dashboard to show, by panel title.
PANELS = {
    "Requests per second",
    "Tokens per second",
    "Time to first token",
    "Inter-token latency",
    "In flight per engine",
    "Queued work",
    "Prefix-cache hit rate",
    "Weight version per engine",
    "Errors by code",
    "NATS reconnects",
    "Engines in the pool",
    "Engines removed for silence",
}


@pytest.fixture(scope="module")
def chart() -> Iterator[Chart]:
    with Chart.load(CHART) as loaded:
        yield loaded


def with_values(**sections: Any) -> dict[str, Any]:
    """MONITORING_VALUES with ``sections`` merged in, one level deep."""
    values = copy.deepcopy(MONITORING_VALUES)
    for key, section in sections.items():
        values[key] = values.get(key, {}) | section
    return values


def dashboard_map(objects: list[Manifest]) -> Manifest:
    [found] = [obj for obj in objects if obj["kind"] == "ConfigMap" and DASHBOARD_KEY in obj.get("data", {})]
    return found


def alerts_of(objects: list[Manifest]) -> dict[str, dict[str, Any]]:
    rule = only(objects, "PrometheusRule")
    return {entry["alert"]: entry for group in rule["spec"]["groups"] for entry in group["rules"]}


def test_off_by_default(chart: Chart) -> None:
    objects = render(chart)
    assert not {"PrometheusRule", "ScaledObject"} & {obj["kind"] for obj in objects}
    assert not [obj for obj in objects if DASHBOARD_KEY in obj.get("data", {})]
    assert only(objects, "StatefulSet")["spec"]["replicas"] == 2


def test_monitoring_lints_clean() -> None:
    report = lint(CHART, MONITORING_VALUES, strict=False)
    assert report["errors"] == []
    findings = [m["error"] for m in report["messages"] if m["severity"] >= 2]
    assert findings == ["chart directory is missing these dependencies: nats"]


def test_the_dashboard_is_a_configmap_for_grafanas_sidecar(chart: Chart, tmp_path: Path) -> None:
    objects = render(chart, MONITORING_VALUES)
    config_map = dashboard_map(objects)
    validate(config_map, "configmap", tmp_path)
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == NAMESPACE
    dashboard = dashboard_of(objects)
    assert dashboard == json.loads((CHART / "dashboards" / "dpcoord.json").read_text())
    validate(dashboard, "grafana-dashboard", tmp_path)
    panels = dashboard["panels"]
    assert {panel["title"] for panel in panels} == PANELS
    assert len({panel["id"] for panel in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        refs = [target["refId"] for target in panel["targets"]]
        assert len(set(refs)) == len(refs), panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        area = {
            (x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area

    moved = with_values(
        grafanaDashboard={
            "enabled": True,
            "labels": {"grafana_dashboard": None, "dashboards": "llm"},
            "annotations": {"grafana_folder": "LLM"},
            "namespace": "monitoring",
        }
    )
    metadata = dashboard_map(render(chart, moved))["metadata"]
    assert metadata["labels"]["dashboards"] == "llm" and "grafana_dashboard" not in metadata["labels"]
    assert metadata["annotations"] == {"grafana_folder": "LLM"} and metadata["namespace"] == "monitoring"


def test_every_query_lexes_and_is_scoped_to_the_namespace(chart: Chart) -> None:
    for where, expression in queries(render(chart, MONITORING_VALUES)).items():
        selected = reads(expression).selectors
        assert selected, where
        assert all(labels >= {"namespace"} for labels in selected.values()) or where.startswith("dashboard variable"), (
            f"{where}: {expression}"
        )


def test_alerts_watch_this_releases_services(chart: Chart, tmp_path: Path) -> None:
    objects = render(chart, with_values(prometheusRule={"labels": {"release": "kube-prometheus-stack"}}))
    rule = only(objects, "PrometheusRule")
    validate(rule, "prometheusrule", tmp_path)
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    alerts = alerts_of(objects)
    assert set(alerts) == ALERTS
    services = {obj["metadata"]["name"] for obj in objects if obj["kind"] == "Service"}
    for name, alert in alerts.items():
        assert set(re.findall(r'namespace="([^"]*)"', alert["expr"])) == {NAMESPACE}, name
        watched = set(re.findall(r'service="([^"]*)"', alert["expr"]))
        assert watched and watched <= services, f"{name} watches {watched}, not among {services}"
        assert alert["labels"]["severity"] in {"critical", "warning"}
    # Prometheus's own templates reach it: Helm must not have expanded them.
    assert "{{ $value | humanize }}" in alerts["DpcoordEngineMissingHeartbeats"]["annotations"]["description"]
    assert alerts["DpcoordNoEngineRegistered"]["for"] == "5m"


def test_alert_thresholds_are_values(chart: Chart) -> None:
    defaults = alerts_of(render(chart, MONITORING_VALUES))
    assert defaults["DpcoordHighErrorRate"]["expr"].endswith("> 0.05")
    assert defaults["DpcoordQueueFilling"]["expr"].endswith("> 2048")  # half of max_queued_requests, 4096
    tuned = with_values(
        prometheusRule={"errorRatio": 0.1, "queueFullRatio": 0.25}, settings={"max_queued_requests": 1000}
    )
    alerts = alerts_of(render(chart, tuned))
    assert alerts["DpcoordHighErrorRate"]["expr"].endswith("> 0.1")
    assert alerts["DpcoordQueueFilling"]["expr"].endswith("> 250")
    assert "(1000)" in alerts["DpcoordQueueFilling"]["annotations"]["description"]


def test_keda_scales_the_engines_on_the_coordinators_work(chart: Chart, tmp_path: Path) -> None:
    objects = render(chart, MONITORING_VALUES)
    scaler = only(objects, "ScaledObject")
    validate(scaler, "scaledobject", tmp_path)
    engines = only(objects, "StatefulSet")
    assert "replicas" not in engines["spec"]  # KEDA owns the count; an upgrade must not reset it
    spec = scaler["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": engines["metadata"]["name"],
    }
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 8)
    [trigger] = spec["triggers"]
    assert trigger["type"] == "prometheus"
    metadata = trigger["metadata"]
    assert metadata["serverAddress"] == "http://prometheus.monitoring:9090" and metadata["threshold"] == "192"
    coordinators = only(objects, "Service", "coordinator")["metadata"]["name"]
    assert metadata["query"] == f'sum(dpcoord_requests_in_flight{{namespace="{NAMESPACE}", service="{coordinators}"}})'


@pytest.mark.parametrize(
    ("autoscaling", "complaint"),
    [
        ({"prometheusServerAddress": ""}, "engines.autoscaling.prometheusServerAddress"),
        ({"minReplicas": 4, "maxReplicas": 2}, "maxReplicas must be at least"),
    ],
)
def test_keda_refuses_what_cannot_scale(chart: Chart, autoscaling: dict[str, Any], complaint: str) -> None:
    values = with_values()
    values["engines"]["autoscaling"] |= autoscaling
    with pytest.raises(HelmRenderError, match=re.escape(complaint)):
        render(chart, values)


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"engines": {"autoscaling": {"minReplicas": 0}}}, "/engines/autoscaling/minReplicas"),
        (
            {"engines": {"autoscaling": {"targetRequestsPerEngine": "many"}}},
            "/engines/autoscaling/targetRequestsPerEngine",
        ),
        ({"engines": {"autoscaling": {"prometheusServerAddress": "prometheus:9090"}}}, "prometheusServerAddress"),
        ({"prometheusRule": {"errorRatio": 1.5}}, "/prometheusRule/errorRatio"),
        ({"prometheusRule": {"queueFullRatio": 0}}, "/prometheusRule/queueFullRatio"),
        ({"grafanaDashboard": {"labels": {"grafana_dashboard": 1}}}, "/grafanaDashboard/labels/grafana_dashboard"),
    ],
)
def test_schema_rejects_wrong_monitoring_values(chart: Chart, values: dict[str, Any], complaint: str) -> None:
    with pytest.raises(HelmValuesError, match=re.escape(complaint)):
        chart.render(values, name="rel", namespace=NAMESPACE)


def test_the_schemas_catch_what_the_api_server_would_prune_or_refuse(chart: Chart, tmp_path: Path) -> None:
    """Each schema can fail: one mistake per object, each named."""
    objects = render(chart, MONITORING_VALUES)
    scaler = copy.deepcopy(only(objects, "ScaledObject"))
    scaler["spec"]["triggers"][0]["metadata"]["threshold"] = 192  # KEDA reads a map of strings
    rule = copy.deepcopy(only(objects, "PrometheusRule"))
    rule["spec"]["groups"][0]["rules"][0]["for"] = "five minutes"
    dashboard = dashboard_of(objects)
    dashboard["panels"][0]["targets"][0]["exp"] = dashboard["panels"][0]["targets"][0].pop("expr")
    config_map = copy.deepcopy(dashboard_map(objects))
    config_map["data"]["extra"] = 1
    for document, schema, complaint in (
        (scaler, "scaledobject", "/spec/triggers/0/metadata/threshold"),
        (rule, "prometheusrule", "/spec/groups/0/rules/0/for"),
        (dashboard, "grafana-dashboard", "/panels/0/targets/0"),
        (config_map, "configmap", "/data/extra"),
    ):
        with pytest.raises(HelmValuesError, match=re.escape(complaint)):
            validate(document, schema, tmp_path)
