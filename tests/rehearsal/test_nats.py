"""The rehearsal's bundled NATS follows the values handed to the nats sub-chart beyond the
defaults: with a three-server cluster enabled (JetStream is on by default), the servers route to
each other, JetStream answers, and the coordinators' control-state bucket gets three replicas
(the chart's defaults, which the deployment tests run, have one server)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats
import pytest

from service.coordinator.shared_state import SharedControlState
from tests.rehearsal.deployment import render
from tests.rehearsal.nats import bundled_nats

pytestmark = [pytest.mark.rehearsal]

CLUSTERED_JETSTREAM = {
    "nats": {"config": {"jetstream": {"enabled": True}, "cluster": {"enabled": True, "replicas": 3}}}
}


async def test_bundled_nats_follows_jetstream_and_cluster_values(tmp_path: Path) -> None:
    rendered = render(CLUSTERED_JETSTREAM, "rel", "llm")
    with bundled_nats(rendered, tmp_path) as bus:
        assert len(bus.urls) == 3
        nc = await nats.connect(
            bus.url, user="coordinator", password=bus.passwords["coordinator"], inbox_prefix="_INBOX_coordinator"
        )
        shared = SharedControlState("dpcoord", "rehearsal", 5.0, lambda previous, current: None)
        try:
            async with asyncio.timeout(60):
                while len(nc.discovered_servers) < 2:  # the other two, told by the server once routed
                    await nc.flush()
                    await asyncio.sleep(0.1)
                await shared.open(nc)  # waits while the cluster elects its JetStream leader
            assert shared.shared
            info = await nc.jetstream(timeout=5).stream_info(f"KV_{shared.bucket}")
            assert info.config.num_replicas == 3  # the bucket's replicas follow the cluster's size
        finally:
            await shared.close()
            await nc.close()
