"""Inside a Python-backend stub: notice that the server is shutting down, so the model can drain."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable

from backend.contract.server_args import command_line, drain_grace

log = logging.getLogger(__name__)


class ShutdownNotice:
    """Notice, inside a Python-backend stub process, that the server is shutting down: SIGTERM or SIGINT arrives.

    Triton 2.51 (triton_workarounds.SHUTDOWN_NOT_FORWARDED) tells a Python model nothing until it finalizes it, and by
    then the model can no longer respond (and it finalizes a model only once every client stream that used it is
    closed). So whoever stops the server signals the stubs too (``backend.triton.launcher.shutdown.stop``: the launcher,
    the container's entry, the tests), and the model drains: it refuses new requests, lets the ones it has run for
    ``grace`` seconds, and then ends the rest with "the server is shutting down" — before tritonserver's own
    ``--exit-timeout-secs`` runs out.
    ``on_notice(grace)`` runs on a watcher thread.

    NOTE: the stub's own C handler ignores these signals. Python's replaces it; its C-level part writes the signal
    number to the wakeup fd at once, whatever the main thread is doing, and the watcher thread reads it there.
    Must be created on the stub's main thread (initialize()).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, on_notice: Callable[[float], None] | None = None, grace: float | None = None) -> None:
        self.grace = shutdown_grace() if grace is None else grace
        self.deadline: float | None = None  # time.monotonic() after which nothing more runs
        self._on_notice = on_notice
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd)
        for sig in self.SIGNALS:
            signal.signal(sig, lambda *_: None)  # the wakeup fd does the work
        threading.Thread(target=self._watch, args=(read_fd,), name="shutdown-notice", daemon=True).start()

    def is_set(self) -> bool:
        return self.deadline is not None

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def _watch(self, read_fd: int) -> None:
        while not set(os.read(read_fd, 64)) & {int(s) for s in self.SIGNALS}:
            pass
        log.warning("shutdown signal: refusing new requests, ending open ones within %.1f s", self.grace)
        self.deadline = time.monotonic() + self.grace
        if self._on_notice is not None:
            self._on_notice(self.grace)


def shutdown_grace(parent_pid: int | None = None) -> float:
    """Seconds to keep serving after a shutdown signal: tritonserver's exit timeout (read from its command line,
    as this process is its child) less a margin (``backend.contract.server_args.drain_grace``)."""
    return drain_grace(command_line(parent_pid or os.getppid()))
