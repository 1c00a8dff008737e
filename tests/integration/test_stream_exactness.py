"""The receiving side keeps streams exact whatever an engine sends: through a real coordinator,
a scripted engine (a test double on raw nats-py, named ScriptedEngine) sends partials twice,
from two runs, or with a gap; the client library drops what repeats or belongs to an older
run, with its text, lets the final fill a gap, and ends a stream the final does not repair
with 502; the gateway turns that into an error event, then ``[DONE]``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import msgspec
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from service.client import ClientError, DpcoordClient
from service.coordinator.coordinator import Coordinator
from service.ops.settings import Settings
from service.protocol.codec import Encoding, encode, encode_msgpack
from service.protocol.membership import EngineRegister
from service.protocol.messages import Final, Partial
from service.protocol.routed import EngineReplyBatch, RoutedReply, RoutedRequestBatch
from tests.gateway_helpers import http, serve_gateway, sse_data

ENGINE_ID = "scripted"
MODEL = "scripted-model"
# (token, offset, attempt) of each partial the engine sends, then the final's tokens.
Script = tuple[list[tuple[int, int, int]], list[int]]


class ScriptedEngine:
    """Test double: an engine that answers every routed request with the partials of its script,
    each a token given as its character, then a final with the script's tokens."""

    def __init__(self, nc: NATS, coordinator: Coordinator) -> None:
        self.nc = nc
        self.coordinator = coordinator
        self.script: Script = ([], [])

    async def start(self) -> None:
        subjects = self.coordinator.subjects
        await self.nc.subscribe(subjects.engine(ENGINE_ID, "submit_request"), cb=self._serve)
        await self.nc.request(
            subjects.sent_by("register", ENGINE_ID),
            encode_msgpack(EngineRegister(ENGINE_ID, served_model_name=MODEL)),
            timeout=5,
        )

    async def _serve(self, msg: Msg) -> None:
        subjects = self.coordinator.subjects
        for routed in msgspec.msgpack.decode(msg.data, type=RoutedRequestBatch).requests:
            path, encoding = routed.return_path, Encoding(routed.return_path.encoding)
            partials, final_tokens = self.script
            replies = []
            for seq, (token, offset, attempt) in enumerate(partials):
                partial = Partial(path.request_id, path.client_request_id, [token], chr(token), offset, attempt)
                replies.append(RoutedReply(path, encode(partial, encoding), seq, [token], attempt))
            await self.nc.publish(
                subjects.sent_by("engine_reply_partial", ENGINE_ID),
                encode_msgpack(EngineReplyBatch(ENGINE_ID, replies)),
            )
            text = "".join(chr(token) for token in final_tokens)
            final = Final(path.request_id, path.client_request_id, ENGINE_ID, final_tokens, text, "length")
            await self.nc.publish(
                subjects.sent_by("engine_reply", ENGINE_ID),
                encode_msgpack(
                    EngineReplyBatch(ENGINE_ID, [RoutedReply(path, encode(final, encoding), len(partials))])
                ),
            )


@pytest.fixture
async def engine(coordinator: Coordinator, nc: NATS) -> AsyncIterator[ScriptedEngine]:
    scripted = ScriptedEngine(nc, coordinator)
    await scripted.start()
    yield scripted


A, B, C = ord("a"), ord("b"), ord("c")


async def streamed(settings: Settings) -> list[Partial | Final]:
    async with await DpcoordClient.connect(settings) as client:
        return [reply async for reply in client.stream("abc", timeout=10)]


async def test_duplicates_and_an_older_runs_partials_are_dropped_with_their_text(
    engine: ScriptedEngine, settings: Settings
) -> None:
    engine.script = ([(A, 0, 0), (A, 0, 0), (B, 1, 0), (C, 2, 1), (ord("x"), 2, 0), (C, 2, 1)], [A, B, C])
    replies = await streamed(settings)
    partials = [reply for reply in replies if isinstance(reply, Partial)]
    assert [(partial.offset, partial.attempt) for partial in partials] == [(0, 0), (1, 0), (2, 1)]
    assert "".join(partial.text for partial in partials) == "abc"
    final = replies[-1]
    assert isinstance(final, Final) and final.generated_text == "abc"


async def test_a_gap_stops_the_partials_and_the_final_fills_it(engine: ScriptedEngine, settings: Settings) -> None:
    engine.script = ([(A, 0, 0), (C, 2, 0), (ord("d"), 3, 0)], [A, B, C, ord("d")])
    replies = await streamed(settings)
    assert [reply.text for reply in replies if isinstance(reply, Partial)] == ["a"]
    final = replies[-1]
    assert isinstance(final, Final) and final.generated_text == "abcd"


X = ord("x")


@pytest.mark.parametrize(
    ("script", "reason"),
    [
        (([(A, 0, 0), (C, 2, 0)], [X, B, C]), "missing"),
        (([(A, 0, 0), (B, 1, 0), (C, 1, 1)], [A, X]), "run 1 continues at token 1"),
        (([(A, 0, 0), (B, 1, 0)], [A, C]), "do not begin with"),
    ],
    ids=["gap", "runs-that-do-not-join", "final-that-disagrees"],
)
async def test_a_stream_its_final_does_not_repair_ends_with_502(
    engine: ScriptedEngine, settings: Settings, script: Script, reason: str
) -> None:
    engine.script = script
    with pytest.raises(ClientError, match=reason) as raised:
        await streamed(settings)
    assert raised.value.code == 502


async def test_the_gateway_repairs_a_gap_from_the_final_or_ends_with_an_error_event_then_done(
    engine: ScriptedEngine, settings: Settings
) -> None:
    async with serve_gateway(settings) as served:
        body = {"model": MODEL, "prompt": "abc", "stream": True}
        engine.script = ([(A, 0, 0), (A, 0, 0), (C, 2, 0)], [A, B, C])
        repaired = sse_data((await http(served.port, "POST", "/v1/completions", body)).body)
        engine.script = ([(A, 0, 0), (A, 0, 0), (C, 2, 0)], [X, B, C])
        broken = sse_data((await http(served.port, "POST", "/v1/completions", body)).body)
    for events in (repaired, broken):
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    texts = [choice["text"] for event in repaired[:-1] for choice in json.loads(event)["choices"]]
    assert texts == ["a", "bc"]  # the duplicate never reached the HTTP client; the final filled the gap
    texts = [choice["text"] for event in broken[:-2] for choice in json.loads(event)["choices"]]
    assert texts == ["a"]
    error = json.loads(broken[-2])["error"]
    assert error["type"] == "bad_gateway" and "missing" in error["message"]
