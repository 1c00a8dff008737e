"""update_weights and pause modes over a real NATS server, with echo engines (the documented
test double: it has no tensors, so it checks only that a directory holds ``*.safetensors``;
tests/torch/test_torch_weight_updates.py checks real checkpoints against a model)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client as NATS
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

from engines.echo import EchoBackend
from engines.metrics import EngineCollector
from engines.observability import engine_readiness, engine_status
from engines.runtime import EngineRuntime
from handlers import HANDLERS
from service.client import ClientError, DpcoordClient
from service.coordinator.coordinator import Coordinator
from service.coordinator.metrics import CoordinatorCollector
from service.coordinator.observability import coordinator_status
from service.ops.settings import Settings
from service.protocol.checkpoint import checkpoint_digest, checkpoint_files
from service.protocol.messages import Final, Partial, WeightVersionSpan
from service.protocol.state import ControlRecord
from service.protocol.subjects import Header
from tests.conftest import EngineFactory
from tests.helpers import engines_become
from tests.integration.test_control import barrier


def checkpoint(path: Path, content: bytes) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "model.safetensors").write_bytes(content)
    return path


async def until(changed: asyncio.Event, condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait until ``condition`` holds, checking it each time ``changed`` is set."""

    async def reached() -> None:
        while not condition():
            changed.clear()
            await changed.wait()

    await asyncio.wait_for(reached(), timeout_s)


def exposition(collector: Collector) -> str:
    """What ``/metrics`` serves for ``collector``."""
    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry).decode()


@pytest.fixture
async def client(settings: Settings, nc: NATS) -> AsyncIterator[DpcoordClient]:
    async with await DpcoordClient.connect(settings, nc=nc) as connected:
        yield connected


async def test_an_update_is_acknowledged_by_every_engine_and_recorded_for_the_fleet(
    coordinator: Coordinator,
    start_engines: EngineFactory,
    client: DpcoordClient,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    engines = await start_engines(2)
    path = checkpoint(tmp_path / "b", b"weights of B")
    with pytest.raises(ClientError) as running:
        await client.update_weights(str(path), 1)
    assert running.value.code == 409 and "paused or suspended" in running.value.message

    await client.pause()
    ack = await client.update_weights(str(path), 1)
    digest = checkpoint_digest(checkpoint_files(path))
    assert ack.weight_version == 1 and ack.digest == digest and ack.state == "paused"
    assert ack.engines == {engine.engine_id: digest for engine in engines}
    said = [record.getMessage() for record in caplog.records if record.name == "engines.weight_updates"]
    for phase in (": staging from ", ": digest: done, 12 B in ", ": swap: done, in "):  # each engine says each phase
        assert sum(phase in line for line in said) == 2, (phase, said)
    record = coordinator.shared.record
    assert (record.weight_version, record.weight_path, record.weight_digest) == (1, str(path), digest)
    assert all(engine.weights.version == 1 and engine_status(engine).weight_version == 1 for engine in engines)
    assert coordinator_status(coordinator).weight_version == 1
    assert 'dpcoord_fleet_weight_version_info{version="1"} 1.0' in exposition(CoordinatorCollector(coordinator))
    assert 'dpcoord_engine_weight_version_info{version="1"} 1.0' in exposition(EngineCollector(engines[0]))
    await client.unpause()
    final = await client.submit("abc", max_tokens=4, timeout=10)
    assert final.weight_versions == [WeightVersionSpan(1, 0, 4)]


async def test_a_refused_checkpoint_changes_no_engine(
    coordinator: Coordinator, start_engines: EngineFactory, client: DpcoordClient, tmp_path: Path
) -> None:
    engines = await start_engines(2)
    await client.pause()
    await client.update_weights(str(checkpoint(tmp_path / "a", b"A")), "a")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ClientError) as refused:
        await client.update_weights(str(tmp_path / "empty"), "b")
    assert refused.value.code == 400 and "has no *.safetensors files" in refused.value.message
    assert "keeps its weights" in refused.value.message
    assert coordinator.shared.record.weight_version == "a"
    assert all(engine.weights.version == "a" for engine in engines)


async def test_an_engine_started_after_the_update_loads_it_before_it_serves(
    coordinator: Coordinator, start_engines: EngineFactory, client: DpcoordClient, tmp_path: Path
) -> None:
    await start_engines(1)
    await client.pause()
    await client.update_weights(str(checkpoint(tmp_path / "b", b"B")), 2)
    (late,) = await start_engines(1)
    assert late.weights.version == 2 and coordinator.engines.get(late.engine_id) is not None
    await client.unpause()
    finals = [await client.submit("xy", max_tokens=3, timeout=10) for _ in range(4)]
    assert all(final.weight_versions == [WeightVersionSpan(2, 0, 3)] for final in finals)


async def test_an_engine_that_cannot_load_the_fleets_weights_gets_no_work_and_says_why(
    settings: Settings,
    coordinator: Coordinator,
    start_engines: EngineFactory,
    client: DpcoordClient,
    nc: NATS,
    tmp_path: Path,
) -> None:
    (first,) = await start_engines(1)
    path = checkpoint(tmp_path / "b", b"B")
    await client.pause()
    await client.update_weights(str(path), 3)
    (path / "model.safetensors").unlink()
    async with EngineRuntime(settings, EchoBackend()) as late:
        await until(late.weights.changed, lambda: late.weights.problem is not None)
        status = engine_status(late)
        assert status.weights_problem is not None and "has no *.safetensors files" in status.weights_problem
        assert status.weight_version is None and not status.registered
        assert coordinator.engines.get(late.engine_id) is None
        readiness = engine_readiness(late)
        assert not readiness.ok and readiness.detail == status.weights_problem
        await barrier(nc, coordinator)
        assert coordinator.engines.get(late.engine_id) is None and coordinator.counters["engines_on_other_weights"]
    await engines_become(coordinator, 1)
    assert first.weights.version == 3


async def test_a_keep_pause_spanning_an_update_reports_two_version_spans(
    start_engines: EngineFactory, client: DpcoordClient, tmp_path: Path
) -> None:
    await start_engines(1, token_delay_ms=20)
    stream = client.stream("abcdef", max_tokens=40, timeout=30)
    assert isinstance(await anext(stream), Partial)
    async with client.paused(mode="keep") as paused:
        assert paused.mode == "keep"
        await client.update_weights(str(checkpoint(tmp_path / "b", b"B")), "b")
    replies = [reply async for reply in stream]
    final = replies[-1]
    assert isinstance(final, Final) and final.finish_reason == "length" and len(final.generated_tokens) == 40
    assert final.weight_versions is not None and [span.version for span in final.weight_versions] == [None, "b"]
    first, second = final.weight_versions
    assert first.start == 0 and first.end == second.start and second.end == 40


async def test_an_abort_pause_ends_requests_in_flight_with_their_tokens(
    coordinator: Coordinator, start_engines: EngineFactory, client: DpcoordClient
) -> None:
    (engine,) = await start_engines(1, token_delay_ms=20)
    stream = client.stream("abcdef", max_tokens=200, timeout=30)
    first = await anext(stream)
    assert isinstance(first, Partial)
    streamed = list(first.new_tokens)
    ack = await client.pause(mode="abort")
    assert ack.mode == "abort" and engine.load == 0 and engine.paused
    replies = [reply async for reply in stream]
    final = replies[-1]
    streamed += [token for reply in replies[:-1] if isinstance(reply, Partial) for token in reply.new_tokens]
    assert isinstance(final, Final) and final.finish_reason == "abort"
    assert 0 < len(final.generated_tokens) < 200 and final.generated_tokens == streamed
    assert len(coordinator.requests) == 0


async def test_a_drain_pause_is_acknowledged_once_requests_in_flight_finished_and_holds_new_ones(
    coordinator: Coordinator, start_engines: EngineFactory, client: DpcoordClient, nc: NATS
) -> None:
    (engine,) = await start_engines(1, token_delay_ms=20)
    stream = client.stream("abcdef", max_tokens=25, timeout=30)
    assert isinstance(await anext(stream), Partial)
    ack = await client.pause(mode="drain")
    assert ack.mode == "drain" and ack.state == "paused"
    assert engine.load == 0 and engine.paused and len(coordinator.requests) == 0  # finished before the ack
    final = [reply async for reply in stream][-1]
    assert isinstance(final, Final) and final.finish_reason == "length" and len(final.generated_tokens) == 25
    held = asyncio.ensure_future(client.submit("new", max_tokens=2, timeout=30))
    await barrier(nc, coordinator)  # the client shares ``nc``: its submission was handled before this
    assert len(coordinator.requests) == 1
    assert not held.done() and engine.load == 0
    await client.unpause()
    assert (await held).finish_reason == "length"


async def test_mode_applies_to_pause_only(coordinator: Coordinator, client: DpcoordClient) -> None:
    with pytest.raises(ClientError) as refused:
        await client.control(Header.SUSPEND, mode="abort")
    assert refused.value.code == 400 and "pause only" in refused.value.message


async def test_two_replicas_three_engines_an_update_through_either(
    settings: Settings, coordinator: Coordinator, start_engines: EngineFactory, nc: NATS, tmp_path: Path
) -> None:
    second_settings = settings.model_copy(update={"coordinator_id": "second-replica"})
    async with Coordinator(second_settings, HANDLERS) as second:
        engines = await start_engines(3)
        await engines_become(second, 3)
        replicas = [coordinator, second]
        async with await DpcoordClient.connect(settings, nc=nc) as client:
            await client.pause()
            # The queue group hands each update to one replica or the other: send until both served
            # some (the chance that 24 all go to one replica is 2 ** -23).
            version = 0
            while version < 24 and not all(replica.counters["weight_updates"] for replica in replicas):
                version += 1
                ack = await client.update_weights(str(checkpoint(tmp_path / f"v{version}", b"v%d" % version)), version)
                assert ack.weight_version == version and len(ack.engines or {}) == 3
                for replica in replicas:
                    await until(replica.control_changed, lambda: replica.control_state.weight_version == version)  # noqa: B023
                assert all(engine.weights.version == version for engine in engines)
            assert all(replica.counters["weight_updates"] for replica in replicas)
            await client.unpause()
            finals = [await client.submit("ab", max_tokens=2, timeout=10) for _ in range(6)]
        assert all(final.weight_versions == [WeightVersionSpan(version, 0, 2)] for final in finals)


class SwapFailsOnce(EchoBackend):
    """A test double: the echo backend whose first weight swap raises, as a device error would."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    async def swap_weights(self, staged: object) -> None:
        if not self.failed:
            self.failed = True
            raise RuntimeError("device lost during the copy")


async def test_an_engine_that_fails_to_commit_leaves_the_pool_and_comes_back_on_the_fleets_weights(
    settings: Settings, coordinator: Coordinator, start_engines: EngineFactory, client: DpcoordClient, tmp_path: Path
) -> None:
    (steady,) = await start_engines(1)
    async with EngineRuntime(settings, SwapFailsOnce()) as flaky:
        await engines_become(coordinator, 2)
        await client.pause()
        with pytest.raises(ClientError) as failed:
            await client.update_weights(str(checkpoint(tmp_path / "b", b"B")), 5)
        assert failed.value.code == 500 and "weights 5 recorded, but engines left the pool" in failed.value.message
        assert f"{flaky.engine_id}: RuntimeError: device lost during the copy" in failed.value.message
        assert coordinator.shared.record.weight_version == 5 and steady.weights.version == 5
        await until(flaky.weights.changed, lambda: flaky.weights.version == 5)  # registering again loaded it
        await engines_become(coordinator, 2)
        assert flaky.weights.problem is None
        await client.unpause()
        finals = [await client.submit("ab", max_tokens=2, timeout=10) for _ in range(4)]
        assert all(final.weight_versions == [WeightVersionSpan(5, 0, 2)] for final in finals)


async def test_weights_recorded_by_a_replica_that_died_before_committing_reach_every_engine(
    coordinator: Coordinator, start_engines: EngineFactory, client: DpcoordClient, tmp_path: Path
) -> None:
    """The record a replica writes before its commit, written here by hand as if that replica
    died right after: the engines' heartbeats show other weights, so this replica repairs."""
    engines = await start_engines(2)
    await client.pause()
    path = checkpoint(tmp_path / "b", b"B")
    digest = checkpoint_digest(checkpoint_files(path))

    def recorded(current: ControlRecord) -> ControlRecord:
        return msgspec.structs.replace(
            current, weight_version=9, weight_path=str(path), weight_digest=digest, signal="update_weights"
        )

    await coordinator.shared.change(recorded)
    for engine in engines:
        await until(engine.weights.changed, lambda: engine.weights.version == 9)  # noqa: B023
        assert engine.weights.digest == digest
    assert coordinator.counters["weight_repairs"] == 1 and len(coordinator.engines) == 2
    await client.unpause()
    final = await client.submit("ab", max_tokens=2, timeout=10)
    assert final.weight_versions == [WeightVersionSpan(9, 0, 2)]
