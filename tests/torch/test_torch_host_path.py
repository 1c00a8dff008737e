"""The host side of a decode step, kept from step to step (``DecodeRows``) and staged into the
static buffers a CUDA graph reads (``StaticDecodeBatch.load``, on CPU tensors), against the same
inputs built from scratch (``GraphInputs.of``) over a real scheduler's life: requests joining,
decoding across page boundaries, finishing and being preempted; and the incremental
detokeniser against decoding everything at once."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engines.torch_backend.block_manager import BlockManager
from engines.torch_backend.cuda_graphs import StaticDecodeBatch, decode_buckets
from engines.torch_backend.decode_rows import DecodeRows, GraphInputs
from engines.torch_backend.placeholders import decode_sources
from engines.torch_backend.scheduler import Scheduler
from engines.torch_backend.sequence import PLACEHOLDER, Sequence, SequenceStatus, feed
from engines.torch_backend.tokenizer import ByteTokenizer, IncrementalDetokenizer
from tests.torch.reference import record_token

BLOCK = 4


def same_inputs(kept: GraphInputs, fresh: GraphInputs, sequences: list[Sequence]) -> None:
    assert (kept.size, kept.count) == (fresh.size, fresh.count)
    np.testing.assert_array_equal(kept.longs, fresh.longs)
    for row, sequence in enumerate(sequences):  # columns past a row's pages are never read
        pages = len(sequence.block_table)
        np.testing.assert_array_equal(kept.tables[row, :pages], fresh.tables[row, :pages])
    width = fresh.tables.shape[1]  # a padding row reads column 0 only; the rest is scratch too
    np.testing.assert_array_equal(kept.tables[len(sequences) :, :width], fresh.tables[len(sequences) :])


@pytest.mark.parametrize("seed", range(4))
def test_rows_kept_between_steps_equal_rows_built_from_scratch(seed: int) -> None:
    draw = random.Random(seed)
    num_blocks, max_batch = 48, 8
    scheduler = Scheduler(BlockManager(num_blocks, BLOCK, prefix_caching=True), max_batch, max_prefill_tokens=64)
    scratch = num_blocks
    rows = DecodeRows(max_batch, num_blocks, BLOCK, scratch)
    static = StaticDecodeBatch(max_batch, num_blocks, BLOCK, scratch, torch.device("cpu"))
    buckets = decode_buckets(max_batch)
    graph_steps = kept_steps = 0
    for step in range(300):
        if draw.random() < 0.15:
            prompt = [draw.randrange(256) for _ in range(draw.randrange(1, 12))]
            scheduler.add(Sequence.from_prompt(f"s{step}", prompt))
        scheduled = scheduler.schedule()
        if not scheduled:
            continue
        if scheduled.prefill:
            rows.forget()  # as the backend does when a step runs eagerly
        else:
            decode = scheduled.decode
            size = next(bucket for bucket in buckets if bucket >= len(decode))
            rows.update(decode, scheduler.grown, size)
            fresh = GraphInputs.of(decode, size, BLOCK, scratch)
            same_inputs(rows.inputs(size, len(decode)), fresh, decode)
            static.load(rows.inputs(size, len(decode)))  # what a replay reads, tables copied only when changed
            staged = GraphInputs(size, len(decode), static.longs[:, :size].numpy(), static.tables[:size].numpy())
            same_inputs(staged, fresh, decode)
            np.testing.assert_array_equal(static.lengths[:size].numpy(), fresh.longs[1] + 1)
            graph_steps += 1
            kept_steps += rows.reused
        for sequence in scheduled.sequences:
            record_token(sequence, draw.randrange(256), scheduler.blocks)
            if sequence.num_generated >= draw.randrange(8, 40):
                scheduler.remove(sequence)
    assert graph_steps > 100 and kept_steps > 50  # both paths ran, the kept one most


@pytest.mark.parametrize("seed", range(3))
def test_rows_launched_ahead_equal_rows_built_from_scratch(seed: int) -> None:
    """The overlap scheduler's flow: each step is launched (placeholders fed) before the step
    before it is read back. Kept rows leave the token ids to the device; their positions,
    slots and tables equal a build from scratch, and each row's source in the step in flight
    is its own row whenever the rows are kept."""
    draw = random.Random(seed)
    num_blocks, max_batch = 48, 8
    scheduler = Scheduler(BlockManager(num_blocks, BLOCK, prefix_caching=True), max_batch, max_prefill_tokens=64)
    rows = DecodeRows(max_batch, num_blocks, BLOCK, num_blocks)
    buckets = decode_buckets(max_batch)
    in_flight: list[tuple[Sequence, int]] = []
    kept_steps = 0
    for step in range(300):
        if draw.random() < 0.15:
            prompt = [draw.randrange(256) for _ in range(draw.randrange(1, 12))]
            scheduler.add(Sequence.from_prompt(f"s{step}", prompt, limit=len(prompt) + draw.randrange(4, 40)))
        scheduled = scheduler.schedule()
        if scheduled and scheduled.prefill:
            rows.forget()
        elif scheduled:
            decode = scheduled.decode
            size = next(bucket for bucket in buckets if bucket >= len(decode))
            rows.update(decode, scheduler.grown, size, ids_on_device=bool(in_flight))
            kept = rows.inputs(size, len(decode))
            fresh = GraphInputs.of(decode, size, BLOCK, num_blocks)
            np.testing.assert_array_equal(kept.longs[1:], fresh.longs[1:])
            for row, sequence in enumerate(decode):
                np.testing.assert_array_equal(kept.tables[row, : len(sequence.block_table)], sequence.block_table)
            if in_flight:
                assert all(sequence.token_ids[-1] == PLACEHOLDER for sequence in decode)
                sources = decode_sources(decode)
                assert sources is None or not rows.reused
                expected = [next(r for r, (s, _) in enumerate(in_flight) if s is sequence) for sequence in decode]
                assert (sources or list(range(len(decode)))) == expected
            kept_steps += rows.reused
        positions = feed(scheduled.sequences) if scheduled else []
        for sequence, position in in_flight:  # the step before is read back after this one launched
            if sequence.status is SequenceStatus.RUNNING and sequence.token_ids[position] == PLACEHOLDER:
                sequence.token_ids[position] = draw.randrange(256)
                if position + 1 >= sequence.limit:
                    scheduler.remove(sequence)
        in_flight = list(zip(scheduled.sequences, positions, strict=True)) if scheduled else []
    assert kept_steps > 50


def test_a_sequence_that_skipped_a_graph_step_is_rewritten() -> None:
    """Same rows, but a step ran eagerly in between (one more token each): rebuilt, not shifted."""
    sequences = [Sequence.from_prompt("a", [1, 2, 3]), Sequence.from_prompt("b", [4, 5])]
    for index, sequence in enumerate(sequences):
        sequence.block_table = [index * 4, index * 4 + 1]
    rows = DecodeRows(4, 8, BLOCK, 7)
    rows.update(sequences, [], 2)
    for sequence in sequences:
        record_token(sequence, 9)
        record_token(sequence, 10)
    rows.update(sequences, [], 2)
    same_inputs(rows.inputs(2, 2), GraphInputs.of(sequences, 2, BLOCK, 7), sequences)


def test_incremental_detokenising_equals_decoding_all_at_once() -> None:
    text = "héllo wörld, ça va? 日本語 🙂 done"
    tokens = list(text.encode())
    tokenizer = ByteTokenizer()
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    pieces = [detokenizer.push(token) for token in tokens]
    assert "".join(pieces) + detokenizer.flush() == text
    assert all("\ufffd" not in piece for piece in pieces)  # a character is emitted whole
