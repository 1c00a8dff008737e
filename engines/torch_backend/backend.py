"""The torch backend: a Llama-family model served with continuous batching.

Glue in the nano-vllm shape: requests in and out (``add``, ``abort``), memory (suspend, resume),
weight updates and the profiler. A step (:mod:`engines.torch_backend.step_phases`: launch →
collect → emit, steps launched ahead on CUDA) runs in a worker thread, so the event loop never
waits on torch.
"""

from __future__ import annotations

import asyncio
import collections.abc
import contextlib
import logging
import tempfile
import threading
from pathlib import Path

import torch

from engines.backend import Backend, ExecutionPath, GenerationRequest, PrefixCacheStats, TokenOutput
from engines.chat_template import plain_prompt
from engines.torch_backend.block_manager import BlockManager
from engines.torch_backend.cuda_graphs import DecodeGraphs
from engines.torch_backend.fast_path import (
    LoadPhases,
    capture_graphs,
    execution_path,
    possible_path,
    require_fast,
)
from engines.torch_backend.kernels import Kernels
from engines.torch_backend.loading import load_model
from engines.torch_backend.memory import (
    allocate_cache,
)
from engines.torch_backend.options import TorchOptions
from engines.torch_backend.profiler import StepProfiler
from engines.torch_backend.request_state import RequestState
from engines.torch_backend.sampling import request_key
from engines.torch_backend.scheduler import Scheduler
from engines.torch_backend.sequence import Sequence
from engines.torch_backend.setup import resolve_device
from engines.torch_backend.step_phases import StepPhases
from engines.torch_backend.step_records import Launched, StepRows
from engines.torch_backend.tokenizer import (
    IncrementalDetokenizer,
)
from engines.torch_backend.weight_update import StagedWeights, stage_checkpoint, swap_in
from service.protocol.errors import ErrorCode, WireError
from service.protocol.messages import ChatMessage

log = logging.getLogger(__name__)


class TorchBackend(StepPhases, Backend):
    name = "torch"
    max_context: int  # set from the model and the KV cache; the runtime holds max_tokens to it

    def __init__(self, options: TorchOptions, model_path: str | None = None) -> None:
        self.options = options
        self.device = resolve_device(options.device)
        if self.device.type == "cpu" and options.cpu_threads is not None:
            torch.set_num_threads(options.cpu_threads)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # kernels launch on the current device; steps set it per thread
        if options.require_fast_path:  # before loading anything when the options alone rule it out
            require_fast(possible_path(self.device, options.cuda_graphs, options.torch_compile))
        self.load_phases = phases = LoadPhases()
        loaded = load_model(options, model_path, self.device, phases)
        self.config, self.dtype, self.model, self.tokenizer = (
            loaded.config,
            loaded.dtype,
            loaded.model,
            loaded.tokenizer,
        )
        self.model_name, self.default_model_name = loaded.model_name, loaded.default_model_name
        self.chat_template = loaded.chat_template
        self._rotary, self._failures = loaded.rotary, loaded.failures
        self.max_context = loaded.max_context
        self._cache_shape = loaded.cache_shape
        self._kv_cache: torch.Tensor | None = loaded.kv_cache
        plan, page = loaded.plan, loaded.page_bytes
        self._use_graphs = options.cuda_graphs and self.device.type == "cuda" and self.kernels.paged_decode is not None
        self._graphs: DecodeGraphs | None = self._capture_graphs()
        phases.done("graph capture")
        self._path = execution_path(self.device, self.kernels, self._graphs is not None, self._failures)
        if options.require_fast_path:
            require_fast(self._path)
        self.scheduler = Scheduler(
            BlockManager(plan.num_blocks, options.kv_block_size, options.prefix_caching),
            options.max_batch,
            options.max_prefill_tokens,
        )
        self._overlap = options.overlap_steps if options.overlap_steps is not None else self.device.type == "cuda"

        self._requests: dict[str, RequestState] = {}
        self._launched: Launched | None = None
        self._rows = StepRows()
        self._lock = threading.Lock()  # scheduler and request table: step thread vs add/abort on the loop
        self._step_lock = asyncio.Lock()  # step, suspend and resume never overlap
        self.profiler = StepProfiler(self.device, Path(options.profile_dir or tempfile.gettempdir()))
        log.info(
            "torch backend: %s, %.1f M parameters, %s on %s (%d CPU threads), context %d, KV cache %s; %s; "
            "decode %s; path %s; prefix caching %s; steps %s; loaded in %s",
            self.model_name,
            sum(p.numel() for p in self.model.parameters()) / 1e6,
            self.dtype,
            self.device,
            torch.get_num_threads(),
            self.max_context,
            plan.describe(page),
            self.kernels.describe(),
            "replays CUDA graphs" if self._graphs else "runs eagerly",
            self._path.describe(),
            "on" if options.prefix_caching else "off",
            "overlapped" if self._overlap else "one at a time",
            phases.describe(),
        )

    @property
    def kernels(self) -> Kernels:
        return self.model.kernels

    @property
    def graphs(self) -> DecodeGraphs | None:
        return self._graphs

    @property
    def launches_ahead(self) -> bool:
        return self._overlap

    def execution_path(self) -> ExecutionPath:
        """The path decode runs: while suspended, the one it ran and resumes on."""
        return self._path

    def _capture_graphs(self) -> DecodeGraphs | None:
        if not self._use_graphs or self._kv_cache is None:
            return None
        pages = -(-self.max_context // self.options.kv_block_size)
        with self._on_device():
            return capture_graphs(
                self.model,
                self._rotary,
                self._kv_cache,
                self.options.max_batch,
                pages,
                self.options.kv_block_size,
                self._failures,
            )

    # ------------------------------------------------------------ requests

    def render_chat(self, messages: collections.abc.Sequence[ChatMessage]) -> str | list[int]:
        """The model's chat template, tokenised without adding special tokens (the template writes
        them, as transformers' ``apply_chat_template`` does); the plain fallback without one."""
        if self.chat_template is None:
            return plain_prompt(messages)
        return self.tokenizer.encode(self.chat_template.render(messages), add_special_tokens=False)

    def add(self, request: GenerationRequest) -> int:
        prompt = self.tokenizer.encode(request.prompt) if isinstance(request.prompt, str) else list(request.prompt)
        if not prompt:
            raise WireError(ErrorCode.MALFORMED, "the prompt is empty: the model needs at least one token")
        resume = list(request.resume_tokens)
        vocab = self.config.vocab_size
        outside = next((token for token in (*prompt, *resume) if token >= vocab), None)
        if outside is not None:
            raise WireError(ErrorCode.MALFORMED, f"token id {outside} is outside the vocabulary (0..{vocab - 1})")
        if resume and len(prompt) + len(resume) >= self.max_context:
            raise WireError(
                ErrorCode.TOO_LARGE,
                f"prompt and resume tokens ({len(prompt)} + {len(resume)}) leave no room in the context of {self.max_context} tokens",
            )
        if len(prompt) >= self.max_context:
            raise WireError(
                ErrorCode.TOO_LARGE,
                f"prompt of {len(prompt)} tokens does not fit the context of {self.max_context} tokens (at most {self.max_context - 1})",
            )
        # Unseeded requests draw from their request id's stream, which a migrated run keeps.
        key = request_key(request.seed if request.seed is not None else request.request_id)
        state = RequestState(
            request,
            Sequence.from_prompt(
                request.request_id,
                prompt,
                resume,
                limit=self.max_context,  # and max_tokens: RequestState bounds it
            ),
            key,
            IncrementalDetokenizer(self.tokenizer, prompt),
        )
        state.resume(resume)
        with self._lock:
            if request.request_id in self._requests:
                raise WireError(ErrorCode.CONFLICT, f"request {request.request_id} is already running")
            self.scheduler.add(state.sequence)
            self._requests[request.request_id] = state
        return len(prompt)

    def resumed_text(self, request_id: str) -> str:
        with self._lock:
            return self._requests[request_id].resumed_text

    def abort(self, request_id: str) -> bool:
        with self._lock:
            state = self._requests.pop(request_id, None)
            if state is None:
                return False
            self.scheduler.remove(state.sequence)
            return True

    def has_work(self) -> bool:
        return self._kv_cache is not None and (self._launched is not None or self.scheduler.has_work())

    def waiting_requests(self) -> int:
        return len(self.scheduler.waiting)

    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.scheduler.blocks.stats()

    # ------------------------------------------------------------ steps

    async def step(self) -> list[TokenOutput]:
        async with self._step_lock:
            return await asyncio.to_thread(self._step)

    def _on_device(self) -> contextlib.AbstractContextManager[object]:
        """A worker thread's current CUDA device is the first until set: make it the engine's."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _step(self) -> list[TokenOutput]:
        with self._on_device():
            return self._step_on_device()

    # ------------------------------------------------------------ memory

    async def suspend(self) -> None:
        """Free the KV cache; running requests go back to the queue and are recomputed on resume."""
        async with self._step_lock:
            self._drop_launched()
            with self._lock:
                self.scheduler.drop_cache()
                self._kv_cache = None
                self._graphs = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            log.info("torch backend suspended: KV cache released, %d requests kept for recompute", len(self._requests))

    async def resume(self) -> None:
        async with self._step_lock:
            if self._kv_cache is None:
                self._kv_cache = await asyncio.to_thread(allocate_cache, self._cache_shape, self.dtype, self.device)
                self._graphs = await asyncio.to_thread(self._capture_graphs)
                self._path = execution_path(self.device, self.kernels, self._graphs is not None, self._failures)
                log.info("torch backend resumed: KV cache reallocated; path %s", self._path.describe())

    # ------------------------------------------------------------ weight updates (engines/torch_backend/weight_update.py)

    async def quiesce(self) -> None:
        async with self._step_lock:
            if self.device.type == "cuda":
                await asyncio.to_thread(torch.cuda.synchronize, self.device)

    def stage_weights(self, path: Path) -> object:
        return stage_checkpoint(self.model, self.dtype, path)

    async def swap_weights(self, staged: object) -> None:
        """A step launched ahead is dropped (its tokens are sampled again with the new weights),
        and the KV cache is dropped with every prefix in it: running requests are recomputed."""
        async with self._step_lock:
            await asyncio.to_thread(self._swap, staged)

    def _swap(self, staged: object) -> None:
        if not isinstance(staged, StagedWeights):
            raise TypeError(f"swap_weights takes what stage_weights returned, not {type(staged).__name__}")
        with self._on_device():
            self._drop_launched()
            swap_in(self.model, staged)
            with self._lock:
                self.scheduler.drop_cache()
        log.info("torch backend: weights swapped, %d requests to recompute", len(self._requests))

    # ------------------------------------------------------------ profiler

    def start_profiler(self) -> str:
        return self.profiler.start()

    def stop_profiler(self) -> str:
        return self.profiler.stop()

    async def close(self) -> None:
        async with self._step_lock:
            self.profiler.close()
            self._drop_launched()
            with self._lock:
                self._requests.clear()
                self.scheduler.drop_cache()
                self._kv_cache = None
                self._graphs = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
