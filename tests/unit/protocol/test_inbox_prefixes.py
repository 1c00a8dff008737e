"""Replies go only to inboxes, and the inbox prefix a reply subject is under owns the request."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from service.ops.settings import Settings
from service.protocol.subjects import InboxPrefixes, Subjects, id_problem, publishable, utf8_length


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


@pytest.mark.parametrize(
    "prefixes", [["_INBOX", "tenant.a.inbox"], ["tenant.a.inbox", "_INBOX"], ["tenant.a.inbox"], ["a", "a_b"]]
)
def test_the_first_prefix_matched_inline_owns_what_owner_says(prefixes: list[str]) -> None:
    """The coordinator's hot path matches ``first`` inline, then asks ``owner``: the same answer."""
    inboxes = InboxPrefixes(prefixes)
    dotted, first = inboxes.first
    for subject in ("_INBOX.abc.1", "tenant.a.inbox.x", "tenant.a.inbox_bob.x", "a.x", "a_b.x", "a.b.c"):
        if subject.startswith(dotted):
            assert inboxes.owner(subject) == first


@pytest.mark.parametrize(
    ("prefixes", "served", "overlaps"),
    [
        (["_INBOX"], "dpcoord", False),
        (["_INBOX", "tenant.a.inbox"], "dpcoord", False),
        (["dpcoord_inbox"], "dpcoord", False),  # dpcoord_inbox.x is not under dpcoord.
        (["dpcoord"], "dpcoord", True),
        (["dpcoord.inbox"], "dpcoord", True),
        (["_INBOX"], "_INBOX.dpcoord", True),
        (["dp"], "dp_x", True),  # dp_x.pause is under dp (extended with _x)
        (["$SYS"], "dpcoord", True),
    ],
)
def test_inbox_prefixes_must_lie_apart_from_the_served_subjects(
    prefixes: list[str], served: str, overlaps: bool
) -> None:
    assert (InboxPrefixes(prefixes).overlap(Subjects(served)) is not None) is overlaps


def test_settings_refuse_inbox_prefixes_that_overlap_the_served_subjects() -> None:
    with pytest.raises(ValidationError, match="overlaps the subjects dpcoord serves"):
        Settings(subject_prefix="dpcoord", reply_inbox_prefixes="_INBOX,dpcoord.replies")


@pytest.mark.parametrize(
    ("subject", "allowed"),
    [("_INBOX.a.1", True), ("a", True), ("", False), ("a..b", False), (".a", False), ("a.", False), ("a b", False)]
    + [("a.*", False), ("a.>", False), ("a\tb", False), ("a\x00b", False), ("a\u2028b", False), ("é.ü", True)],
)
def test_publishable_subjects(subject: str, allowed: bool) -> None:
    assert publishable(subject) is allowed


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
