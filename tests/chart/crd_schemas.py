"""Rendered objects validated against the JSON schemas in tests/chart/schemas/: the kinds whose
schemas no offline tool holds (the Prometheus Operator's PrometheusRule, KEDA's ScaledObject,
Grafana's dashboard model) and the ConfigMap that carries the dashboard.

Helm's own validator does the work, the one that holds values to values.schema.json: each schema
becomes the values schema of a scratch chart, and the object is validated as its values.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from helm_python import Chart

SCHEMAS = Path(__file__).resolve().parent / "schemas"


def validate(document: dict[str, Any], schema: str, scratch: Path) -> None:
    """Raises HelmValuesError naming each path of ``document`` that breaks ``schemas/<schema>.json``."""
    chart = scratch / f"{schema}-schema"
    if not chart.exists():
        chart.mkdir(parents=True)
        (chart / "Chart.yaml").write_text(f"apiVersion: v2\nname: {schema}-schema\nversion: 0.0.0\n")
        shutil.copy(SCHEMAS / f"{schema}.json", chart / "values.schema.json")
    with Chart.load(chart) as loaded:
        loaded.validate_schema(document)
