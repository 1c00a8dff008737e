"""The CUDA fast path of the torch backend, built piece by piece, each piece guarded.

Three pieces make a decode step fast: the compiled element-wise kernels, the Triton paged
decode kernel and the CUDA graphs replayed per batch bucket (which need the paged kernel).
Each is built and checked at load time (:mod:`engines.torch_backend.setup` for the kernels,
:func:`capture_graphs` here for the graphs); a piece that fails is logged with its traceback,
counted in :attr:`ExecutionPath.failures` and replaced by its eager form, so the engine still
serves, slower, and says so: the path is in the startup log, in the engine's status and in
every benchmark row. ``require_fast_path`` turns a missing piece into a refusal to start
(:func:`require_fast`), which is what a benchmark run on a GPU wants.
"""

from __future__ import annotations

import logging
import time

import torch

from engines.backend import ExecutionPath
from engines.torch_backend.cuda_graphs import DecodeGraphs
from engines.torch_backend.kernels import Kernels, rms_norm
from engines.torch_backend.model import DecoderModel

log = logging.getLogger(__name__)


class LoadPhases:
    """Seconds each phase of loading took (weights, kernel checks, cache, graph capture), for
    the startup log and the GPU preflight: a slow load says where its time went."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._mark = time.perf_counter()

    def done(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = now - self._mark
        self._mark = now

    def describe(self) -> str:
        return ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in self.seconds.items())


class FastPathUnavailable(RuntimeError):
    """``require_fast_path`` is set and a piece of the fast path is off: the engine does not start."""


def require_fast(path: ExecutionPath) -> None:
    if not path.fast:
        raise FastPathUnavailable(
            f"require_fast_path is set, but {', '.join(path.missing())} "
            f"{'is' if len(path.missing()) == 1 else 'are'} off ({path.describe()}); "
            "see the log for the tracebacks, or drop the setting to serve on the slower path"
        )


def possible_path(device: torch.device, cuda_graphs: bool, torch_compile: bool) -> ExecutionPath:
    """The best path the device and the options allow, before anything is built."""
    on_cuda = device.type == "cuda"
    return ExecutionPath(device.type, on_cuda and cuda_graphs, on_cuda, on_cuda and torch_compile)


def capture_graphs(
    model: DecoderModel,
    rotary: torch.Tensor,
    kv_cache: torch.Tensor,
    max_batch: int,
    max_pages: int,
    block_size: int,
    failures: list[str],
) -> DecodeGraphs | None:
    """The decode graphs, or None (decode then runs eagerly) if capturing them fails: the
    failure is logged with its traceback and appended to ``failures``."""
    try:
        return DecodeGraphs(model, rotary, kv_cache, max_batch, max_pages, block_size)
    except Exception:
        log.exception("capturing the decode CUDA graphs failed: decode runs eagerly")
        failures.append("CUDA graphs")
        return None


def execution_path(device: torch.device, kernels: Kernels, graphs: bool, failures: list[str]) -> ExecutionPath:
    return ExecutionPath(
        device=device.type,
        cuda_graphs=graphs,
        paged_kernel=kernels.paged_decode is not None,
        compiled=kernels.rms_norm is not rms_norm,
        failures=tuple(dict.fromkeys(failures)),
    )
