"""The torch backend from the command line: it is the default, and its settings are flags."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from engines.factory import make_backend
from engines.torch_backend.backend import TorchBackend
from service.cli.main import build_parser, settings_from
from service.ops.settings import Settings
from tests.helpers import REPO_ROOT, read_up_banner
from tests.torch.families import Checkpoints


def test_torch_is_the_default_backend() -> None:
    assert Settings().backend == "torch"


def test_engine_flags_reach_the_settings() -> None:
    args = build_parser().parse_args(
        [
            "engine",
            "--model",
            "/models/llama",
            "--dtype",
            "bfloat16",
            "--max-batch",
            "8",
            "--kv-cache-gb",
            "0.5",
            "--max-context",
            "1024",
            "--model-seed",
            "3",
            "--device",
            "cpu",
        ]
    )
    settings = settings_from(args)
    assert args.model == "/models/llama"
    assert (settings.dtype, settings.max_batch, settings.kv_cache_gb, settings.max_context, settings.model_seed) == (
        "bfloat16",
        8,
        0.5,
        1024,
        3,
    )
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


@pytest.mark.parametrize("family", [None, "qwen3_moe"], ids=["default model", "qwen3-moe checkpoint"])
def test_up_then_submit_streams_tokens_from_torch_engines(
    tmp_path: Path, checkpoints: Checkpoints, family: str | None
) -> None:
    """The issue's acceptance check: `dpcoord up`, then `dpcoord submit "Hello" --stream`; also
    with `--model` a model directory of another family than Llama."""
    model_dir = None if family is None else checkpoints.get(family).path
    model = [] if model_dir is None else ["--model", str(model_dir)]
    dpcoord = [sys.executable, "-m", "service"]
    env = {key: value for key, value in os.environ.items() if not key.startswith("DPCOORD_")}
    env.update(
        DPCOORD_SUBJECT_PREFIX="torchup", DPCOORD_KV_CACHE_GB="0.01", DPCOORD_MAX_CONTEXT="256", DPCOORD_CPU_THREADS="1"
    )
    with (tmp_path / "up.log").open("w") as log:
        stack = subprocess.Popen(
            dpcoord + ["up", "--engines", "1", *model],
            env=env,
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        try:
            assert stack.stdout is not None
            lines = read_up_banner(stack.stdout)
            assert "1 torch engine(s)" in lines[0]
            if model_dir is not None:  # the engine serves the directory's model, named after it
                assert f"(models: {model_dir.name})" in "".join(lines)
            url = next(line.split()[1] for line in lines if line.startswith("NATS:"))
            submit = subprocess.run(
                dpcoord + ["submit", "Hello", "--stream", "--max-tokens", "6", "--seed", "1"],
                env=dict(env, DPCOORD_NATS_URL=url),
                cwd=REPO_ROOT,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert submit.returncode == 0, submit.stderr
            streamed, final_line = submit.stdout.rstrip("\n").rsplit("\n", 1)  # JSON escapes its own newlines
            final = json.loads(final_line)
            assert final["type"] == "final" and len(final["generated_tokens"]) == 6
            assert streamed == final["generated_text"]
        finally:
            stack.send_signal(signal.SIGINT)
            assert stack.wait(timeout=30) == 0
