"""Forwarding: a resubmission or an abort that reached a replica not holding its request is
passed to the live peers, so the request's owner (or the adopter of a dead owner) answers it.

Contract:
- A resubmission (the client library marks every publish after a submission's first) that
  this replica does not hold, in flight or cached, is run here only once every live peer said
  it does not hold it either and none of them, nor this replica, is settling (adopting a dead
  peer, or missing a peer's heartbeats: then a request held nowhere now may be adopted in a
  moment). Until then it asks again each heartbeat interval, up to ``heartbeat_timeout_s``
  plus ``control_timeout_s``, the longest adoption can take; then it runs it. So a request
  runs twice only when its first run was lost altogether.
- An abort this replica cannot apply goes to the replica its request id names when that one
  lives, else to every live peer; the first that holds it applies it and its answer is the
  client's. A 403 from the holder is the client's too; when none holds it, 404.
- A peer that does not answer within :data:`FORWARD_TIMEOUT_S` counts as unsettled.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from service.coordinator.core import Core
from service.coordinator.peers import CoordinatorPeers
from service.protocol.codec import encode_msgpack, msgpack_decoder
from service.protocol.errors import ErrorCode, WireError
from service.protocol.handover import ForwardedAbort, ForwardedSubmission, Holding
from service.protocol.messages import Ack, ErrorReply
from service.protocol.subjects import Header

log = logging.getLogger(__name__)

FORWARD_TIMEOUT_S = 1.0
_answer_decoder = msgpack_decoder(Holding | Ack | ErrorReply)  # type: ignore[arg-type]
Answer = Holding | Ack | ErrorReply


class Forwarding:
    def __init__(self, core: Core, peers: CoordinatorPeers, settling: Callable[[], bool]) -> None:
        self._core = core
        self._peers = peers
        self._settling = settling
        settings = core.settings
        self._interval_s = settings.heartbeat_interval_s
        self._patience_s = settings.heartbeat_timeout_s + settings.control_timeout_s
        self._timeout_s = min(FORWARD_TIMEOUT_S, settings.heartbeat_interval_s)

    async def held_elsewhere(self, message: ForwardedSubmission, holder: str | None = None) -> bool:
        """Whether a live peer holds this submission (it answers the client from now on): the
        one ``holder`` when given (the replica claiming its id), else every live peer. Raises
        the holder's WireError (403 another owner, 409 another body or in progress)."""
        body = encode_msgpack(message)
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + self._patience_s
        while True:
            unsettled = self._settling()
            peers = self._peers.live()
            if holder is not None:
                peers = [holder] if holder in peers else []
            for answer in await self._ask(Header.FORWARD_SUBMISSION, peers, body):
                if isinstance(answer, ErrorReply):
                    raise WireError(answer.error.code, answer.error.message)
                if isinstance(answer, Holding):
                    if answer.held:
                        self._core.counters["resubmissions_forwarded"] += 1
                        return True
                    unsettled = unsettled or answer.settling
                else:
                    unsettled = True
            if not unsettled:
                return False
            if loop.time() >= give_up_at:
                self._core.counters["resubmissions_unsettled"] += 1
                log.warning(
                    "client_request_id=%s client_id=%s: peers still settling after %.1f s; running it here",
                    message.client_request_id,
                    message.client_id,
                    self._patience_s,
                )
                return False
            await asyncio.sleep(self._interval_s)

    async def abort_elsewhere(self, message: ForwardedAbort) -> str | None:
        """The request id a live peer aborted; None when none holds it. Raises 403 from a holder
        that the sender does not own the request of."""
        peers = self._peers.live()
        if message.request_id is not None:
            owner = message.request_id.rpartition("-")[0]
            if owner in peers:
                peers = [owner]
        forbidden: ErrorReply | None = None
        for answer in await self._ask(Header.FORWARD_ABORT, peers, encode_msgpack(message)):
            if isinstance(answer, Ack):
                self._core.counters["aborts_forwarded"] += 1
                return answer.request_id
            if isinstance(answer, ErrorReply) and answer.error.code == ErrorCode.FORBIDDEN:
                forbidden = answer
        if forbidden is not None:
            raise WireError(forbidden.error.code, forbidden.error.message)
        return None

    async def _ask(self, header: Header, peers: list[str], body: bytes) -> list[Answer | None]:
        return list(await asyncio.gather(*(self._ask_one(header, peer, body) for peer in peers)))

    async def _ask_one(self, header: Header, peer: str, body: bytes) -> Answer | None:
        subject = self._core.subjects.addressed_to(header, peer)
        try:
            msg = await self._core.nc.request(subject, body, timeout=self._timeout_s)
            answer: Answer = _answer_decoder.decode(msg.data)
        except (NoRespondersError, NatsTimeoutError, TimeoutError):
            return None
        except NatsError as exc:
            log.warning("%s to coordinator %s failed: %s", header, peer, exc)
            return None
        except ValueError as exc:  # msgspec's DecodeError and ValidationError
            self._core.counters["malformed_forward_answers"] += 1
            log.warning("undecodable answer to %s from coordinator %s: %s", header, peer, exc)
            return None
        return answer
