"""Registration with the NATS Services API (``nats.micro``), so that ``nats micro ls``,
``nats micro info`` and ``nats micro stats`` list the coordinator and every engine.

Each process adds a service with one ``status`` endpoint on ``<prefix>.status.<role>.<id>``;
the request subjects stay on the process's own subscriptions. Serving them as micro
endpoints would put every request through nats.micro's per-message bookkeeping and its
default queue group, which would also break the coordinator's fan-out subjects. The status
snapshot is also the ``data`` of the endpoint's stats, so ``nats micro stats`` shows it.
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Callable

import msgspec
from nats import micro
from nats.aio.client import Client as NATS
from nats.micro.request import Request
from nats.micro.service import EndpointStats, Service

from service.bus.connection import flush_subscriptions

log = logging.getLogger(__name__)

COORDINATOR_SERVICE = "dpcoord-coordinator"
ENGINE_SERVICE = "dpcoord-engine"
STATUS_ENDPOINT = "status"


def package_version() -> str:
    try:
        return importlib.metadata.version("dpcoord")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


class EngineLoad(msgspec.Struct):
    engine_id: str
    in_flight: int
    capacity: int
    model: str | None = None


class CoordinatorStatus(msgspec.Struct):
    """``peers``: the other replicas this one hears; ``revision``: of the shared control state;
    ``arbiters``: the replicas arbitrating request ids as this one sees them, and whether it is
    ``settled`` (runs the ids it arbitrates at once: docs/reliability.md)."""

    coordinator_id: str
    subject_prefix: str
    state: str
    epoch: int | None
    requests_in_flight: int
    engines: list[EngineLoad]
    counters: dict[str, int]
    peers: list[str] = msgspec.field(default_factory=list)
    revision: int = 0
    weight_version: str | int | None = None  # the fleet's, since the last update_weights
    arbiters: list[str] = msgspec.field(default_factory=list)
    settled: bool = False


class PrefixCacheStatus(msgspec.Struct):
    """An engine's KV cache: how often admitted prompts found their prefix already cached."""

    queried_tokens: int
    hit_tokens: int
    hit_rate: float
    cached_pages: int
    evicted_pages: int
    total_pages: int


class EngineStatus(msgspec.Struct):
    engine_id: str
    subject_prefix: str
    backend: str
    registered: bool
    paused: bool
    active_requests: int
    epoch: int | None
    counters: dict[str, int]
    prefix_cache: PrefixCacheStatus | None = None  # None: a backend without a KV cache (echo)
    weight_version: str | int | None = None  # the weights it serves; None: those it started with
    weight_digest: str | None = None
    weights_problem: str | None = None  # why it cannot serve the fleet's weights (it is not in the pool then)
    # The fast pieces decode runs (ExecutionPath.describe()); None: a backend without any (echo).
    execution_path: str | None = None
    fast_path_failures: int = 0  # pieces asked for that failed to build (their tracebacks are in the log)


async def add_status_service(
    nc: NATS,
    name: str,
    description: str,
    instance_id: str,
    subject: str,
    status: Callable[[], msgspec.Struct],
) -> Service:
    """Register ``name`` with one ``status`` endpoint answering ``status()`` in JSON."""

    async def answer(request: Request) -> None:
        await request.respond(msgspec.json.encode(status()))

    def stats_data(endpoint: EndpointStats) -> object:
        return msgspec.to_builtins(status())

    service = await micro.add_service(
        nc,
        name=name,
        version=package_version(),
        description=description,
        metadata={"instance_id": instance_id},
        stats_handler=stats_data,
    )
    await service.add_endpoint(name=STATUS_ENDPOINT, subject=subject, handler=answer)
    await flush_subscriptions(nc)
    log.info("registered NATS service %s (%s), status on %s", name, instance_id, subject)
    return service
