"""What the torch backend is told: device, precision, batching, KV cache and the CUDA fast paths.

The engine's factory (``engines/factory.py``) builds these from the service settings; the
backend sees nothing else of them. Each field is documented in docs/engines.md.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TorchOptions:
    device: str = "auto"  # auto (cuda when available), cpu, cuda, cuda:N
    dtype: str = "auto"  # auto, float32, bfloat16, float16
    cpu_threads: int | None = None
    model_seed: int = 0
    max_batch: int = 128
    max_context: int | None = None  # None: the model's max_position_embeddings
    max_prefill_tokens: int = 4096
    kv_block_size: int = 16
    kv_cache_gb: float | None = None  # None: sized from the memory free after loading
    kv_memory_fraction: float = 0.9
    profile_dir: str | None = None  # None: the system temp directory
    prefix_caching: bool = True
    cuda_graphs: bool = True  # CUDA only: decode steps replay graphs captured per batch bucket
    torch_compile: bool = True  # CUDA only: element-wise pieces fused by torch.compile
    # Launch step n + 1 before step n's tokens are detokenised. None: on CUDA only, where the
    # launch returns at once and the GPU computes while Python works; on CPU it only delays tokens.
    overlap_steps: bool | None = None
    # Refuse to start unless decode replays CUDA graphs over the paged kernel with the compiled
    # pieces (engines/torch_backend/fast_path.py): for benchmarks, which must not measure a fallback.
    require_fast_path: bool = False
