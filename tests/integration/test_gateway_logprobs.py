"""Log-probabilities through the gateway with the official ``openai`` SDK, against echo engines,
whose logprobs are a documented function of token and position (engines/echo.py), so every
value is checked exactly: chat's ``logprobs.content``, completions' legacy fields, ``echo`` with
``max_tokens`` 1 and 0 as lm-eval-harness scores a text, streams, stop strings, the 400s.
The torch engine with a real tokenizer: tests/integration/test_gateway_logprobs_torch.py."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from engines.echo import echo_logprob
from tests.conftest import EngineFactory
from tests.gateway_helpers import Served, http, legacy_logprobs

ECHO = "dpcoord-echo"
CHAT_PROMPT = b"user: Hi\nassistant:"  # the plain fallback the echo engine renders


def _greedy(token: int, position: int, k: int) -> dict[str, float]:
    """The echo engine's top ``k`` at a position as a completions dict: the token itself first."""
    best = echo_logprob(token, position)
    return {chr(token + rank): best - rank / 8 for rank in range(k)} | {chr(token): best}


async def test_completion_logprobs_are_the_engines_exactly(
    start_engines: EngineFactory, aclient: openai.AsyncOpenAI
) -> None:
    await start_engines(1)
    completion = await aclient.completions.create(model=ECHO, prompt="Hello", max_tokens=6, logprobs=2)
    [choice] = completion.choices
    logprobs = legacy_logprobs(choice)
    generated = list(b"HelloH")
    assert choice.text == "HelloH" and logprobs.tokens == list("HelloH")
    assert logprobs.token_logprobs == [echo_logprob(t, 5 + n) for n, t in enumerate(generated)]
    assert logprobs.top_logprobs == [_greedy(t, 5 + n, 2) for n, t in enumerate(generated)]
    assert logprobs.text_offset == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("max_tokens", [1, 0])
async def test_echo_scores_a_text_as_lm_eval_harness_asks(
    start_engines: EngineFactory, aclient: openai.AsyncOpenAI, max_tokens: int
) -> None:
    """lm-eval's ``local-completions`` loglikelihood: a batch of token-id prompts (context then
    continuation), ``echo``, ``logprobs: 1``, ``max_tokens: 1``; it sums ``token_logprobs[ctxlen:-1]``
    and calls a continuation greedy when each token's logprob equals its position's best."""
    await start_engines(2)
    prompts = [list(b"The cat"), list(b"A dog ran")]
    completion = await aclient.completions.create(
        model=ECHO, prompt=prompts, echo=True, logprobs=1, max_tokens=max_tokens, temperature=0, seed=1234
    )
    for choice, prompt in zip(sorted(completion.choices, key=lambda c: c.index), prompts, strict=True):
        extra = list(prompt[:max_tokens])  # the echo engine's first generated token is the prompt's first
        logprobs = legacy_logprobs(choice)
        assert choice.text == bytes(prompt + extra).decode()
        expected = [None] + [echo_logprob(t, p) for p, t in enumerate(prompt)][1:]
        expected += [echo_logprob(t, len(prompt) + n) for n, t in enumerate(extra)]
        assert logprobs.token_logprobs == expected and logprobs.tokens == [chr(t) for t in prompt + extra]
        end = len(logprobs.tokens) - max_tokens  # lm-eval's [ctxlen:-1] with one token generated
        scored, tops = logprobs.token_logprobs[3:end], logprobs.top_logprobs[3:end]
        assert all(top is not None and logprob == max(top.values()) for logprob, top in zip(scored, tops, strict=True))
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 2 * max_tokens and completion.usage.prompt_tokens == 7 + 9


async def test_chat_logprobs_streamed_add_up_to_the_response(
    start_engines: EngineFactory, aclient: openai.AsyncOpenAI
) -> None:
    await start_engines(1)
    body: dict[str, Any] = {
        "model": ECHO,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 5,
        "logprobs": True,
        "top_logprobs": 2,
    }
    chat = await aclient.chat.completions.create(**body)
    [choice] = chat.choices
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    prompt = len(CHAT_PROMPT)
    assert [(entry.token, entry.bytes) for entry in content] == [(chr(t), [t]) for t in CHAT_PROMPT[:5]]
    assert [entry.logprob for entry in content] == [echo_logprob(t, prompt + n) for n, t in enumerate(CHAT_PROMPT[:5])]
    for entry in content:
        assert [(top.token, top.logprob) for top in entry.top_logprobs] == [
            (entry.token, entry.logprob),
            (chr(ord(entry.token) + 1), entry.logprob - 1 / 8),
        ]
    stream = await aclient.chat.completions.create(**body, stream=True)
    streamed = [
        entry
        async for chunk in stream
        if chunk.choices[0].logprobs is not None
        for entry in chunk.choices[0].logprobs.content or []
    ]
    assert [entry.model_dump() for entry in streamed] == [entry.model_dump() for entry in content]


async def test_a_stop_string_cut_from_the_text_takes_its_tokens_logprobs(
    start_engines: EngineFactory, aclient: openai.AsyncOpenAI
) -> None:
    await start_engines(1)
    completion = await aclient.completions.create(
        model=ECHO, prompt="Hello world", max_tokens=20, stop=["wor"], logprobs=0
    )
    [choice] = completion.choices
    assert (choice.text, choice.finish_reason) == ("Hello ", "stop")
    assert legacy_logprobs(choice).tokens == list("Hello ")
    stream = await aclient.completions.create(
        model=ECHO, prompt="Hello world", max_tokens=20, stop=["wor"], logprobs=0, stream=True
    )
    chunks = [chunk.choices[0] async for chunk in stream if chunk.choices]
    assert "".join(c.text for c in chunks) == "Hello "
    assert [t for c in chunks for t in legacy_logprobs(c).tokens] == list("Hello ")
    assert [o for c in chunks for o in legacy_logprobs(c).text_offset] == list(range(6))


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"logprobs_mode": "sampled"}, "logprobs_mode"),
        ("/v1/chat/completions", {"top_logprobs": 1}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
async def test_logprob_fields_out_of_bounds_are_400_by_name(
    start_engines: EngineFactory, gateway: Served, path: str, extra: dict[str, object], param: str
) -> None:
    await start_engines(1)
    body = {"model": ECHO, "max_tokens": 2} | (
        {"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"prompt": "Hi"}
    )
    response = await http(gateway.port, "POST", path, body | extra)
    assert response.status == 400 and response.json()["error"]["param"] == param, response.body


async def test_processed_mode_reaches_the_engine(start_engines: EngineFactory, gateway: Served) -> None:
    """``logprobs_mode`` is an extension field; the echo engine's values do not depend on it."""
    await start_engines(1)
    body = {"model": ECHO, "prompt": "ab", "max_tokens": 1, "logprobs": 0, "logprobs_mode": "processed"}
    response = await http(gateway.port, "POST", "/v1/completions", body)
    assert response.status == 200 and response.json()["choices"][0]["logprobs"]["token_logprobs"] == [
        echo_logprob(ord("a"), 2)
    ]
