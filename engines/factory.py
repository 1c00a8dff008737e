"""Builds the backend a setting names; torch is imported only when it is chosen."""

from __future__ import annotations

from engines.backend import Backend
from service.ops.settings import Settings


def make_backend(settings: Settings, model: str | None = None) -> Backend:
    if settings.backend == "echo":
        if model is not None:
            raise ValueError("--model needs the torch backend; the echo backend runs no model")
        from engines.echo import ECHO_CONTEXT, EchoBackend

        return EchoBackend(token_delay_ms=settings.token_delay_ms, max_context=settings.max_context or ECHO_CONTEXT)
    if settings.backend == "torch":
        from engines.torch_backend.backend import TorchBackend

        return TorchBackend(settings, model)
    raise ValueError(f"backend {settings.backend!r} is not available in this build")
