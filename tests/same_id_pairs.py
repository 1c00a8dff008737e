"""Concurrent same-id pairs (issue 34, 1): two copies of a streamed submission with one
``client_id`` and ``client_request_id`` sent at the same moment, as raw NATS clients send them,
and what each inbox then receives.

Variants: ``same body, one inbox`` (one client sends it twice, as a client resubmitting at once
would); ``same body, two inboxes`` (two clients); ``other body, two inboxes`` (two clients, one
id, two prompts). Per pair: the runs (distinct request ids among the replies: a replayed result
keeps its run's id), and per inbox its outcome: ``final`` (the echo engine's text for its own
prompt), ``409``, ``wrong`` (another prompt's text, or an error other than 409) or ``silent``
(no terminal reply within ``wait_s``). The contract (docs/protocol.md, *Resubmission*): one run
per pair, no inbox silent, none wrong.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription

from tests.helpers import decode_reply

VARIANTS = ("same body, one inbox", "same body, two inboxes", "other body, two inboxes")


def echo_text(prompt: str, max_tokens: int) -> str:
    """What the echo engine generates for an ASCII prompt (engines/echo.py)."""
    return "".join(prompt[n % len(prompt)] for n in range(max_tokens))


@dataclass
class PairTally:
    pairs: int = 0
    runs: Counter[int] = field(default_factory=Counter)  # runs per pair -> pairs
    outcomes: Counter[str] = field(default_factory=Counter)  # per inbox

    def line(self, title: str) -> str:
        runs = ", ".join(f"{count} pairs ran {runs}x" for runs, count in sorted(self.runs.items()))
        outcomes = ", ".join(f"{kind} {count}" for kind, count in sorted(self.outcomes.items()))
        return f"{title}: {self.pairs} pairs; {runs}; inboxes: {outcomes}"

    @property
    def twice(self) -> int:
        return sum(count for runs, count in self.runs.items() if runs > 1)


async def send_pair(
    first: NATS, second: NATS, subject: str, variant: str, index: int, max_tokens: int, wait_s: float
) -> tuple[int, list[str]]:
    """One pair: its runs and each inbox's outcome."""
    client_request_id = f"pair-{index}-{uuid.uuid4().hex[:8]}"
    prompts = [f"pair {index} one ", f"pair {index} two " if variant.startswith("other") else f"pair {index} one "]
    senders = [first, first] if variant.endswith("one inbox") else [first, second]
    inboxes = [senders[0].new_inbox()] if variant.endswith("one inbox") else [nc.new_inbox() for nc in senders]
    subscriptions = [await nc.subscribe(inbox) for nc, inbox in zip(senders, inboxes, strict=False)]
    for nc, prompt, inbox in zip(senders, prompts, inboxes * 2, strict=False):
        body = {
            "prompt": prompt,
            "stream": True,
            "client_id": "pairs",
            "client_request_id": client_request_id,
            "sampling_params": {"max_tokens": max_tokens},
        }
        await nc.publish(subject, json.dumps(body).encode(), reply=inbox)
    await asyncio.gather(first.flush(), second.flush())
    read = await asyncio.gather(
        *(
            read_stream(subscription, prompt, max_tokens, wait_s)
            for subscription, prompt in zip(subscriptions, prompts, strict=False)
        )
    )
    for subscription in subscriptions:
        await subscription.unsubscribe()
    runs = set().union(*(request_ids for _, request_ids in read))
    return len(runs), [outcome for outcome, _ in read]


async def read_stream(subscription: Subscription, prompt: str, max_tokens: int, wait_s: float) -> tuple[str, set[str]]:
    """Replies until the end of the stream: the outcome for an inbox that asked for ``prompt``,
    and the request ids seen."""
    request_ids: set[str] = set()
    outcome = "silent"
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + wait_s
    while True:
        try:
            msg = await subscription.next_msg(timeout=max(0.01, give_up_at - loop.time()))
        except TimeoutError:
            return outcome, request_ids
        if not msg.data:
            return outcome, request_ids
        reply = decode_reply(msg.data)
        if reply.get("request_id"):
            request_ids.add(reply["request_id"])
        if reply["type"] == "final":
            outcome = "final" if reply["generated_text"] == echo_text(prompt, max_tokens) else "wrong"
        elif reply["type"] == "error":
            outcome = "409" if reply["error"]["code"] == 409 else "wrong"
