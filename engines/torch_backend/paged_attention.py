"""Decode attention that reads the paged KV cache in place: a Triton kernel.

The eager path (``model._attend``) gathers every sequence's pages into a contiguous buffer
each step, then attends; this kernel reads each key and value row straight from its page.
One program per (sequence, key/value head) computes all the query heads of that group: it
walks the sequence's tokens ``BLOCK_N`` at a time (a tile may span pages: each row's slot is
looked up in the block table), with an online softmax in float32, so it never materialises
scores for the whole context. Loop bounds come from the sequence lengths on the device, so a
CUDA graph captured once serves every context length. With a sliding window W (Mistral), a
sequence of length L reads only its keys from L - W on: the loop starts at the tile that
holds the first of them and masks the ones before it.

Triton ships with CUDA builds of torch. ``TRITON_INTERPRET=1`` runs the same kernel on CPU
tensors, which is how tests/torch/test_torch_kernels.py checks it against the eager path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # tokens per tile


@triton.jit
def _paged_decode_kernel(  # type: ignore[no-untyped-def]  # Triton reads the annotations: only constexpr ones
    out_ptr,
    q_ptr,
    cache_ptr,
    tables_ptr,
    lens_ptr,
    window,
    scale,
    q_token_stride,
    q_head_stride,
    out_token_stride,
    out_head_stride,
    slot_stride,
    value_offset,
    table_stride,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    sequence = tl.program_id(0)
    kv_head = tl.program_id(1)
    length = tl.load(lens_ptr + sequence)
    rows = tl.arange(0, GROUP_PAD)
    row_ok = rows < GROUP
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    heads = kv_head * GROUP + rows
    q_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(
        q_ptr + sequence * q_token_stride + heads[:, None] * q_head_stride + dims[None, :], mask=q_mask, other=0.0
    )

    first = tl.where(window > 0, tl.maximum(length - window, 0), 0)  # the first key read

    best = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for start in range((first // BLOCK_N) * BLOCK_N, length, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N)
        valid = (positions < length) & (positions >= first)
        page = tl.load(tables_ptr + sequence * table_stride + positions // PAGE, mask=valid, other=0)
        slots = page.to(tl.int64) * PAGE + positions % PAGE
        rows_kv = cache_ptr + slots[:, None] * slot_stride + kv_head * HEAD_DIM + dims[None, :]
        kv_mask = valid[:, None] & dim_ok[None, :]
        keys = tl.load(rows_kv, mask=kv_mask, other=0.0)
        values = tl.load(rows_kv + value_offset, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scale  # [GROUP_PAD, BLOCK_N]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, 1))
        weights = tl.exp(scores - new_best[:, None])
        rescale = tl.exp(best - new_best)
        total = total * rescale + tl.sum(weights, 1)
        acc = acc * rescale[:, None] + tl.dot(weights.to(values.dtype), values, input_precision=PRECISION)
        best = new_best
    out = acc / total[:, None]
    tl.store(
        out_ptr + sequence * out_token_stride + heads[:, None] * out_head_stride + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


def paged_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    window: int = 0,
) -> torch.Tensor:
    """Attention of one query per sequence over its pages.

    ``query`` ``[B, heads, head_dim]`` (any strides with a contiguous last dimension);
    ``kv_cache`` one layer's ``[blocks, block_size, 2, kv_heads, head_dim]``, contiguous;
    ``block_tables`` ``[B, >= pages]`` int32; ``context_lens`` ``[B]`` int32, at least 1 each;
    ``window`` > 0: only each sequence's last ``window`` keys are read (0: all of them).
    Returns ``[B, heads, head_dim]`` in the query's dtype."""
    sequences, heads, head_dim = query.shape
    _, page_size, _, kv_heads, cache_head_dim = kv_cache.shape
    assert cache_head_dim == head_dim and heads % kv_heads == 0, "the query's heads fold onto the cache's"
    assert kv_cache.is_contiguous() and query.stride(2) == 1, "rows are read with unit stride"
    assert block_tables.shape[0] == sequences and context_lens.shape == (sequences,), "one table and length per query"
    group = heads // kv_heads
    out = torch.empty((sequences, heads, head_dim), dtype=query.dtype, device=query.device)
    _paged_decode_kernel[(sequences, kv_heads)](
        out,
        query,
        kv_cache,
        block_tables,
        context_lens,
        window,
        head_dim**-0.5,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(1),
        kv_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        PAGE=page_size,
        BLOCK_N=BLOCK_N,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    return out
