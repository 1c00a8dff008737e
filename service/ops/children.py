"""Child processes that die with their parent.

On Linux, ``PR_SET_PDEATHSIG`` asks the kernel to send a signal to a process when the thread that
started it exits, even when that parent was SIGKILLed and could run no clean-up: ``dpcoord up``
and a gateway with several workers start their children with :func:`die_with_parent` as the
``preexec_fn``, so none outlives them. Elsewhere it does nothing (the parent's own stop path
remains the only clean-up there).

The signal is SIGKILL, not SIGTERM: a parent that exits without stopping its children was
killed, and its other children (``up``'s nats-server among them) die at the same moment, so a
graceful stop has nobody left to hand its work to. It would only wait, for its timeouts, on a
bus that is gone (a coordinator's hand-over to peers took 10 s that way). An orderly stop is the
parent's: it signals its children itself and waits for them.

``preexec_fn`` runs in the child between fork and exec, where looking a library up (which may
start a process) or loading one could deadlock: libc is opened here, at import, in the parent,
and the child only makes the one call.
"""

from __future__ import annotations

import ctypes
import signal
import sys

PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent() -> None:
    """Run in the child between fork and exec: SIGKILL it when its parent dies."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
