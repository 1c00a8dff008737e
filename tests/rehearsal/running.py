"""A rendered deployment, running: its NATS, one process per pod, and when each probe first answered."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.ops.settings import Settings
from tests.rehearsal.deployment import Rendered, pods, render
from tests.rehearsal.image_env import ImageEnvironment
from tests.rehearsal.nats import Nats, bundled_nats, external_nats
from tests.rehearsal.pods import PodProcess

READY_WITHIN_S = 60.0  # the rehearsal's own patience; the manifests' limits are checked separately


@dataclass
class Deployment:
    rendered: Rendered
    nats: Nats
    processes: list[PodProcess]
    # (pod, probe) -> seconds from the process's start to the probe's first success
    first_success: dict[tuple[str, str], float]

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
        return "\n".join(process.log_tail() for process in self.processes)


def wait_for_probes(processes: list[PodProcess]) -> dict[tuple[str, str], float]:
    """Probe every pod until each probe has answered once, or the rehearsal's patience ends."""
    pending = {(process, name) for process in processes for name in process.pod.probes()}
    first: dict[tuple[str, str], float] = {}
    deadline = time.monotonic() + READY_WITHIN_S
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
    values: dict[str, Any], release: str, namespace: str, images: dict[Path, ImageEnvironment], folder: Path
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
            PodProcess(pod, images[pod.dockerfile], folder / pod.name, nats.urls[index % len(nats.urls)])
            for index, pod in enumerate(pods(rendered, nats.operator_objects))
        ]
        try:
            for process in processes:
                process.start()
            yield Deployment(rendered, nats, processes, wait_for_probes(processes))
        finally:
            for process in processes:
                process.kill()
