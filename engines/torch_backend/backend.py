"""The torch backend: a model of one of the supported families (engines/torch_backend/families)
served with continuous batching.

Thin glue in the nano-vllm shape over three parts, each the one owner of its state:

- the request table (:mod:`engines.torch_backend.request_table`): the requests by id and the
  scheduler that batches them, under the lock the step thread shares with ``add`` and ``abort``;
- the model runner (:mod:`engines.torch_backend.model_runner`): the model, the KV cache and the
  decode CUDA graphs;
- the step phases (:mod:`engines.torch_backend.step_phases`): launch → collect → emit over the
  other two, owning the step in flight (steps are launched ahead on CUDA).

The backend itself turns requests into sequences (``add``), runs each step in a worker thread
(so the event loop never waits on torch) and sequences what touches all three under its step
lock: suspend and resume, weight swaps and close. The profiler is its own.
"""

from __future__ import annotations

import asyncio
import collections.abc
import logging
import tempfile
from pathlib import Path

import torch

from engines.backend import Backend, CacheChanges, ExecutionPath, GenerationRequest, PrefixCacheStats, TokenOutput
from engines.chat_template import plain_prompt
from engines.torch_backend.block_manager import BlockManager
from engines.torch_backend.cuda_graphs import DecodeGraphs
from engines.torch_backend.fast_path import LoadPhases, possible_path, require_fast
from engines.torch_backend.kernels import Kernels
from engines.torch_backend.loading import load_model
from engines.torch_backend.model import DecoderModel
from engines.torch_backend.model_runner import ModelRunner
from engines.torch_backend.options import TorchOptions
from engines.torch_backend.profiler import StepProfiler
from engines.torch_backend.request_state import RequestState
from engines.torch_backend.request_table import RequestTable
from engines.torch_backend.sampling import request_key
from engines.torch_backend.scheduler import Scheduler
from engines.torch_backend.sequence import Sequence
from engines.torch_backend.setup import resolve_device
from engines.torch_backend.step_phases import StepPhases
from engines.torch_backend.tokenizer import IncrementalDetokenizer
from engines.torch_backend.weight_update import StagedWeights
from service.protocol.errors import ErrorCode, WireError
from service.protocol.messages import ChatMessage

log = logging.getLogger(__name__)


class TorchBackend(Backend):
    name = "torch"
    computes_logprobs = True
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
        self.config, self.dtype, self.tokenizer = loaded.config, loaded.dtype, loaded.tokenizer
        self.model_name, self.default_model_name = loaded.model_name, loaded.default_model_name
        self.chat_template = loaded.chat_template
        self.max_context = loaded.max_context
        self.runner = ModelRunner(
            loaded.model,
            loaded.rotary,
            loaded.kv_cache,
            loaded.failures,
            device=self.device,
            dtype=self.dtype,
            max_batch=options.max_batch,
            max_context=self.max_context,
            block_size=options.kv_block_size,
            cuda_graphs=options.cuda_graphs,
        )
        phases.done("graph capture")
        if options.require_fast_path:
            require_fast(self.runner.path)
        self.requests = RequestTable(
            Scheduler(
                BlockManager(loaded.plan.num_blocks, options.kv_block_size, options.prefix_caching),
                options.max_batch,
                options.max_prefill_tokens,
            )
        )
        self.steps = StepPhases(
            self.requests,
            self.runner,
            self.config.eos_token_ids,
            self.max_context,
            launches_ahead=options.overlap_steps if options.overlap_steps is not None else self.device.type == "cuda",
        )
        self._step_lock = asyncio.Lock()  # step, suspend, resume, weight swaps and close never overlap
        self._token_bytes: dict[int, bytes] = {}  # each token id's bytes, once asked (the vocabulary bounds it)
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
            loaded.plan.describe(loaded.page_bytes),
            self.kernels.describe(),
            "replays CUDA graphs" if self.graphs else "runs eagerly",
            self.runner.path.describe(),
            "on" if options.prefix_caching else "off",
            "overlapped" if self.launches_ahead else "one at a time",
            phases.describe(),
        )

    @property
    def model(self) -> DecoderModel:
        return self.runner.model

    @property
    def kernels(self) -> Kernels:
        return self.runner.model.kernels

    @property
    def graphs(self) -> DecodeGraphs | None:
        return self.runner.graphs

    @property
    def scheduler(self) -> Scheduler:
        return self.requests.scheduler

    @property
    def launches_ahead(self) -> bool:
        return self.steps.launches_ahead

    def execution_path(self) -> ExecutionPath:
        """The path decode runs: while suspended, the one it ran and resumes on."""
        return self.runner.path

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
        state.sequence.prompt_logits = request.prompt_logprobs is not None
        state.resume(resume)
        self.requests.add(state)
        return len(prompt)

    def resumed_text(self, request_id: str) -> str:
        return self.requests.resumed_text(request_id)

    def token_bytes(self, token_ids: collections.abc.Iterable[int]) -> dict[int, bytes]:
        known, tokenizer = self._token_bytes, self.tokenizer
        return {
            token: known[token] if token in known else known.setdefault(token, tokenizer.token_bytes(token))
            for token in token_ids
        }

    def abort(self, request_id: str) -> bool:
        return self.requests.abort(request_id)

    def has_work(self) -> bool:
        return self.runner.kv_cache is not None and self.steps.has_work()

    def hold(self, request_id: str) -> bool:
        return self.requests.hold(request_id)

    def release(self, request_id: str) -> None:
        self.requests.release(request_id)

    def waiting_requests(self) -> int:
        return len(self.scheduler.waiting)

    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.requests.scheduler.blocks.stats()

    @property
    def publishes_kv_events(self) -> bool:
        """With prefix caching on: the request table knows which prompt prefixes the cache holds."""
        return self.requests.held is not None

    def cache_changes(self) -> CacheChanges:
        return self.requests.cache_changes()

    # ------------------------------------------------------------ steps

    async def step(self) -> list[TokenOutput]:
        async with self._step_lock:
            return await asyncio.to_thread(self._step)

    def _step(self) -> list[TokenOutput]:
        with self.runner.on_device():
            return self.steps.step()

    # ------------------------------------------------------------ memory

    async def suspend(self) -> None:
        """Free the KV cache; running requests go back to the queue and are recomputed on resume."""
        async with self._step_lock:
            self.steps.drop_launched()
            self.requests.drop_cache()
            self.runner.release()
            log.info("torch backend suspended: KV cache released, %d requests kept for recompute", len(self.requests))

    async def resume(self) -> None:
        async with self._step_lock:
            if self.runner.kv_cache is None:
                path = await asyncio.to_thread(self.runner.restore)
                log.info("torch backend resumed: KV cache reallocated; path %s", path.describe())

    # ------------------------------------------------------------ weight updates (engines/torch_backend/weight_update.py)

    async def quiesce(self) -> None:
        async with self._step_lock:
            if self.device.type == "cuda":
                await asyncio.to_thread(torch.cuda.synchronize, self.device)

    def stage_weights(self, path: Path) -> object:
        return self.runner.stage_weights(path)

    async def swap_weights(self, staged: object) -> None:
        """A step launched ahead is dropped (its tokens are sampled again with the new weights),
        and the KV cache is dropped with every prefix in it: running requests are recomputed."""
        async with self._step_lock:
            await asyncio.to_thread(self._swap, staged)

    def _swap(self, staged: object) -> None:
        if not isinstance(staged, StagedWeights):
            raise TypeError(f"swap_weights takes what stage_weights returned, not {type(staged).__name__}")
        with self.runner.on_device():
            self.steps.drop_launched()
            self.runner.swap_weights(staged)
            self.requests.drop_cache()
        log.info("torch backend: weights swapped, %d requests to recompute", len(self.requests))

    # ------------------------------------------------------------ profiler

    def start_profiler(self) -> str:
        return self.profiler.start()

    def stop_profiler(self) -> str:
        return self.profiler.stop()

    async def close(self) -> None:
        async with self._step_lock:
            self.profiler.close()
            self.steps.drop_launched()
            self.requests.clear()
            self.runner.release()
