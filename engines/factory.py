"""Builds the backend a setting names; torch is imported only when it is chosen."""

from __future__ import annotations

from engines.backend import Backend
from engines.torch_backend.options import TorchOptions
from service.ops.settings import Settings


def torch_options(settings: Settings) -> TorchOptions:
    """The torch backend's share of the settings."""
    return TorchOptions(
        device=settings.device,
        dtype=settings.dtype,
        cpu_threads=settings.cpu_threads,
        model_seed=settings.model_seed,
        max_batch=settings.max_batch,
        max_context=settings.max_context,
        max_prefill_tokens=settings.max_prefill_tokens,
        kv_block_size=settings.kv_block_size,
        kv_cache_gb=settings.kv_cache_gb,
        kv_memory_fraction=settings.kv_memory_fraction,
        profile_dir=settings.profile_dir,
        prefix_caching=settings.prefix_caching,
        cuda_graphs=settings.cuda_graphs,
        torch_compile=settings.torch_compile,
        require_fast_path=settings.require_fast_path,
    )


def make_backend(settings: Settings, model: str | None = None) -> Backend:
    if settings.backend == "echo":
        if model is not None:
            raise ValueError("--model needs the torch backend; the echo backend runs no model")
        from engines.echo import ECHO_CONTEXT, EchoBackend

        return EchoBackend(token_delay_ms=settings.token_delay_ms, max_context=settings.max_context or ECHO_CONTEXT)
    if settings.backend == "torch":
        from engines.torch_backend.backend import TorchBackend

        return TorchBackend(torch_options(settings), model)
    raise ValueError(f"backend {settings.backend!r} is not available in this build")
