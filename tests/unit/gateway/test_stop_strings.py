"""Stop strings left out of the text, streamed or not (service/gateway/translate.py and
ChunkWriter in service/gateway/streaming.py), the top-level field named for too-deep nesting,
and nested unknown fields named by their path (service/gateway/errors.py)."""

from __future__ import annotations

import json

import msgspec
import pytest

from service.gateway.errors import deepest_field, from_validation
from service.gateway.responses import rest_of
from service.gateway.schemas import completion_decoder
from service.gateway.streaming import ChunkWriter
from service.gateway.translate import Plan, completion_plan
from service.protocol.messages import Final, Partial


def _plan(stop: list[str], min_tokens: int = 0, stream: bool = True) -> Plan:
    body = {"model": "m", "prompt": "p", "stop": stop, "stream": stream, "max_tokens": 100, "min_tokens": min_tokens}
    return completion_plan(completion_decoder.decode(json.dumps(body).encode()))


def visible_text(plan: Plan, final: Final) -> str:
    return rest_of(plan, plan.jobs[0], final).text


def _final(text: str, reason: str = "stop") -> Final:
    return Final("r", "c", "e", list(range(len(text))), text, reason)  # type: ignore[arg-type]


def _streamed(stop: list[str], pieces: list[str], final_text: str, min_tokens: int = 0) -> str:
    plan = _plan(stop, min_tokens)
    writer = ChunkWriter(plan, chat=False)
    job = plan.jobs[0]
    events = [chunk for piece in pieces for chunk in writer.chunks(job, Partial("r", "c", [1], piece))]
    events += writer.chunks(job, _final(final_text))
    return "".join(json.loads(event[len(b"data: ") :])["choices"][0]["text"] for event in events)


@pytest.mark.parametrize(
    ("stop", "text", "visible"),
    [
        (["wor"], "Hello world", "Hello "),
        (["xyz", "l"], "Hello", "He"),
        (["lo", "el"], "Hello", "H"),  # the first to occur ended it
        (["!"], "no stop here", "no stop here"),  # EOS, not a stop string
    ],
)
def test_the_stop_string_and_what_follows_are_cut(stop: list[str], text: str, visible: str) -> None:
    assert visible_text(_plan(stop), _final(text)) == visible


def test_a_length_finish_keeps_its_text() -> None:
    assert visible_text(_plan(["l"]), _final("Hello", "length")) == "Hello"


def test_with_min_tokens_the_last_occurrence_is_cut() -> None:
    assert visible_text(_plan(["a"], min_tokens=3), _final("abca")) == "abc"


@pytest.mark.parametrize(
    ("pieces", "final"),
    [
        (["Hel", "lo w", "or"], "Hello wor"),
        (["H", "e", "l", "l", "o", " ", "w", "o", "rld"], "Hello world"),
        (["Hello wo", "rld"], "Hello world"),
    ],
)
def test_a_stream_never_sends_a_stop_string_however_it_is_split(pieces: list[str], final: str) -> None:
    assert _streamed(["wor"], pieces, final) == "Hello "


def test_a_stream_without_stop_strings_sends_each_piece_at_once() -> None:
    plan = _plan([])
    writer = ChunkWriter(plan, chat=False)
    [event] = writer.chunks(plan.jobs[0], Partial("r", "c", [1], "Hel"))
    assert json.loads(event[len(b"data: ") :])["choices"][0]["text"] == "Hel"


def test_deep_nesting_names_the_top_level_field() -> None:
    body = b'{"model": "m", "prompt": "a\\"[[[", "messages": [[[[[]]]]], "n": 1}'
    assert deepest_field(body) == "messages"
    with pytest.raises(RecursionError) as raised:
        msgspec.json.decode(b"[" * 100_000 + b"]" * 100_000)
    assert from_validation(raised.value, b'{"prompt": ' + b"[" * 10 + b"]" * 10 + b"}").param == "prompt"


def test_a_nested_unknown_field_is_named_by_its_path() -> None:
    with pytest.raises(msgspec.ValidationError) as raised:
        completion_decoder.decode(b'{"prompt": "p", "stream_options": {"bogus": 1}}')
    assert from_validation(raised.value, b"").param == "stream_options.bogus"
