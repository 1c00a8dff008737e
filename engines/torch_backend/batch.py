"""Turns a scheduled step into the model's input tensors.

Host-side bookkeeping (which token goes to which cache slot, which pages a sequence reads)
is gathered into Python lists and sent to the device in one small transfer per tensor;
masks are built on the device: a query sees the cached slots at or before its position and,
with a ``sliding_window`` W, only the last W of those (its own included), as transformers'
sliding-window mask. Decode groups for the paged kernel carry lengths instead of a mask (the
kernel applies the window itself). Prefills are attended in groups of like query lengths
(:func:`prefill_groups`), their rows packed group by group; ``last_token_index`` keeps the
order of the scheduled sequences whatever the packing. With a step in flight (``previous``), the decode rows'
input ids are its sampled ids, copied on the device (:mod:`engines.torch_backend.placeholders`). A prefill whose
prompt logprobs are due (``Sequence.prompt_rows_due``) also has the rows of its positions
0 .. P-2 in ``last_token_index``, after every sequence's sampling row, in the order of the
sequences: the model returns their logits too.
"""

from __future__ import annotations

import torch

from engines.torch_backend.model import AttentionGroup, ForwardBatch
from engines.torch_backend.placeholders import decode_sources, resolve_on_device
from engines.torch_backend.scheduler import ScheduledBatch
from engines.torch_backend.sequence import Sequence


def _long(values: list[int] | list[list[int]], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def _int32(values: list[int] | list[list[int]], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)


def _block_tables(sequences: list[Sequence]) -> tuple[list[list[int]], int]:
    """Page tables padded with page 0 (masked out) to the longest."""
    width = max(len(sequence.block_table) for sequence in sequences)
    return [sequence.block_table + [0] * (width - len(sequence.block_table)) for sequence in sequences], width


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where attention is allowed, -inf elsewhere: built once per step, not once per layer."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def build_batch(
    scheduled: ScheduledBatch,
    block_size: int,
    group_size: int,
    dtype: torch.dtype,
    device: torch.device,
    paged_decode: bool = False,
    previous: torch.Tensor | None = None,
    sliding_window: int | None = None,
    scratch_slot: int | None = None,
) -> ForwardBatch:
    """``scratch_slot``: where a fed token whose page the prefix cache holds already (a prompt
    read whole from the cache feeds its last token) writes its keys and values; a slot of the
    cache's scratch page, needed only with prefix caching."""
    groups = prefill_groups(scheduled.prefill)
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    first_rows: dict[int, int] = {}  # id(sequence) -> the row of its first new token
    for sequence in [*scheduled.decode, *(sequence for group in groups for sequence in group)]:
        first_rows[id(sequence)] = len(input_ids)
        shared = sequence.num_committed * block_size  # positions in pages others may read: never written
        for position in range(sequence.num_cached, len(sequence.token_ids)):
            input_ids.append(sequence.token_ids[position])
            positions.append(position)
            if position >= shared:
                slots.append(sequence.slot(position, block_size))
            elif scratch_slot is None:
                raise RuntimeError(
                    f"request_id={sequence.request_id}: a cached page's token is fed without a scratch slot"
                )
            else:
                slots.append(scratch_slot)
    last: list[int] = []
    prompt_rows: list[int] = []
    for sequence in scheduled.sequences:
        first = first_rows[id(sequence)]
        last.append(first + sequence.num_new - 1)
        if sequence.prompt_rows_due:
            prompt_rows.extend(range(first, first + sequence.num_prompt_tokens - 1))
    ids = _long(input_ids, device)
    if previous is not None and scheduled.decode:  # decode rows first, one input id each
        resolve_on_device(ids[: len(scheduled.decode)], previous, decode_sources(scheduled.decode))
    return ForwardBatch(
        input_ids=ids,
        positions=_long(positions, device),
        slot_mapping=_long(slots, device),
        last_token_index=_long(last + prompt_rows if prompt_rows else last, device),
        decode=None
        if not scheduled.decode
        else (
            _paged_decode_group(scheduled.decode, device)
            if paged_decode
            else _decode_group(scheduled.decode, block_size, dtype, device, sliding_window)
        ),
        prefill=tuple(_prefill_group(group, block_size, group_size, dtype, device, sliding_window) for group in groups),
    )


def prefill_groups(sequences: list[Sequence]) -> list[list[Sequence]]:
    """The prefills in attention groups, each padded to its longest query: longest first, a group
    closing before a query shorter than half of its first, so padding at most doubles a query.
    (One group for a step that prefills a long prompt beside siblings feeding a page each
    would pad every sibling to the prompt's length.)"""
    groups: list[list[Sequence]] = []
    for sequence in sorted(sequences, key=lambda sequence: sequence.num_new, reverse=True):
        if groups and 2 * sequence.num_new >= groups[-1][0].num_new:
            groups[-1].append(sequence)
        else:
            groups.append([sequence])
    return groups


def _decode_group(
    sequences: list[Sequence], block_size: int, dtype: torch.dtype, device: torch.device, window: int | None
) -> AttentionGroup:
    tables, width = _block_tables(sequences)
    context = _long([len(sequence.token_ids) for sequence in sequences], device)
    keys = torch.arange(width * block_size, device=device)
    allowed = keys[None, :] < context[:, None]
    if window is not None:
        allowed &= keys[None, :] >= context[:, None] - window
    mask = _additive(allowed.view(len(sequences), 1, 1, -1), dtype)
    return AttentionGroup(_long(tables, device), mask, query_len=1)


def _paged_decode_group(sequences: list[Sequence], device: torch.device) -> AttentionGroup:
    tables, _ = _block_tables(sequences)
    lengths = _int32([len(sequence.token_ids) for sequence in sequences], device)
    return AttentionGroup(_int32(tables, device), None, query_len=1, context_lens=lengths)


def _prefill_group(
    sequences: list[Sequence],
    block_size: int,
    group_size: int,
    dtype: torch.dtype,
    device: torch.device,
    window: int | None,
) -> AttentionGroup:
    """Queries padded to the longest prefill; a padded query sits at position 0 so that its
    (discarded) softmax row is never empty. A query sees the cached slots at or before it."""
    tables, width = _block_tables(sequences)
    query_len = max(sequence.num_new for sequence in sequences)
    pad_index: list[int] = []
    query_positions: list[list[int]] = []
    for row, sequence in enumerate(sequences):
        pad_index.extend(range(row * query_len, row * query_len + sequence.num_new))
        own = list(range(sequence.num_cached, len(sequence.token_ids)))
        query_positions.append(own + [0] * (query_len - len(own)))
    # Folded rows are (head in group, query): repeat positions once per head of the group.
    folded = _long(query_positions, device).repeat(1, group_size)
    keys = torch.arange(width * block_size, device=device)
    allowed = keys[None, None, :] <= folded[:, :, None]
    if window is not None:
        allowed &= keys[None, None, :] > folded[:, :, None] - window
    mask = _additive(allowed.unsqueeze(1), dtype)
    return AttentionGroup(_long(tables, device), mask, query_len, _long(pad_index, device))
