"""What ``/healthz``, ``/readyz``, ``/metrics`` and the NATS Services API say about a coordinator.

Healthy means connected to NATS (a process cut off from the bus cannot serve, and one that
stays cut off should be restarted). Ready means healthy with at least one engine in the
pool, since without one every submission gets 503.
"""

from __future__ import annotations

from service.coordinator.coordinator import Coordinator
from service.coordinator.metrics import CoordinatorCollector
from service.ops.http_endpoints import Check
from service.ops.observability import Observability, ServiceSpec
from service.ops.services_api import COORDINATOR_SERVICE, CoordinatorStatus, EngineLoad


def coordinator_health(coordinator: Coordinator) -> Check:
    if not coordinator.nc.is_connected:
        return Check(False, "not connected to NATS")
    return Check(True, f"coordinator {coordinator.id} connected to NATS")


def coordinator_readiness(coordinator: Coordinator) -> Check:
    health = coordinator_health(coordinator)
    if not health.ok:
        return health
    engines = len(coordinator.engines)
    if engines == 0:
        return Check(False, "no engine registered")
    if coordinator.arbiters.joining and not coordinator.arbiters.alone:
        return Check(False, "joining: hearing its peers before it arbitrates request ids")
    return Check(True, f"{engines} engine(s), state {coordinator.state}")


def coordinator_status(coordinator: Coordinator) -> CoordinatorStatus:
    return CoordinatorStatus(
        coordinator_id=coordinator.id,
        subject_prefix=coordinator.subjects.prefix,
        state=coordinator.state.value,
        epoch=coordinator.epoch,
        requests_in_flight=len(coordinator.requests),
        engines=[
            EngineLoad(record.engine_id, record.load, record.capacity, record.model) for record in coordinator.engines
        ],
        counters=dict(coordinator.counters),
        peers=sorted(coordinator.peers.live()),
        revision=coordinator.shared.revision,
        weight_version=coordinator.control_state.weight_version,
        arbiters=sorted(coordinator.arbiters.view),
        settled=coordinator.arbiters.settled,
    )


def coordinator_observability(
    coordinator: Coordinator, http_host: str, http_port: int | None, http_port_chosen: bool = True
) -> Observability:
    """Bind it before the coordinator starts and start it with ``coordinator.nc`` once it has."""
    return Observability(
        CoordinatorCollector(coordinator),
        health=lambda: coordinator_health(coordinator),
        ready=lambda: coordinator_readiness(coordinator),
        service=ServiceSpec(
            COORDINATOR_SERVICE,
            "dpcoord coordinator: routes requests to data-parallel engines",
            coordinator.id,
            coordinator.subjects.status("coordinator", coordinator.id),
            lambda: coordinator_status(coordinator),
        ),
        http_host=http_host,
        http_port=http_port,
        http_port_chosen=http_port_chosen,
    )
