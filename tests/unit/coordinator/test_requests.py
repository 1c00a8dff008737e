"""The request table: popping an entry is the right to send its terminal reply, once."""

from __future__ import annotations

from service.coordinator.requests import InflightRequest, RequestTable
from service.coordinator.timers import CoarseTimers
from service.protocol.codec import Encoding
from service.protocol.routed import ReturnPath


def entry(request_id: str, client: tuple[str | None, str | int] | None = None) -> InflightRequest:
    path = ReturnPath(
        request_id, "c1", "_INBOX.x", "json", False, client[1] if client else None, client[0] if client else None
    )
    return InflightRequest(path, Encoding.JSON, b"{}", client)


def test_pop_answers_once_and_forgets_the_client_key() -> None:
    table = RequestTable()
    first = entry("c1-0", ("alice", 7))
    table.add(first)
    assert table.get("c1-0") is first and table.find_client(("alice", 7)) is first
    assert "c1-0" in table and len(table) == 1
    assert table.pop("c1-0") is first
    assert table.pop("c1-0") is None
    assert table.find_client(("alice", 7)) is None and len(table) == 0


async def test_pop_cancels_the_deadline() -> None:
    timers = CoarseTimers()
    table = RequestTable()
    timed = entry("c1-1")
    timed.deadline = timers.call_later(0.01, table.pop, "c1-1")
    table.add(timed)
    assert len(timers) == 1
    table.pop("c1-1")
    assert len(timers) == 0


def test_iteration_is_a_snapshot_so_entries_may_be_popped_while_iterating() -> None:
    table = RequestTable()
    for n in range(3):
        table.add(entry(f"c1-{n}"))
    for inflight in table:
        table.pop(inflight.return_path.request_id)
    assert len(table) == 0


def test_anonymous_and_named_clients_do_not_share_keys() -> None:
    table = RequestTable()
    table.add(entry("c1-0", (None, 1)))
    table.add(entry("c1-1", ("bob", 1)))
    assert table.find_client((None, 1)) is not table.find_client(("bob", 1))
