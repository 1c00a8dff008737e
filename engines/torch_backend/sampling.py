"""Per-request sampling for a whole batch in one pass, with no host sync per request.

Each row has its own temperature (0: greedy), top-k (0: off) and top-p. Randomness comes
from a counter-based hash of (request key, tokens generated so far), computed on the device
for all rows at once: a request's n-th token depends only on its own seed, prompt and n, so
the same seed and prompt give the same tokens whatever the batch neighbours, on CPU and CUDA
alike, after a suspend/recompute, and in another process: a request migrated to another engine
with its streamed tokens (``resume_tokens``, counted as generated) continues the stream where its
first run left off, so seeded continuations equal an uninterrupted run. The token is drawn by inverse CDF over the
probabilities sorted in descending order, after temperature, top-k and top-p (the order
transformers applies them in).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


def request_key(seed: int | str) -> int:
    """A 32-bit stream key for a seed of any size or sign (or, unseeded, a request id): the same
    in every process, so a request that migrates to another engine keeps its stream."""
    text = str(seed) if isinstance(seed, int) else f"request:{seed}"
    digest = hashlib.blake2b(text.encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) on int64 tensors; products wrap, the mask keeps 32 bits."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def uniforms(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One float in [0, 1) per row from its key and counter (both int64, values below 2**32)."""
    bits = _mix32(keys ^ _mix32(counters + 0x9E3779B9))
    return (bits >> 8).to(torch.float32) * (1.0 / (1 << 24))


@dataclass(slots=True)
class SamplingParams:
    """Per-row parameters of one step, already on the device."""

    temperature: torch.Tensor  # [B] float32, 0: greedy
    top_k: torch.Tensor  # [B] int64, 0: off
    top_p: torch.Tensor  # [B] float32
    keys: torch.Tensor  # [B] int64
    counters: torch.Tensor  # [B] int64: tokens the request generated before this one

    @classmethod
    def build(
        cls,
        temperature: list[float],
        top_k: list[int],
        top_p: list[float],
        keys: list[int],
        counters: list[int],
        device: torch.device,
    ) -> SamplingParams:
        def put(values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return cls(
            put(temperature, torch.float32),
            put(top_k, torch.int64),
            put(top_p, torch.float32),
            put(keys, torch.int64),
            put(counters, torch.int64),
        )


@dataclass(slots=True)
class Draw:
    """What :func:`draw` sampled, and from what: the distribution each row's token was drawn
    from (after temperature, top-k and top-p; a greedy row's is not this one but the one-hot
    at its token), in descending order, unnormalised, with its token ids and the sampled
    token's rank in it. ``sorted_probs``, ``order`` and ``rank`` are None when every row is
    greedy."""

    tokens: torch.Tensor  # [B]
    sorted_probs: torch.Tensor | None  # [B, vocab] float32
    order: torch.Tensor | None  # [B, vocab] int64: the token id at each rank
    rank: torch.Tensor | None  # [B] int64


def sample(logits: torch.Tensor, params: SamplingParams | None) -> torch.Tensor:
    """Next token ids ``[B]`` from float32 logits ``[B, vocab]``; ``params`` None: all greedy."""
    return draw(logits, params).tokens


def draw(logits: torch.Tensor, params: SamplingParams | None) -> Draw:
    """:func:`sample`, keeping the distribution sampled from (for processed log-probabilities)."""
    greedy_tokens = logits.argmax(dim=-1)
    if params is None:
        return Draw(greedy_tokens, None, None, None)
    vocab = logits.shape[-1]
    greedy = params.temperature == 0
    temperature = torch.where(greedy, torch.ones_like(params.temperature), params.temperature)
    sorted_logits, order = (logits / temperature[:, None]).sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    ranks = torch.arange(vocab, device=logits.device)
    top_k = torch.where(params.top_k > 0, params.top_k, vocab)
    probs = probs * (ranks[None, :] < top_k[:, None])
    probs = probs / probs.sum(dim=-1, keepdim=True)
    # top-p: keep the smallest prefix whose mass reaches p (the first token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    probs = probs * (mass_before < params.top_p[:, None])
    cdf = probs.cumsum(dim=-1)
    threshold = uniforms(params.keys, params.counters) * cdf[:, -1]
    choice = (cdf <= threshold[:, None]).sum(dim=-1).clamp_(max=vocab - 1)
    sampled = order.gather(1, choice[:, None]).squeeze(1)
    return Draw(torch.where(greedy, greedy_tokens, sampled), probs, order, choice)
