"""The edge's departure extension (service/gateway/edge.py): callbacks run once when the
connection is lost, a discarded one never, and an app finds it in the scope (or None when the
server is another)."""

from __future__ import annotations

from service.gateway.edge import DEPARTURE, Departure, departure_of


def test_callbacks_run_once_on_loss_and_a_discarded_one_never() -> None:
    departure = Departure()
    heard: list[str] = []

    def kept() -> None:
        heard.append("kept")

    def dropped() -> None:
        heard.append("dropped")

    departure.add(kept)
    departure.add(dropped)
    departure.discard(dropped)
    departure.discard(dropped)  # twice is harmless
    departure.fire()
    departure.fire()
    assert heard == ["kept"] and departure.gone


def test_an_app_finds_the_departure_in_the_scope_only_under_the_edge() -> None:
    departure = Departure()
    assert departure_of({"extensions": {DEPARTURE: {"departure": departure}}}) is departure
    assert departure_of({"extensions": None}) is None
    assert departure_of({}) is None
