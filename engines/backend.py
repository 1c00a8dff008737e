"""The interface between the engine runtime (NATS side) and a model backend.

The runtime owns the protocol: it decodes routed requests, streams partials, batches
replies, tracks epochs and obeys control signals. A backend only schedules and generates:
``add`` requests (and say how many tokens the prompt is; a migrated request continues after
its ``resume_tokens``, prefilled with the prompt, counted as generated), ``step`` to advance every running
request by (at most) one token (``hold`` leaves one out until ``release``), and report new tokens, the text they complete, and why a
request finished. It also names the model it serves and renders chat ``messages`` into a
prompt, since it owns the tokenizer and so the chat template.

Log-probabilities, when a request asks for them: each output carries its new tokens'
(``logprobs``, with ``top_logprobs`` when it asked for alternatives), and a request's first
output its prompt's (``prompt``); :meth:`Backend.token_bytes` names each token's bytes. A
backend that computes none says so (``computes_logprobs``): the runtime then refuses such
requests and does not announce the feature.

KV events, for a backend with a prefix cache (``publishes_kv_events``): each request comes with
its prompt's prefixes as submitted (``GenerationRequest.prefixes``, docs/protocol.md *KV
events*), and :meth:`Backend.cache_changes`, asked after every step, says which of them it began
and stopped holding since it was last asked, and how many prompt tokens wait for their prefill.
The runtime numbers and publishes them (:mod:`engines.kv_prefixes`).
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from engines.chat_template import plain_prompt
from service.protocol.errors import ErrorCode, WireError
from service.protocol.messages import ChatMessage, FinishReason, LogprobsMode, SubmitRequest, TopLogprob

DEFAULT_MAX_TOKENS = 16
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0


@dataclass(frozen=True, slots=True)
class PromptPrefix:
    """One prefix of a request's prompt as submitted, named as routing names it: its prefix hash,
    its length in the hash chain's blocks, and the prompt tokens it covers (a token prompt's
    first ``16 * blocks``; None for text and chat prompts, whose blocks are bytes: the backend
    then ties it to the prompt's whole cached length)."""

    prefix_hash: int
    blocks: int
    tokens: int | None


@dataclass(frozen=True, slots=True)
class CacheChanges:
    """What a prefix cache's backend began (``stored``: ``(prefix_hash, blocks)``) and stopped
    (``evicted``) holding since it was last asked, each at most once and only where its state
    changed over that time; ``queued_tokens``: prompt tokens of its requests still waiting for
    their prefill, less what its cache serves."""

    stored: list[tuple[int, int]]
    evicted: list[int]
    queued_tokens: int


@dataclass(slots=True)
class GenerationRequest:
    request_id: str
    prompt: str | list[int]
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    top_k: int = 0  # 0: off
    top_p: float = DEFAULT_TOP_P
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # Tokens an earlier run of this request generated and streamed (a migration): the backend
    # continues after them exactly as if it had generated them itself.
    resume_tokens: tuple[int, ...] = ()
    ignore_eos: bool = False  # EOS ids do not end the request
    min_tokens: int = 0  # no EOS id and no stop string ends the request before this many tokens
    logprobs: int | None = None  # alternatives per generated token's logprob; None: no logprobs
    prompt_logprobs: int | None = None  # alternatives per prompt token's logprob; None: none
    logprobs_mode: LogprobsMode = "raw"  # of the model's distribution, or of the one sampled from
    # Its prompt's prefixes, for a backend that publishes KV events (empty otherwise).
    prefixes: tuple[PromptPrefix, ...] = ()

    @classmethod
    def from_submit(cls, request_id: str, submit: SubmitRequest, prompt: str | list[int]) -> GenerationRequest:
        """``prompt``: the submission's own, or its ``messages`` rendered by the backend."""
        params = submit.sampling_params
        return cls(
            request_id=request_id,
            prompt=prompt,
            max_tokens=params.max_tokens if params.max_tokens is not None else DEFAULT_MAX_TOKENS,
            temperature=params.temperature if params.temperature is not None else DEFAULT_TEMPERATURE,
            top_k=params.top_k or 0,
            top_p=params.top_p if params.top_p is not None else DEFAULT_TOP_P,
            seed=params.seed,
            stop=tuple(params.stop or ()),
            ignore_eos=params.ignore_eos,
            min_tokens=params.min_tokens,
            logprobs=params.logprobs,
            prompt_logprobs=params.prompt_logprobs,
            logprobs_mode=params.logprobs_mode,
        )


@dataclass(slots=True)
class PromptLogprobs:
    """A prompt's tokens and the log-probability of each given the ones before it (the first has
    none), with the ``prompt_logprobs`` most likely tokens at each position (None when that is 0)."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[TopLogprob] | None] | None


@dataclass(slots=True)
class TokenOutput:
    """What one step produced for one request; ``text`` is the newly completed text only.
    ``cached_tokens``: how many of its prompt's tokens the backend read from its prefix cache
    when it first scheduled the request (the runtime reads it from the first output)."""

    request_id: str
    new_tokens: list[int]
    text: str
    finish_reason: FinishReason | None = None
    # A request that asked for logprobs: each new token's, and its alternatives (most likely
    # first) when it asked for some; a request that asked for prompt logprobs gets them on its
    # first output.
    logprobs: list[float] | None = None
    top_logprobs: list[list[TopLogprob]] | None = None
    prompt: PromptLogprobs | None = None
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """The KV-cache pages and how often admitted requests found their prefix already there."""

    queried_tokens: int  # tokens of the requests admitted (recomputes after preemption included)
    hit_tokens: int  # of them, read from cached pages instead of being computed
    cached_pages: int  # pages holding a known prefix, in use or not
    evicted_pages: int  # cached pages handed out again under memory pressure
    total_pages: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass(frozen=True, slots=True)
class ExecutionPath:
    """Which fast pieces a backend's steps run, so that no figure and no status hides a slow path.

    ``failures`` names the pieces that were asked for but failed to build (their tracebacks are
    in the log); a piece not asked for is simply off."""

    device: str
    cuda_graphs: bool
    paged_kernel: bool
    compiled: bool
    failures: tuple[str, ...] = ()

    @property
    def fast(self) -> bool:
        """Decode replays CUDA graphs over the paged kernel, with the compiled element-wise pieces."""
        return self.cuda_graphs and self.paged_kernel and self.compiled

    def missing(self) -> list[str]:
        pieces = {"CUDA graphs": self.cuda_graphs, "paged kernel": self.paged_kernel, "compiled pieces": self.compiled}
        return [name for name, on in pieces.items() if not on]

    def describe(self) -> str:
        """One line for logs, status and benchmark rows: ``cuda: graphs on, paged kernel on, compiled on``."""

        def on(flag: bool) -> str:
            return "on" if flag else "off"

        text = (
            f"{self.device}: graphs {on(self.cuda_graphs)}, paged kernel {on(self.paged_kernel)}, "
            f"compiled {on(self.compiled)}"
        )
        return text + (f" (failed: {', '.join(self.failures)})" if self.failures else "")


class Backend(abc.ABC):
    name: str
    default_model_name: str  # the served model name unless --served-model-name gives one
    # Tokens one request may hold, prompt plus generated; None: no bound. The runtime refuses a
    # ``max_tokens`` beyond it (engines/limits.py).
    max_context: int | None = None
    # Whether its outputs carry the log-probabilities requests ask for (the engine announces the
    # feature at register; the runtime refuses such requests otherwise).
    computes_logprobs: bool = False

    @abc.abstractmethod
    def add(self, request: GenerationRequest) -> int:
        """Queue a request and return its prompt's length in tokens; raise WireError (400, 413)
        for one this backend cannot serve."""

    def render_chat(self, messages: Sequence[ChatMessage]) -> str | list[int]:
        """The prompt for a conversation: text, or token ids when the backend tokenised it
        itself. Backends without a chat template use the plain fallback (engines/chat_template.py)."""
        return plain_prompt(messages)

    @abc.abstractmethod
    def resumed_text(self, request_id: str) -> str:
        """The text a request's ``resume_tokens`` completed, as an uninterrupted run would have
        emitted it for them (the final's text starts with it); call right after ``add``."""

    def token_bytes(self, token_ids: Iterable[int]) -> dict[int, bytes]:
        """Each token's bytes as the tokenizer decodes it alone (a byte-level piece may be part
        of a UTF-8 character), for the logprob fields; only a backend that computes logprobs is asked."""
        raise NotImplementedError(f"the {self.name} backend computes no log-probabilities")

    @abc.abstractmethod
    def abort(self, request_id: str) -> bool:
        """Drop a request and free what it holds; False if unknown."""

    @abc.abstractmethod
    def has_work(self) -> bool:
        """Whether a step would advance a request: one running or waiting, not held."""

    def hold(self, request_id: str) -> bool:
        """Backpressure (docs/protocol.md): leave the request out of the steps until
        :meth:`release`, keeping it (its KV pages, or preempted to be recomputed then). False
        when the request is not here, or this backend cannot hold (it keeps stepping it)."""
        return False

    def release(self, request_id: str) -> None:
        """Step a request :meth:`hold` held again."""

    @abc.abstractmethod
    async def step(self) -> list[TokenOutput]:
        """Advance every running request; must not block the event loop for long."""

    async def suspend(self) -> None:
        """Release accelerator memory; requests in flight must survive until ``resume``."""

    async def resume(self) -> None:
        """Take back what ``suspend`` released."""

    async def quiesce(self) -> None:
        """Return once no step of this backend is running, on the accelerator too (on CUDA,
        after a device synchronize): the runtime calls it under its step lock, so a pause
        confirmed after it is a barrier."""

    def stage_weights(self, path: Path) -> object:
        """Blocking, run in a worker thread while the backend serves: read the checkpoint in
        ``path`` and check it against the running model, without touching the model. Returns
        what :meth:`swap_weights` takes; raises WireError 400 naming the first tensor that does
        not match. A backend without weights refuses."""
        raise WireError(ErrorCode.INTERNAL, f"the {self.name} backend cannot update its weights")

    async def swap_weights(self, staged: object) -> None:
        """Serve the weights :meth:`stage_weights` returned from now on; called while paused,
        with no step running. What running requests hold (their KV cache) is recomputed with
        the new weights."""
        raise WireError(ErrorCode.INTERNAL, f"the {self.name} backend cannot update its weights")

    @property
    def launches_ahead(self) -> bool:
        """Whether ``step`` returns with the next step already launched on the device: the
        runtime then publishes the replies at once instead of while the next step runs."""
        return False

    def waiting_requests(self) -> int:
        """Requests added and not running yet (waiting for a place in the batch or for KV-cache
        pages); 0 for a backend that runs every request it holds at once."""
        return 0

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The KV cache's prefix-cache counters; None for a backend without one."""
        return None

    @property
    def publishes_kv_events(self) -> bool:
        """Whether it has a prefix cache it reports (:meth:`cache_changes`): the runtime then
        gives each request its prompt's prefixes and publishes KV events."""
        return False

    def cache_changes(self) -> CacheChanges:
        """The prefixes it began and stopped holding since it was last asked, and the prompt
        tokens waiting for their prefill; asked between steps, only when it publishes KV events."""
        raise NotImplementedError(f"the {self.name} backend publishes no KV events")

    def execution_path(self) -> ExecutionPath | None:
        """The fast pieces the steps run; None for a backend without any (echo)."""
        return None

    def start_profiler(self) -> str:
        """Start profiling; returns a detail for the ack (a trace path, say)."""
        return f"{self.name} backend has no profiler"

    def stop_profiler(self) -> str:
        return f"{self.name} backend has no profiler"

    async def close(self) -> None:
        """Free everything; the runtime calls it once on exit."""
