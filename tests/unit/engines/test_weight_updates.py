"""Weight updates on the request table alone: a commit the engine cannot serve makes it rejoin
the pool and drop what it held without replies; one it can serve changes nothing else."""

from __future__ import annotations

from pathlib import Path

from engines.backend import GenerationRequest
from engines.runtime_weights import WeightUpdates
from service.protocol.codec import Encoding
from service.protocol.routed import WeightSignal
from tests.unit.engines.wiring import Floor, build


class Rejoins:
    """Membership's ``rejoin``, recorded: ``registered`` says what it returns."""

    def __init__(self, registered: bool) -> None:
        self.registered = registered
        self.calls = 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.registered


def hold(floor: Floor) -> None:
    routed = floor.routed()
    request_id = routed.return_path.request_id
    floor.requests.start(routed, Encoding.JSON, GenerationRequest(request_id, "abc"), None)


def checkpoint(path: Path) -> str:
    path.mkdir()
    (path / "model.safetensors").write_bytes(b"weights")
    return str(path)


async def test_prepare_then_commit_serves_the_new_version_and_keeps_the_requests(tmp_path: Path) -> None:
    floor = build()
    hold(floor)
    rejoin = Rejoins(registered=True)
    job = WeightUpdates(floor.weights, floor.requests, rejoin=rejoin)
    signal = WeightSignal(checkpoint(tmp_path / "v2"), 2, revision=1)
    prepared = await job.prepare(signal)
    assert prepared.ok and prepared.digest is not None
    committed = await job.commit(signal)
    assert committed.ok and floor.weights.version == 2 and len(floor.requests) == 1 and rejoin.calls == 0


async def test_a_commit_the_engine_cannot_serve_drops_its_requests_silently_and_rejoins(tmp_path: Path) -> None:
    floor = build()
    hold(floor)
    rejoin = Rejoins(registered=True)
    ack = await WeightUpdates(floor.weights, floor.requests, rejoin=rejoin).commit(
        WeightSignal(str(tmp_path / "missing"), 3, revision=1)
    )
    assert not ack.ok and floor.weights.problem is not None
    assert rejoin.calls == 1 and len(floor.requests) == 0 and floor.bus.published == []


async def test_a_failed_commit_during_a_registration_keeps_the_requests(tmp_path: Path) -> None:
    floor = build()
    hold(floor)
    rejoin = Rejoins(registered=False)  # a registration is under way: nothing to leave
    ack = await WeightUpdates(floor.weights, floor.requests, rejoin=rejoin).commit(
        WeightSignal(str(tmp_path / "missing"), 3, revision=1)
    )
    assert not ack.ok and len(floor.requests) == 1


async def test_discard_frees_what_was_staged(tmp_path: Path) -> None:
    floor = build()
    job = WeightUpdates(floor.weights, floor.requests, rejoin=Rejoins(registered=True))
    signal = WeightSignal(checkpoint(tmp_path / "v2"), 2)
    await job.prepare(signal)
    job.discard(signal)
    stale = tmp_path / "v2" / "model.safetensors"
    stale.unlink()  # a commit now has to load the checkpoint again, and cannot
    assert not (await job.commit(WeightSignal(str(tmp_path / "v2"), 2, revision=1))).ok
