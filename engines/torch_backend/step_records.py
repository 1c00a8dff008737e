"""What one step of the torch backend carries between its phases: the step in flight
(:class:`Launched`), each row's token once read back (:class:`Sampled`), and the batch's
sampling parameters, built from the rows' requests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.torch_backend.request_state import RequestState
from engines.torch_backend.sampling import SamplingParams
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


@dataclass(slots=True)
class Sampled:
    state: RequestState
    token: int
    finish: FinishReason | None
    generated: int  # which generated token of its request it is, counting from 1


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
