"""What a handler may ask of the coordinator: one narrow ``Protocol`` per group of handlers.

Handlers never see the coordinator's fields; they call these methods, which the coordinator
provides (``service/coordinator/coordinator.py``): most are the methods of the job that acts on
the message, bound as they are, the others a few lines that combine two jobs. A handler that needs something new adds
it here first, so this file lists everything a message can make the coordinator do.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, Protocol

from msgspec import Struct

from service.bus.registry import Incoming
from service.protocol.handover import ArbiterClaims, ForwardedAbort, ForwardedHold, ForwardedSubmission
from service.protocol.kv_events import KvEvents
from service.protocol.membership import Heartbeat
from service.protocol.messages import (
    ClientRequestId,
    ControlSignal,
    HoldRequest,
    ServedModel,
    SubmitEnvelope,
    SubmitRequest,
    UpdateWeights,
    WeightVersion,
)
from service.protocol.routed import RoutedReply
from service.protocol.state import CoordinatorState, Written
from service.protocol.subjects import Header


class Replier(Protocol):
    @property
    def id(self) -> str: ...

    async def reply(self, incoming: Incoming, message: Struct) -> None:
        """Answer ``incoming`` on its reply subject, in its encoding; nothing when it gave none."""


class ClientContext(Replier, Protocol):
    @property
    def state(self) -> CoordinatorState: ...

    async def admit(self, incoming: Incoming, submit: SubmitRequest | SubmitEnvelope) -> None:
        """Route ``submit`` to an engine, or queue it; raises WireError when it is refused."""

    async def abort(
        self, incoming: Incoming, request_id: str | None, client_key: tuple[str | None, ClientRequestId] | None
    ) -> str:
        """End the request so named with an ``abort`` final; its request id. Raises WireError 404,
        or 403 when ``incoming`` comes from another owner than the request's."""

    async def hold(self, incoming: Incoming, payload: HoldRequest) -> str:
        """Hold (or release) the request so named in its engine; its request id. Raises
        WireError 404, or 403 when ``incoming`` comes from another owner than the request's."""

    def client_connected(self, incoming: Incoming) -> None:
        """Remember the owner of ``incoming``'s reply subject as a client that connected."""

    def served_models(self) -> list[ServedModel]:
        """The models this replica's engines serve, with their engines, capacity and load."""

    async def shut_down(self, incoming: Incoming) -> None:
        """Stop every coordinator replica of the prefix, this one too: acknowledge ``incoming``
        with how many there were, then stop; open requests get an error reply on the way out.
        Raises WireError 403 unless ``incoming``'s owner connected."""


class ControlContext(Replier, Protocol):
    @property
    def state(self) -> CoordinatorState: ...

    async def apply_control(self, signal: Header, payload: ControlSignal) -> Written:
        """Validate ``signal`` against the transition table on the control state every replica
        shares and write it there: the record and revision, and whether this call changed it.
        Raises WireError 409 when the table forbids it."""

    async def control_engines(
        self, incoming: Incoming, signal: Header, payload: ControlSignal, written: Written | None
    ) -> None:
        """Broadcast ``signal`` to every engine, settle what it changes, and answer ``incoming``
        with what was ``written`` (None for profiler signals) once every engine confirmed (or
        with the engines that did not)."""

    def spawn(self, coro: Coroutine[Any, Any, object]) -> None:
        """Run ``coro`` in the background, so a handler never blocks on engine acknowledgements."""

    def check_weight_update(self) -> None:
        """Raises WireError 409 unless the fleet is paused or suspended and no update runs here."""

    async def update_weights(self, incoming: Incoming, request: UpdateWeights) -> None:
        """Load the checkpoint on every engine, record its version for the fleet, swap it in
        everywhere, and answer ``incoming`` with an ``Ack`` (or the error naming the engines)."""


class EngineContext(Replier, Protocol):
    """Engine ids reach these methods through :meth:`engine_sender` (see handlers/engine.py)."""

    def engine_sender(self, incoming: Incoming, claimed: str) -> str:
        """The engine ``incoming`` is from, which must be ``claimed``, the one its body names:
        the one its subject names, or on the plain subject of earlier releases the claimed one
        unless that engine speaks on its own subjects. Raises WireError 403 otherwise."""

    async def register_engine(
        self,
        incoming: Incoming,
        engine_id: str,
        capacity: int,
        model: str | None,
        weight_version: WeightVersion | None,
        kv_sequence: int | None,
        logprobs: bool,
    ) -> None:
        """Add an engine with zero load, serving ``model`` (an engine registering again had
        restarted; ``logprobs``: it computes log-probabilities), and answer with the control
        state and epoch it must start in. One that serves other weights than the fleet's is not
        added: the answer names the fleet's. One that publishes KV events (``kv_sequence``) is
        asked for a snapshot of its prefix cache."""

    async def engine_heartbeat(self, heartbeat: Heartbeat, own_subjects: bool) -> None:
        """Refresh an engine's liveness; adopt an unknown one (``own_subjects``: it sends on its
        own subjects); reconcile what it no longer holds; snapshot its prefix cache when this
        replica does not know it yet, or missed its last KV event."""

    def kv_events(self, engine_id: str, events: KvEvents) -> None:
        """Apply one step's KV events of ``engine_id`` to the block index, in their order; a gap
        in their numbering asks the engine for a snapshot."""

    async def relay_finals(self, engine_id: str, replies: list[RoutedReply]) -> None:
        """Send terminal replies to their clients and free their engine slots."""

    async def relay_partials(self, engine_id: str, replies: list[RoutedReply]) -> None:
        """Send streamed replies to their clients; the requests stay open."""

    async def remove_engine(self, engine_id: str, reason: str) -> None:
        """Drop an engine that left: what it had not streamed is routed again, the rest fails."""

    def peer_seen(self, coordinator_id: str, leaving: bool = False, arbitrates: bool = False) -> None:
        """Note a live coordinator replica (``arbitrates``: one that arbitrates request ids), or
        (``leaving``) one that stops: its requests are adopted now. Raises WireError 400 for an
        invalid id."""


class ReplicaContext(Replier, Protocol):
    @property
    def settling(self) -> bool:
        """Adopting a dead peer's requests, or missing a peer's heartbeats."""

    async def take_resubmission(self, forwarded: ForwardedSubmission) -> bool:
        """Answer a resubmission another replica forwarded, if this one holds it (in flight or
        cached); False when it does not. Raises WireError 403 or 409 as admission does."""

    async def admit_handed(self, reply: str, body: bytes) -> None:
        """Admit a submission whose id this replica arbitrates, handed over by the replica its
        client reached: answered as a ``submit_request`` with NATS reply subject ``reply``
        ("" for none) and ``body``. Raises WireError only when no submission is served."""

    async def take_claims(self, claims: ArbiterClaims) -> None:
        """Take (a part of) the ids another replica holds that this one arbitrates."""

    async def abort_held(self, forwarded: ForwardedAbort) -> str:
        """Abort a request held here for another replica's client; its request id. Raises
        WireError 404 when none is held here, 403 when another owner's."""

    async def hold_held(self, forwarded: ForwardedHold) -> str:
        """Pass a hold another replica forwarded on to the engine of a request held here; its
        request id. Raises WireError 404 when none is held here, 403 when another owner's."""


class CoordinatorContext(ClientContext, ControlContext, EngineContext, ReplicaContext, Protocol):
    """Everything a handler may ask: what the coordinator gives every handler (mypy checks that
    it provides all of it, :mod:`service.coordinator.dispatch`)."""
