"""Fleet membership on the wire: engines registering, heartbeating and leaving, the resend
check a coordinator runs on an engine's silence, and the heartbeats replicas exchange.

msgpack only, between engines and coordinators; the client-facing messages live in
:mod:`service.protocol.messages`.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta, Struct

from service.protocol.kv_events import Count
from service.protocol.messages import Int64, ModelName, WeightVersion

# Features an engine announces (``features`` of its register and heartbeats), so the coordinator
# routes a request that needs one only to engines that have it: "logprobs", the engine computes
# the log-probabilities ``sampling_params.logprobs`` and ``prompt_logprobs`` ask for. An engine
# of an earlier release announces none.
LOGPROBS = "logprobs"
Features = Annotated[list[Annotated[str, Meta(max_length=64)]], Meta(max_length=64)]


def computes_logprobs(features: list[str] | None) -> bool:
    return features is not None and LOGPROBS in features


class EngineRegister(Struct):
    engine_id: str
    capacity: Annotated[int, Meta(ge=1)] = 256
    backend: str = "unknown"
    paused: bool = False
    served_model_name: ModelName | None = None
    weight_version: WeightVersion | None = None  # an extension: the weights it serves (None: its own)
    # An extension (service/protocol/kv_events.py): the number of its last KV event, 0 before the
    # first; None when it publishes none (it is then routed by load alone).
    kv_sequence: Count | None = None
    features: Features | None = None  # an extension: what it offers beyond earlier releases (LOGPROBS)


class RegisterAck(Struct):
    """``revision``: the control-state revision ``state`` and ``epoch`` were read at, so the
    engine can tell a broadcast that overtook it from one that is news."""

    coordinator_id: str
    state: str
    epoch: int | None
    revision: int = 0
    # Extensions: the fleet's weights. An engine that does not serve ``weight_version`` was not
    # added to the pool; it loads ``weight_path`` and registers again.
    weight_version: WeightVersion | None = None
    weight_path: str | None = None


class Heartbeat(Struct):
    """``active`` lists the requests the engine holds, so the coordinator can notice one that
    a lost message left unanswered; ``steps`` shows an engine busy with long requests is
    still working (see the coordinator's progress watch)."""

    engine_id: str
    load: Annotated[int, Meta(ge=0)] = 0
    capacity: Annotated[int, Meta(ge=1)] = 256
    active: list[str] = msgspec.field(default_factory=list)
    served_model_name: ModelName | None = None  # so a coordinator that adopts the engine routes by model
    steps: Int64 | None = None  # steps taken since the engine started: progress while no reply is due
    weight_version: WeightVersion | None = None  # an extension: the weights it serves
    kv_sequence: Count | None = None  # an extension, as in EngineRegister: a missed last KV event shows here
    # An extension: the requests of ``active`` held by backpressure (hold_request), which the
    # engine rightly does not step; None from engines that predate it.
    held: list[str] | None = None
    features: Features | None = None  # an extension, as the register's: a coordinator that adopts it routes by them


class ResendReplies(Struct):
    request_ids: list[str]


class ResendAnswer(Struct):
    """Ids the engine neither holds nor recently answered: it never received them."""

    unknown: list[str]


class CoordinatorHeartbeat(Struct):
    coordinator_id: str
    # An extension: the last beat of a replica that stops while peers live; the lowest of them
    # adopts its requests at once (docs/reliability.md, ownership).
    leaving: bool = False
    # An extension: this replica arbitrates request ids (service/protocol/arbiter.py): it takes
    # part in the rendezvous, serves ``submit_request.<id>`` and hands over claims when the
    # replicas change. Replicas of earlier releases omit it and take no part.
    arbitrates: bool = False


class EngineDisconnect(Struct):
    engine_id: str
    reason: str = ""
