"""The chart's deployment run as processes: probes, a client's request, the admin's control
signals, the NATS Services API, and a SIGTERM of every pod (last: it takes the deployment down).

Each test runs against the chart rendered with its default values (bundled NATS) and with an
external NATS (see conftest.VARIANTS). The images are not built (no Docker engine here): the
pods run from environments installed as the Dockerfiles install them; what else differs from a
cluster is in overrides.py.
"""

from __future__ import annotations

import collections
import json
from typing import Any

import nats
import pytest

from service.client import DpcoordClient
from service.protocol.state import CoordinatorState
from tests.rehearsal.pods import PodProcess
from tests.rehearsal.running import Deployment

pytestmark = [pytest.mark.rehearsal, pytest.mark.timeout(900)]


def window_s(probe: dict[str, int]) -> float:
    """How long a probe may fail from the container's start before the kubelet acts on it."""
    return probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)


def test_every_probe_answers_as_the_manifests_say(deployment: Deployment) -> None:
    for process in deployment.processes:
        probes = process.pod.probes()
        assert {"livenessProbe", "readinessProbe"} <= probes.keys(), f"{process.pod.name} lacks a probe"
        never = [name for name in probes if (process.pod.name, name) not in deployment.first_success]
        assert not never, f"{process.pod.name}: {never} never answered\n{deployment.logs()}"
        # Liveness failing past its window restarts the container: the first /healthz must come sooner
        # (after the startup probe's window, where there is one).
        guard = "startupProbe" if "startupProbe" in probes else "livenessProbe"
        took = deployment.first_success[process.pod.name, guard]
        assert took < window_s(probes[guard]), f"{process.pod.name}: {guard} first answered after {took:.1f} s"
        for name, spec in probes.items():
            answer = process.probe(name)
            assert answer.ok, f"{process.pod.name}: {name} GET {spec['httpGet']['path']} -> {answer}"
            assert answer.seconds < spec.get("timeoutSeconds", 1)


async def test_a_client_with_the_charts_client_credentials_gets_a_final(deployment: Deployment) -> None:
    async with await DpcoordClient.connect(deployment.person("client"), timeout=10) as client:
        final = await client.submit("rehearsal", max_tokens=3, timeout=10)
    assert (final.generated_text, final.finish_reason) == ("reh", "length"), final  # the echo backend
    assert final.engine_id in {process.pod.name for process in deployment.processes}, final


# The coordinator replicas share one control state (JetStream, on in the chart), so a signal
# holds for all of them whichever replica the queue group hands it to. Were it not shared, an
# unpause would meet a replica that missed the pause in all but one in 2**CYCLES runs (409).
CYCLES = 16


async def test_the_admin_pauses_and_unpauses(deployment: Deployment) -> None:
    async with await DpcoordClient.connect(deployment.person("admin"), timeout=10) as admin:
        for _ in range(CYCLES):
            paused = await admin.pause(timeout=10)
            assert paused.state == CoordinatorState.PAUSED.value, paused
            unpaused = await admin.unpause(timeout=10)
            assert unpaused.state == CoordinatorState.RUNNING.value, unpaused


async def test_the_services_api_lists_every_instance(deployment: Deployment) -> None:
    """What `nats micro ls` and `nats micro info` show the admin: one instance per coordinator and
    engine pod. The gateway's NATS user has a client's permissions, which leave out the Services API."""
    expected = collections.Counter(
        f"dpcoord-{process.pod.component}" for process in deployment.processes if process.pod.component != "gateway"
    )
    engines = {process.pod.name for process in deployment.processes if process.pod.component == "engine"}
    admin = deployment.person("admin")
    nc = await nats.connect(
        admin.nats_url, user=admin.nats_user, password=admin.nats_password, inbox_prefix=admin.nats_inbox_prefix
    )
    try:
        for verb in ("PING", "INFO"):
            replies = await _every_answer(nc, f"$SRV.{verb}", sum(expected.values()))
            assert collections.Counter(reply["name"] for reply in replies) == expected, (verb, replies)
            ids = {reply["metadata"]["instance_id"] for reply in replies if reply["name"] == "dpcoord-engine"}
            assert ids == engines, f"engine ids {ids} are not the StatefulSet's pod names {engines}"
            assert len({reply["id"] for reply in replies}) == len(replies)
    finally:
        await nc.close()


async def _every_answer(nc: nats.NATS, subject: str, count: int) -> list[dict[str, Any]]:
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, max_msgs=count)
    await nc.publish(subject, b"", reply=inbox)
    replies: list[dict[str, Any]] = []
    try:
        while len(replies) < count:
            replies.append(json.loads((await sub.next_msg(timeout=5)).data))
    except nats.errors.TimeoutError:
        raise AssertionError(f"{subject}: {len(replies)} of {count} answered: {replies}") from None
    return replies


def _interleaved(processes: list[PodProcess]) -> list[PodProcess]:
    """One pod of each component in turn, so every component keeps a pod for as long as it can."""
    by_component: dict[str, list[PodProcess]] = collections.defaultdict(list)
    for process in processes:
        by_component[process.pod.component].append(process)
    order = []
    while any(by_component.values()):
        for queue in by_component.values():
            if queue:
                order.append(queue.pop(0))
    return order


async def test_each_pod_drains_on_sigterm_within_its_grace_period(deployment: Deployment) -> None:
    """A rolling stop: SIGTERM one pod at a time; while every component has a pod left, a client
    still gets a final."""
    running = list(deployment.processes)
    for process in _interleaved(deployment.processes):
        code, took = process.terminate()
        running.remove(process)
        assert code == 0, f"{process.pod.name} exited {code} on SIGTERM\n{process.log_tail()}"
        assert took < process.pod.grace_s, f"{process.pod.name} took {took:.1f} s of {process.pod.grace_s} s"
        components = {other.pod.component for other in deployment.processes}
        if components <= {other.pod.component for other in running}:
            async with await DpcoordClient.connect(deployment.person("client"), timeout=10) as client:
                await client.submit("still here", max_tokens=2, timeout=10)
