"""Torch tests without a CUDA device run Triton kernels under Triton's interpreter. Triton reads
``TRITON_INTERPRET`` when it is first imported, and torch imports it lazily (``torch.compile``,
``torch._dynamo``), possibly in any test of this directory: so it is set here, at collection.
Also the session's tiny checkpoints of every model family."""

from __future__ import annotations

import os

import pytest
import torch

from tests.torch.families import Checkpoints

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    """Tiny checkpoints of every family (tests/torch/families.py), made once per session."""
    return Checkpoints(tmp_path_factory.mktemp("families"))
