"""Coordinator peers: exactly one live replica adopts a dead replica's orphan replies."""

from __future__ import annotations

from service.coordinator.peers import CoordinatorPeers
from tests.unit.coordinator.conftest import Clock


def test_not_warmed_up_until_a_heartbeat_timeout_passed(clock: Clock) -> None:
    peers = CoordinatorPeers("c2", timeout_s=3.0)
    assert not peers.warmed_up
    clock.now += 3.0
    assert peers.warmed_up


def test_lowest_live_id_adopts_a_dead_owners_replies(clock: Clock) -> None:
    low, high = CoordinatorPeers("c1", 3.0), CoordinatorPeers("c2", 3.0)
    low.saw("c2")
    high.saw("c1")
    assert low.should_adopt("c9") and not high.should_adopt("c9")


def test_a_live_owner_keeps_its_replies(clock: Clock) -> None:
    peers = CoordinatorPeers("c1", 3.0)
    peers.saw("c5")
    assert not peers.should_adopt("c5")


def test_a_silent_peer_is_forgotten_so_the_survivor_adopts(clock: Clock) -> None:
    survivor = CoordinatorPeers("c2", 3.0)
    survivor.saw("c1")
    assert not survivor.should_adopt("c9")  # c1 is live and lower: it adopts
    clock.now += 3.0
    assert survivor.should_adopt("c9") and survivor.should_adopt("c1")


def test_own_heartbeats_are_ignored(clock: Clock) -> None:
    peers = CoordinatorPeers("c3", 3.0)
    peers.saw("c3")
    assert peers.should_adopt("c9")


def test_peer_clocks_restart_after_this_replicas_own_reconnect(clock: Clock) -> None:
    """Cut off from NATS, a replica heard no one: its live peers are not dead for that."""
    peers = CoordinatorPeers("c1", 3.0)
    peers.saw("c2")
    clock.now += 2.9
    peers.restart_clocks()  # back on the bus
    clock.now += 2.9
    assert peers.live() == ["c2"] and peers.take_departed() == []
    clock.now += 0.2
    assert peers.live() == [] and peers.take_departed() == ["c2"]


def test_a_silent_peer_is_suspected_before_it_is_dead(clock: Clock) -> None:
    peers = CoordinatorPeers("c1", 3.0, suspect_after_s=2.0)
    peers.saw("c2")
    assert not peers.suspected()
    clock.now += 2.0
    assert peers.suspected() and peers.is_live("c2")
    clock.now += 1.0
    assert not peers.is_live("c2")
    assert peers.take_departed() == ["c2"] and peers.take_departed() == []
    assert not peers.suspected()
