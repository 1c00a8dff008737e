"""The coordinator's queue: owners take turns, an owner over its share is passed over while
others wait, and requests answered while they wait neither count nor linger."""

from __future__ import annotations

from collections.abc import Callable

from service.coordinator.fair_queue import COMPACT_SLACK, FairQueue
from service.coordinator.request_ids import ID_HEX_DIGITS, request_ids
from service.coordinator.requests import InflightRequest, RequestTable
from service.protocol.codec import Encoding
from service.protocol.routed import ReturnPath


def entry(table: RequestTable, request_id: str, owner: str, body: bytes = b"{}") -> InflightRequest:
    path = ReturnPath(request_id, "c1", f"{owner}.x", "json", False, None)
    request = InflightRequest(path, Encoding.JSON, body, None, owner=owner)
    table.add(request)
    return request


def drain(queue: FairQueue, over_share: Callable[[str], bool] = lambda owner: False) -> list[str]:
    order = []
    while (head := queue.peek(over_share)) is not None:
        queue.pop(head)
        order.append(head.return_path.request_id)
    return order


def test_owners_take_turns_and_keep_their_order() -> None:
    table = RequestTable()
    queue = FairQueue(table)
    for index in range(4):
        queue.append(entry(table, f"hog-{index}", "_INBOX_hog"))
    queue.append(entry(table, "fair-0", "_INBOX_fair"))
    queue.append(entry(table, "fair-1", "_INBOX_fair"))
    assert len(queue) == 6
    assert drain(queue) == ["hog-0", "fair-0", "hog-1", "fair-1", "hog-2", "hog-3"]
    assert len(queue) == 0 and table.queued_bytes == 0


def test_an_owner_over_its_share_waits_while_others_wait_but_not_alone() -> None:
    table = RequestTable()
    queue = FairQueue(table)
    for index in range(3):
        queue.append(entry(table, f"hog-{index}", "_INBOX_hog"))
    queue.append(entry(table, "fair-0", "_INBOX_fair"))
    queue.append(entry(table, "fair-1", "_INBOX_fair"))
    assert drain(queue, lambda owner: owner == "_INBOX_hog") == ["fair-0", "fair-1", "hog-0", "hog-1", "hog-2"]


def test_a_request_its_engine_lost_goes_first() -> None:
    table = RequestTable()
    queue = FairQueue(table)
    queue.append(entry(table, "a-0", "_INBOX_a"))
    queue.append(entry(table, "b-0", "_INBOX_b"))
    queue.appendleft(entry(table, "b-lost", "_INBOX_b"))
    assert drain(queue) == ["b-lost", "a-0", "b-0"]


def test_answered_requests_leave_the_counts_at_once_and_the_lines_soon() -> None:
    table = RequestTable()
    queue = FairQueue(table)
    waiting = [entry(table, f"r-{index}", "_INBOX_a", b"x" * 100) for index in range(3)]
    for request in waiting:
        queue.append(request)
    assert table.queued_bytes == 300
    table.pop("r-0")  # its deadline passed while it waited
    assert len(queue) == 2 and table.queued_bytes == 200
    assert drain(queue) == ["r-1", "r-2"]
    for index in range(3 * COMPACT_SLACK):  # a flood that expires while it waits never piles up
        request = entry(table, f"flood-{index}", "_INBOX_a")
        queue.append(request)
        table.pop(request.return_path.request_id)
    assert len(queue) == 0 and queue._held <= COMPACT_SLACK + 1


def test_slots_held_follow_routing_and_answers() -> None:
    table = RequestTable()
    routed = entry(table, "r-0", "_INBOX_a")
    routed.engine_id = "e0"
    table.held["_INBOX_a"] = 1  # as the outbox counts it when it routes the request
    assert table.held_by("_INBOX_a") == 1
    table.pop("r-0")
    assert table.held_by("_INBOX_a") == 0
    table.forget_idle_owners()  # the coordinator's heartbeat does this
    assert "_INBOX_a" not in table.held


def test_request_ids_are_random_and_never_repeat() -> None:
    ids = request_ids("c1")
    drawn = [next(ids) for _ in range(2000)]
    assert len(set(drawn)) == len(drawn)
    assert all(request_id.startswith("c1-") and len(request_id) == 3 + ID_HEX_DIGITS for request_id in drawn)
    assert all(int(request_id[3:], 16) >= 0 for request_id in drawn)
    assert drawn[1] != "c1-1" and int(drawn[1][3:], 16) != int(drawn[0][3:], 16) + 1
