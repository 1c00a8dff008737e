"""The chaos suite with torch engines (issue 19's last row): 3 coordinator replicas, 2 torch
engines running the built-in random model on CPU, and the gateway, as processes; streamed chat
completions through the official ``openai`` SDK while a replica is SIGKILLed and restarted, an
engine is SIGKILLed and nats-server restarts with its store, all in one run.

A torch engine's text cannot be computed the way the echo engine's is, so the suite first runs
each of :data:`CASES` distinct requests once with no fault, greedy and with EOS ignored (so each
ends at ``max_tokens``): that stream's text is the reference. A stream under the faults must
give exactly its case's reference: a migrated stream continues on the other engine from the
tokens already streamed (greedy decoding continues exactly; tests/torch/test_torch_migration.py),
and a resubmitted one runs again from the start. A stream that differs counts as corrupt.

Every fifth stream asks for log-probabilities, through the client library
(tests/faults/chaos_load.py): its final must carry each token's within 1e-4 of the reference
run's (read through the client library too), and each token first among its alternatives (a
migrated run computes the tokens after the cut in one prefill instead of decode steps, and the
batch around a request changes the last bits: tests/torch/test_torch_migration.py and
benchmarks/logprob_numerics.py measure both).

The outcomes are those of tests/faults/chaos_load.py; the line is printed and added to the
terminal summary. Targets: 0 corrupt, 0 hung, 0 broken, clear errors at most 1 %.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

import pytest

from service.client import DpcoordClient
from service.protocol.messages import ChatMessage
from tests.faults.chaos import ChaosStack
from tests.faults.chaos_load import (
    LOGPROBS_EVERY,
    LOGPROBS_K,
    Logprobs,
    StreamCase,
    kill_an_engine,
    kill_and_restart_a_replica,
    report,
    restart_nats,
    run_load,
)

pytest.importorskip("torch")

pytestmark = [pytest.mark.faults, pytest.mark.timeout(240)]

MODEL = "dpcoord-random"
TORCH_ENGINE = (
    "--backend",
    "torch",
    "--cpu-threads",
    "1",
    "--max-batch",
    "64",
    "--max-context",
    "256",
    "--kv-cache-gb",
    "0.05",
)
CASES = 40
STREAMS = 400
IN_FLIGHT = 100
GREEDY_NO_EOS: dict[str, Any] = {"temperature": 0.0, "ignore_eos": True}
TOLERANCE = 1e-4  # logprobs against the reference run's


def case_of(index: int, expected: str = "", logprobs: Sequence[float] | None = None) -> StreamCase:
    """Request ``index % CASES``: a distinct prompt and a length of 48 to 127 tokens (asking for
    log-probabilities every :data:`LOGPROBS_EVERY`-th one, when the reference's are given)."""
    number = index % CASES
    asked = None if logprobs is None or index % LOGPROBS_EVERY else Logprobs(logprobs, None, TOLERANCE)
    return StreamCase(f"torch chaos case {number:03d}", 48 + number * 2, expected, GREEDY_NO_EOS, MODEL, asked)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosStack]:
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    chaos = ChaosStack(tmp_path_factory.mktemp("chaos-torch"), engines=2, engine_args=TORCH_ENGINE).start()
    try:
        yield chaos
    finally:
        chaos.close()


async def reference_texts(stack: ChaosStack) -> dict[int, str]:
    """Each case's text from a run with no fault, read as the suite reads every stream."""
    import openai

    texts: dict[int, str] = {}
    async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused") as client:
        for number in range(CASES):
            case = case_of(number)
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": case.content}],
                max_tokens=case.max_tokens,
                stream=True,
                extra_body=dict(GREEDY_NO_EOS),
            )
            parts: list[str] = []
            finish: str | None = None
            async for chunk in stream:
                for choice in chunk.choices:
                    parts.append(choice.delta.content or "")
                    finish = choice.finish_reason or finish
            assert finish == "length", f"case {number}: a reference run ended {finish!r}"
            texts[number] = "".join(parts)
    return texts


async def reference_logprobs(stack: ChaosStack, texts: dict[int, str]) -> dict[int, list[float]]:
    """The token logprobs of the cases that ask for them, from a run with no fault through the
    client library (its text must be the reference's)."""
    numbers = [number for number in range(CASES) if number % LOGPROBS_EVERY == 0]
    async with await DpcoordClient.connect(stack.settings) as client:
        finals = await asyncio.gather(
            *(
                client.submit(
                    messages=[ChatMessage("user", case_of(number).content)],
                    model=MODEL,
                    max_tokens=case_of(number).max_tokens,
                    logprobs=LOGPROBS_K,
                    timeout=120,
                    **GREEDY_NO_EOS,
                )
                for number in numbers
            )
        )
    for number, final in zip(numbers, finals, strict=True):
        assert final.generated_text == texts[number] and final.token_logprobs is not None, f"case {number}"
    return {number: final.token_logprobs or [] for number, final in zip(numbers, finals, strict=True)}


async def test_torch_streams_stay_exact_through_faults(stack: ChaosStack, chaos_report: list[str]) -> None:
    await stack.heal(timeout_s=90.0)
    texts = await reference_texts(stack)
    logprobs = await reference_logprobs(stack, texts)
    faults = [partial(fault, stack) for fault in (kill_and_restart_a_replica, kill_an_engine, restart_nats)]
    tally = await run_load(
        stack,
        "torch: replica + engine + nats-server",
        STREAMS,
        faults,
        IN_FLIGHT,
        lambda _scenario, index: case_of(index, texts[index % CASES], logprobs.get(index % CASES)),
    )
    await report(stack, tally, chaos_report)
