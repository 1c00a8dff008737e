"""What ``/healthz``, ``/readyz``, ``/metrics`` and the NATS Services API say about an engine.

Healthy means connected to NATS. Ready means registered with a coordinator: the runtime
starts only once its backend (and so its model) is built and registers after it started,
so a registered engine has its model loaded.
"""

from __future__ import annotations

from engines.metrics import EngineCollector
from engines.runtime import EngineRuntime
from service.ops.http_endpoints import Check
from service.ops.observability import Observability, ServiceSpec
from service.ops.services_api import ENGINE_SERVICE, EngineStatus, PrefixCacheStatus


def engine_health(runtime: EngineRuntime) -> Check:
    if not runtime.nc.is_connected:
        return Check(False, "not connected to NATS")
    return Check(True, f"engine {runtime.engine_id} connected to NATS")


def engine_readiness(runtime: EngineRuntime) -> Check:
    health = engine_health(runtime)
    if not health.ok:
        return health
    if runtime.weights.problem is not None:
        return Check(False, runtime.weights.problem)
    if not runtime.registered.is_set():
        return Check(False, "not registered with a coordinator yet")
    return Check(True, f"engine {runtime.engine_id} registered, {runtime.backend.name} backend loaded")


def engine_status(runtime: EngineRuntime) -> EngineStatus:
    stats = runtime.backend.prefix_cache_stats()
    path = runtime.backend.execution_path()
    return EngineStatus(
        engine_id=runtime.engine_id,
        subject_prefix=runtime.subjects.prefix,
        backend=runtime.backend.name,
        registered=runtime.registered.is_set(),
        paused=runtime.paused,
        active_requests=runtime.load,
        epoch=runtime.epoch,
        counters=dict(runtime.counters),
        prefix_cache=None
        if stats is None
        else PrefixCacheStatus(
            stats.queried_tokens,
            stats.hit_tokens,
            stats.hit_rate,
            stats.cached_pages,
            stats.evicted_pages,
            stats.total_pages,
        ),
        weight_version=runtime.weights.version,
        weight_digest=runtime.weights.digest,
        weights_problem=runtime.weights.problem,
        execution_path=None if path is None else path.describe(),
        fast_path_failures=0 if path is None else len(path.failures),
    )


def engine_observability(
    runtime: EngineRuntime, http_host: str, http_port: int | None, http_port_chosen: bool = True
) -> Observability:
    """Bind it before the runtime starts (a chosen port that is taken stops the engine before it
    registers) and start it with ``runtime.nc`` once the runtime has started."""
    return Observability(
        EngineCollector(runtime),
        health=lambda: engine_health(runtime),
        ready=lambda: engine_readiness(runtime),
        service=ServiceSpec(
            ENGINE_SERVICE,
            f"dpcoord engine: one data-parallel rank ({runtime.backend.name} backend)",
            runtime.engine_id,
            runtime.subjects.status("engine", runtime.engine_id),
            lambda: engine_status(runtime),
        ),
        http_host=http_host,
        http_port=http_port,
        http_port_chosen=http_port_chosen,
    )
