"""The host side of a persistent decode batch, as vLLM's persistent batch keeps it.

A CUDA graph step needs, per row, the token it feeds, its position, the cache slot its key and
value go to and its block table. Built from the sequences each step, that is several Python
lists of ``B`` items and a ``B x pages`` table converted to arrays: about 2 ms at batch 256.
:class:`DecodeRows` keeps those arrays (numpy) from one step to the next instead: row ``i``
holds the ``i``-th decode sequence. A step with the same sequences in the same order as the
last one (most decode steps: the scheduler keeps its running list in order) moves every
position on by one, takes each row's new token and writes only the block tables of the
sequences the scheduler just gave a page (``Scheduler.grown``); slots are then one vectorised
lookup. Any other step (a request joined, finished or was preempted, or the last step ran
eagerly, which :meth:`forget` records) rewrites every row. Free of torch, so it is tested
against the from-scratch build on CPU (tests/torch/test_torch_host_path.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engines.torch_backend.sequence import Sequence


@dataclass(slots=True)
class GraphInputs:
    """One step's inputs on the host, padded to the bucket ``size``: rows past ``count`` feed
    token 0 at position 0 into the scratch page and read only that slot (length 1). The arrays
    may be views of a :class:`DecodeRows`, valid until its next update."""

    size: int
    count: int
    longs: np.ndarray  # [3, size] int64: token ids, positions, cache slots
    tables: np.ndarray  # [size, width] int32
    tables_changed: bool = True  # False: the same tables as the step before, already on the device

    @classmethod
    def of(cls, sequences: list[Sequence], size: int, block_size: int, scratch_page: int) -> GraphInputs:
        """The decode inputs of ``sequences`` (read under the scheduler's lock), built from scratch."""
        pages = max((len(sequence.block_table) for sequence in sequences), default=1)
        rows = DecodeRows(size, pages, block_size, scratch_page)
        rows.update(sequences, [], size)
        return rows.inputs(size, len(sequences))


class DecodeRows:
    def __init__(self, largest: int, max_pages: int, block_size: int, scratch_page: int) -> None:
        self.block_size = block_size
        self.scratch_page = scratch_page
        # [3, largest]: token ids, positions, cache slots (the graph's long inputs, in its order).
        self.longs = np.zeros((3, largest), dtype=np.int64)
        self.tables = np.full((largest, max_pages), scratch_page, dtype=np.int32)
        self.width = 1  # table columns in use: the longest row's pages
        self.reused = False  # whether the last update kept the rows (else it rewrote them)
        self.tables_changed = True  # whether the last update wrote any block table entry
        self._rows: list[Sequence] = []
        self._row_of: dict[Sequence, int] = {}
        self._size = 0
        self._first_length = 0  # tokens of the first row's sequence at the last update
        self._all_rows = np.arange(largest)
        self._views: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def forget(self) -> None:
        """The next step rewrites every row: the last one did not go through :meth:`update`."""
        self._rows = []

    def update(self, sequences: list[Sequence], grown: list[Sequence], size: int, ids_on_device: bool = False) -> None:
        """The rows of a decode step of ``sequences`` (read under the scheduler's lock), padded to
        the bucket ``size`` with rows that feed token 0 at position 0 into the scratch page.
        ``grown``: the sequences given a page since the last step. ``ids_on_device``: the rows'
        token ids are copied on the device from the step in flight (placeholders here), so kept
        rows leave them unwritten.

        Kept rows rely on the scheduler's page rule: a sequence's position enters a new page
        exactly when the scheduler gives it that page, so every other row's slot is the next
        one in its page."""
        if (
            sequences
            and size == self._size
            and sequences == self._rows  # identity, row by row, in C: Sequence compares by identity
            and len(sequences[0].token_ids) == self._first_length + 1
        ):
            self._first_length += 1
            self.reused = True
            self.tables_changed = bool(grown)
            count = len(sequences)
            self.longs[1:, :count] += 1  # positions and slots
            if not ids_on_device:
                self.longs[0, :count] = [sequence.token_ids[-1] for sequence in sequences]
            slots, block_size, width = self.longs[2], self.block_size, self.width
            for sequence in grown:
                row, table, position = self._row_of[sequence], sequence.block_table, len(sequence.token_ids) - 1
                self.tables[row, : len(table)] = table
                self.width = max(self.width, len(table))
                slots[row] = table[position // block_size] * block_size + position % block_size
            self.tables[count:size, width : self.width] = self.scratch_page  # padding rows, new columns
            return
        self.reused = False
        self.tables_changed = True
        self._rewrite(sequences, size)

    def inputs(self, size: int, count: int) -> GraphInputs:
        """Views of the rows :meth:`update` wrote last (made once per shape: slicing costs)."""
        views = self._views.get((size, self.width))
        if views is None:
            views = self._views[size, self.width] = (self.longs[:, :size], self.tables[:size, : self.width])
        return GraphInputs(size, count, views[0], views[1], self.tables_changed)

    def _rewrite(self, sequences: list[Sequence], size: int) -> None:
        self._rows = list(sequences)
        self._row_of = {sequence: row for row, sequence in enumerate(sequences)}
        self._size = size
        self._first_length = len(sequences[0].token_ids) if sequences else 0
        count = len(sequences)
        token_ids, positions = self.longs[0], self.longs[1]
        token_ids[:count] = [sequence.token_ids[-1] for sequence in sequences]
        positions[:count] = [len(sequence.token_ids) - 1 for sequence in sequences]
        self.width = max((len(sequence.block_table) for sequence in sequences), default=1)
        for row, sequence in enumerate(sequences):
            self.tables[row, : len(sequence.block_table)] = sequence.block_table
        token_ids[count:size] = 0
        positions[count:size] = 0
        self.tables[count:size, : self.width] = self.scratch_page
        pages = self.tables[self._all_rows[:size], positions[:size] // self.block_size].astype(np.int64)
        self.longs[2, :size] = pages * self.block_size + positions[:size] % self.block_size
