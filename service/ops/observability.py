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

from service.bus.connection import unless_lost
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
    """Binds its HTTP port before the process it watches joins the fleet, and starts after that
    process has connected; ``http_port`` None serves no HTTP, 0 a free port. ``http_port_chosen``
    false lets a busy port fall back to a free one (see ``HttpEndpoints``)."""

    def __init__(
        self,
        collector: Collector,
        health: Callable[[], Check],
        ready: Callable[[], Check],
        service: ServiceSpec,
        http_host: str,
        http_port: int | None,
        http_port_chosen: bool = True,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self.http = (
            None
            if http_port is None
            else HttpEndpoints(http_host, http_port, health, ready, self.registry, port_chosen=http_port_chosen)
        )
        self._spec = service
        self._service: Service | None = None
        self._nc: NATS | None = None

    async def bind(self) -> None:
        """Take the HTTP port; a port that cannot be had stops the process before it serves."""
        if self.http is not None:
            await self.http.bind()

    async def start(self, nc: NATS) -> None:
        if self.http is not None:
            await self.http.start()
        spec = self._spec
        self._nc = nc
        self._service = await add_status_service(
            nc, spec.name, spec.description, spec.instance_id, spec.subject, spec.status
        )

    async def stop(self) -> None:
        """Safe to call twice; the Services API entry's unsubscription is given up when NATS
        is going away (:func:`~service.bus.connection.unless_lost`)."""
        service, self._service = self._service, None
        if service is not None and self._nc is not None and self._nc.is_connected:
            await unless_lost(self._nc, service.stop(), "leaving the NATS Services API")
        if self.http is not None:
            await self.http.stop()
