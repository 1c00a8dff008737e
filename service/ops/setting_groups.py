"""Who reads each setting: the groups ``Settings`` fields are annotated with.

``NatsSetting[str]`` marks a field every process that connects to NATS reads; each command's
``--help`` lists the fields of the groups it reads (:func:`service.ops.settings.settings_in`).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, TypeVar

from pydantic.fields import FieldInfo

T = TypeVar("T")


class SettingGroup(StrEnum):
    """Who reads a setting; the value is the heading ``--help`` shows the group under."""

    NATS = "NATS connection, auth and TLS"
    SERVICE = "health, metrics, logs and event loop"
    COORDINATOR = "coordinator"
    ENGINE = "engine"
    TORCH = "torch backend (see docs/engines.md)"
    GATEWAY = "OpenAI-compatible HTTP gateway (see docs/gateway.md)"


NatsSetting = Annotated[T, SettingGroup.NATS]
ServiceSetting = Annotated[T, SettingGroup.SERVICE]
CoordinatorSetting = Annotated[T, SettingGroup.COORDINATOR]
EngineSetting = Annotated[T, SettingGroup.ENGINE]
TorchSetting = Annotated[T, SettingGroup.TORCH]
GatewaySetting = Annotated[T, SettingGroup.GATEWAY]


def group_of(field: FieldInfo) -> SettingGroup:
    """The group a ``Settings`` field was annotated with; every field has exactly one."""
    groups = [item for item in field.metadata if isinstance(item, SettingGroup)]
    if len(groups) != 1:
        raise TypeError(f"a Settings field needs exactly one SettingGroup, not {groups}")
    return groups[0]
