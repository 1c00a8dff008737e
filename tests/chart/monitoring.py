"""The chart's monitoring objects (dashboard, alerts, KEDA trigger) and the PromQL they hold.

``MONITORING_VALUES`` turns all three on; :func:`queries` lists every expression they render,
named by where it is, for the tests that hold them to the chart (test_helm_monitoring.py) and to
what the services export (tests/integration/test_monitoring_queries.py).
"""

from __future__ import annotations

import json
import re
from typing import Any

from tests.chart.render import Manifest

MONITORING_VALUES: dict[str, Any] = {
    "serviceMonitor": {"enabled": True},
    "grafanaDashboard": {"enabled": True},
    "prometheusRule": {"enabled": True},
    "engines": {"autoscaling": {"enabled": True, "prometheusServerAddress": "http://prometheus.monitoring:9090"}},
}
DASHBOARD_KEY = "dpcoord.json"
# Labels Prometheus adds to every series it scrapes through the chart's ServiceMonitor.
TARGET_LABELS = frozenset({"namespace", "service", "pod", "container", "endpoint", "job", "instance"})
_LABEL_VALUES = re.compile(r"^label_values\((.+),\s*([A-Za-z_]\w*)\)$")


def dashboard_of(objects: list[Manifest]) -> dict[str, Any]:
    [config_map] = [obj for obj in objects if obj["kind"] == "ConfigMap" and DASHBOARD_KEY in obj.get("data", {})]
    dashboard: dict[str, Any] = json.loads(config_map["data"][DASHBOARD_KEY])
    return dashboard


def queries(objects: list[Manifest]) -> dict[str, str]:
    """Every PromQL expression of the rendered monitoring objects, keyed by where it is."""
    found: dict[str, str] = {}
    dashboard = dashboard_of(objects)
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            found[f"dashboard panel {panel['title']!r} {target['refId']}"] = target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            match = _LABEL_VALUES.match(variable["definition"])
            assert match, f"dashboard variable {variable['name']}: not label_values(<selector>, <label>)"
            found[f"dashboard variable {variable['name']}"] = match.group(1)
    for rule in (obj for obj in objects if obj["kind"] == "PrometheusRule"):
        for group in rule["spec"]["groups"]:
            for entry in group["rules"]:
                found[f"alert {entry['alert']}"] = entry["expr"]
    for scaler in (obj for obj in objects if obj["kind"] == "ScaledObject"):
        for trigger in scaler["spec"]["triggers"]:
            found[f"ScaledObject {scaler['metadata']['name']} trigger"] = trigger["metadata"]["query"]
    return found
