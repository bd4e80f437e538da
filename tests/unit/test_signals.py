"""SIGTERM ends a command that started servers as Ctrl-C does: its with-blocks run and stop what they started."""

import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from loadtest.signals import EXIT_STATUS, exit_on_sigterm

REPO_ROOT = Path(__file__).resolve().parents[2]
# A command holding a "server" in a with-block, as peer_sweep, compare, soak and slo do; the flag file says its
# cleanup ran.
COMMAND = textwrap.dedent("""
    import contextlib, pathlib, sys, time
    from loadtest.signals import exit_on_sigterm
    folder = pathlib.Path(sys.argv[1])
    if sys.argv[2] == "handled":
        exit_on_sigterm()

    @contextlib.contextmanager
    def server():
        try:
            yield
        finally:
            (folder / "stopped").write_text("yes")

    with server():
        (folder / "ready").write_text("yes")
        time.sleep(120)
""")


def run_and_terminate(folder: Path, mode: str) -> int:
    process = subprocess.Popen([sys.executable, "-c", COMMAND, str(folder), mode], cwd=REPO_ROOT)
    try:
        deadline = time.monotonic() + 60  # a loaded machine may take long to start Python
        while not (folder / "ready").exists():
            assert process.poll() is None, "the command ended before it was ready"
            assert time.monotonic() < deadline, "the command never got ready"
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        return process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_sigterm_runs_the_with_blocks_that_stop_the_servers(tmp_path):
    assert run_and_terminate(tmp_path, "handled") == EXIT_STATUS == 143
    assert (tmp_path / "stopped").read_text() == "yes"


def test_without_it_sigterm_skips_them(tmp_path):  # why it is needed: Python's default leaves the servers running
    assert run_and_terminate(tmp_path, "default") == -signal.SIGTERM
    assert not (tmp_path / "stopped").exists()


def test_outside_the_main_thread_it_sets_nothing():
    before = signal.getsignal(signal.SIGTERM)
    errors = []

    def call():
        try:
            exit_on_sigterm()
        except Exception as exc:  # pragma: no cover - the failure this test looks for
            errors.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    thread.join()
    assert not errors and signal.getsignal(signal.SIGTERM) is before


COMMANDS = ["bench/peer_sweep.py", "loadtest/compare.py", "loadtest/soak.py", "loadtest/slo.py"]


@pytest.mark.parametrize("module", COMMANDS)
def test_every_command_that_starts_servers_sets_it_before_main(module):
    main_block = (REPO_ROOT / module).read_text().split('if __name__ == "__main__":', 1)[1]
    assert main_block.index("exit_on_sigterm()") < main_block.index("main()")
