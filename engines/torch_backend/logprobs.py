"""Log-probabilities from the logits a step already holds: no second forward pass.

For the rows of a step whose requests asked for them, on the device:

- raw: a log-softmax of the row's logits, a gather at the sampled token and the top k;
- processed: the log of the distribution the token was drawn from
  (:class:`~engines.torch_backend.sampling.Draw`: after temperature, top-k and top-p), normalised,
  at the token's rank, and its first k entries (it is sorted already); a greedy row's is the
  one-hot at its token, which needs no device work (0.0, the token alone);
- prompt logprobs: the raw ones over the logits of every prompt position of a prefill that asked
  (the model returns those rows after the sampling rows, :mod:`engines.torch_backend.batch`),
  gathered at the next prompt token.

Only the asking rows are computed, and only k + 1 floats and k ids per token are copied to the
host: one tensor of each per kind, their copies started beside the sampled ids' (non-blocking on
CUDA) and read with them in the step's collect. A raw logprob is floored at
:data:`LOGPROB_FLOOR` (finite, for JSON); a processed alternative of probability 0 (outside
top-k or top-p) is left out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.backend import PromptLogprobs
from engines.torch_backend.request_state import RequestState
from engines.torch_backend.sampling import Draw
from service.protocol.messages import TopLogprob

LOGPROB_FLOOR = -9999.0
_NEVER = float("-inf")  # a processed alternative's logprob outside the distribution drawn from
RowLogprobs = tuple[float, list[TopLogprob]]  # a sampled token's logprob and its alternatives


@dataclass(slots=True)
class RowsAsking:
    """The rows of a step whose requests asked for generated logprobs, built once per set of
    rows (``StepRows``): computed raw (``raw``), from the distribution drawn from (``drawn``),
    or the one-hot of a greedy row in processed mode (``one_hot``); each batch row with its k."""

    raw: list[tuple[int, int]]
    drawn: list[tuple[int, int]]
    one_hot: list[tuple[int, int]]

    @classmethod
    def of(cls, states: list[RequestState]) -> RowsAsking | None:
        raw: list[tuple[int, int]] = []
        drawn: list[tuple[int, int]] = []
        one_hot: list[tuple[int, int]] = []
        for row, state in enumerate(states):
            request = state.request
            if request.logprobs is None:
                continue
            kind = raw if request.logprobs_mode == "raw" else drawn if request.temperature > 0 else one_hot
            kind.append((row, request.logprobs))
        return cls(raw, drawn, one_hot) if raw or drawn or one_hot else None


@dataclass(slots=True)
class LaunchedLogprobs:
    """A step's logprobs on their way to the host (pinned, copied without blocking, on CUDA)."""

    asking: RowsAsking | None
    values: torch.Tensor | None  # [R, 1 + K]: each raw, then drawn row's token logprob, then its alternatives'
    ids: torch.Tensor | None  # [R, K]: the alternatives' ids
    prompts: list[RequestState]  # the prefills whose prompt rows these are, in row order
    prompt_values: torch.Tensor | None  # [E, 1 + K']
    prompt_ids: torch.Tensor | None  # [E, K']


def launch_logprobs(
    logits: torch.Tensor, sampled: Draw, batch: int, asking: RowsAsking | None, prompts: list[RequestState]
) -> LaunchedLogprobs:
    """The step's logprobs on the device: ``logits`` ``[batch + E, vocab]`` holds the sampling
    rows, then the prompt rows of ``prompts`` (each prefill's positions 0 .. P-2)."""
    values = ids = prompt_values = prompt_ids = None
    if asking is not None and (asking.raw or asking.drawn):
        computed: list[tuple[torch.Tensor, torch.Tensor]] = []
        top = max(k for _, k in asking.raw + asking.drawn)
        if asking.raw:
            rows = _index([row for row, _ in asking.raw], logits)
            computed.append(_raw(logits, rows, sampled.tokens.index_select(0, rows), top))
        if asking.drawn:
            computed.append(_processed(sampled, _index([row for row, _ in asking.drawn], logits), top))
        values = torch.cat([value for value, _ in computed]) if len(computed) > 1 else computed[0][0]
        ids = torch.cat([index for _, index in computed]) if len(computed) > 1 else computed[0][1]
    if prompts:
        targets = [
            token for state in prompts for token in state.sequence.token_ids[1 : state.sequence.num_prompt_tokens]
        ]
        rows = torch.arange(batch, batch + len(targets), device=logits.device)
        top = max(state.request.prompt_logprobs or 0 for state in prompts)
        prompt_values, prompt_ids = _raw(logits, rows, _index(targets, logits), top)
    return LaunchedLogprobs(asking, values, ids, prompts, prompt_values, prompt_ids)


def _index(rows: list[int], logits: torch.Tensor) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)


def _raw(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[R, 1 + k]`` floats (the token's logprob, then the top k) and ``[R, k]`` ids of the
    log-softmax of ``logits`` at ``rows``; ``tokens``: each row's token."""
    logprobs = torch.log_softmax(logits.index_select(0, rows), dim=-1).clamp_(min=LOGPROB_FLOOR)
    chosen = logprobs.gather(1, tokens[:, None])
    best, best_ids = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)
    return torch.cat((chosen, best), dim=1), best_ids


def _processed(sampled: Draw, rows: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`_raw`, of the distribution each row's token was drawn from (sorted already)."""
    assert sampled.sorted_probs is not None and sampled.order is not None and sampled.rank is not None
    probs = sampled.sorted_probs.index_select(0, rows)
    logprobs = probs.log() - probs.sum(dim=-1, keepdim=True).log()
    chosen = logprobs.gather(1, sampled.rank.index_select(0, rows)[:, None])
    width = min(top, logprobs.shape[-1])
    return torch.cat((chosen, logprobs[:, :width]), dim=1), sampled.order.index_select(0, rows)[:, :width]


def to_host(launched: LaunchedLogprobs) -> None:
    """On CUDA: start the copies into pinned host memory, without blocking (the step's event
    fires once they are done)."""

    def copy(tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None:
            return None
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return host.copy_(tensor, non_blocking=True)

    launched.values, launched.ids = copy(launched.values), copy(launched.ids)
    launched.prompt_values, launched.prompt_ids = copy(launched.prompt_values), copy(launched.prompt_ids)


def read_rows(launched: LaunchedLogprobs, tokens: list[int]) -> dict[int, RowLogprobs]:
    """After the step's sync: each asking batch row's token logprob and alternatives."""
    asking = launched.asking
    if asking is None:
        return {}
    values = launched.values.tolist() if launched.values is not None else []
    ids = launched.ids.tolist() if launched.ids is not None else []
    out: dict[int, RowLogprobs] = {}
    for position, (row, k) in enumerate(asking.raw):
        out[row] = (values[position][0], list(zip(ids[position][:k], values[position][1 : k + 1], strict=True)))
    for position, (row, k) in enumerate(asking.drawn, start=len(asking.raw)):
        alternatives = zip(ids[position][:k], values[position][1 : k + 1], strict=True)
        out[row] = (values[position][0], [(token, lp) for token, lp in alternatives if lp != _NEVER])
    for row, k in asking.one_hot:
        out[row] = (0.0, [(tokens[row], 0.0)] if k else [])
    return out


def read_prompts(launched: LaunchedLogprobs) -> list[tuple[RequestState, PromptLogprobs]]:
    """After the step's sync: each prefill's prompt logprobs (the first token's is None)."""
    if not launched.prompts or launched.prompt_values is None or launched.prompt_ids is None:
        return []
    values, ids = launched.prompt_values.tolist(), launched.prompt_ids.tolist()
    out = []
    start = 0
    for state in launched.prompts:
        sequence = state.sequence
        count = sequence.num_prompt_tokens - 1
        k = state.request.prompt_logprobs or 0
        rows = range(start, start + count)
        start += count
        logprobs: list[float | None] = [None, *(values[row][0] for row in rows)]
        top: list[list[TopLogprob] | None] | None = None
        if k:
            top = [None, *([*zip(ids[row][:k], values[row][1 : k + 1], strict=True)] for row in rows)]
        out.append((state, PromptLogprobs(sequence.token_ids[: sequence.num_prompt_tokens], logprobs, top)))
    return out
