"""The torch backend's step: launch → collect → emit, with steps launched ahead.

:class:`StepPhases` composes the request table (:mod:`engines.torch_backend.request_table`: the
requests, the scheduler and their lock) and the model runner
(:mod:`engines.torch_backend.model_runner`: the model, the KV cache and the graphs) and owns only
the step in flight. Each phase asks those two for what it needs:

- **launch** schedules (pure bookkeeping, under the lock shared with ``add`` and ``abort``),
  then runs one forward pass, eagerly or as a CUDA graph replay (decode-only steps on CUDA),
  and one batched sampling pass; on CUDA the sampled ids start their copy to the host. Each
  row's token is a placeholder in its sequence from then on (``sequence.feed``).
- **collect** reads the sampled ids (the step's one host sync), writes each token over its
  placeholder and ends the requests the token alone ends (EOS, ``max_tokens``, the context).
- **emit** detokenises and checks stop strings.

Log-probabilities come from the same pass (:mod:`engines.torch_backend.logprobs`): launch
computes those of the rows that asked, and of the prompt positions of a prefill that asked for
prompt logprobs, on the device and starts their copy with the ids'; collect reads them with the
ids; emit puts each on its token's output, and a prompt's on the request's next output. A step
whose rows ask for none runs exactly as before.

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

import torch

from engines.backend import PromptLogprobs, TokenOutput
from engines.torch_backend.logprobs import RowLogprobs, launch_logprobs, read_prompts, read_rows, to_host
from engines.torch_backend.model_runner import ModelRunner
from engines.torch_backend.request_state import RequestState
from engines.torch_backend.request_table import RequestTable
from engines.torch_backend.sampling import draw, sample
from engines.torch_backend.sequence import SequenceStatus, feed
from engines.torch_backend.step_records import Launched, Sampled, sampling_params


class StepPhases:
    """One step at a time (the backend's step lock sees to it), on the step thread, with the
    runner's device current (``ModelRunner.on_device``). ``launches_ahead``: whether step n + 1
    is launched before step n is collected."""

    def __init__(
        self,
        requests: RequestTable,
        runner: ModelRunner,
        eos_token_ids: tuple[int, ...],
        max_context: int,
        launches_ahead: bool,
    ) -> None:
        self._requests, self._runner = requests, runner
        self._eos_token_ids, self._max_context = eos_token_ids, max_context
        self.launches_ahead = launches_ahead
        self._launched: Launched | None = None
        # Prompt logprobs read back and not yet on an output (their row's token was dropped).
        self._prompts: dict[RequestState, PromptLogprobs] = {}

    @property
    def in_flight(self) -> Launched | None:
        """The step launched and not yet collected, if any."""
        return self._launched

    def has_work(self) -> bool:
        return self._launched is not None or self._requests.has_work()

    def step(self) -> list[TokenOutput]:
        """Launch a step (or take the one launched ahead), launch the next one when launching
        ahead, then collect and emit this one. Nothing while the runner has no cache."""
        if self._runner.kv_cache is None:  # released: has_work() says so; a step that slips in does nothing
            return []
        launched, self._launched = self._launched or self._launch(None), None
        if launched is None:
            return []
        if self.launches_ahead:
            self._launched = self._launch(launched)
        return self._emit(self._collect(launched))

    def drop_launched(self) -> None:
        """Forget a step in flight: its tokens are never written in, so they are sampled again
        later. Callers drop the cache next, which preempts every sequence and so removes the
        placeholders the step left (``RequestTable.drop_cache``)."""
        launched, self._launched = self._launched, None
        if launched is not None and launched.ready is not None:
            launched.ready.synchronize()

    def _launch(self, previous: Launched | None) -> Launched | None:
        """Schedule and launch a step; ``previous``: the step still in flight, whose sampled ids
        this step's decode rows feed."""
        requests, runner = self._requests, self._runner
        scheduler = requests.scheduler
        earlier = previous.device_tokens if previous is not None else None
        with torch.inference_mode():
            with requests.lock:
                scheduled = scheduler.schedule()
                if not scheduled:
                    return None
                sequences = scheduled.sequences
                states, greedy = requests.states(sequences)
                asking = requests.asking
                prompts: list[RequestState] = []
                if scheduled.prefill:
                    prefilled = states[len(scheduled.decode) :]
                    first_cached(prefilled)
                    prompts = [state for state in prefilled if state.sequence.prompt_rows_due]
                params = None if greedy else sampling_params(states, runner.device)
                inputs = runner.prepare(scheduled, scheduler.grown, earlier)
                positions = feed(sequences)
                mark = scheduler.num_preempted
            logits = runner.forward(inputs, earlier)
            logprobs = None
            if asking is None and not prompts:
                tokens = sample(logits, params)
            else:
                drawn = draw(logits[: len(states)], params)
                tokens = drawn.tokens
                logprobs = launch_logprobs(logits, drawn, len(states), asking, prompts)
        if runner.device.type != "cuda":
            return Launched(states, positions, tokens, tokens, None, mark, logprobs)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        if logprobs is not None:
            to_host(logprobs)
        ready = torch.cuda.Event(blocking=True)  # synchronize() then sleeps instead of spinning a core
        ready.record()
        return Launched(states, positions, host, tokens, ready, mark, logprobs)

    def _collect(self, launched: Launched) -> tuple[list[Sampled], dict[RequestState, RowLogprobs]]:
        """Read the step's ids back, write each over its placeholder (the pages it fills join
        the prefix cache: every cached token is known by then, as the newest a launched step
        feeds is this one) and end the requests a token ends; with them, the logprobs of the
        rows that asked (and the prompts', kept until their request's next output)."""
        if launched.ready is not None:
            launched.ready.synchronize()
        tokens = launched.tokens.tolist()  # the step's one host sync
        asked: dict[RequestState, RowLogprobs] = {}
        if launched.logprobs is not None:
            asked = {launched.states[row]: values for row, values in read_rows(launched.logprobs, tokens).items()}
            for state, prompt in read_prompts(launched.logprobs):
                if state.sequence.prompt_logits:
                    state.sequence.prompt_logits = False  # a later prefill (a preemption) computes them no more
                    self._prompts[state] = prompt
        sampled: list[Sampled] = []
        keep = sampled.append
        eos, max_context, mark = self._eos_token_ids, self._max_context, launched.mark
        running = SequenceStatus.RUNNING
        requests = self._requests
        blocks = requests.scheduler.blocks
        page = blocks.block_size
        with requests.lock:
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
                requests.finish(state)
                keep((state, token, finish, position + 1 - sequence.num_prompt_tokens))
        return sampled, asked

    def _emit(self, collected: tuple[list[Sampled], dict[RequestState, RowLogprobs]]) -> list[TokenOutput]:
        sampled, asked = collected
        outputs = []
        requests = self._requests
        for state, token, finish, generated in sampled:
            text, stopped = state.text(token, generated)
            if stopped and finish != "stop":
                if finish is None:
                    with requests.lock:
                        requests.finish(state)
                finish = "stop"
            if finish is not None:
                text += state.detokenizer.flush()
            output = TokenOutput(
                state.request.request_id, [token], text, finish, cached_tokens=state.cached_prompt_tokens
            )
            if asked and (row := asked.get(state)) is not None:
                output.logprobs = [row[0]]
                output.top_logprobs = [row[1]] if state.request.logprobs else None
            outputs.append(output)
        if self._prompts:
            self._attach_prompts(sampled, outputs)
        return outputs

    def _attach_prompts(self, sampled: list[Sampled], outputs: list[TokenOutput]) -> None:
        """Each prompt's logprobs on its request's output of this step; those of requests that
        left meanwhile are dropped, the others wait for their next output."""
        prompts = self._prompts
        for (state, *_), output in zip(sampled, outputs, strict=True):
            output.prompt = prompts.pop(state, None)
        for state in [state for state in prompts if state.sequence.status is SequenceStatus.FINISHED]:
            del prompts[state]


def first_cached(prefilled: list[RequestState]) -> None:
    """Note, for the requests a step prefills for the first time, how many of their prompt's
    tokens the prefix cache held (``Final.timings.cached_prompt_tokens``)."""
    for state in prefilled:
        if state.cached_prompt_tokens < 0:
            sequence = state.sequence
            state.cached_prompt_tokens = min(sequence.num_cached, sequence.num_prompt_tokens)
