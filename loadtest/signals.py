"""SIGTERM ends a run that started servers as Ctrl-C does.

Why: Python's default for SIGTERM (a CI job's timeout, ``kill``, ``timeout``, a container's stop) ends the process at
once, without running its ``finally`` and ``with`` blocks, so the servers a sweep, comparison or soak started (each a
process group of its own) kept running without it, holding the cores and ports the next run needs. Raised as
``SystemExit`` instead, the signal unwinds those blocks, and they stop what they started.
"""

from __future__ import annotations

import signal
import threading

EXIT_STATUS = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM


def exit_on_sigterm() -> None:
    """From now on SIGTERM raises ``SystemExit`` in the main thread. Call it from a command's ``__main__`` block; in
    any other thread (a test calling ``main()`` from a worker) it does nothing, as Python allows handlers only there."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_exit)


def _raise_exit(signum, frame) -> None:
    raise SystemExit(EXIT_STATUS)
