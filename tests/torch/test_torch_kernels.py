"""The CUDA-path pieces checked on CPU: the Triton paged decode kernel (run by Triton's
interpreter, ``TRITON_INTERPRET=1``) against the eager gathered attention, alone and inside
the model; the ``torch.compile`` element-wise pieces traced whole (``aot_eager``, so the same
graphs as on CUDA, without a GPU) against eager; the kernels' load-time check; the CUDA graph
batch buckets. Where Triton is not installed (it is not in the CPU install; CUDA builds of
torch bring it), the kernel tests skip. With a CUDA device they run on it instead; without one,
tests/torch/conftest.py makes Triton interpret them."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engines.torch_backend.batch import build_batch
from engines.torch_backend.cuda_graphs import (
    GraphInputs,
    StaticDecodeBatch,
    decode_buckets,
)
from engines.torch_backend.kernels import EAGER, Kernels, compiled_pointwise
from engines.torch_backend.rope import rotary_table
from engines.torch_backend.scheduler import ScheduledBatch
from engines.torch_backend.sequence import Sequence
from engines.torch_backend.setup import check_kernels
from tests.torch.reference import TINY, engine_model, random_weights, record_token, tiny

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(
    not HAS_TRITON, reason="Triton is not installed (pip install triton, or a CUDA build of torch)"
)


def paged_decode_kernel() -> Kernels:
    """Imported late: this module loads without Triton. On CPU it runs interpreted (conftest.py)."""
    from engines.torch_backend.paged_attention import paged_decode

    return Kernels(EAGER.rms_norm, EAGER.rotate_, EAGER.silu_mul, paged_decode)


def test_decode_buckets() -> None:
    assert decode_buckets(1) == [1]
    assert decode_buckets(6) == [1, 2, 4, 6]
    assert decode_buckets(16) == [1, 2, 4, 8, 16]
    assert decode_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert decode_buckets(256) == [1, 2, 4, 8, *range(16, 257, 16)]


@needs_triton
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "window"),
    [(8, 2, 32, 16, 0), (4, 4, 24, 3, 0), (6, 1, 16, 5, 0), (8, 2, 32, 16, 7), (4, 2, 16, 4, 66)],
)
def test_paged_decode_equals_gathered_attention(
    heads: int, kv_heads: int, head_dim: int, block_size: int, window: int
) -> None:
    """``window`` > 0 (a sliding window): only each sequence's last ``window`` keys count; 66
    starts the 70-token sequence's keys past the first 64-token tile."""
    kernel = paged_decode_kernel().paged_decode
    assert kernel is not None
    generator = torch.Generator().manual_seed(heads * head_dim)
    pages, lengths = 60, [1, block_size, 2 * block_size + 1, 70, 140]
    cache = torch.randn((pages, block_size, 2, kv_heads, head_dim), generator=generator).to(DEVICE)
    width = max(-(-length // block_size) for length in lengths)
    tables = torch.stack([torch.randperm(pages - 1, generator=generator)[:width] for _ in lengths]).to(torch.int32)
    # A view of fused q|k|v rows, as the model passes it.
    query = torch.randn((len(lengths), heads + 2 * kv_heads, head_dim), generator=generator).to(DEVICE)[:, :heads]
    out = kernel(query, cache, tables.to(DEVICE), torch.tensor(lengths, dtype=torch.int32, device=DEVICE), window)
    for row, length in enumerate(lengths):
        first = max(length - window, 0) if window else 0
        slots = [int(tables[row, p // block_size]) * block_size + p % block_size for p in range(first, length)]
        kv = cache.view(-1, 2, kv_heads, head_dim)[slots].transpose(0, 2)
        folded = query[row].reshape(kv_heads, heads // kv_heads, head_dim)
        expected = torch.nn.functional.scaled_dot_product_attention(folded, kv[:, 0], kv[:, 1]).reshape(heads, head_dim)
        torch.testing.assert_close(out[row], expected, atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("window", [None, 5], ids=["full", "sliding window"])
def test_the_model_decodes_the_same_with_the_paged_kernel(window: int | None) -> None:
    config = tiny(num_layers=2, sliding_window=window)
    model = engine_model(config, random_weights(config, seed=8)).to(DEVICE)
    block_size, pages = 4, 40
    rotary = rotary_table(config.rope, config.head_dim, 128, torch.float32, DEVICE)
    prompts = [[(5 * i + k) % 256 for k in range(3 + 4 * i)] for i in range(4)]
    sequences = [Sequence.from_prompt(str(i), prompt) for i, prompt in enumerate(prompts)]
    next_page = 0
    for sequence in sequences:
        count = -(-(len(sequence.token_ids) + 1) // block_size)
        sequence.block_table = list(range(next_page, next_page + count))
        next_page += count
    cache = torch.zeros(config.num_layers, pages, block_size, 2, config.num_kv_heads, config.head_dim, device=DEVICE)
    with torch.inference_mode():
        prefill = build_batch(
            ScheduledBatch([], sequences), block_size, config.group_size, torch.float32, DEVICE, sliding_window=window
        )
        first = model(prefill, rotary, cache).argmax(dim=-1).tolist()
        for sequence, token in zip(sequences, first, strict=True):
            record_token(sequence, token)
        decode = ScheduledBatch(sequences, [])
        gathered = build_batch(decode, block_size, config.group_size, torch.float32, DEVICE, sliding_window=window)
        eager = model(gathered, rotary, cache.clone())
        model.kernels = paged_decode_kernel()
        paged_batch = build_batch(decode, block_size, config.group_size, torch.float32, DEVICE, paged_decode=True)
        assert paged_batch.decode is not None and paged_batch.decode.mask is None
        paged = model(paged_batch, rotary, cache)
    torch.testing.assert_close(paged, eager, atol=1e-4, rtol=1e-4)


def test_compiled_pointwise_pieces_trace_whole_and_equal_eager() -> None:
    kernels = Kernels(*compiled_pointwise("aot_eager"), None)
    rotary = rotary_table(TINY.rope, TINY.head_dim, 64, torch.float32, torch.device("cpu"))
    check_kernels(kernels, TINY, rotary)  # fullgraph=True: a graph break would raise
    for tokens in (1, 7, 33):  # dynamic shapes: one compilation serves every length
        hidden = torch.randn(tokens, TINY.hidden_size).to(torch.bfloat16)
        weight = torch.randn(TINY.hidden_size).to(torch.bfloat16)
        torch.testing.assert_close(kernels.rms_norm(hidden, weight, 1e-5), EAGER.rms_norm(hidden, weight, 1e-5))


@needs_triton
def test_the_load_time_check_passes_the_kernels_and_catches_a_wrong_one() -> None:
    kernels = paged_decode_kernel()
    rotary = rotary_table(TINY.rope, TINY.head_dim, 64, torch.float32, DEVICE)
    check_kernels(kernels, TINY, rotary)
    check_kernels(kernels, tiny(sliding_window=4096), rotary)  # checked with a window that leaves keys out
    assert kernels.paged_decode is not None
    kernel = kernels.paged_decode

    def off_by_one(
        query: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor, window: int = 0
    ) -> torch.Tensor:
        return kernel(query, cache, tables, (lengths - 1).clamp(min=1), window)

    with pytest.raises(AssertionError):
        check_kernels(Kernels(EAGER.rms_norm, EAGER.rotate_, EAGER.silu_mul, off_by_one), TINY, rotary)


@needs_triton
def test_a_padded_static_decode_batch_gives_the_unpadded_rows_and_touches_only_the_scratch_page() -> None:
    """What a CUDA graph replays, run eagerly: the static buffers of a bucket, padding rows
    included, reused by a smaller step after a larger one."""
    config = tiny(num_layers=2)
    model = engine_model(config, random_weights(config, seed=9)).to(DEVICE)
    block_size, pages = 4, 30
    scratch = pages  # the cache's extra last page
    rotary = rotary_table(config.rope, config.head_dim, 128, torch.float32, DEVICE)
    sequences = [Sequence.from_prompt(str(i), [(3 * i + k) % 256 for k in range(2 + 3 * i)]) for i in range(5)]
    next_page = 0
    for sequence in sequences:
        count = -(-(len(sequence.token_ids) + 1) // block_size)
        sequence.block_table = list(range(next_page, next_page + count))
        next_page += count
    cache = torch.zeros(
        config.num_layers, pages + 1, block_size, 2, config.num_kv_heads, config.head_dim, device=DEVICE
    )
    static = StaticDecodeBatch(8, max_pages=10, block_size=block_size, scratch_page=scratch, device=DEVICE)
    with torch.inference_mode():
        prefill = build_batch(ScheduledBatch([], sequences), block_size, config.group_size, torch.float32, DEVICE)
        for sequence, token in zip(sequences, model(prefill, rotary, cache).argmax(dim=-1).tolist(), strict=True):
            record_token(sequence, token)
        model.kernels = paged_decode_kernel()
        for chosen in (sequences, sequences[:3]):  # five rows, then three: rows 3..7 are padding the second time
            expected = model(
                build_batch(ScheduledBatch(chosen, []), block_size, config.group_size, torch.float32, DEVICE),
                rotary,
                cache.clone(),
            )
            before = cache.clone()
            static.load(GraphInputs.of(chosen, 8, block_size, scratch))
            logits = model(static.batch(8), rotary, cache)
            torch.testing.assert_close(logits[: len(chosen)], expected, atol=1e-4, rtol=1e-4)
            written = (cache != before).any(dim=(0, 2, 3, 4, 5)).nonzero().flatten().tolist()
            own = {sequence.block_table[(len(sequence.token_ids) - 1) // block_size] for sequence in chosen}
            assert set(written) <= own | {scratch}
