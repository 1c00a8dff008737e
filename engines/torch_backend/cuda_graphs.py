"""CUDA graphs of the decode step, captured once per padded batch size.

A decode step of a small model is a few hundred short kernels; launched one by one from
Python, the GPU spends most of the step waiting for the next launch. A CUDA graph records
the whole forward pass once and replays it with one launch. A graph's shapes and addresses
are fixed, so:

- it is captured per batch bucket (:func:`decode_buckets`: 1, 2, 4, 8, then every 16 up to
  ``max_batch``); a step runs the smallest bucket that holds its sequences;
- its inputs live in static buffers (token ids, positions, cache slots, block tables,
  sequence lengths) that each step overwrites before the replay. Rows past the step's
  sequences are padding: they read and write only the scratch page (the cache's last page,
  which the block manager never hands out);
- attention must not depend on the context length's shape: it is the paged decode kernel,
  whose loop bounds are read from the lengths buffer on the device;
- the graphs hold the KV cache's address: they are captured again after the cache is
  reallocated (resume).

Only decode-only steps replay a graph; steps with a prefill run eagerly. The logits stay on
the device: the step samples from them, and reading the sampled ids is its only host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.torch_backend.model import AttentionGroup, ForwardBatch, LlamaModel
from engines.torch_backend.sequence import Sequence


def decode_buckets(max_batch: int) -> list[int]:
    """Batch sizes a graph is captured for, ascending, the last one ``max_batch``."""
    sizes = [size for size in (1, 2, 4, 8) if size < max_batch]
    sizes += range(16, max_batch, 16)
    return [*sizes, max_batch]


@dataclass(slots=True)
class GraphInputs:
    """One step's inputs on the host, padded to the bucket ``size``."""

    size: int
    count: int
    longs: torch.Tensor  # [3, size]: token ids, positions, cache slots
    lengths: torch.Tensor  # [size] int32
    tables: torch.Tensor  # [size, width] int32


class DecodeGraphs:
    def __init__(self, model: LlamaModel, rotary: torch.Tensor, kv_cache: torch.Tensor, max_batch: int,
                 max_pages: int, block_size: int) -> None:
        if model.kernels.paged_decode is None:
            raise ValueError("decode graphs need the paged decode kernel: gathered attention has per-step shapes")
        device = kv_cache.device
        self.buckets = decode_buckets(max_batch)
        self.block_size = block_size
        self.scratch_page = kv_cache.shape[1] - 1
        largest = self.buckets[-1]
        self._model, self._rotary, self._kv_cache = model, rotary, kv_cache
        self._longs = torch.zeros((3, largest), dtype=torch.long, device=device)
        self._longs[2].fill_(self.scratch_page * block_size)
        self._lengths = torch.ones(largest, dtype=torch.int32, device=device)
        self._tables = torch.full((largest, max_pages), self.scratch_page, dtype=torch.int32, device=device)
        self._last = torch.arange(largest, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self._capture()

    def _batch(self, size: int) -> ForwardBatch:
        group = AttentionGroup(self._tables[:size], None, query_len=1, context_lens=self._lengths[:size])
        return ForwardBatch(self._longs[0, :size], self._longs[1, :size], self._longs[2, :size], self._last[:size], group, None)

    @torch.inference_mode()
    def _capture(self) -> None:
        """Largest bucket first, all in one memory pool: a smaller graph reuses the larger's memory."""
        pool = None
        for size in reversed(self.buckets):
            batch = self._batch(size)
            self._model(batch, self._rotary, self._kv_cache)  # compiles and autotunes outside the capture
            torch.cuda.synchronize(self._kv_cache.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[size] = self._model(batch, self._rotary, self._kv_cache)
            pool = graph.pool() if pool is None else pool
            self._graphs[size] = graph
        torch.cuda.synchronize(self._kv_cache.device)

    def fits(self, count: int) -> bool:
        return 0 < count <= self.buckets[-1]

    def inputs(self, sequences: list[Sequence]) -> GraphInputs:
        """The step's inputs, read from the sequences (call under the scheduler's lock)."""
        count = len(sequences)
        size = next(bucket for bucket in self.buckets if bucket >= count)
        block_size, scratch = self.block_size, self.scratch_page
        padding = size - count
        token_ids = [sequence.token_ids[-1] for sequence in sequences] + [0] * padding
        positions = [len(sequence.token_ids) - 1 for sequence in sequences]
        slots = [sequence.slot(position, block_size) for sequence, position in zip(sequences, positions, strict=True)]
        lengths = [position + 1 for position in positions] + [1] * padding
        width = max(len(sequence.block_table) for sequence in sequences)
        tables = [sequence.block_table + [scratch] * (width - len(sequence.block_table)) for sequence in sequences]
        tables += [[scratch] * width] * padding
        longs = torch.tensor([token_ids, positions + [0] * padding, slots + [scratch * block_size] * padding], dtype=torch.long)
        return GraphInputs(size, count, longs, torch.tensor(lengths, dtype=torch.int32), torch.tensor(tables, dtype=torch.int32))

    def replay(self, inputs: GraphInputs) -> torch.Tensor:
        """Logits ``[count, vocab]`` (float32, on the device) of the step ``inputs`` describe."""
        size = inputs.size
        self._longs[:, :size].copy_(inputs.longs, non_blocking=True)
        self._lengths[:size].copy_(inputs.lengths, non_blocking=True)
        self._tables[:size, : inputs.tables.shape[1]].copy_(inputs.tables, non_blocking=True)
        self._graphs[size].replay()
        return self._logits[size][: inputs.count]
