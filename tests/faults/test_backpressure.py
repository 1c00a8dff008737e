"""Bounded under a flood: a paused coordinator holds up to max_queued_requests and answers the
rest with 429 at once; its memory does not grow with the number refused."""

from __future__ import annotations

import json
from pathlib import Path

from nats.aio.client import Client as NATS

from handlers import HANDLERS
from service.coordinator.coordinator import Coordinator
from tests.conftest import make_settings
from tests.helpers import request_json

FLOOD = 100_000


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


async def flood(nc: NATS, subject: str, count: int, start: int) -> None:
    for i in range(start, start + count):
        body = json.dumps({"prompt": "flood", "client_request_id": i, "reply_to": "flood.replies"}).encode()
        await nc.publish(subject, body)
        if i % 5000 == 0:
            await nc.flush()


async def test_rss_stays_flat_over_100k_rejected_submissions(nats_url: str, nc: NATS) -> None:
    settings = make_settings(nats_url, max_queued_requests=1000)
    async with Coordinator(settings, HANDLERS) as coordinator:
        subject = coordinator.subjects.coordinator("submit_request")
        await request_json(nc, coordinator.subjects.coordinator("pause"), {})
        await flood(nc, subject, 10_000, 0)  # warm up: fill the queue, let the allocator settle
        refused = await request_json(nc, subject, {"prompt": "barrier"})
        assert refused["error"]["code"] == 429
        before = rss_mib()

        await flood(nc, subject, FLOOD, 10_000)
        refused = await request_json(nc, subject, {"prompt": "barrier"})
        assert refused["error"]["code"] == 429
        after = rss_mib()

        print(f"\nRSS before {before:.1f} MiB, after {FLOOD} more refused submissions {after:.1f} MiB")
        assert coordinator.counters["error_429"] == 9_000 + FLOOD + 2
        assert len(coordinator.requests) == 1000
        assert after - before < 20, f"RSS grew {after - before:.1f} MiB"
