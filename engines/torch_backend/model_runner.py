"""The device side of the torch backend: the one owner of the model, its rotary table, the KV
cache and the decode CUDA graphs (nano-vllm's ``ModelRunner``).

A step's forward pass is two calls. :meth:`ModelRunner.prepare` turns the scheduled step into
the pass's inputs: a decode-only step that fits a graph bucket (CUDA) stages the graph's inputs
(:mod:`engines.torch_backend.cuda_graphs`), any other step builds its batch
(:mod:`engines.torch_backend.batch`). It reads the sequences' tokens and pages, so it runs under
the request table's lock. :meth:`ModelRunner.forward` then runs the pass, outside the lock, and
returns the logits on the device. ``earlier``, in both: the sampled ids of the step still in
flight, which the decode rows feed (the overlap scheduler, :mod:`engines.torch_backend.placeholders`).

The cache and the graphs come and go together: :meth:`release` frees them (suspend, close),
:meth:`restore` allocates the cache again and captures the graphs anew (they hold its address);
the execution path follows. New weights are copied into the parameters in place
(:meth:`swap_weights`), so the graphs stay valid.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from engines.backend import ExecutionPath
from engines.torch_backend.batch import build_batch
from engines.torch_backend.cuda_graphs import DecodeGraphs
from engines.torch_backend.decode_rows import GraphInputs
from engines.torch_backend.fast_path import capture_graphs, execution_path
from engines.torch_backend.memory import allocate_cache
from engines.torch_backend.model import DecoderModel, ForwardBatch
from engines.torch_backend.placeholders import decode_sources
from engines.torch_backend.scheduler import ScheduledBatch
from engines.torch_backend.sequence import Sequence
from engines.torch_backend.weight_update import StagedWeights, stage_checkpoint, swap_in


@dataclass(slots=True)
class ForwardInputs:
    """One step's prepared inputs: an eager ``batch``, or a graph ``replay`` whose decode rows
    feed rows ``sources`` of the step in flight (None: row ``i`` from row ``i``)."""

    batch: ForwardBatch | None
    replay: GraphInputs | None
    sources: list[int] | None


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        rotary: torch.Tensor,
        kv_cache: torch.Tensor,
        failures: list[str],
        *,
        device: torch.device,
        dtype: torch.dtype,
        max_batch: int,
        max_context: int,
        block_size: int,
        cuda_graphs: bool,
    ) -> None:
        self.model = model
        self.device, self.dtype = device, dtype
        self._rotary = rotary
        self._kv_cache: torch.Tensor | None = kv_cache
        self._cache_shape = tuple(kv_cache.shape)
        self._scratch_slot = (kv_cache.shape[1] - 1) * block_size  # the first slot of the last page
        self._failures = failures  # fast-path pieces that failed to build, graph capture included
        self._max_batch, self._block_size = max_batch, block_size
        self._group_size = model.config.group_size  # query heads per key-value head
        self._sliding_window = model.config.sliding_window  # None: attention sees every key
        self._pages = -(-max_context // block_size)  # the most pages a sequence holds
        self._use_graphs = cuda_graphs and self.device.type == "cuda" and model.kernels.paged_decode is not None
        self._graphs = self._capture_graphs()
        self._path = self._execution_path()

    @property
    def rotary(self) -> torch.Tensor:
        return self._rotary

    @property
    def kv_cache(self) -> torch.Tensor | None:
        """None while released (suspended, closed)."""
        return self._kv_cache

    @property
    def graphs(self) -> DecodeGraphs | None:
        """None when decode runs eagerly (not CUDA, graphs off or failed, or released)."""
        return self._graphs

    @property
    def path(self) -> ExecutionPath:
        """The path decode runs: while released, the one it ran and runs again once restored."""
        return self._path

    def on_device(self) -> contextlib.AbstractContextManager[object]:
        """A worker thread's current CUDA device is the first until set: make it the engine's."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def prepare(self, scheduled: ScheduledBatch, grown: list[Sequence], earlier: torch.Tensor | None) -> ForwardInputs:
        """Under the request table's lock: the step's inputs (``grown``: the sequences the
        scheduler gave a page this step; ``earlier``: the sampled ids of the step in flight)."""
        graphs = self._graphs
        decode = scheduled.decode
        replay = (
            graphs.inputs(decode, grown, earlier is not None)
            if graphs and not scheduled.prefill and graphs.fits(len(decode))
            else None
        )
        if graphs is not None and replay is not None:
            sources = None if earlier is None or graphs.rows_reused else decode_sources(decode)
            return ForwardInputs(None, replay, sources)
        if graphs is not None:
            graphs.forget_rows()
        batch = build_batch(
            scheduled,
            self._block_size,
            self._group_size,
            self.dtype,
            self.device,
            self.model.kernels.paged_decode is not None,
            earlier,
            self._sliding_window,
            self._scratch_slot,
        )
        return ForwardInputs(batch, None, None)

    def forward(self, inputs: ForwardInputs, earlier: torch.Tensor | None) -> torch.Tensor:
        """Logits ``[rows, vocab]`` on the device, by graph replay or an eager pass."""
        if inputs.replay is not None:
            graphs = self._graphs
            assert graphs is not None, "a replay is prepared only with graphs"
            return graphs.replay(inputs.replay, earlier, inputs.sources)
        cache = self._kv_cache
        assert inputs.batch is not None and cache is not None, "an eager step has its batch and a cache"
        return self.model(inputs.batch, self._rotary, cache)

    def release(self) -> None:
        """Free the KV cache and the graphs that hold its address."""
        self._kv_cache = None
        self._graphs = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def restore(self) -> ExecutionPath:
        """Allocate the KV cache again (zeroed) and capture the graphs on it; the path they give."""
        if self._kv_cache is None:
            self._kv_cache = allocate_cache(self._cache_shape, self.dtype, self.device)
            self._graphs = self._capture_graphs()
            self._path = self._execution_path()
        return self._path

    def stage_weights(self, path: Path) -> StagedWeights:
        return stage_checkpoint(self.model, self.dtype, path)

    def swap_weights(self, staged: StagedWeights) -> None:
        swap_in(self.model, staged)

    def _capture_graphs(self) -> DecodeGraphs | None:
        if not self._use_graphs or self._kv_cache is None:
            return None
        with self.on_device():
            return capture_graphs(
                self.model,
                self._rotary,
                self._kv_cache,
                self._max_batch,
                self._pages,
                self._block_size,
                self._failures,
            )

    def _execution_path(self) -> ExecutionPath:
        return execution_path(self.device, self.model.kernels, self._graphs is not None, self._failures)
