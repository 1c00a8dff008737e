"""A rendered deployment, running: its NATS, one process or container per pod (``PodFactory``),
and when each probe first answered."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.ops.settings import Settings
from tests.rehearsal.deployment import Pod, Rendered, pods, render
from tests.rehearsal.nats import Nats, bundled_nats, external_nats
from tests.rehearsal.pods import RunningPod

# (pod, its folder, the NATS URL it connects to) -> the pod, not started yet
PodFactory = Callable[[Pod, Path, str], RunningPod]

READY_WITHIN_S = 60.0  # the rehearsal's own patience; the manifests' limits are checked separately


@dataclass
class Deployment:
    rendered: Rendered
    nats: Nats
    processes: list[RunningPod]
    # (pod, probe) -> seconds from the process's start to the probe's first success
    first_success: dict[tuple[str, str], float]
    make_pod: PodFactory
    folder: Path
    retired: list[RunningPod] = field(default_factory=list)  # replaced in a rolling restart

    def start_pod(self, pod: Pod) -> RunningPod:
        """Start one more pod (a replacement, in a rolling restart); the deployment's teardown removes it."""
        running = self.make_pod(pod, self.folder / pod.name, self.nats.url)
        self.processes.append(running)
        running.start()
        return running

    def retire(self, old: RunningPod) -> tuple[int, float]:
        """Terminate a pod as a rolling update does (its ``terminate``), no longer counted as running."""
        self.processes.remove(old)
        self.retired.append(old)
        return old.terminate()

    @property
    def prefix(self) -> str:
        return str(self.rendered.values["settings"]["subject_prefix"])

    def person(self, user: str) -> Settings:
        """The settings of someone who connects with ``user``'s credentials, as docs/security.md tells them."""
        return Settings(
            nats_url=self.nats.url,
            nats_user=user,
            nats_password=self.nats.passwords[user],
            subject_prefix=self.prefix,
            nats_inbox_prefix=self.nats.inbox_prefixes[user],
        )

    def logs(self) -> str:
        return "\n".join(process.log_tail() for process in [*self.processes, *self.retired])


def wait_for_probes(processes: list[RunningPod], within_s: float = READY_WITHIN_S) -> dict[tuple[str, str], float]:
    """Probe every pod until each probe has answered once, or the rehearsal's patience ends."""
    pending = {(process, name) for process in processes for name in process.pod.probes()}
    first: dict[tuple[str, str], float] = {}
    deadline = time.monotonic() + within_s
    while pending and time.monotonic() < deadline:
        for process, name in sorted(pending, key=lambda entry: (entry[0].pod.name, entry[1])):
            if process.probe(name).ok:
                first[process.pod.name, name] = time.monotonic() - process.started_at
                pending.discard((process, name))
            elif process.returncode is not None:
                pending.discard((process, name))  # exited: its probes never answer
        time.sleep(0.1)
    return first


@contextmanager
def running(
    values: dict[str, Any], release: str, namespace: str, make_pod: PodFactory, folder: Path
) -> Iterator[Deployment]:
    """The chart rendered with ``values``, its NATS started, then every pod at once (as a Deployment's
    and a Parallel StatefulSet's pods start), waited on until each probe answered once."""
    rendered = render(values, release, namespace)
    start_nats: AbstractContextManager[Nats] = (
        bundled_nats(rendered, folder / "nats")
        if rendered.values["nats"]["enabled"]
        else external_nats(rendered, folder / "nats")
    )
    with start_nats as nats:
        processes = [
            make_pod(pod, folder / pod.name, nats.urls[index % len(nats.urls)])
            for index, pod in enumerate(pods(rendered, nats.operator_objects))
        ]
        deployment = Deployment(rendered, nats, processes, {}, make_pod, folder)
        try:
            for process in processes:
                process.start()
            deployment.first_success = wait_for_probes(processes)
            yield deployment
        finally:
            for process in [*deployment.processes, *deployment.retired]:
                process.kill()
