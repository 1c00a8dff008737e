"""CUDA graphs of the decode step, captured once per padded batch size.

A decode step of a small model is a few hundred short kernels; launched one by one from
Python, the GPU spends most of the step waiting for the next launch. A CUDA graph records
the whole forward pass once and replays it with one launch. A graph's shapes and addresses
are fixed, so:

- it is captured per batch bucket (:func:`decode_buckets`: 1, 2, 4, 8, then every 16 up to
  ``max_batch``); a step runs the smallest bucket that holds its sequences;
- its inputs live in static buffers (token ids, positions, cache slots, block tables,
  sequence lengths) that each step overwrites before the replay, copied from pinned host
  mirrors. Rows past the step's
  sequences are padding: they read and write only the scratch page (the cache's last page,
  which the block manager never hands out);
- attention must not depend on the context length's shape: it is the paged decode kernel,
  whose loop bounds are read from the lengths buffer on the device; a mixture-of-experts
  layer must not read its routing on the host: its experts are the grouped ones
  (:func:`~engines.torch_backend.experts.grouped_experts`);
- the graphs hold the KV cache's address: they are captured again after the cache is
  reallocated (resume).

Only decode-only steps replay a graph; steps with a prefill run eagerly. The logits stay on
the device: the step samples from them, and reading the sampled ids is its only host sync.
"""

from __future__ import annotations

import numpy as np
import torch

from engines.torch_backend.decode_rows import DecodeRows, GraphInputs
from engines.torch_backend.experts import loop_experts
from engines.torch_backend.model import AttentionGroup, DecoderModel, ForwardBatch
from engines.torch_backend.placeholders import resolve_on_device
from engines.torch_backend.sequence import Sequence


def decode_buckets(max_batch: int) -> list[int]:
    """Batch sizes a graph is captured for, ascending, the last one ``max_batch``."""
    sizes = [size for size in (1, 2, 4, 8) if size < max_batch]
    sizes += range(16, max_batch, 16)
    return [*sizes, max_batch]


class _Mirror:
    """Host copies of the static buffers, pinned on CUDA: a copy from pageable memory with
    ``non_blocking`` is staged through a driver buffer and synchronous in effect. Two mirrors
    alternate, and a mirror is rewritten only once its last copy is done (``copied``)."""

    def __init__(self, largest: int, max_pages: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.longs = torch.zeros((3, largest), dtype=torch.long, pin_memory=pin)
        self.lengths = torch.ones(largest, dtype=torch.int32, pin_memory=pin)
        self.tables = torch.zeros((largest, max_pages), dtype=torch.int32, pin_memory=pin)
        self.longs_np, self.lengths_np, self.tables_np = self.longs.numpy(), self.lengths.numpy(), self.tables.numpy()
        # Recorded after each copy from this mirror; reused, as creating one costs a few µs.
        self.copied = torch.cuda.Event(blocking=True) if pin else None
        self.pending = False


class StaticDecodeBatch:
    """The buffers a decode graph reads: ``largest`` rows, block tables ``max_pages`` wide.
    Each step overwrites the rows of its bucket; table columns past a row's pages keep stale
    values that the kernel never reads (it stops at the row's length)."""

    def __init__(self, largest: int, max_pages: int, block_size: int, scratch_page: int, device: torch.device) -> None:
        self.longs = torch.zeros((3, largest), dtype=torch.long, device=device)
        self.longs[2].fill_(scratch_page * block_size)
        self.lengths = torch.ones(largest, dtype=torch.int32, device=device)
        self.tables = torch.full((largest, max_pages), scratch_page, dtype=torch.int32, device=device)
        self.last = torch.arange(largest, device=device)
        self._mirrors = [_Mirror(largest, max_pages, device), _Mirror(largest, max_pages, device)]
        self._turn = 0
        # Per bucket size and mirror, the (device, host) views a step copies: slicing a tensor
        # costs microseconds, so each view is made once. Tables are copied whole rows wide.
        self._copies: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        # What the last tables copy wrote: its rows and the array they came from (kept alive).
        self._tables_size = 0
        self._tables_rows: np.ndarray | None = None

    def batch(self, size: int) -> ForwardBatch:
        group = AttentionGroup(self.tables[:size], None, query_len=1, context_lens=self.lengths[:size])
        return ForwardBatch(
            self.longs[0, :size], self.longs[1, :size], self.longs[2, :size], self.last[:size], group, ()
        )

    def _views(self, size: int, turn: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        views = self._copies.get((size, turn))
        if views is None:
            mirror = self._mirrors[turn]
            views = self._copies[size, turn] = [
                (self.longs[:, :size], mirror.longs[:, :size]),
                (self.lengths[:size], mirror.lengths[:size]),
                (self.tables[:size], mirror.tables[:size]),
            ]
        return views

    def load(self, inputs: GraphInputs) -> None:
        """Stage ``inputs`` in a pinned mirror and start its copy to the device (stream-ordered
        before the replay that reads it)."""
        turn = self._turn
        self._turn ^= 1
        mirror = self._mirrors[turn]
        if mirror.copied is not None and mirror.pending:
            mirror.copied.synchronize()
        size = inputs.size
        mirror.longs_np[:, :size] = inputs.longs
        np.add(inputs.longs[1], 1, out=mirror.lengths_np[:size])
        longs, lengths, tables = self._views(size, turn)
        longs[0].copy_(longs[1], non_blocking=True)
        lengths[0].copy_(lengths[1], non_blocking=True)
        rows = inputs.tables.base  # the DecodeRows array the device's tables would come from
        if inputs.tables_changed or size != self._tables_size or rows is not self._tables_rows:
            mirror.tables_np[:size, : inputs.tables.shape[1]] = inputs.tables
            tables[0].copy_(tables[1], non_blocking=True)
            self._tables_size, self._tables_rows = size, rows
        if mirror.copied is not None:
            mirror.copied.record()
            mirror.pending = True


class DecodeGraphs:
    def __init__(
        self,
        model: DecoderModel,
        rotary: torch.Tensor,
        kv_cache: torch.Tensor,
        max_batch: int,
        max_pages: int,
        block_size: int,
    ) -> None:
        if model.kernels.paged_decode is None:
            raise ValueError("decode graphs need the paged decode kernel: gathered attention has per-step shapes")
        if model.config.moe is not None and model.kernels.moe_experts is loop_experts:
            raise ValueError("decode graphs need the grouped MoE experts: the per-expert loop syncs with the host")
        self.buckets = decode_buckets(max_batch)
        self.block_size = block_size
        self.scratch_page = kv_cache.shape[1] - 1
        self._model, self._rotary, self._kv_cache = model, rotary, kv_cache
        self._static = StaticDecodeBatch(self.buckets[-1], max_pages, block_size, self.scratch_page, kv_cache.device)
        self._rows = DecodeRows(self.buckets[-1], max_pages, block_size, self.scratch_page)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self._views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # ids, logits
        self._bucket_of = [next(bucket for bucket in self.buckets if bucket >= count) for count in range(max_batch + 1)]
        self._capture()

    @torch.inference_mode()
    def _capture(self) -> None:
        """Largest bucket first, all in one memory pool: a smaller graph reuses the larger's memory."""
        pool = None
        for size in reversed(self.buckets):
            batch = self._static.batch(size)
            # Outside the capture: the first run compiles and autotunes, the second runs what
            # the first left cached (lazy initialisations, allocator pools) as the capture will.
            for _ in range(2):
                self._model(batch, self._rotary, self._kv_cache)
            torch.cuda.synchronize(self._kv_cache.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[size] = self._model(batch, self._rotary, self._kv_cache)
            pool = graph.pool() if pool is None else pool
            self._graphs[size] = graph
        torch.cuda.synchronize(self._kv_cache.device)

    def fits(self, count: int) -> bool:
        return 0 < count <= self.buckets[-1]

    def inputs(self, sequences: list[Sequence], grown: list[Sequence], ids_on_device: bool = False) -> GraphInputs:
        """The step's inputs, read from the sequences (call under the scheduler's lock);
        ``grown``: those the scheduler gave a page since the last step; ``ids_on_device``: the
        token ids come from the step in flight (:meth:`replay`'s ``previous``)."""
        count = len(sequences)
        size = self._bucket_of[count]
        self._rows.update(sequences, grown, size, ids_on_device)
        return self._rows.inputs(size, count)

    @property
    def rows_reused(self) -> bool:
        """Whether the last :meth:`inputs` kept the rows of the step before, in order."""
        return self._rows.reused

    def forget_rows(self) -> None:
        """A step ran eagerly: the next graph step rewrites its rows from the sequences."""
        self._rows.forget()

    def replay(
        self, inputs: GraphInputs, previous: torch.Tensor | None = None, sources: list[int] | None = None
    ) -> torch.Tensor:
        """Logits ``[count, vocab]`` (float32, on the device) of the step ``inputs`` describe;
        with a step in flight, the rows' input ids are its sampled ids ``previous``, from its
        rows ``sources`` (None: row ``i`` from row ``i``)."""
        self._static.load(inputs)
        size, count = inputs.size, inputs.count
        views = self._views.get((size, count))
        if views is None:  # slicing a tensor costs microseconds: each view is made once
            views = self._views[size, count] = (self._static.longs[0, :count], self._logits[size][:count])
        if previous is not None:
            resolve_on_device(views[0], previous, sources)
        self._graphs[size].replay()
        return views[1]


__all__ = ["DecodeGraphs", "GraphInputs", "StaticDecodeBatch", "decode_buckets"]
