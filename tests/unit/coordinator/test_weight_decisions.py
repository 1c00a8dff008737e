"""What the coordinator makes of the engines' answers to ``prepare_weights``, without a server."""

from __future__ import annotations

import pytest

from service.coordinator.broadcast import BroadcastResult
from service.coordinator.weights import agreed_digest
from service.protocol.errors import WireError
from service.protocol.messages import UpdateWeights
from service.protocol.routed import EngineAck

REQUEST = UpdateWeights("/ckpt/7", 7)


def prepared(engine_id: str, digest: str = "xxh3-128:aa") -> EngineAck:
    return EngineAck(engine_id, "prepare_weights", True, digest, 7, digest)


def refused(engine_id: str, code: int, detail: str) -> EngineAck:
    return EngineAck(engine_id, "prepare_weights", False, detail, None, None, code)


def decide(*acks: EngineAck, missing: set[str] | None = None) -> str:
    return agreed_digest(BroadcastResult({ack.engine_id: ack for ack in acks}, missing or set()), REQUEST)


def test_every_engine_with_the_same_digest_agrees() -> None:
    assert decide(prepared("e1"), prepared("e2")) == "xxh3-128:aa"


@pytest.mark.parametrize(
    ("acks", "missing", "code", "text"),
    [
        # A checkpoint that does not fit is the caller's to fix: its 400 wins over other failures.
        (
            [refused("e2", 400, "x has shape (1,)"), refused("e1", 500, "OSError"), prepared("e3")],
            {"e4"},
            400,
            "checkpoint /ckpt/7 refused by engines e2: x has shape (1,); the fleet keeps its weights",
        ),
        ([refused("e1", 500, "OSError: disk"), prepared("e2")], set(), 500, "e1: OSError: disk"),
        ([prepared("e1")], {"e2"}, 504, "no confirmation from engines e2 loading /ckpt/7"),
        ([prepared("e1"), prepared("e2", "xxh3-128:bb")], set(), 409, "engines read different files at /ckpt/7"),
    ],
)
def test_any_engine_that_could_not_refuses_the_update(
    acks: list[EngineAck], missing: set[str], code: int, text: str
) -> None:
    with pytest.raises(WireError) as refusal:
        decide(*acks, missing=missing)
    assert refusal.value.code == code and text in refusal.value.message
    assert refusal.value.message.endswith("the fleet keeps its weights")
