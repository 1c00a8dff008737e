"""The decoder every supported family is, over a paged KV cache: RMSNorm, rotary embeddings,
grouped-query attention, a SwiGLU MLP or a mixture of experts; what a family adds (biases,
head norms on q and k, a sliding window, experts) is switched on by its
:class:`~engines.torch_backend.config.ModelConfig`.

One forward pass runs a whole step of continuous batching: the new tokens of every scheduled
sequence are flattened into ``T`` rows, so the projections and the MLP are single matrix
products over the batch. Attention reads the cache: decode sequences (one query each) in one
group, prefills in groups of like query lengths (queries padded to each group's longest). Projections are fused
(q|k|v and gate|up) to save kernel launches; :mod:`engines.torch_backend.weights` maps
Hugging Face parameter names onto them. Query heads are folded onto their key/value head
(``[B, kv_heads, group * Q, head_dim]``), which is grouped-query attention without copying
keys and values per query head.

Decode attention has two forms: by default each sequence's pages are gathered into a
contiguous buffer and attended with an additive mask; with ``kernels.paged_decode`` (CUDA)
a kernel reads the pages in place, bounded by each sequence's length. A sliding window is in
the masks (:mod:`engines.torch_backend.batch`) and passed to the kernel. The element-wise
pieces and the experts come from :mod:`engines.torch_backend.kernels` as well: eager, or
fused on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engines.torch_backend.config import ModelConfig
from engines.torch_backend.kernels import EAGER, Kernels
from engines.torch_backend.mlp import DenseMlp, SparseMoe, project_add


@dataclass(slots=True)
class AttentionGroup:
    """Sequences attended together. ``block_tables`` ``[B, blocks]`` index cache pages.
    Gathered attention: ``mask`` ``[B, 1, group * Q, blocks * block_size]`` (additive: 0 or
    -inf, the model's dtype) says which cached slots each query sees. Paged decode:
    ``context_lens`` ``[B]`` (int32, as are the block tables) says how many slots each reads.
    ``pad_index`` ``[tokens]`` places the group's flat query rows into ``[B * Q]`` padded rows;
    it is None for decode, where ``Q`` is 1 and rows map one to one."""

    block_tables: torch.Tensor
    mask: torch.Tensor | None
    query_len: int
    pad_index: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None


@dataclass(slots=True)
class ForwardBatch:
    """One step's inputs; flat rows are the decode tokens first, then each prefill's tokens."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] cache slot each token's key and value go to
    last_token_index: torch.Tensor  # [B (+ prompt rows)] the row whose logits sample each sequence's next token
    decode: AttentionGroup | None
    prefill: tuple[AttentionGroup, ...]  # their rows follow the decode rows, group after group


class RMSNorm(nn.Module):
    """The norm's weight; ``kernels.rms_norm`` applies it."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.config = config
        hidden, head_dim = config.hidden_size, config.head_dim
        self.input_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.qkv = nn.Linear(hidden, (config.num_heads + 2 * config.num_kv_heads) * head_dim, bias=config.qkv_bias)
        self.o = nn.Linear(config.num_heads * head_dim, hidden, bias=config.o_bias)
        # Qwen3: one RMSNorm over each query head and one over each key head, before rotary.
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.post_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.mlp: DenseMlp | SparseMoe = (
            SparseMoe(hidden, config.moe) if config.moe is not None and config.sparse(index) else DenseMlp(config)
        )

    def forward(
        self, hidden: torch.Tensor, rotary: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch, kernels: Kernels
    ) -> torch.Tensor:
        normed = kernels.rms_norm(hidden, self.input_norm.weight, self.input_norm.eps)
        hidden = project_add(hidden, self._attention(normed, rotary, kv_cache, batch, kernels), self.o)
        normed = kernels.rms_norm(hidden, self.post_norm.weight, self.post_norm.eps)
        return self.mlp(normed, hidden, kernels)

    def _attention(
        self, x: torch.Tensor, rotary: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch, kernels: Kernels
    ) -> torch.Tensor:
        config = self.config
        heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        tokens = x.shape[0]
        qkv = F.linear(x, self.qkv.weight, self.qkv.bias).view(tokens, heads + 2 * kv_heads, head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            qkv[:, :heads] = kernels.rms_norm(qkv[:, :heads], self.q_norm.weight, self.q_norm.eps)
            qkv[:, heads : heads + kv_heads] = kernels.rms_norm(
                qkv[:, heads : heads + kv_heads], self.k_norm.weight, self.k_norm.eps
            )
        kernels.rotate_(qkv[:, : heads + kv_heads], rotary)

        # kv_cache: [blocks, block_size, 2, kv_heads, head_dim]; slot s is row s of the flat view.
        new_kv = qkv[:, heads:].view(tokens, 2, kv_heads, head_dim)
        assert batch.slot_mapping.shape == (tokens,), "one cache slot per new token"
        kv_cache.view(-1, 2, kv_heads, head_dim).index_copy_(0, batch.slot_mapping, new_kv)

        query = qkv[:, :heads]
        out = []
        if batch.decode is not None:
            out.append(
                self._attend_decode(query[: batch.decode.block_tables.shape[0]], kv_cache, batch.decode, kernels)
            )
        row = 0 if batch.decode is None else batch.decode.block_tables.shape[0]
        for group in batch.prefill:
            assert group.pad_index is not None, "a prefill group carries its padding index"
            rows = group.pad_index.shape[0]
            out.append(self._attend_prefill(query[row : row + rows], kv_cache, group))
            row += rows
        return out[0] if len(out) == 1 else torch.cat(out)

    def _attend_decode(
        self, query: torch.Tensor, kv_cache: torch.Tensor, group: AttentionGroup, kernels: Kernels
    ) -> torch.Tensor:
        config = self.config
        sequences = query.shape[0]
        if group.context_lens is not None:
            assert kernels.paged_decode is not None, "a paged decode group needs the paged kernel"
            window = config.sliding_window or 0
            return kernels.paged_decode(query, kv_cache, group.block_tables, group.context_lens, window).view(
                sequences, -1
            )
        folded = query.reshape(sequences, config.num_kv_heads, config.group_size, config.head_dim)
        out = _attend(folded, kv_cache, group)  # [B, kv_heads, group, head_dim]
        return out.reshape(sequences, config.num_heads * config.head_dim)

    def _attend_prefill(self, query: torch.Tensor, kv_cache: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
        config = self.config
        sequences, q_len = group.block_tables.shape[0], group.query_len
        assert group.pad_index is not None, "a prefill group carries its padding index"
        padded = query.new_zeros(sequences * q_len, config.num_heads, config.head_dim)
        padded.index_copy_(0, group.pad_index, query)
        folded = (
            padded.view(sequences, q_len, config.num_kv_heads, config.group_size, config.head_dim)
            .permute(0, 2, 3, 1, 4)
            .reshape(sequences, config.num_kv_heads, config.group_size * q_len, config.head_dim)
        )
        out = _attend(folded, kv_cache, group)  # [B, kv_heads, group * Q, head_dim]
        unfolded = (
            out.view(sequences, config.num_kv_heads, config.group_size, q_len, config.head_dim)
            .permute(0, 3, 1, 2, 4)
            .reshape(sequences * q_len, config.num_heads * config.head_dim)
        )
        return unfolded.index_select(0, group.pad_index)


def _attend(query: torch.Tensor, kv_cache: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """Attention of folded queries ``[B, kv_heads, rows, head_dim]`` over the group's pages."""
    sequences, kv_heads, _, head_dim = query.shape
    pages = kv_cache.index_select(0, group.block_tables.view(-1))  # [B * blocks, block_size, 2, kv_heads, head_dim]
    kv = pages.view(sequences, -1, 2, kv_heads, head_dim)
    keys, values = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # [B, kv_heads, L, head_dim]
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=group.mask)


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, index) for index in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.kernels = EAGER

    def forward(self, batch: ForwardBatch, rotary_table: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, vocab]`` (float32) for the next token of each scheduled sequence, then
        those of the prompt rows ``batch.last_token_index`` adds (engines/torch_backend/batch.py).

        ``kv_cache`` is ``[layers, blocks, block_size, 2, kv_heads, head_dim]``."""
        assert kv_cache.shape[0] == len(self.layers), "one cache page table per layer"
        hidden = self.embed(batch.input_ids)
        rotary = rotary_table[batch.positions]  # [T, 2, head_dim]: cos, signed sin
        kernels = self.kernels
        for layer, layer_cache in zip(self.layers, kv_cache, strict=True):
            hidden = layer(hidden, rotary, layer_cache, batch, kernels)
        last = kernels.rms_norm(hidden[batch.last_token_index], self.norm.weight, self.norm.eps)
        return self.lm_head(last).float()
