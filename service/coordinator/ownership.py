"""Ownership across replicas: what a replica does with a client's message about a request it
does not hold, and with a peer's forwarded one.

Contract (docs/reliability.md, ownership):
- A request belongs to the replica that admitted it (its id starts with that replica's id),
  or to the adopter of that replica once it is dead (:mod:`.adoption`).
- A resubmission this replica does not hold is forwarded (:mod:`.forwarding`) before it may
  run here; an answer that cannot come at once (the peers are asked on a task of its own,
  since submissions are handled on the reading task) reaches the client as an error reply.
- An abort this replica does not hold is forwarded too; the holder's answer is the client's.
- Forwarded messages are answered from this replica's own table alone, never forwarded on.
"""

from __future__ import annotations

from service.bus.registry import Incoming
from service.coordinator.admission import Admission
from service.coordinator.core import Core
from service.coordinator.forwarding import Forwarding
from service.coordinator.ledger import RequestLedger
from service.coordinator.peers import CoordinatorPeers
from service.coordinator.requests import ClientKey, InflightRequest
from service.protocol.codec import detect_encoding, encode
from service.protocol.errors import ErrorCode, WireError
from service.protocol.handover import ForwardedAbort, ForwardedSubmission
from service.protocol.messages import SubmitEnvelope, SubmitRequest, error_reply
from service.protocol.subjects import ReplySubjects


class Ownership:
    def __init__(
        self,
        core: Core,
        ledger: RequestLedger,
        peers: CoordinatorPeers,
        admission: Admission,
        forwarding: Forwarding,
        replies: ReplySubjects,
    ) -> None:
        self._core = core
        self._ledger = ledger
        self._peers = peers
        self._admission = admission
        self._forwarding = forwarding
        self._replies = replies

    async def admit(self, incoming: Incoming, submit: SubmitEnvelope) -> None:
        """A resubmission: forwarded when this replica does not hold it and has live peers."""
        forwarded = self._admission.forwardable(incoming, submit)
        if forwarded is None or not self._peers.live():
            await self._admission.admit(incoming, submit)
            return
        self._core.spawn(self._admit_unless_held_elsewhere(incoming, submit, forwarded))

    def admit_unless_held(
        self, incoming: Incoming, submit: SubmitRequest | SubmitEnvelope, holder: str | None = None
    ) -> bool:
        """Ask ``holder`` (else every live peer) whether it holds this named submission, on a
        task of its own, and admit it here when none does; False when it cannot be asked
        (admit it, or refuse it, at once)."""
        forwarded = self._admission.as_forwarded(incoming, submit)
        if forwarded is None or not self._peers.live():
            return False
        self._core.spawn(self._admit_unless_held_elsewhere(incoming, submit, forwarded, holder))
        return True

    async def _admit_unless_held_elsewhere(
        self,
        incoming: Incoming,
        submit: SubmitRequest | SubmitEnvelope,
        forwarded: ForwardedSubmission,
        holder: str | None = None,
    ) -> None:
        try:
            if not await self._forwarding.held_elsewhere(forwarded, holder):
                await self._admission.admit(incoming, submit)
        except WireError as err:
            self._core.counters[f"error_{err.code}"] += 1
            reply = error_reply(err, forwarded.client_request_id)
            await self._core.nc.publish(forwarded.reply_to, encode(reply, detect_encoding(forwarded.body)))
            if forwarded.stream:
                await self._core.nc.publish(forwarded.reply_to, b"")

    async def take_resubmission(self, forwarded: ForwardedSubmission) -> bool:
        owner, problem = self._replies.check(forwarded.reply_to)
        if problem is not None or owner != forwarded.owner:
            raise WireError(
                ErrorCode.MALFORMED, f"reply_to {forwarded.reply_to[:256]!r} is not under {forwarded.owner!r}"
            )
        client_key = (forwarded.client_id, forwarded.client_request_id)
        if not self._admission.holds(client_key):
            return False
        return await self._admission.resubmitted(
            client_key, forwarded.reply_to, forwarded.stream, forwarded.owner, forwarded.body
        )

    async def abort(self, incoming: Incoming, request_id: str | None, client_key: ClientKey | None) -> str:
        entry, wanted = self._find(request_id, client_key)
        if entry is not None:
            return await self._abort(entry, incoming.owner, wanted)
        if incoming.owner is not None and self._peers.live():
            client_id, client_request_id = client_key if client_key is not None else (None, None)
            forwarded = ForwardedAbort(incoming.owner, request_id, client_id, client_request_id)
            aborted = await self._forwarding.abort_elsewhere(forwarded)
            if aborted is not None:
                return aborted
        raise WireError(ErrorCode.NOT_FOUND, f"no request in flight with {wanted}")

    async def abort_held(self, forwarded: ForwardedAbort) -> str:
        client_key = None
        if forwarded.client_request_id is not None:
            client_key = (forwarded.client_id, forwarded.client_request_id)
        entry, wanted = self._find(forwarded.request_id, client_key)
        if entry is None:
            raise WireError(ErrorCode.NOT_FOUND, f"no request in flight with {wanted}")
        return await self._abort(entry, forwarded.owner, wanted)

    def _find(self, request_id: str | None, client_key: ClientKey | None) -> tuple[InflightRequest | None, str]:
        if request_id is not None:
            return self._ledger.get(request_id), f"request_id {request_id!r}"
        if client_key is not None:
            wanted = f"client_request_id {client_key[1]!r} of client_id {client_key[0]!r}"
            return self._ledger.find_client(client_key), wanted
        raise WireError(ErrorCode.MALFORMED, "abort_request needs request_id or client_request_id")

    async def _abort(self, entry: InflightRequest, owner: str | None, wanted: str) -> str:
        if owner != entry.owner:
            raise WireError(ErrorCode.FORBIDDEN, f"the request with {wanted} belongs to another owner")
        await self._ledger.abort(entry)
        return entry.return_path.request_id
