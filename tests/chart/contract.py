"""The contract between the settings model and the Helm chart (helm/dpcoord).

Every field of ``Settings`` is either a value under ``settings:`` in values.yaml, with the
JSON schema that pydantic derives for it in values.schema.json, or set per pod by the chart
(``DERIVED_SETTINGS``). The drift tests in tests/chart/test_helm_chart.py hold the chart to it.
When a field is added to Settings, add it to values.yaml under ``settings:`` and paste the
schema printed by ``python -m tests.chart.contract`` into values.schema.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from service.ops.settings import Settings

CHART = Path(__file__).resolve().parents[2] / "helm" / "dpcoord"

# Settings the chart sets per pod rather than from values, and where from.
DERIVED_SETTINGS: dict[str, str] = {
    "nats_url": "nats.enabled (the bundled NATS Service) or externalNats.url",
    "nats_inbox_prefix": "the role's reply-inbox prefix, _INBOX_<component> (docs/security.md)",
    "coordinator_id": "left unset: random per process, so a restarted container never reuses its request ids",
    "engine_id": "the engine pod's name (its data-parallel rank)",
    "nats_user": "the credentials Secret, key <component>-user",
    "nats_password": "the credentials Secret, key <component>-password",
    "nats_token": "the credentials Secret, key <component>-token",
    "nats_creds_file": "the credentials Secret, file <component>.creds",
    "nats_nkey_seed_file": "the credentials Secret, file <component>.nk",
    "gateway_api_key_file": "gateway.apiKeys.existingSecret, mounted in the gateway pods",
}

_NOT_CONSTRAINTS = ("title", "default")


def valued_settings() -> list[str]:
    """The settings that values.yaml must carry under ``settings:``, in model order."""
    return [name for name in Settings.model_fields if name not in DERIVED_SETTINGS]


def setting_schema(name: str) -> dict[str, Any]:
    """The JSON schema pydantic derives for one setting, as values.schema.json holds it."""
    schema = Settings.model_json_schema()["properties"][name]
    return {key: value for key, value in schema.items() if key not in _NOT_CONSTRAINTS}


def settings_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "description": "Every DPCOORD_ setting but those the chart sets per pod (see values.yaml)",
        "additionalProperties": False,
        "properties": {name: setting_schema(name) for name in valued_settings()},
    }


if __name__ == "__main__":
    print(json.dumps(settings_schema(), indent=2))
