"""Arbitration: every submission that names a ``client_request_id`` runs on the one replica
arbitrating its id, so two copies never both run (docs/reliability.md, *One run per id*).

Contract:
- A replica that holds the id (in flight, or as a cached result) answers the copy itself, as
  admission does: the same reply subject is answered, another gets 409 ``in progress``, a
  cached result is sent again.
- Otherwise a replica that does not arbitrate the id hands the copy, as its client sent it, to
  the arbiter (``<prefix>.arbiter_submission.<arbiter>``, batched per loop turn); the client
  library sends it there itself (``<prefix>.submit_request.<arbiter>``), so this costs a hop
  only to clients that do not.
- The arbiter, once settled (:mod:`.arbiters`), runs it, or, when another replica claims the
  id, asks that one first (:mod:`.forwarding`; the holder answers the client). A resubmission
  it holds nothing of also asks every peer first, as before arbitration.
- Unsettled (the replicas changed a moment ago, this one just started or is adopting), the
  arbiter holds the copy, and so does a replica handed a copy it does not arbitrate in its
  view (the sender's view differs: one of the two is changing). Held copies are admitted (or
  handed on) as soon as it is settled; after ``heartbeat_timeout_s + control_timeout_s`` they
  run here once no live peer holds them (``arbitration_unsettled``). At most
  ``max_queued_requests`` + :data:`HELD_BEYOND_QUEUE` are held (429 beyond).
- Claims: whenever its view changes (and twice more, a beat apart, as NATS may lose one), after
  an adoption, and after a reconnect, a replica sends each replica of its view the ids it holds
  that that one arbitrates (``<prefix>.arbiter_claims.<peer>``).
- A replica that stops while peers live stops arbitrating first: it sends its claims for the
  view without it and says so in a heartbeat, so its peers hand it nothing more.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from service.bus.batches import ITEM_OVERHEAD, fits_alone, split_batches
from service.bus.registry import Incoming
from service.coordinator.admission import Admission
from service.coordinator.arbiters import Arbiters
from service.coordinator.core import Core
from service.coordinator.ledger import RequestLedger
from service.coordinator.ownership import Ownership
from service.coordinator.peers import CoordinatorPeers
from service.coordinator.requests import ClientKey
from service.coordinator.results import ResultCache
from service.protocol.codec import encode_msgpack
from service.protocol.errors import ErrorCode, WireError
from service.protocol.handover import ArbiterClaims, HandedSubmissions
from service.protocol.messages import SubmitEnvelope, SubmitRequest
from service.protocol.subjects import Header

log = logging.getLogger(__name__)

# Beats after a view change on which the claims are sent again (NATS delivers at most once).
CLAIM_REPEATS = 2
# Submissions held while the replicas settle, beyond what the queue takes (a start's quiet time
# holds every named submission: those the queue will take, and the ones it will refuse).
HELD_BEYOND_QUEUE = 1024


@dataclass(slots=True)
class Held:
    incoming: Incoming
    submit: SubmitRequest | SubmitEnvelope
    handed: bool
    since: float


class Arbitration:
    def __init__(
        self,
        core: Core,
        ledger: RequestLedger,
        results: ResultCache,
        peers: CoordinatorPeers,
        arbiters: Arbiters,
        admission: Admission,
        ownership: Ownership,
        adopting: Callable[[], bool],
        refuse: Callable[[Incoming, WireError], Awaitable[None]],
        admit: Callable[[Incoming, SubmitRequest | SubmitEnvelope], Awaitable[object]] | None = None,
    ) -> None:
        self._refuse = refuse
        self._admit = admit or admission.admit  # the traced admission when tracing is on
        self._core = core
        self._id = core.id
        self._ledger = ledger
        self._results = results
        self._peers = peers
        self._arbiters = arbiters
        self._admission = admission
        self._ownership = ownership
        self._adopting = adopting
        settings = core.settings
        self._patience_s = settings.heartbeat_timeout_s + settings.control_timeout_s
        self._quiet_s = quiet_s(settings.heartbeat_interval_s)
        self._max_held = settings.max_queued_requests + HELD_BEYOND_QUEUE
        self._held: deque[Held] = deque()
        self._handing: dict[str, list[tuple[str, bytes]]] = {}  # arbiter -> this turn's copies
        self._repeats = 0  # beats left on which the claims go again
        self._claims_due = False  # an adoption ended, or NATS came back: send the claims
        self._releasing = False

    @property
    def arbitrating(self) -> bool:
        return self._arbiters.arbitrating

    def join(self) -> bool:
        """Arbitrate from now on if the quiet time has passed; True when this replica joined now
        (its next heartbeat says so)."""
        return self._arbiters.join()

    # ------------------------------------------------------------ submissions (the hot path)

    async def admit(self, incoming: Incoming, submit: SubmitRequest | SubmitEnvelope, handed: bool = False) -> None:
        """A submission (``handed``: by a replica that took it for the arbiter); one naming no
        ``client_request_id`` goes straight to admission. The hot path is the first lines: a
        settled arbiter that no other replica claims anything of admits at once."""
        client_request_id = submit.client_request_id
        arbiters = self._arbiters
        if client_request_id is None or (
            arbiters.settled
            and not arbiters.claimed
            and (arbiters.alone or arbiters.table.of(submit.client_id, client_request_id) == self._id)
        ):
            if type(submit) is SubmitEnvelope and submit.resubmission and client_request_id is not None:
                await self._resubmitted(incoming, submit, handed)
            else:
                await self._admit(incoming, submit)
            return
        key = (submit.client_id, client_request_id)
        if arbiters.settled and arbiters.of(key) == self._id:
            holder = arbiters.holder(key)
            # A claimed id is asked of its holder each time until held here: the holder answers
            # while it holds it (its result expires after result_ttl_s), then this one runs it.
            if holder is not None and not self._admission.holds(key):
                if self._ownership.admit_unless_held(incoming, submit, holder):
                    return
            if type(submit) is SubmitEnvelope and submit.resubmission:
                await self._resubmitted(incoming, submit, handed)
            else:
                await self._admit(incoming, submit)
            return
        await self._elsewhere(incoming, submit, handed, key)

    async def admit_handed(self, _: object, incoming: Incoming, submit: SubmitRequest | SubmitEnvelope) -> None:
        """A copy another replica handed over, as dispatched (``_``: the handler context)."""
        await self.admit(incoming, submit, handed=True)

    async def _resubmitted(self, incoming: Incoming, submit: SubmitEnvelope, handed: bool) -> None:
        """A resubmission this replica arbitrates: its peers are asked first (:mod:`.ownership`);
        within its quiet time it waits, as a peer not heard yet may hold it."""
        if self._arbiters.quiet_now and not self._admission.holds((submit.client_id, submit.client_request_id)):  # type: ignore[arg-type]
            self._hold(incoming, submit, handed)
            return
        await self._ownership.admit(incoming, submit)

    async def _elsewhere(
        self, incoming: Incoming, submit: SubmitRequest | SubmitEnvelope, handed: bool, key: ClientKey
    ) -> None:
        """Not settled, or not the arbiter: answer what this replica holds, hand over, or hold."""
        if self._admission.holds(key):
            await self._admit(incoming, submit)
            return
        arbiters = self._arbiters
        arbiter = arbiters.of(key)
        if arbiter != self._id and (not handed or not arbiters.arbitrating):
            await self._hand_over(arbiter, incoming, submit)
            return
        self._hold(incoming, submit, handed)

    def _hold(self, incoming: Incoming, submit: SubmitRequest | SubmitEnvelope, handed: bool) -> None:
        if len(self._held) >= self._max_held:
            raise WireError(
                ErrorCode.OVERLOADED, f"coordinator queue full ({self._max_held} held while replicas settle)"
            )
        self._held.append(Held(incoming, submit, handed, time.monotonic()))
        self._core.counters["arbitration_held"] += 1

    # ------------------------------------------------------------ handing over

    async def _hand_over(self, arbiter: str, incoming: Incoming, submit: SubmitRequest | SubmitEnvelope) -> None:
        """Give the copy to ``arbiter`` with this loop turn's others; one too large to travel
        inside a batch runs here once no live peer holds it."""
        copy = (incoming.reply or "", incoming.body)
        if not fits_alone(_copy_size(copy), self._core.nc.max_payload):
            if not self._ownership.admit_unless_held(incoming, submit):
                await self._admit(incoming, submit)
            return
        handing = self._handing
        if not handing:
            asyncio.get_running_loop().call_soon(self._send_soon)
        copies = handing.get(arbiter)
        if copies is None:
            handing[arbiter] = [copy]
        else:
            copies.append(copy)
        self._core.counters["submissions_handed"] += 1

    def _send_soon(self) -> None:
        self._core.spawn(self._send_handed())

    async def _send_handed(self) -> None:
        """This loop turn's copies, one message per arbiter, each under ``max_payload``."""
        handing, self._handing = self._handing, {}
        nc, subjects = self._core.nc, self._core.subjects
        for arbiter, copies in handing.items():
            subject = subjects.addressed_to(Header.ARBITER_SUBMISSION, arbiter)
            for batch in split_batches(copies, _copy_size, nc.max_payload):
                await nc.publish(subject, encode_msgpack(HandedSubmissions(batch)))

    # ------------------------------------------------------------ holding while unsettled

    async def release(self) -> None:
        """Admit (or hand on) what was held, once settled; past the patience, run it here once no
        live peer holds it."""
        if self._releasing or not self._held:
            return
        self._releasing = True
        try:
            settled = self._arbiters.refresh(self._adopting())
            now = time.monotonic()
            for _ in range(len(self._held)):
                held = self._held.popleft()
                if settled:
                    await self._guarded(held, self.admit(held.incoming, held.submit, held.handed))
                elif now - held.since >= self._patience_s:
                    self._core.counters["arbitration_unsettled"] += 1
                    log.warning(
                        "client_request_id=%s: replicas unsettled for %.1f s (%s); running it once no peer holds it",
                        held.submit.client_request_id,
                        self._patience_s,
                        ", ".join(self._arbiters.missing()) or "no reason left",
                    )
                    if not self._ownership.admit_unless_held(held.incoming, held.submit):
                        await self._guarded(held, self._admit(held.incoming, held.submit))
                else:
                    self._held.append(held)
        finally:
            self._releasing = False

    async def _guarded(self, held: Held, step: Awaitable[object]) -> None:
        """``step``, a refusal of it answered to its client (dispatch does so on the reading task)."""
        try:
            await step
        except WireError as err:
            await self._refuse(held.incoming, err)

    # ------------------------------------------------------------ claims

    def stalled(self) -> None:
        """This replica's loop stalled (a stopped process, say): quiet again, then settle."""
        self._arbiters.quiet()
        asyncio.get_running_loop().call_later(self._quiet_s, lambda: self._core.spawn(self.beat()))

    def heard(self, peer: str, arbitrates: bool) -> None:
        """A peer's heartbeat: a peer that starts or stops arbitrating changes the view at once,
        before the next message is read (one that stops may be closing: nothing more goes to it)."""
        if self._arbiters.heard(peer, arbitrates) and self._peers.is_live(peer):
            self._follow_view()
            self._core.spawn(self.beat())

    def departed(self, peer: str) -> None:
        """A peer died or left; its adopter is the lowest live replica."""
        self._arbiters.departed(peer, min([self._id, *self._peers.live()]))

    def adopted(self) -> None:
        """An adoption ended: the claims go out with what it added."""
        self._claims_due = True
        self._core.spawn(self.beat())

    def reconnected(self) -> None:
        self._claims_due = True

    async def beat(self) -> None:
        """Each heartbeat (and at once when the view may have changed): follow the view, send the
        claims when due, settle, release what was held."""
        arbiters = self._arbiters
        self._follow_view()
        adopting = self._adopting()
        if (self._repeats or self._claims_due) and not adopting and self._core.nc.is_connected:
            self._repeats = max(0, self._repeats - 1)
            self._claims_due = False
            await self.send_claims()
        if arbiters.refresh(adopting) or self._held:
            await self.release()

    def _follow_view(self) -> None:
        """The view from the live peers; when it changed, the claims go on the next beats."""
        arbiters = self._arbiters
        if arbiters.set_view(self._peers.live()):
            self._repeats = CLAIM_REPEATS + 1
            state = "leaving" if not arbiters.arbitrating and not arbiters.joining else "joining"
            log.info("arbitrating among %s", ", ".join(sorted(arbiters.view)) or f"none ({state})")

    async def send_claims(self) -> None:
        """To each peer of the view, the ids this replica holds that it arbitrates."""
        arbiters = self._arbiters
        view = sorted(arbiters.view)
        by_peer: dict[str, list[ClientKey]] = {peer: [] for peer in view if peer != self._id}
        if not by_peer:
            return
        for key in {*self._ledger.client_keys(), *self._results.keys()}:
            keys = by_peer.get(arbiters.of(key))
            if keys is not None:
                keys.append(key)
        nc, subjects = self._core.nc, self._core.subjects
        for peer, keys in by_peer.items():
            parts = list(split_batches(keys, _key_size, nc.max_payload - _view_size(view))) or [[]]
            for number, part in enumerate(parts):
                claims = ArbiterClaims(self._id, view, part, number, number == len(parts) - 1)
                await nc.publish(subjects.addressed_to(Header.ARBITER_CLAIMS, peer), encode_msgpack(claims))

    async def take_claims(self, claims: ArbiterClaims) -> None:
        """A peer's claims (a part of them). One for an id an engine runs for this replica means
        the peer adopted it while this replica was taken for dead (its loop stalled): the peer
        answers it, so it leaves this ledger unanswered here."""
        for key in claims.keys:
            entry = self._ledger.find_client(key)
            if entry is not None and entry.engine_id is not None:
                if self._ledger.finish(entry.return_path.request_id) is not None:
                    self._core.counters["requests_adopted_away"] += 1
                    log.warning(
                        "request_id=%s: held by %s too; it answers", entry.return_path.request_id, claims.holder
                    )
        self._arbiters.take_claims(claims.holder, claims.view, claims.keys, claims.part, claims.last)
        if claims.last:
            self._core.counters["claims_received"] += len(claims.keys)
            if self._arbiters.refresh(self._adopting()) and self._held:
                await self.release()

    # ------------------------------------------------------------ stopping

    async def stop_arbitrating(self) -> None:
        """This replica stops while peers live: its claims for the view without it (then its
        heartbeat says it no longer arbitrates, so its peers hand it nothing more), and what it
        held handed to the others."""
        self._arbiters.stop_arbitrating()
        self._arbiters.set_view(self._peers.live())
        self._arbiters.refresh(self._adopting())
        await self.send_claims()
        for _ in range(len(self._held)):  # what waited here goes to its arbiter among the others
            held = self._held.popleft()
            await self._guarded(held, self.admit(held.incoming, held.submit, held.handed))


def quiet_s(heartbeat_interval_s: float) -> float:
    """A replica's quiet time: every live peer beats within an interval of it."""
    return 1.5 * heartbeat_interval_s


def _copy_size(copy: tuple[str, bytes]) -> int:
    return len(copy[0]) + len(copy[1]) + ITEM_OVERHEAD


def _key_size(key: ClientKey) -> int:
    client_id, client_request_id = key
    return len(client_id or "") * 4 + (len(client_request_id) * 4 if isinstance(client_request_id, str) else 9) + 8


def _view_size(view: list[str]) -> int:
    return sum(len(replica) for replica in view) + 64
