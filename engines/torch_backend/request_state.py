"""One request inside the torch backend: its sequence, sampling key, detokeniser and stop rules.

A sampled token ends a request in two stages. What the token alone decides (an EOS id,
``max_tokens``, a full context) is known as soon as the ids are read back, and the request
leaves the scheduler before the next step is scheduled. What needs its text (a stop string)
is known once the token has been detokenised, which may happen while the next step runs. A
migrated request replays its earlier run's tokens through the detokeniser and the stop check
first (:meth:`RequestState.resume`), so its text continues exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from engines.backend import GenerationRequest
from engines.torch_backend.sequence import Sequence
from engines.torch_backend.tokenizer import IncrementalDetokenizer
from service.protocol.messages import FinishReason


@dataclass(eq=False, slots=True)
class RequestState:
    request: GenerationRequest
    sequence: Sequence
    key: int  # the sampling stream's key
    detokenizer: IncrementalDetokenizer
    eos_from: int = 0  # the first position at which an EOS id ends the request (set from the request)
    stop_window: str = ""  # the last characters of the text, enough to see a stop string complete
    resumed_text: str = ""  # the text of the tokens an earlier run generated (a migration)
    cached_prompt_tokens: int = -1  # prompt tokens the prefix cache held when first scheduled; -1 before

    def __post_init__(self) -> None:
        request, sequence = self.request, self.sequence
        self.eos_from = 1 << 62 if request.ignore_eos else sequence.num_prompt_tokens + request.min_tokens
        sequence.limit = min(sequence.limit, sequence.num_prompt_tokens + request.max_tokens)

    def resume(self, tokens: list[int]) -> None:
        """Detokenise the tokens an earlier run generated, as that run did, so the detokeniser's
        window and the stop check continue exactly where it left off."""
        self.resumed_text = "".join(self.text(token)[0] for token in tokens)

    def token_finish(
        self, token: int, eos_token_ids: tuple[int, ...], max_context: int, position: int | None = None
    ) -> FinishReason | None:
        """Whether the token at ``position`` (by default the last) ends the request, by the token
        alone: an EOS id (not with ``ignore_eos``, and only past ``min_tokens``), or its length
        (``max_tokens``, the context). With steps launched ahead, the sequence already holds the
        next step's placeholder after it. Runs for every row of every step: the bounds are
        precomputed (``eos_from``, ``Sequence.limit``)."""
        if position is None:
            position = len(self.sequence.token_ids) - 1
        if token in eos_token_ids and position >= self.eos_from:
            return "stop"
        if position + 1 >= self.sequence.limit or position + 1 >= max_context:
            return "length"
        return None

    def text(self, token: int, generated: int | None = None) -> tuple[str, bool]:
        """The text the token completes, and whether that text completes a stop string (from
        ``min_tokens`` tokens on: a stop string completed before is not matched later).
        ``generated``: which generated token it is, counting from 1 (by default the last)."""
        text = self.detokenizer.push(token)
        stops = self.request.stop
        if not stops or not text:
            return text, False
        window = self.stop_window + text
        keep = max(len(stop) for stop in stops) - 1
        self.stop_window = window[-keep:] if keep else ""
        if (self.sequence.num_generated if generated is None else generated) < self.request.min_tokens:
            self.stop_window = ""
            return text, False
        return text, any(stop in window for stop in stops)
