"""Log-probabilities through the gateway's plans, responses and streams
(service/gateway/translate.py, responses.py, streaming.py): what is asked of the engines, the
400s, echo, ``max_tokens: 0``, and a stream's chunks adding up to the response not streamed,
stop strings included, however the replies are split. Replies are built as the echo engine
sends them: byte tokens, logprob ``-(1 + (token + position) mod 16) / 8``."""

from __future__ import annotations

import codecs
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.gateway.errors import GatewayError
from service.gateway.responses import completion_response, usage_of
from service.gateway.schemas import chat_decoder, completion_decoder
from service.gateway.streaming import ChunkWriter, sse_events
from service.gateway.translate import Plan, chat_plan, completion_plan
from service.protocol.messages import Final, Partial

NAMES = {byte: bytes((byte,)) for byte in range(256)}


def _logprob(token: int, position: int) -> float:
    return -(1 + (token + position) % 16) / 8


def _tops(token: int, position: int, k: int) -> list[tuple[int, float]]:
    return [(token + rank, _logprob(token, position) - rank / 8) for rank in range(k)]


def _completion(**body: Any) -> Plan:
    return completion_plan(completion_decoder.decode(json.dumps({"model": "m", "prompt": "p", **body})))


def _chat(**body: Any) -> Plan:
    messages = [{"role": "user", "content": "hi"}]
    return chat_plan(chat_decoder.decode(json.dumps({"model": "m", "messages": messages, **body})))


def _scored(tokens: list[int], start: int, k: int) -> dict[str, Any]:
    return {
        "token_logprobs": [_logprob(t, start + i) for i, t in enumerate(tokens)],
        "top_logprobs": [_tops(t, start + i, k) for i, t in enumerate(tokens)] if k else None,
        "token_bytes": {t: NAMES[t] for t in tokens}
        | {t + r: bytes(((t + r) % 256,)) for t in tokens for r in range(k)},
    }


def _final(prompt: list[int], text: str, reason: str, k: int, prompt_k: int | None = None) -> Final:
    tokens = list(text.encode())
    fields = _scored(tokens, len(prompt), k)
    if prompt_k is not None:
        fields["prompt_token_ids"] = prompt
        fields["prompt_logprobs"] = [None] + [_logprob(t, p) for p, t in enumerate(prompt)][1:]
        fields["token_bytes"] |= {t: NAMES[t] for t in prompt}
    return Final("r", "c", "e", tokens, text, reason, prompt_tokens=len(prompt), **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("plan", "param"),
    [
        (lambda: _completion(logprobs=21), "logprobs"),
        (lambda: _completion(logprobs=-1), "logprobs"),
        (lambda: _completion(max_tokens=0), "max_tokens"),
        (lambda: _completion(echo=True, max_tokens=0, min_tokens=1), "min_tokens"),
        (lambda: _chat(top_logprobs=2), "top_logprobs"),
        (lambda: _chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    ],
)
def test_logprob_fields_out_of_bounds_are_400_by_name(plan: Any, param: str) -> None:
    with pytest.raises(GatewayError) as raised:
        plan()
    assert (raised.value.status, raised.value.param) == (400, param)


def test_what_the_engines_are_asked() -> None:
    assert "logprobs" not in _completion().sampling and "prompt_logprobs" not in _completion().sampling
    assert _completion(logprobs=3).sampling["logprobs"] == 3
    scoring = _completion(echo=True, logprobs=1, max_tokens=0, logprobs_mode="processed").sampling
    assert (scoring["max_tokens"], scoring["logprobs"], scoring["prompt_logprobs"]) == (1, 1, 1)
    assert scoring["logprobs_mode"] == "processed"
    assert "prompt_logprobs" not in _completion(echo=True).sampling  # a text prompt echoes itself
    assert _completion(echo=True, prompt=[104, 105]).sampling["prompt_logprobs"] == 0  # ids need their bytes
    assert _chat(logprobs=True).sampling["logprobs"] == 0 and _chat(logprobs=True, top_logprobs=4).logprobs == 4


def test_echo_puts_the_prompt_first_and_max_tokens_0_leaves_the_generated_token_out() -> None:
    prompt = list(b"hi!")
    plan = _completion(prompt=prompt, echo=True, logprobs=1, max_tokens=2)
    final = _final(prompt, "hi", "length", 1, prompt_k=1)
    [choice] = completion_response(plan, [final], usage_of(plan, [(0, final)])).choices
    assert choice.text == "hi!hi" and choice.logprobs is not None
    assert choice.logprobs.tokens == ["h", "i", "!", "h", "i"] and choice.logprobs.text_offset == [0, 1, 2, 3, 4]
    assert choice.logprobs.token_logprobs == [
        None,
        _logprob(105, 1),
        _logprob(33, 2),
        _logprob(104, 3),
        _logprob(105, 4),
    ]
    assert choice.logprobs.top_logprobs[0] is None
    only = _completion(prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    response = completion_response(only, [final], usage_of(only, [(0, final)]))
    [choice] = response.choices
    assert (choice.text, choice.finish_reason) == ("hi!", "length")
    assert choice.logprobs is not None and len(choice.logprobs.tokens) == 3
    assert response.usage is not None and (response.usage.prompt_tokens, response.usage.completion_tokens) == (3, 0)


def test_echo_without_logprobs_echoes_a_text_prompt_as_given() -> None:
    plan = _completion(prompt="hé", echo=True)
    final = Final("r", "c", "e", [104], "h", "length", prompt_tokens=3)
    [choice] = completion_response(plan, [final], usage_of(plan, [(0, final)])).choices
    assert (choice.text, choice.logprobs) == ("hé" + "h", None)


def _events(writer: ChunkWriter, plan: Plan, replies: list[Partial | Final]) -> list[dict[str, Any]]:
    chunks = [chunk for reply in replies for chunk in writer.chunks(plan.jobs[0], reply)]
    return [json.loads(chunk[len(b"data: ") :])["choices"][0] for chunk in chunks]


def _stream(plan: Plan, chat: bool, final: Final, cuts: list[int]) -> list[dict[str, Any]]:
    """``final``'s tokens streamed as partials split at ``cuts``, then the final."""
    tokens, text, k = final.generated_tokens, final.generated_text, plan.logprobs or 0
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(tokens)}), len(tokens)]
    partials: list[Partial | Final] = []
    decoder = codecs.getincrementaldecoder("utf-8")("replace")  # as the engines' detokenizers
    for start, end in zip(bounds, bounds[1:], strict=False):
        piece = decoder.decode(bytes(tokens[start:end]))
        scored = _scored(tokens[start:end], (final.prompt_tokens or 0) + start, k)
        partials.append(Partial("r", "c", tokens[start:end], piece, offset=start, **scored))
    assert "".join(p.text for p in partials if isinstance(p, Partial)) == text
    return _events(ChunkWriter(plan, chat), plan, [*partials, final])


TEXT = st.text(alphabet="ab é€", min_size=1, max_size=10)
STOPS = st.lists(st.text(alphabet="aé€", min_size=1, max_size=2), max_size=2)


@settings(max_examples=150, deadline=None)
@given(text=TEXT, stop=STOPS, cuts=st.lists(st.integers(0, 30)))
def test_a_stream_adds_up_to_the_response_not_streamed(text: str, stop: list[str], cuts: list[int]) -> None:
    """Multi-byte characters split across partials (byte tokens) included: a token holding part
    of a character goes with the chunk that sends the character."""
    plan = _completion(logprobs=2, stream=True, max_tokens=50, stop=stop or None)
    ends = [text.find(s) + len(s) for s in stop if s in text]
    ended = text[: min(ends)] if ends else text  # what the engine generated: up to the first stop string
    final = _final([112], ended, "stop" if ends else "length", 2)
    [whole] = completion_response(plan, [final], usage_of(plan, [(0, final)])).choices
    assert whole.logprobs is not None
    events = _stream(plan, False, final, cuts)
    assert "".join(e["text"] for e in events) == whole.text
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for e in events for v in e["logprobs"][field]] == getattr(whole.logprobs, field)
    assert len(whole.logprobs.tokens) == len(whole.text.encode())  # the stop string's tokens left out
    if stop:  # each chunk carries the logprobs of its own text's tokens (byte tokens: one a byte)
        assert all(len(event["logprobs"]["tokens"]) == len(event["text"].encode()) for event in events)


def test_a_chat_stream_carries_each_tokens_logprob_with_its_text() -> None:
    plan = _chat(logprobs=True, top_logprobs=1, stream=True)
    final = _final([1, 2], "user", "length", 1)
    events = _stream(plan, True, final, [1, 3])
    assert events[0]["logprobs"] is None  # the role chunk
    content = [entry for event in events[1:] for entry in event["logprobs"]["content"]]
    assert [(entry["token"], entry["bytes"]) for entry in content] == [(c, [ord(c)]) for c in "user"]
    assert [entry["logprob"] for entry in content] == [_logprob(t, 2 + i) for i, t in enumerate(b"user")]
    assert all(entry["top_logprobs"][0]["logprob"] == entry["logprob"] for entry in content)


def test_an_echoed_stream_arrives_whole_with_its_final() -> None:
    prompt = list(b"ab")
    plan = _completion(prompt=prompt, echo=True, logprobs=0, stream=True, max_tokens=2)
    final = _final(prompt, "ab", "length", 0, prompt_k=0)
    events = _stream(plan, False, final, [1])
    assert len(events) == 1 and events[0]["text"] == "abab" and events[0]["logprobs"]["tokens"] == list("abab")


def test_an_abort_before_any_token_answers_empty_logprobs_and_an_echo_of_it_503() -> None:
    plan = _completion(logprobs=1)
    aborted = Final("r", "c", None, [], "", "abort")
    [choice] = completion_response(plan, [aborted], usage_of(plan, [(0, aborted)])).choices
    assert choice.finish_reason == "abort" and choice.logprobs is not None and choice.logprobs.tokens == []
    echo = _completion(logprobs=1, echo=True)
    with pytest.raises(GatewayError) as raised:
        completion_response(echo, [aborted], usage_of(echo, [(0, aborted)]))
    assert raised.value.status == 503


class RepliesDouble:
    """A test double of :class:`~service.gateway.streaming.Replies` whose streams ended."""

    async def batch(self) -> list[Any]:
        return []


async def test_a_reply_without_the_logprobs_asked_ends_the_stream_with_a_502_event() -> None:
    plan = _completion(logprobs=0, stream=True)
    writer = ChunkWriter(plan, chat=False)
    first = [(plan.jobs[0], Partial("r", "c", [104], "h", offset=0))]  # no token_logprobs
    events = [event async for event in sse_events(writer, first, RepliesDouble())]  # type: ignore[arg-type]
    assert (
        events[-1] == b"data: [DONE]\n\n" and json.loads(events[0][len(b"data: ") :])["error"]["type"] == "bad_gateway"
    )
