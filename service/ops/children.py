"""Child processes that die with their parent.

On Linux, ``PR_SET_PDEATHSIG`` asks the kernel to send a signal to a process when the thread that
started it exits, even when that parent was SIGKILLed and could run no clean-up: ``dpcoord up``
and a gateway with several workers start their children with :func:`die_with_parent` as the
``preexec_fn``, so none outlives them. Elsewhere it does nothing (the parent's own stop path
remains the only clean-up there).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Run in the child between fork and exec: SIGTERM it when its parent dies."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
