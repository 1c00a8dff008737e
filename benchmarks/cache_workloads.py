"""The workloads of the cache-aware routing benchmark, run through the client library (its
envelopes carry prefix hashes, ``session_id`` and ``group_id``), streamed so that each request's
time to its first token is known, and each with its ideal prefix-cache hit ratio: the share of
its prompt tokens that an earlier request already prefilled.

- **GRPO**: ``prompts`` prompts of ``length`` random tokens, ``samples`` samples of each (one
  ``group_id`` per prompt, a seed per sample), all submitted at once as one RL step does. Ideal:
  ``(samples - 1) / samples``.
- **multi-turn**: ``sessions`` conversations (one ``session_id`` each) of ``turns`` turns, run
  side by side; a session's first prompt is ``first`` random tokens, each next one the last
  prompt, the tokens generated for it and ``added`` new ones. After the first turn every session
  waits for the others (``between`` runs then: the runner reads the engines' counters, or
  restarts the coordinator). Ideal: each later turn's earlier prompt and generated tokens but
  the last (sampled, never fed), over every prompt token.
- **uniform**: ``requests`` unrelated prompts of ``length`` random tokens, ``concurrency`` in
  flight at a time. Ideal: 0.

Every prompt is drawn from ``rng`` over the random model's vocabulary (256 ids), so runs of
different policies hold different prompts and never hit on an earlier run's cache.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from service.client import DpcoordClient
from service.protocol.messages import Final, Partial

VOCABULARY = 256


@dataclass(slots=True)
class Outcome:
    """One request: where it ran, when it was submitted, got its first token and ended, and how
    many of its prompt tokens an earlier request had already prefilled."""

    engine_id: str
    submitted: float
    first_token: float
    finished: float
    prompt_tokens: int
    prefilled_before: int
    generated: list[int]


@dataclass(slots=True)
class WorkloadRun:
    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    later: list[Outcome] = field(default_factory=list)  # multi-turn: the turns after ``between``
    moved: list[int] = field(default_factory=list)  # multi-turn: per turn, sessions on another engine than before

    @property
    def ideal(self) -> float:
        return _ideal(self.outcomes)

    @property
    def later_ideal(self) -> float:
        return _ideal(self.later)


def _ideal(outcomes: list[Outcome]) -> float:
    total = sum(outcome.prompt_tokens for outcome in outcomes)
    return sum(outcome.prefilled_before for outcome in outcomes) / total if total else 0.0


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(VOCABULARY) for _ in range(length)]


async def one(
    client: DpcoordClient, prompt: list[int], max_tokens: int, prefilled_before: int = 0, **routing: Any
) -> Outcome:
    submitted = time.perf_counter()
    first = None
    final = None
    async for reply in client.stream(prompt, max_tokens=max_tokens, timeout=600, ignore_eos=True, **routing):
        if first is None and (isinstance(reply, Final) or (isinstance(reply, Partial) and reply.new_tokens)):
            first = time.perf_counter()
        if isinstance(reply, Final):
            final = reply
    if final is None or first is None or final.engine_id is None:
        raise RuntimeError("a stream ended without a final naming its engine")
    return Outcome(
        final.engine_id,
        submitted,
        first,
        time.perf_counter(),
        len(prompt),
        prefilled_before,
        list(final.generated_tokens),
    )


async def grpo(
    client: DpcoordClient, rng: random.Random, prompts: int, samples: int, length: int, max_tokens: int
) -> WorkloadRun:
    tag = uuid.uuid4().hex[:8]
    texts = [random_prompt(rng, length) for _ in range(prompts)]
    jobs = [
        one(client, text, max_tokens, length if sample else 0, group_id=f"{tag}-g{index}", seed=sample)
        for index, text in enumerate(texts)
        for sample in range(samples)
    ]
    return WorkloadRun("grpo", list(await asyncio.gather(*jobs)))


async def multi_turn(
    client: DpcoordClient,
    rng: random.Random,
    sessions: int,
    turns: int,
    first: int,
    added: int,
    max_tokens: int,
    between: Callable[[], Awaitable[None]],
) -> WorkloadRun:
    tag = uuid.uuid4().hex[:8]
    prompts = [random_prompt(rng, first) for _ in range(sessions)]
    additions = [[random_prompt(rng, added) for _ in range(turns)] for _ in range(sessions)]
    run = WorkloadRun("multi-turn", moved=[0] * turns)
    done = [0] * sessions  # tokens of each session's last prompt and generated tokens but the last
    turn_done = asyncio.Barrier(sessions + 1)

    async def session(index: int) -> None:
        prompt = prompts[index]
        engine = None
        for turn in range(turns):
            outcome = await one(client, prompt, max_tokens, done[index], session_id=f"{tag}-s{index}")
            (run.later if turn else run.outcomes).append(outcome)
            run.moved[turn] += engine is not None and outcome.engine_id != engine
            engine = outcome.engine_id
            done[index] = len(prompt) + len(outcome.generated) - 1
            prompt = [*prompt, *outcome.generated, *additions[index][turn]]
            if turn == 0:
                await turn_done.wait()
                await turn_done.wait()  # until ``between`` is over

    async def pause() -> None:
        await turn_done.wait()
        await between()
        await turn_done.wait()

    await asyncio.gather(pause(), *(session(index) for index in range(sessions)))
    run.outcomes.extend(run.later)
    return run


async def uniform(
    client: DpcoordClient, rng: random.Random, requests: int, length: int, concurrency: int, max_tokens: int
) -> WorkloadRun:
    texts = [random_prompt(rng, length) for _ in range(requests)]
    gate = asyncio.Semaphore(concurrency)

    async def gated(text: list[int]) -> Outcome:
        async with gate:
            return await one(client, text, max_tokens)

    return WorkloadRun("uniform", list(await asyncio.gather(*(gated(text) for text in texts))))
