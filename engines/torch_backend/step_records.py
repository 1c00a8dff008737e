"""What one step of the torch backend carries between its phases: the step in flight
(:class:`Launched`), each row's token once read back (:class:`Sampled`), and the batch's
sampling parameters, built from the rows' requests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.torch_backend.logprobs import LaunchedLogprobs, RowsAsking
from engines.torch_backend.request_state import RequestState
from engines.torch_backend.sampling import SamplingParams
from engines.torch_backend.sequence import Sequence
from service.protocol.messages import FinishReason


@dataclass(slots=True)
class Launched:
    """A step on its way: the sampled ids are on the host (``tokens``) once ``ready`` (CUDA)
    has fired, and on the device (``device_tokens``) for the next step to feed."""

    states: list[RequestState]
    positions: list[int]  # of each row's sampled token in its sequence (a placeholder until read)
    tokens: torch.Tensor
    device_tokens: torch.Tensor
    ready: torch.cuda.Event | None
    mark: int  # the scheduler's preemption count at launch: a row preempted since drops its token
    logprobs: LaunchedLogprobs | None = None  # rows that asked for them, on their way to the host too


# A row's token once read back: its request, the token, why it ends the request (None: it does
# not), and which generated token of the request it is, counting from 1. A tuple: one is made
# per row and step.
Sampled = tuple[RequestState, int, FinishReason | None, int]


class StepRows:
    """The rows of the last step launched: a step with the same sequences in the same order
    (most decode steps) reuses their request states, whether all of them are greedy and which
    asked for logprobs, instead of looking each up again."""

    def __init__(self) -> None:
        self._sequences: list[Sequence] = []
        self._states: list[RequestState] = []
        self.greedy = True  # every row of the last step samples greedily
        self.asking: RowsAsking | None = None  # the rows of the last step that asked for logprobs

    def states(self, sequences: list[Sequence], requests: dict[str, RequestState]) -> list[RequestState]:
        if sequences != self._sequences:  # identity, row by row, in C: Sequence compares by identity
            self._sequences = sequences
            self._states = [requests[sequence.request_id] for sequence in sequences]
            self.greedy = all(state.request.temperature == 0 for state in self._states)
            self.asking = RowsAsking.of(self._states)
        return self._states


def sampling_params(states: list[RequestState], device: torch.device) -> SamplingParams | None:
    """None when every row is greedy: argmax needs no parameters."""
    requests = [state.request for state in states]
    if all(request.temperature == 0 for request in requests):
        return None
    return SamplingParams.build(
        [request.temperature for request in requests],
        [request.top_k for request in requests],
        [request.top_p for request in requests],
        [state.key for state in states],
        [state.sequence.num_generated for state in states],
        device,
    )
