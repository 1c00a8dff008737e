"""The torch backend: a Llama-family model served with continuous batching.

Glue in the nano-vllm shape: each step schedules (pure bookkeeping, under a lock shared with
``add`` and ``abort``), runs one forward pass and one batched sampling pass in a worker thread
(the event loop never waits on torch), then records each sampled token: incremental text,
stop strings, EOS, ``max_tokens`` and the context limit. One host sync per step: the sampled
ids.
"""

from __future__ import annotations

import asyncio
import collections.abc
import logging
import os
import random
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engines.backend import Backend, GenerationRequest, TokenOutput
from engines.chat_template import ChatTemplate, plain_prompt
from engines.torch_backend.batch import build_batch
from engines.torch_backend.config import ModelConfig
from engines.torch_backend.memory import page_bytes, plan_cache
from engines.torch_backend.model import LlamaModel
from engines.torch_backend.rope import rotary_table
from engines.torch_backend.sampling import SamplingParams, request_key, sample
from engines.torch_backend.scheduler import BlockAllocator, ScheduledBatch, Scheduler, Sequence, SequenceStatus
from engines.torch_backend.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer
from engines.torch_backend.weights import build_model, checkpoint_weights, random_weights
from service.ops.settings import Settings
from service.protocol.errors import ErrorCode, WireError
from service.protocol.messages import ChatMessage, FinishReason

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} asked for, but torch sees no CUDA device")
    return device


def resolve_dtype(name: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    """``--dtype`` wins, then the checkpoint's dtype, then bf16 on CUDA and float32 on CPU."""
    if name != "auto":
        return _DTYPES[name]
    if config.dtype is not None:
        return _DTYPES[config.dtype]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@dataclass(eq=False, slots=True)
class _Request:
    request: GenerationRequest
    sequence: Sequence
    key: int
    detokenizer: IncrementalDetokenizer
    stop_window: str = ""  # the last characters of the text, enough to see a stop string complete


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, settings: Settings, model_path: str | None = None) -> None:
        self.device = resolve_device(settings.device)
        if self.device.type == "cpu" and settings.cpu_threads is not None:
            torch.set_num_threads(settings.cpu_threads)
        model_dir = Path(model_path).expanduser() if model_path else None
        self.config = ModelConfig.from_dir(model_dir) if model_dir else ModelConfig()
        self.dtype = resolve_dtype(settings.dtype, self.config, self.device)
        weights = checkpoint_weights(model_dir) if model_dir else iter(random_weights(self.config, settings.model_seed).items())
        self.model: LlamaModel = build_model(self.config, weights, self.dtype, self.device)
        self.tokenizer: Tokenizer = load_tokenizer(model_dir)
        self.model_name = str(model_dir) if model_dir else f"random default model (seed {settings.model_seed})"
        self.default_model_name = (model_dir.resolve().name or str(model_dir)) if model_dir else "dpcoord-random"
        self.chat_template = ChatTemplate.from_dir(model_dir) if model_dir else None

        max_context = settings.max_context or self.config.max_position_embeddings
        if max_context > self.config.max_position_embeddings:
            raise ValueError(f"max_context {max_context} exceeds the model's max_position_embeddings {self.config.max_position_embeddings}")
        block_size = settings.kv_block_size
        page = page_bytes(self.config, block_size, self.dtype)
        pages_per_sequence = -(-max_context // block_size)
        self._rotary = rotary_table(self.config.rope, self.config.head_dim, max_context, self.dtype, self.device)
        peak = self._warm_up(settings.max_prefill_tokens, max_context, block_size) if self.device.type == "cuda" else 0
        plan = plan_cache(self.device, page, settings.max_batch * pages_per_sequence,
                          settings.kv_memory_fraction, settings.kv_cache_gb, peak)
        self.max_context = min(max_context, plan.num_blocks * block_size)
        if self.max_context < max_context:
            log.warning("the KV cache holds %d tokens: requests are limited to that context, not %d", self.max_context, max_context)
        self._cache_shape = (self.config.num_layers, plan.num_blocks, block_size, 2, self.config.num_kv_heads, self.config.head_dim)
        self._kv_cache: torch.Tensor | None = self._allocate_cache()
        self.scheduler = Scheduler(BlockAllocator(plan.num_blocks, block_size), settings.max_batch, settings.max_prefill_tokens)

        self._requests: dict[str, _Request] = {}
        self._lock = threading.Lock()  # scheduler and request table: step thread vs add/abort on the loop
        self._step_lock = asyncio.Lock()  # step, suspend and resume never overlap
        self._random = random.Random()
        self._profiler: torch.profiler.profile | None = None
        self._profile_dir = Path(settings.profile_dir or tempfile.gettempdir())
        log.info(
            "torch backend: %s, %.1f M parameters, %s on %s (%d CPU threads), context %d, KV cache %s",
            self.model_name, sum(p.numel() for p in self.model.parameters()) / 1e6, self.dtype, self.device,
            torch.get_num_threads(), self.max_context, plan.describe(page),
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
        vocab = self.config.vocab_size
        outside = next((token for token in prompt if token >= vocab), None)
        if outside is not None:
            raise WireError(ErrorCode.MALFORMED, f"token id {outside} is outside the vocabulary (0..{vocab - 1})")
        if len(prompt) >= self.max_context:
            raise WireError(
                ErrorCode.TOO_LARGE,
                f"prompt of {len(prompt)} tokens does not fit the context of {self.max_context} tokens (at most {self.max_context - 1})",
            )
        key = request_key(request.seed) if request.seed is not None else self._random.getrandbits(32)
        state = _Request(request, Sequence.from_prompt(request.request_id, prompt), key,
                         IncrementalDetokenizer(self.tokenizer, prompt))
        with self._lock:
            if request.request_id in self._requests:
                raise WireError(ErrorCode.CONFLICT, f"request {request.request_id} is already running")
            self.scheduler.add(state.sequence)
            self._requests[request.request_id] = state
        return len(prompt)

    def abort(self, request_id: str) -> bool:
        with self._lock:
            state = self._requests.pop(request_id, None)
            if state is None:
                return False
            self.scheduler.remove(state.sequence)
            return True

    def has_work(self) -> bool:
        return self._kv_cache is not None and self.scheduler.has_work()

    async def step(self) -> list[TokenOutput]:
        async with self._step_lock:
            return await asyncio.to_thread(self._step)

    def _step(self) -> list[TokenOutput]:
        cache = self._kv_cache
        if cache is None:  # suspended: has_work() says so; a step that slips in does nothing
            return []
        with torch.inference_mode():
            with self._lock:
                scheduled = self.scheduler.schedule()
                if not scheduled:
                    return []
                states = [self._requests[sequence.request_id] for sequence in scheduled.sequences]
                batch = build_batch(scheduled, self.scheduler.allocator.block_size, self.config.group_size, self.dtype, self.device)
                params = self._sampling_params(states)
            logits = self.model(batch, self._rotary, cache)
            tokens = sample(logits, params).tolist()  # the step's one host sync
        with self._lock:
            # A request aborted while the model ran is gone: its token is dropped.
            return [self._record(state, token) for state, token in zip(states, tokens, strict=True)
                    if state.sequence.status is SequenceStatus.RUNNING]

    def _sampling_params(self, states: list[_Request]) -> SamplingParams | None:
        """None when every row is greedy: argmax needs no parameters."""
        requests = [state.request for state in states]
        if all(request.temperature == 0 for request in requests):
            return None
        return SamplingParams.build(
            [request.temperature for request in requests], [request.top_k for request in requests],
            [request.top_p for request in requests], [state.key for state in states],
            [state.sequence.num_generated for state in states], self.device,
        )

    def _record(self, state: _Request, token: int) -> TokenOutput:
        sequence, request = state.sequence, state.request
        sequence.append(token)
        text = state.detokenizer.push(token)
        finish: FinishReason | None = None
        if token in self.config.eos_token_ids:
            finish = "stop"
        elif request.stop and text:
            window = state.stop_window + text
            if any(stop in window for stop in request.stop):
                finish = "stop"
            keep = max(len(stop) for stop in request.stop) - 1
            state.stop_window = window[-keep:] if keep else ""
        if finish is None and (sequence.num_generated >= request.max_tokens or len(sequence.token_ids) >= self.max_context):
            finish = "length"
        if finish is not None:
            text += state.detokenizer.flush()
            self.scheduler.remove(sequence)
            del self._requests[request.request_id]
        return TokenOutput(request.request_id, [token], text, finish)

    # ------------------------------------------------------------ memory

    def _allocate_cache(self) -> torch.Tensor:
        # Zeroed: padded page-table entries read page 0, and a masked NaN would still poison the output.
        return torch.zeros(self._cache_shape, dtype=self.dtype, device=self.device)

    def _warm_up(self, max_prefill_tokens: int, max_context: int, block_size: int) -> int:
        """Run the largest prefill once on a scratch cache; return the activation peak in bytes."""
        tokens = min(max_prefill_tokens, max_context - 1)
        pages = -(-tokens // block_size)
        scratch = torch.zeros((self.config.num_layers, pages, block_size, 2, self.config.num_kv_heads, self.config.head_dim),
                              dtype=self.dtype, device=self.device)
        sequence = Sequence.from_prompt("warm-up", [0] * tokens)
        sequence.block_table = list(range(pages))
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        with torch.inference_mode():
            batch = build_batch(ScheduledBatch([], [sequence]), block_size, self.config.group_size, self.dtype, self.device)
            self.model(batch, self._rotary, scratch)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del scratch
        torch.cuda.empty_cache()
        return peak

    async def suspend(self) -> None:
        """Free the KV cache; running requests go back to the queue and are recomputed on resume."""
        async with self._step_lock:
            with self._lock:
                self.scheduler.preempt_all()
                self._kv_cache = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            log.info("torch backend suspended: KV cache released, %d requests kept for recompute", len(self._requests))

    async def resume(self) -> None:
        async with self._step_lock:
            if self._kv_cache is None:
                self._kv_cache = await asyncio.to_thread(self._allocate_cache)
                log.info("torch backend resumed: KV cache reallocated")

    # ------------------------------------------------------------ profiler

    def start_profiler(self) -> str:
        if self.device.type == "cuda":
            torch.cuda.profiler.start()
            return f"cudaProfilerStart on {self.device}"
        if self._profiler is not None:
            raise RuntimeError("the torch profiler is already running")
        from torch._C._profiler import _ExperimentalConfig

        # All threads: the steps run in a worker thread, not the one that starts the profiler.
        try:
            all_threads = _ExperimentalConfig(profile_all_threads=True)
        except TypeError:
            raise RuntimeError(f"the CPU profiler needs torch >= 2.7 to see the step thread; this is {torch.__version__}") from None
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], experimental_config=all_threads)
        profiler.start()
        self._profiler = profiler
        return f"torch.profiler started; the trace goes to {self._profile_dir} on stop"

    def stop_profiler(self) -> str:
        if self.device.type == "cuda":
            torch.cuda.profiler.stop()
            return f"cudaProfilerStop on {self.device}"
        if self._profiler is None:
            raise RuntimeError("the torch profiler is not running")
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        self._profile_dir.mkdir(parents=True, exist_ok=True)
        path = self._profile_dir / f"dpcoord-torch-trace-{os.getpid()}-{time.time_ns()}.json"
        profiler.export_chrome_trace(str(path))
        return str(path)

    async def close(self) -> None:
        async with self._step_lock:
            if self._profiler is not None:
                self._profiler.stop()
                self._profiler = None
            with self._lock:
                self._requests.clear()
                self.scheduler.preempt_all()
                self._kv_cache = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
