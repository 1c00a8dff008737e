"""The rehearsal's bundled NATS follows the values handed to the nats sub-chart beyond the
defaults: with JetStream and a three-server cluster enabled, the servers route to each other and
JetStream answers (the chart's defaults, which the deployment tests run, have neither)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats
import pytest
from nats.js.errors import ServiceUnavailableError

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
        try:
            async with asyncio.timeout(30):
                while len(nc.discovered_servers) < 2:  # the other two, told by the server once routed
                    await nc.flush()
                    await asyncio.sleep(0.1)
                while True:
                    try:
                        info = await nc.jetstream(timeout=1).account_info()
                        break
                    except (ServiceUnavailableError, nats.errors.TimeoutError):  # no meta leader elected yet
                        await asyncio.sleep(0.2)
            assert info.limits is not None
        finally:
            await nc.close()
