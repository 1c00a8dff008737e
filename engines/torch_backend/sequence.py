"""One request's tokens and the cache pages that hold their keys and values, free of torch.

The KV cache is pages of ``block_size`` token slots. A sequence owns a block table (the pages
holding its tokens in order); token ``i`` lives in slot
``block_table[i // block_size] * block_size + i % block_size``.

A step being launched feeds a sequence's uncached tokens and samples the next one on the
device: :func:`feed` records that at once with :data:`PLACEHOLDER` in the token's place, so
the next step can be scheduled (lengths, pages, positions) before the token is read back; the
step's collect writes it in once it is (``engines/torch_backend/step_phases.py``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

PLACEHOLDER = -1  # a token sampled on the device and not yet read back: never fed as itself


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    HELD = "held"  # by backpressure: no pages, not scheduled until released
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """The tokens of one request and where their keys and values live.

    ``num_cached`` tokens have keys and values in the cache; a step feeds the rest
    (``token_ids[num_cached:]``) and samples the token that follows them. ``page_hashes``
    are the chained content hashes of the sequence's leading full pages, computed as needed
    by the block manager; ``num_committed`` of its pages are known to the prefix cache.

    ``limit``: the length at which the request ends whatever its tokens (``max_tokens``, the
    context), so a step whose token reaches it is the last one scheduled. ``pending_row``: the
    row of the step in flight whose sampled token the trailing placeholder is. ``preempted``:
    the scheduler's preemption count when this sequence last lost its pages; a step launched
    before that drops its token. ``prompt_logits``: the request asked for prompt logprobs and
    has not got them yet, so its prefill reuses no cached prefix and returns the logits of every
    prompt position (:attr:`prompt_rows_due`).
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_cached: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    page_hashes: list[bytes] = field(default_factory=list)
    num_committed: int = 0
    limit: int = 1 << 62
    pending_row: int = -1
    preempted: int = 0
    prompt_logits: bool = False

    @classmethod
    def from_prompt(
        cls, request_id: str, prompt: list[int], generated: list[int] | None = None, limit: int = 1 << 62
    ) -> Sequence:
        """``generated``: tokens an earlier run of the request generated (a migration); they are
        prefilled with the prompt and count as generated."""
        return cls(request_id, [*prompt, *(generated or ())], len(prompt), limit=limit)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_new(self) -> int:
        """Tokens the next step feeds."""
        return len(self.token_ids) - self.num_cached

    @property
    def prompt_rows_due(self) -> bool:
        """The step being prepared feeds its whole prompt and returns the logits of positions
        0 .. P-2 as well (its prompt logprobs): read before :func:`feed` caches its tokens."""
        return self.prompt_logits and self.num_cached == 0

    def drop_placeholder(self) -> None:
        """The step in flight will not give this sequence its token (it was preempted)."""
        if self.token_ids and self.token_ids[-1] == PLACEHOLDER:
            self.token_ids.pop()

    def slot(self, position: int, block_size: int) -> int:
        return self.block_table[position // block_size] * block_size + position % block_size


def feed(sequences: list[Sequence]) -> list[int]:
    """A step being launched as rows ``sequences`` feeds their uncached tokens: those are cached
    from now on, and the token it samples for row ``i`` follows them as a placeholder, whose row
    the sequence keeps (``pending_row``). Returns the placeholders' positions. One loop for the
    step: it runs for every row of every step."""
    positions: list[int] = []
    keep = positions.append
    for row, sequence in enumerate(sequences):
        token_ids = sequence.token_ids
        position = sequence.num_cached = len(token_ids)
        token_ids.append(PLACEHOLDER)
        sequence.pending_row = row
        keep(position)
    return positions
