"""The torch backend from the command line: it is the default, and its settings are flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.factory import make_backend
from engines.torch_backend.backend import TorchBackend
from service.cli import build_parser, settings_from
from service.settings import Settings


def test_torch_is_the_default_backend() -> None:
    assert Settings().backend == "torch"


def test_engine_flags_reach_the_settings() -> None:
    args = build_parser().parse_args(
        ["engine", "--model", "/models/llama", "--dtype", "bfloat16", "--max-batch", "8", "--kv-cache-gb", "0.5",
         "--max-context", "1024", "--model-seed", "3", "--device", "cpu"]
    )
    settings = settings_from(args)
    assert args.model == "/models/llama"
    assert (settings.dtype, settings.max_batch, settings.kv_cache_gb, settings.max_context, settings.model_seed) == (
        "bfloat16", 8, 0.5, 1024, 3)
    submit = build_parser().parse_args(["submit", "Hello", "--stream", "--seed", "4"])
    assert submit.seed == 4  # a request's seed, not the model's


def test_factory_builds_the_torch_backend_and_refuses_a_model_for_echo(tmp_path: Path) -> None:
    settings = Settings(device="cpu", max_context=64, kv_cache_gb=0.001)
    assert isinstance(make_backend(settings), TorchBackend)
    with pytest.raises(ValueError, match="needs the torch backend"):
        make_backend(settings.model_copy(update={"backend": "echo"}), str(tmp_path))


def test_a_directory_without_config_json_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no config.json"):
        make_backend(Settings(device="cpu"), str(tmp_path))
