"""What operators see of a running coordinator or engine: ``/healthz``, ``/readyz`` and
``/metrics`` over HTTP, and an entry in the NATS Services API.

The process supplies what healthy and ready mean, its metrics collector and its status; see
``service/coordinator_observability.py`` and ``engines/observability.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client as NATS
from nats.micro.service import Service
from prometheus_client.registry import Collector, CollectorRegistry

from service.ops.http_endpoints import Check, HttpEndpoints
from service.ops.services_api import add_status_service


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    """How a process appears in ``nats micro ls``: its status endpoint answers ``status()``."""

    name: str
    description: str
    instance_id: str
    subject: str
    status: Callable[[], msgspec.Struct]


class Observability:
    """Starts after the process it watches has connected; ``http_port`` None serves no HTTP, 0 a free port."""

    def __init__(
        self,
        collector: Collector,
        health: Callable[[], Check],
        ready: Callable[[], Check],
        service: ServiceSpec,
        http_host: str,
        http_port: int | None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self.http = None if http_port is None else HttpEndpoints(http_host, http_port, health, ready, self.registry)
        self._spec = service
        self._service: Service | None = None
        self._nc: NATS | None = None

    async def start(self, nc: NATS) -> None:
        if self.http is not None:
            await self.http.start()
        spec = self._spec
        self._nc = nc
        self._service = await add_status_service(nc, spec.name, spec.description, spec.instance_id, spec.subject, spec.status)

    async def stop(self) -> None:
        """Safe to call twice."""
        service, self._service = self._service, None
        if service is not None and self._nc is not None and self._nc.is_connected:
            await service.stop()
        if self.http is not None:
            await self.http.stop()
