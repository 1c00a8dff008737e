"""The chart rendered offline (helm-python-sdk: Helm v4 as a library) into parsed objects."""

from __future__ import annotations

import re
from typing import Any

from helm_python import Chart, values_from_yaml

Manifest = dict[str, Any]


def render_objects(chart: Chart, values: dict[str, Any], release: str, namespace: str) -> list[Manifest]:
    """Every object the chart renders with ``values``, parsed (NOTES.txt and empty documents left out)."""
    objects = []
    for path, text in chart.render(values, name=release, namespace=namespace).items():
        if not path.endswith(".yaml"):
            continue
        for document in re.split(r"^---\s*$", text, flags=re.MULTILINE):
            if document.strip():
                parsed = values_from_yaml(document)
                if parsed:
                    objects.append(parsed)
    return objects
