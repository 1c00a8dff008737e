"""Input ids resolved on the device: the overlap scheduler's placeholders (SGLang's overlap
scheduler, vLLM's async scheduling).

With steps launched ahead, step n + 1 is scheduled and launched before step n's sampled ids
are read back: each decode row of step n + 1 feeds the token step n samples for it, which the
host only knows as :data:`~engines.torch_backend.sequence.PLACEHOLDER`. The row's input id is
copied on the device from step n's output tensor instead, stream-ordered after the sampler
that writes it, so the host never waits for step n's tokens before launching step n + 1.
Every decode row then holds such a placeholder: every running sequence was in step n (as a
decode or a prefill row), and a preempted one dropped its placeholder.
"""

from __future__ import annotations

import torch

from engines.torch_backend.sequence import Sequence


def decode_sources(decode: list[Sequence]) -> list[int] | None:
    """Each decode row's row in the step in flight; None when row ``i`` is row ``i`` there
    (most steps: the same sequences in the same order), which needs no index on the device."""
    sources = [sequence.pending_row for sequence in decode]
    return None if sources == list(range(len(sources))) else sources


def resolve_on_device(ids: torch.Tensor, previous: torch.Tensor, sources: list[int] | None) -> None:
    """Overwrite ``ids`` ``[count]`` (the decode rows' input ids, on the device) with the ids
    ``previous`` ``[rows]`` (the step in flight's sampled ids) holds for them."""
    if sources is None:
        count = ids.shape[0]
        ids.copy_(previous if previous.shape[0] == count else previous[:count], non_blocking=True)
        return
    index = torch.tensor(sources, dtype=torch.long).to(previous.device, non_blocking=True)
    ids.copy_(previous.index_select(0, index), non_blocking=True)
