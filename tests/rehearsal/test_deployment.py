"""The chart's deployment run as containers of the built images (where Docker holds them) or as
processes: probes, a client's request, completions and a stream through the gateway with the
openai SDK, the admin's control signals, the NATS Services API, a rolling restart of the
coordinators under load, and a stop of every pod (last: it takes the deployment down).

Each test runs against the chart rendered with its default values (bundled NATS) and with an
external NATS (see conftest.VARIANTS). Without Docker the pods run from environments installed
as the Dockerfiles install them; what else differs from a cluster is in overrides.py.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import time
from typing import Any

import nats
import openai
import pytest

from service.client import DpcoordClient
from service.protocol.state import CoordinatorState
from tests.rehearsal.containers import PodContainer
from tests.rehearsal.pods import RunningPod
from tests.rehearsal.running import Deployment, wait_for_probes

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


def test_containers_run_as_the_pods_security_context_says(deployment: Deployment) -> None:
    """Inside each container: the pod's user and group, a read-only root, no capabilities, a
    writable /tmp (the emptyDir). Processes cannot show this; they skip."""
    containers = [process for process in deployment.processes if isinstance(process, PodContainer)]
    if not containers:
        pytest.skip("the pods run as processes here (no Docker engine or no images)")
    check = (
        "import os, tempfile\n"
        "try:\n    open('/probe-write', 'w')\nexcept OSError as exc:\n    root = exc.strerror\n"
        "tempfile.NamedTemporaryFile(dir='/tmp').close()\n"
        "caps = [line.split()[1] for line in open('/proc/self/status') if line.startswith('CapEff')]\n"
        "print(os.getuid(), os.getgid(), repr(root), caps[0])"
    )
    for container in containers:
        security = container.pod.spec["securityContext"]
        answer = container.exec(["python", "-c", check])
        assert answer == f"{security['runAsUser']} {security['runAsGroup']} 'Read-only file system' 0000000000000000", (
            container.pod.name,
            answer,
        )


def _gateway(deployment: Deployment) -> openai.AsyncOpenAI:
    [gateway, *_] = [process for process in deployment.processes if process.pod.component == "gateway"]
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.http_port}/v1", api_key="unused", max_retries=0)


async def test_a_completion_and_a_stream_through_the_gateway_with_the_openai_sdk(deployment: Deployment) -> None:
    async with _gateway(deployment) as client:
        [model] = (await client.models.list()).data
        completion = await client.completions.create(model=model.id, prompt="Hello", max_tokens=7)
        [choice] = completion.choices
        assert (choice.text, choice.finish_reason) == ("HelloHe", "length"), completion  # the echo backend
        stream = await client.chat.completions.create(
            model=model.id, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, stream=True
        )
        chunks = [chunk async for chunk in stream]
    pieces = [chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices]
    assert len(pieces) >= 5 and len("".join(pieces)) == 5, pieces
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "length"


LOAD_WORKERS = 4


async def test_a_rolling_restart_of_the_coordinators_under_load_loses_nothing(deployment: Deployment) -> None:
    """The coordinator Deployment replaced one pod at a time, as its RollingUpdate does: a new pod
    started and ready, then the old one stopped within its grace period, while clients keep
    submitting. Every request gets its final; none fails."""
    old = [process for process in deployment.processes if process.pod.component == "coordinator"]
    finals: list[float] = []  # when each final came
    failures: list[tuple[float, BaseException]] = []  # (when it was sent, what the client raised)
    stops: list[tuple[float, float]] = []  # when each old pod's stop began and ended
    done = asyncio.Event()
    restarted = asyncio.Event()
    served_after = asyncio.Event()  # a request sent once every old pod was gone got its final

    async def load(client: DpcoordClient, worker: int) -> None:
        sent = 0
        while not done.is_set():
            sent += 1
            after = restarted.is_set()
            sent_at = time.monotonic()
            try:
                final = await client.submit(f"w{worker}-{sent}", max_tokens=2, timeout=30)
                assert final.generated_text == f"w{worker}-{sent}"[:2], final
                finals.append(time.monotonic())
                if after:
                    served_after.set()
            except Exception as exc:  # counted, and the test fails naming them
                failures.append((sent_at, exc))

    async with await DpcoordClient.connect(deployment.person("client"), timeout=10) as client:
        workers = [asyncio.create_task(load(client, worker)) for worker in range(LOAD_WORKERS)]
        try:
            for index, replaced in enumerate(old):
                before = len(finals)
                fresh = dataclasses.replace(
                    replaced.pod, name=f"{replaced.pod.name.rsplit('-', 1)[0]}-{len(old) + index}"
                )
                new = await asyncio.to_thread(deployment.start_pod, fresh)
                ready = await asyncio.to_thread(wait_for_probes, [new])
                assert (new.pod.name, "readinessProbe") in ready, new.log_tail()
                stop_began = time.monotonic()
                code, took = await asyncio.to_thread(deployment.retire, replaced)
                stops.append((stop_began, time.monotonic()))
                assert code == 0, f"{replaced.pod.name} exited {code}\n{replaced.log_tail()}"
                assert took < replaced.pod.grace_s, f"{replaced.pod.name} took {took:.1f} s"
                assert len(finals) > before, "no request completed while this pod was replaced"
            restarted.set()
            await asyncio.wait_for(served_after.wait(), 30)
        finally:
            done.set()
            await asyncio.gather(*workers)
    summary = f"{len(failures)} of {len(finals) + len(failures)} requests failed: {[exc for _, exc in failures][:5]}"
    # A stopping coordinator leaves what its engines hold to the others (its last heartbeat says
    # it leaves), so nothing is lost (docs/reliability.md, ownership).
    assert not failures, f"{summary}\n{deployment.logs()}"


def _interleaved(processes: list[RunningPod]) -> list[RunningPod]:
    """One pod of each component in turn, so every component keeps a pod for as long as it can."""
    by_component: dict[str, list[RunningPod]] = collections.defaultdict(list)
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
