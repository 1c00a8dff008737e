"""Torch tests without a CUDA device run Triton kernels under Triton's interpreter. Triton reads
``TRITON_INTERPRET`` when it is first imported, and torch imports it lazily (``torch.compile``,
``torch._dynamo``), possibly in any test of this directory: so it is set here, at collection."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
