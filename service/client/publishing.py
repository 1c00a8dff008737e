"""Where the client library publishes a submission: to the replica arbitrating its id
(``<prefix>.submit_request.<coordinator_id>``), else to the subject every replica shares.

Contract: each replica's own subject is watched for NATS refusals from its first use (NATS
users of earlier releases may not publish there): a refusal stops the addressing for every
submission (:meth:`~service.client.exchanges.CoordinatorWatch.address_refused`), which then go
to the shared subject. A body beyond the server's ``max_payload`` raises ClientError 413.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import ExitStack

from nats.aio.client import Client as NATS
from nats.errors import MaxPayloadError

from service.bus.refusals import PublishRefusals
from service.client.calls import ClientError
from service.client.exchanges import CoordinatorWatch
from service.protocol.errors import ErrorCode


class SubmitPublisher:
    """The :data:`~service.client.submission.Publish` of a client's submissions."""

    def __init__(
        self, nc: NATS, shared_subject: str, refusals: PublishRefusals, watches: ExitStack, watch: CoordinatorWatch
    ) -> None:
        self._nc = nc
        self._shared = shared_subject
        self._refusals = refusals
        self._watches = watches
        self._watch = watch
        self._watched: set[str] = set()  # replicas' own subjects whose refusals are watched

    async def __call__(self, body: bytes, inbox: str, subject: str | None, headers: Mapping[str, str] | None) -> None:
        if subject is None:
            subject = self._shared
        elif subject not in self._watched:
            self._watched.add(subject)
            self._watches.enter_context(self._refusals.watch(subject, self._watch.address_refused))
        try:
            await self._nc.publish(subject, body, reply=inbox, headers=headers)  # type: ignore[arg-type]
        except MaxPayloadError:
            raise ClientError(
                ErrorCode.TOO_LARGE,
                f"submission of {len(body)} bytes exceeds the NATS server's max_payload {self._nc.max_payload}",
            ) from None
