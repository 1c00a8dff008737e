"""A request's runs: each loss of its engine starts a new one, and replies of an older run from
an engine that ran it are recognised as stale (never from an engine that did not)."""

from __future__ import annotations

from service.coordinator.requests import InflightRequest
from service.protocol.codec import Encoding
from service.protocol.routed import ReturnPath, RoutedReply


def entry() -> InflightRequest:
    return InflightRequest(ReturnPath("r1", "c1", "_INBOX.x", "msgpack", True, None), Encoding.MSGPACK, b"{}", None)


def test_the_first_routing_is_run_zero_and_nothing_is_stale() -> None:
    request = entry()
    assert request.attempt == 0
    request.engine_id, request.attempts = "e1", 1
    assert request.attempt == 0 and not request.stale("e1", 0)


def test_a_new_run_resets_the_stream_order_and_remembers_the_engine() -> None:
    request = entry()
    request.engine_id, request.attempts = "e1", 1
    request.partials_delivered = 4
    request.early_final = RoutedReply(request.return_path, b"", 9)
    request.new_run()
    request.engine_id, request.attempts = "e2", 2  # as the outbox routes it again
    assert request.attempt == 1 and request.partials_delivered == 0 and request.early_final is None
    assert request.stale("e1", 0)  # the older run, still talking
    assert not request.stale("e1", 1) and not request.stale("e3", 0)
