"""Replies go only to inboxes, and the inbox prefix a reply subject is under owns the request."""

from __future__ import annotations

import pytest

from service.protocol.subjects import InboxPrefixes, id_problem, utf8_length


@pytest.mark.parametrize(
    ("subject", "owner"),
    [
        ("_INBOX.abc", "_INBOX"),
        ("_INBOX.abc.1", "_INBOX"),
        ("_INBOX_client.abc.1", "_INBOX_client"),  # per-user prefixes, as nats-py's inbox_prefix makes them
        ("_INBOX_admin.acks", "_INBOX_admin"),
        ("_INBOX", None),  # nothing under it
        ("_INBOX.", None),
        ("_INBOXX.abc", None),  # a longer token is another prefix, not under _INBOX
        ("_inbox.abc", None),
        ("billing.charge", None),
        ("dpcoord.status.coordinator.c1", None),
        ("tenant.a.inbox.x", "tenant.a.inbox"),
        ("tenant.a.inbox_bob.x", "tenant.a.inbox_bob"),
        ("tenant.a.inbox", None),
        ("tenant.b.inbox.x", None),
    ],
)
def test_owner_is_the_inbox_prefix_a_subject_is_under(subject: str, owner: str | None) -> None:
    assert InboxPrefixes(["_INBOX", "tenant.a.inbox"]).owner(subject) == owner


def test_an_empty_list_of_prefixes_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        InboxPrefixes([])


@pytest.mark.parametrize(
    ("value", "allowed"),
    [
        ("e0", True),
        ("release-dpcoord-engine-3", True),
        ("gpu_0", True),
        ("gpu 0", False),
        ("a.b", False),
        ("a*", False),
        ("a>", False),
        ("", False),
        ("é", False),
        ("x" * 64, True),
        ("x" * 65, False),
    ],
)
def test_ids_that_become_subject_tokens(value: str, allowed: bool) -> None:
    assert (id_problem(value, 64) is None) is allowed


def test_utf8_length_counts_bytes() -> None:
    assert utf8_length("abc") == 3 and utf8_length("é") == 2 and utf8_length("🙂") == 4
