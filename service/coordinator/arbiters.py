"""The replicas that arbitrate request ids, as this replica sees them, and whether it may run
the ids it arbitrates now: the state of arbitration (docs/reliability.md, *One run per id*).

Contract:
- A replica joins: for its quiet time after it starts, in which every live peer's heartbeat
  arrives, it does not arbitrate (its heartbeats say so) and hands what it gets to the
  arbiters among its peers, so a replica that starts holds nothing up; then it arbitrates,
  until it leaves (:meth:`Arbiters.stop_arbitrating`).
- The view is this replica (while it arbitrates) and the live peers whose heartbeats say they
  arbitrate; the arbiter of an id is :class:`service.protocol.arbiter.ArbiterTable`'s for it.
- Claims: the ids other replicas hold (in flight, or as a cached result) that this replica
  arbitrates, by holder. Each holder's claims come whole whenever its view changes and
  replace what it claimed before; a departed holder's are forgotten (its adopter claims again
  what it adopted).
- Settled: this replica may run an id it arbitrates (or hand it to the holder its claims
  name) only when every replica of its view sent claims for that same view, none is adopting
  (itself, or the adopter of a peer that departed, until that one's claims arrive), and,
  unless it sees no peer at all, a short quiet time after it started (or found its own loop
  stalled) has passed, in which every live peer's heartbeat arrives. Two settled replicas with
  peers have the same view, so they name the same arbiter: no id runs on two replicas.
  Unsettled, the arbiter holds what it would run. A replica alone (no arbitrating peer, and,
  while it joins, no live peer at all) runs new submissions at once but holds resubmissions
  for its quiet time (``quiet_now``): a replica that restarts gets its clients' resubmissions
  at once, and a peer it has not heard yet may hold them. Replicas that start together, each
  joining, hold what they get until they arbitrate.

Everything here is read on the hot path as plain attributes (``settled``, ``alone``,
``claimed``); it changes only when a heartbeat, a view or claims change.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from service.coordinator.requests import ClientKey
from service.protocol.arbiter import ArbiterTable


class Arbiters:
    def __init__(self, own_id: str, quiet_s: float, max_claims: int) -> None:
        self.own_id = own_id
        self.joining = True  # until its quiet time has passed (:meth:`join`)
        self.arbitrating = False  # from joining until leaving
        self.view: frozenset[str] = frozenset()
        self.table = ArbiterTable({own_id})
        self.alone = True  # every id is its own, no hash needed (see the module docstring)
        self.settled = True  # alone as it starts: it runs new submissions until it hears a peer
        self.claimed = False  # some claims are held (the hot path skips the lookup otherwise)
        self._quiet_s = quiet_s
        self._quiet_until = time.monotonic() + quiet_s
        self._max_claims = max_claims
        self._peers: set[str] = set()  # peers whose heartbeats say they arbitrate
        self._received: dict[str, frozenset[str]] = {}  # peer -> the view of its last whole claims
        self._claims: dict[ClientKey, str] = {}  # id -> the holder claiming it
        self._by_holder: dict[str, set[ClientKey]] = {}
        self._incoming: dict[str, set[ClientKey]] = {}  # holder -> claims still arriving in parts
        self._awaiting: set[str] = set()  # adopters of departed peers, until their claims arrive

    # ------------------------------------------------------------ reading (hot)

    def of(self, key: ClientKey) -> str:
        """The replica arbitrating ``key`` in this view."""
        if self.alone:
            return self.own_id
        return self.table.of(key[0], key[1])

    def holder(self, key: ClientKey) -> str | None:
        """The replica that claimed ``key``, if one did."""
        return self._claims.get(key)

    # ------------------------------------------------------------ the view

    def heard(self, peer: str, arbitrates: bool) -> bool:
        """A peer's heartbeat; True when it started or stopped arbitrating as this replica sees it."""
        if arbitrates == (peer in self._peers):
            return False
        if arbitrates:
            self._peers.add(peer)
        else:
            self._peers.discard(peer)
        return True

    def set_view(self, live_peers: Iterable[str]) -> bool:
        """The view from the live peers; True when it changed (the table is computed again)."""
        live = set(live_peers)
        members = live & self._peers
        alone = not members and (self.arbitrating or not live)
        if self.arbitrating:
            members.add(self.own_id)
        view = frozenset(members)
        if view == self.view and alone == self.alone:
            return False
        self.view = view
        self.table = ArbiterTable(view or {self.own_id})
        self.alone = alone
        return True

    def join(self) -> bool:
        """Arbitrate from now on, the quiet time having passed; True when this replica joined now."""
        if not self.joining or self.quiet_now:
            return False
        self.joining = False
        self.arbitrating = True
        return True

    def departed(self, peer: str, adopter: str) -> None:
        """A peer died or left: its claims go (its adopter claims again what it adopts) and,
        unless this replica adopts, it waits for the adopter's claims."""
        self._peers.discard(peer)
        self._received.pop(peer, None)
        self._incoming.pop(peer, None)
        self._awaiting.discard(peer)
        self._forget_claims(peer)
        if adopter != self.own_id and adopter in self._peers:  # one of an earlier release sends none
            self._awaiting.add(adopter)

    def stop_arbitrating(self) -> None:
        self.joining = False
        self.arbitrating = False

    def quiet(self) -> None:
        """Start the quiet time again: this replica's loop stalled, so it may have missed peers."""
        self._quiet_until = time.monotonic() + self._quiet_s

    @property
    def quiet_now(self) -> bool:
        """Within the quiet time: a peer not heard yet may hold what is resubmitted here."""
        return time.monotonic() < self._quiet_until

    # ------------------------------------------------------------ claims

    def take_claims(
        self, holder: str, view: Iterable[str], keys: Iterable[tuple[str | None, object]], part: int, last: bool
    ) -> None:
        """One part of ``holder``'s claims; the whole replaces its earlier claims."""
        if part == 0:
            self._incoming[holder] = set()
        arriving = self._incoming.get(holder)
        if arriving is None:  # a part whose first was lost: the next whole claims come later
            return
        arriving.update(keys)  # type: ignore[arg-type]  # msgspec checked them as ClientKey
        if not last:
            return
        del self._incoming[holder]
        self._forget_claims(holder)
        room = max(0, self._max_claims - len(self._claims))
        kept = set(list(arriving)[:room]) if len(arriving) > room else arriving
        claims = self._claims
        for key in kept:
            claims[key] = holder
        self._by_holder[holder] = kept
        self.claimed = bool(claims)
        self._received[holder] = frozenset(view)
        self._awaiting.discard(holder)

    def _forget_claims(self, holder: str) -> None:
        claims = self._claims
        for key in self._by_holder.pop(holder, ()):
            if claims.get(key) == holder:
                del claims[key]
        self.claimed = bool(claims)

    # ------------------------------------------------------------ settled

    def refresh(self, adopting: bool) -> bool:
        """Decide ``settled`` again (see the module docstring); returns it."""
        received = self._received
        self.settled = (
            not adopting
            and not self._awaiting
            and (
                self.alone
                or (
                    self.arbitrating
                    and time.monotonic() >= self._quiet_until
                    and all(received.get(peer) == self.view for peer in self.view if peer != self.own_id)
                )
            )
        )
        return self.settled

    def missing(self) -> list[str]:
        """What keeps this replica unsettled, for a log line."""
        reasons = [
            f"claims of {peer}" for peer in sorted(self.view - {self.own_id}) if self._received.get(peer) != self.view
        ]
        reasons += [f"the adopter {adopter}" for adopter in sorted(self._awaiting)]
        if self.joining:
            reasons.append("joining")
        if time.monotonic() < self._quiet_until:
            reasons.append("its quiet time")
        return reasons
