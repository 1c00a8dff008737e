"""The engine's generation pace (engines/token_pace.py): tokens counted per step, and the gap
between steps observed once per request that continued, never for a request's first token."""

from __future__ import annotations

import pytest

from engines import token_pace
from engines.backend import TokenOutput
from engines.replies import ActiveRequest
from engines.token_pace import TokenPace
from service.protocol.codec import Encoding
from service.protocol.routed import ReturnPath


class Clock:
    """A test double of time.monotonic, moved by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    stand_in = Clock()
    monkeypatch.setattr(token_pace.time, "monotonic", stand_in)
    return stand_in


def request(request_id: str) -> ActiveRequest:
    return ActiveRequest(ReturnPath(request_id, "c", "_INBOX.x.1", "msgpack", True, None), Encoding.MSGPACK)


def observed(pace: TokenPace) -> dict[str, int]:
    """Observations by bucket bound, the empty buckets left out."""
    bounds = [repr(bound) for bound in pace.inter_token.bounds] + ["+Inf"]
    return {bound: count for bound, count in zip(bounds, pace.inter_token.counts, strict=True) if count}


def test_first_tokens_count_as_generated_but_not_as_gaps(clock: Clock) -> None:
    pace = TokenPace()
    active = {"a": request("a"), "b": request("b")}
    pace.stepped([TokenOutput("a", [1], "x"), TokenOutput("b", [2], "y")], active)
    assert pace.generated == 2 and observed(pace) == {}
    for name, token in (("a", 1), ("b", 2)):
        active[name].tokens.append(token)  # what the runtime records before the next step ends

    clock.now += 0.02
    active["c"] = request("c")  # admitted meanwhile: its prefill is not an inter-token gap
    outputs = [TokenOutput("a", [3], "z"), TokenOutput("b", [4], "w"), TokenOutput("c", [5], "v")]
    pace.stepped(outputs, active)
    assert pace.generated == 5
    assert observed(pace) == {"0.02": 2} and pace.inter_token.sum == pytest.approx(0.04)


def test_requests_gone_or_without_a_token_are_not_gaps(clock: Clock) -> None:
    pace = TokenPace()
    active = {"a": request("a")}
    active["a"].tokens.append(1)
    pace.stepped([], active)  # the first step: no gap to measure yet
    clock.now += 0.2
    pace.stepped([TokenOutput("a", [], "", "stop"), TokenOutput("gone", [7], "q")], active)
    assert pace.generated == 1 and observed(pace) == {}
    clock.now += 3.0  # a pause: the requests it froze waited that long
    pace.stepped([TokenOutput("a", [8], "r")], active)
    assert observed(pace) == {"+Inf": 1}
