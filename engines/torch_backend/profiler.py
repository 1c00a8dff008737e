"""The start/stop profiler control signals for the torch backend.

On CUDA they bracket a capture range for Nsight Systems (``cudaProfilerStart`` /
``cudaProfilerStop``, for ``nsys --capture-range=cudaProfilerApi``). On CPU they run
``torch.profiler`` over every thread (the steps run in a worker thread, not the one that
starts the profiler) and write a Chrome trace, whose path the stop answers with.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch


class StepProfiler:
    def __init__(self, device: torch.device, trace_dir: Path) -> None:
        self.device = device
        self.trace_dir = trace_dir
        self._profiler: torch.profiler.profile | None = None

    def start(self) -> str:
        if self.device.type == "cuda":
            torch.cuda.profiler.start()
            return f"cudaProfilerStart on {self.device}"
        if self._profiler is not None:
            raise RuntimeError("the torch profiler is already running")
        from torch._C._profiler import _ExperimentalConfig

        try:
            all_threads = _ExperimentalConfig(profile_all_threads=True)
        except TypeError:
            raise RuntimeError(
                f"the CPU profiler needs torch >= 2.7 to see the step thread; this is {torch.__version__}"
            ) from None
        profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], experimental_config=all_threads
        )
        profiler.start()
        self._profiler = profiler
        return f"torch.profiler started; the trace goes to {self.trace_dir} on stop"

    def stop(self) -> str:
        if self.device.type == "cuda":
            torch.cuda.profiler.stop()
            return f"cudaProfilerStop on {self.device}"
        if self._profiler is None:
            raise RuntimeError("the torch profiler is not running")
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        path = self.trace_dir / f"dpcoord-torch-trace-{os.getpid()}-{time.time_ns()}.json"
        profiler.export_chrome_trace(str(path))
        return str(path)

    def close(self) -> None:
        """Stop a running CPU profiler without writing its trace."""
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None
