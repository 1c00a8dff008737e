"""Backpressure: a client's ``hold_request`` passed on to the engine that runs the request.

Contract (docs/protocol.md, *Backpressure*; docs/reliability.md, *Slow readers*):
- Only the owner of a request (the inbox prefix its replies go to) may hold or release it,
  as for aborts: 403 otherwise, 404 when no replica holds it.
- The replica that holds the request passes the hold on to its engine as a
  :class:`~service.protocol.routed.RoutedHold` on ``<prefix>.engine.<id>.hold_request`` and
  answers an ``ack`` naming the request; a request still queued (no engine yet) is acked with
  nothing to pass on (its client cannot have fallen behind it).
- A replica that does not hold it asks the replica its id names (if alive, else every live
  peer) with a :class:`~service.protocol.handover.ForwardedHold`, as aborts are forwarded; the
  holder's answer is the client's.
- Nothing is remembered here: the engine keeps the hold (and the newest ``seq``), and a run
  that starts elsewhere (a migration) starts released, which the client corrects by holding
  again should its reader still lag (service/client/flow.py).
"""

from __future__ import annotations

import asyncio
import logging

from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from service.bus.registry import Incoming
from service.coordinator.core import Core
from service.coordinator.ledger import RequestLedger
from service.coordinator.peers import CoordinatorPeers
from service.ops.log_limit import RateLimitedLog
from service.protocol.codec import encode_msgpack, msgpack_decoder
from service.protocol.errors import ErrorCode, WireError
from service.protocol.handover import ForwardedHold
from service.protocol.messages import Ack, ErrorReply, HoldRequest
from service.protocol.routed import RoutedHold
from service.protocol.subjects import Header

log = logging.getLogger(__name__)

FORWARD_TIMEOUT_S = 1.0
_answer_decoder = msgpack_decoder(Ack | ErrorReply)  # type: ignore[arg-type]


class Holds:
    def __init__(self, core: Core, ledger: RequestLedger, peers: CoordinatorPeers) -> None:
        self._core = core
        self._ledger = ledger
        self._peers = peers
        self._timeout_s = min(FORWARD_TIMEOUT_S, core.settings.heartbeat_interval_s)
        self._failures = RateLimitedLog(log)

    async def hold(self, incoming: Incoming, payload: HoldRequest) -> str:
        """A client's hold or release: passed to the engine here, or to the replica holding it.
        Returns the request id; raises WireError 404 or 403."""
        entry = self._ledger.get(payload.request_id)
        if entry is None:
            if incoming.owner is not None and self._peers.live():
                forwarded = ForwardedHold(incoming.owner, payload.request_id, payload.held, payload.seq)
                if await self._held_elsewhere(forwarded):
                    return payload.request_id
            raise WireError(ErrorCode.NOT_FOUND, f"no request in flight with request_id {payload.request_id!r}")
        return await self._pass_on(incoming.owner, payload.request_id, payload.held, payload.seq)

    async def hold_held(self, forwarded: ForwardedHold) -> str:
        """A hold another replica forwarded: applied only when held here (404 otherwise)."""
        return await self._pass_on(forwarded.owner, forwarded.request_id, forwarded.held, forwarded.seq)

    async def _pass_on(self, owner: str | None, request_id: str, held: bool, seq: int) -> str:
        entry = self._ledger.get(request_id)
        if entry is None:
            raise WireError(ErrorCode.NOT_FOUND, f"no request in flight with request_id {request_id!r}")
        if owner != entry.owner:
            raise WireError(ErrorCode.FORBIDDEN, f"the request with request_id {request_id!r} belongs to another owner")
        counters = self._core.counters
        counters["holds" if held else "releases"] += 1
        if entry.engine_id is None:
            return request_id
        subject = self._core.subjects.engine(entry.engine_id, Header.HOLD_REQUEST)
        try:
            await self._core.nc.publish(subject, encode_msgpack(RoutedHold(request_id, held, seq)))
        except Exception as exc:  # best effort, as the client's own message is
            counters["holds_lost"] += 1
            self._failures.warning("engine_id=%s request_id=%s: hold not sent: %s", entry.engine_id, request_id, exc)
        return request_id

    async def _held_elsewhere(self, forwarded: ForwardedHold) -> bool:
        """Whether a live peer held the request and passed the hold on; raises its 403."""
        peers = self._peers.live()
        named = forwarded.request_id.rpartition("-")[0]
        if named in peers:
            peers = [named]
        body = encode_msgpack(forwarded)
        answers = await asyncio.gather(*(self._ask(peer, body) for peer in peers))
        forbidden: ErrorReply | None = None
        for answer in answers:
            if isinstance(answer, Ack):
                self._core.counters["holds_forwarded"] += 1
                return True
            if isinstance(answer, ErrorReply) and answer.error.code == ErrorCode.FORBIDDEN:
                forbidden = answer
        if forbidden is not None:
            raise WireError(forbidden.error.code, forbidden.error.message)
        return False

    async def _ask(self, peer: str, body: bytes) -> Ack | ErrorReply | None:
        subject = self._core.subjects.addressed_to(Header.FORWARD_HOLD, peer)
        try:
            msg = await self._core.nc.request(subject, body, timeout=self._timeout_s)
            answer: Ack | ErrorReply = _answer_decoder.decode(msg.data)
        except (NoRespondersError, NatsTimeoutError, TimeoutError):
            return None
        except NatsError as exc:
            self._failures.warning("forward_hold to coordinator %s failed: %s", peer, exc)
            return None
        except ValueError as exc:  # msgspec's DecodeError and ValidationError
            self._core.counters["malformed_forward_answers"] += 1
            self._failures.warning("undecodable answer to forward_hold from coordinator %s: %s", peer, exc)
            return None
        return answer
