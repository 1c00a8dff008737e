"""The rules between ``Settings`` fields, checked once the fields are read: each raises
ValueError naming what is wrong, so a process refuses to start on settings that cannot work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.protocol.subjects import InboxPrefixes, Subjects

if TYPE_CHECKING:
    from service.ops.settings import Settings


def check_consistent(settings: Settings) -> None:
    """Every rule below, in order; the first broken raises."""
    _one_way_to_authenticate(settings)
    _ids_fit(settings)
    _inboxes_apart(settings)
    _heartbeat_fits_timeout(settings)


def _one_way_to_authenticate(settings: Settings) -> None:
    if settings.nats_password and not settings.nats_user:
        raise ValueError("nats_password is set without nats_user")
    if settings.nats_user and not settings.nats_password:
        raise ValueError("nats_user is set without nats_password")
    chosen = [
        name
        for name in ("nats_user", "nats_token", "nats_nkey_seed_file", "nats_creds_file")
        if getattr(settings, name)
    ]
    if len(chosen) > 1:
        raise ValueError(f"choose one NATS authentication method, not {' and '.join(chosen)}")
    if settings.nats_tls_key_file and not settings.nats_tls_cert_file:
        raise ValueError("nats_tls_key_file is set without nats_tls_cert_file")


def _ids_fit(settings: Settings) -> None:
    for name in ("coordinator_id", "engine_id"):
        value = getattr(settings, name)
        if value is not None and len(value) > settings.max_id_bytes:
            raise ValueError(f"{name} is longer than max_id_bytes ({settings.max_id_bytes})")


def _inboxes_apart(settings: Settings) -> None:
    """Replies go only under inbox prefixes (the coordinator's hot path relies on it): none
    may reach the subjects dpcoord serves."""
    problem = InboxPrefixes(settings.reply_inbox_prefixes.split(",")).overlap(Subjects(settings.subject_prefix))
    if problem is not None:
        raise ValueError(f"reply_inbox_prefixes: {problem}")


def _heartbeat_fits_timeout(settings: Settings) -> None:
    if settings.heartbeat_interval_s >= settings.heartbeat_timeout_s:
        raise ValueError(
            f"heartbeat_interval_s ({settings.heartbeat_interval_s}) must be below heartbeat_timeout_s "
            f"({settings.heartbeat_timeout_s}), or live engines get removed"
        )
