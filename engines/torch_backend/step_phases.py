"""The torch backend's step: launch → collect → emit, with steps launched ahead.

- **launch** schedules (pure bookkeeping, under the lock shared with ``add`` and ``abort``),
  then runs one forward pass, eagerly or as a CUDA graph replay (decode-only steps on CUDA),
  and one batched sampling pass; on CUDA the sampled ids start their copy to the host. Each
  row's token is a placeholder in its sequence from then on (``sequence.feed``).
- **collect** reads the sampled ids (the step's one host sync), writes each token over its
  placeholder and ends the requests the token alone ends (EOS, ``max_tokens``, the context).
- **emit** detokenises and checks stop strings.

With overlapped steps (on by default on CUDA), step n + 1 is scheduled and launched *before*
step n is collected: its decode rows' input ids are step n's sampled ids, copied on the device
(:mod:`engines.torch_backend.placeholders`), so the host prepares step n + 1 while the device
computes step n, and collects and emits step n while it computes step n + 1. Decisions that
need the token are then applied one step late: a request that step n ends by EOS or a stop
string has a row in step n + 1, whose token is dropped (never emitted), and its pages are free
from step n's collect on; a request aborted or preempted while its step ran drops that step's
token as well. A request that step n ends by length is known to end before its token is read,
so it gets no row in step n + 1. Greedy and seeded outputs are those of steps run one at a time:
a row's token depends only on its own sequence and its count of generated tokens.
"""

from __future__ import annotations

import threading

import torch

from engines.backend import TokenOutput
from engines.torch_backend.batch import build_batch
from engines.torch_backend.config import ModelConfig
from engines.torch_backend.cuda_graphs import DecodeGraphs
from engines.torch_backend.model import DecoderModel
from engines.torch_backend.placeholders import decode_sources
from engines.torch_backend.request_state import RequestState
from engines.torch_backend.sampling import sample
from engines.torch_backend.scheduler import Scheduler
from engines.torch_backend.sequence import SequenceStatus, feed
from engines.torch_backend.step_records import Launched, Sampled, StepRows, sampling_params


class StepPhases:
    """The step's phases, on the backend's state (``TorchBackend`` sets every field)."""

    device: torch.device
    dtype: torch.dtype
    config: ModelConfig
    model: DecoderModel
    max_context: int
    scheduler: Scheduler
    _rotary: torch.Tensor
    _kv_cache: torch.Tensor | None
    _graphs: DecodeGraphs | None
    _overlap: bool
    _requests: dict[str, RequestState]
    _launched: Launched | None
    _lock: threading.Lock
    _rows: StepRows

    def _step_on_device(self) -> list[TokenOutput]:
        if self._kv_cache is None:  # suspended: has_work() says so; a step that slips in does nothing
            return []
        launched, self._launched = self._launched or self._launch(None), None
        if launched is None:
            return []
        if self._overlap:
            self._launched = self._launch(launched)
        return self._emit(self._collect(launched))

    def _launch(self, previous: Launched | None) -> Launched | None:
        """Schedule and launch a step; ``previous``: the step still in flight, whose sampled ids
        this step's decode rows feed."""
        cache = self._kv_cache
        assert cache is not None, "steps run only with a cache"
        graphs = self._graphs
        earlier = previous.device_tokens if previous is not None else None
        with torch.inference_mode():
            with self._lock:
                scheduled = self.scheduler.schedule()
                if not scheduled:
                    return None
                sequences = scheduled.sequences
                states = self._rows.states(sequences, self._requests)
                params = None if self._rows.greedy else sampling_params(states, self.device)
                decode = scheduled.decode
                replay = (
                    graphs.inputs(decode, self.scheduler.grown, earlier is not None)
                    if graphs and not scheduled.prefill and graphs.fits(len(decode))
                    else None
                )
                if graphs is not None and replay is not None:
                    sources = None if earlier is None or graphs.rows_reused else decode_sources(decode)
                    batch = None
                else:
                    if graphs is not None:
                        graphs.forget_rows()
                    batch = build_batch(
                        scheduled,
                        self.scheduler.blocks.block_size,
                        self.config.group_size,
                        self.dtype,
                        self.device,
                        self.model.kernels.paged_decode is not None,
                        earlier,
                        self.config.sliding_window,
                    )
                positions = feed(sequences)
                mark = self.scheduler.num_preempted
            if graphs is not None and replay is not None:
                logits = graphs.replay(replay, earlier, sources)
            else:
                assert batch is not None, "an eager step has its batch"
                logits = self.model(batch, self._rotary, cache)
            tokens = sample(logits, params)
        if self.device.type != "cuda":
            return Launched(states, positions, tokens, tokens, None, mark)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event(blocking=True)  # synchronize() then sleeps instead of spinning a core
        ready.record()
        return Launched(states, positions, host, tokens, ready, mark)

    def _collect(self, launched: Launched) -> list[Sampled]:
        """Read the step's ids back, write each over its placeholder (the pages it fills join
        the prefix cache: every cached token is known by then, as the newest a launched step
        feeds is this one) and end the requests a token ends."""
        if launched.ready is not None:
            launched.ready.synchronize()
        tokens = launched.tokens.tolist()  # the step's one host sync
        sampled: list[Sampled] = []
        keep = sampled.append
        eos, max_context, mark = self.config.eos_token_ids, self.max_context, launched.mark
        running = SequenceStatus.RUNNING
        blocks = self.scheduler.blocks
        page = blocks.block_size
        with self._lock:
            for state, position, token in zip(launched.states, launched.positions, tokens, strict=True):
                sequence = state.sequence
                # A request aborted, finished or preempted while its step ran: its token is dropped.
                if sequence.status is not running or sequence.preempted > mark:
                    continue
                sequence.token_ids[position] = token
                if sequence.num_cached >= (sequence.num_committed + 1) * page:  # a page filled
                    blocks.commit(sequence)
                finish = state.token_finish(token, eos, max_context, position)
                if finish is None:
                    keep((state, token, None, position + 1 - sequence.num_prompt_tokens))
                    continue
                self._finish(state)
                keep((state, token, finish, position + 1 - sequence.num_prompt_tokens))
        return sampled

    def _emit(self, sampled: list[Sampled]) -> list[TokenOutput]:
        outputs = []
        for state, token, finish, generated in sampled:
            text, stopped = state.text(token, generated)
            if stopped and finish != "stop":
                if finish is None:
                    with self._lock:
                        self._finish(state)
                finish = "stop"
            if finish is not None:
                text += state.detokenizer.flush()
            outputs.append(TokenOutput(state.request.request_id, [token], text, finish))
        return outputs

    def _finish(self, state: RequestState) -> None:
        """Under the lock: the request leaves the scheduler (its pages are free) and the table."""
        if state.sequence.status is SequenceStatus.FINISHED:
            return
        self.scheduler.remove(state.sequence)
        del self._requests[state.request.request_id]

    def _drop_launched(self) -> None:
        """Forget a step in flight: its tokens are never written in, so they are sampled again
        later. Callers drop the cache next, which preempts every sequence and so removes the
        placeholders the step left (``Scheduler.drop_cache``)."""
        launched, self._launched = self._launched, None
        if launched is not None and launched.ready is not None:
            launched.ready.synchronize()
