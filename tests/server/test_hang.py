"""A hung or crashed tritonserver under load is noticed and replaced by ``make serve``
(``python -m backend.triton.launcher.serve``), its OpenAI frontend refuses new requests at once meanwhile and serves
again afterwards, and SIGTERM ends the launcher within its grace whatever state tritonserver is in.

A SIGSTOPped tritonserver stands in for the hang seen under load (a crash whose signal handler deadlocked: "Signal (11)
received.", "malloc(): unsorted double linked list corrupted", then every thread asleep and nothing answering).
Bounds are generous and every wait polls with a deadline: these run on a loaded two-core machine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from backend.triton.launcher import processes, shutdown, watchdog
from backend.triton.launcher.launch_options import free_ports
from tests.server.test_launcher import _tritonserver_child, group_members
from tests.server_harness import LOCALHOST, REPO_ROOT, make_repository

EXIT_TIMEOUT_S = 5  # tritonserver's --exit-timeout-secs here
# How long the launcher may take to see a hang and have a new server ready: the hang bound and its last probe, the
# kill, and a restart of the tiny model on a busy machine.
RESTART_BOUND_S = watchdog.HANG_TIMEOUT_S + watchdog.PROBE_TIMEOUT_S + 150
BODY = {"model": "llm_continuous", "prompt": "Hello there", "max_tokens": 16}


class Launcher:
    """``make serve`` as a child process on free loopback ports, with its output read on a thread."""

    def __init__(self, repository: Path, model: Path, *extra: str) -> None:
        self.http, self.grpc, self.metrics, self.openai = free_ports(4)
        self.openai_url = f"http://{LOCALHOST}:{self.openai}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "backend.triton.launcher.serve", "--model-repository", str(repository),
             "--model", str(model), "--address", LOCALHOST, "--http-port", str(self.http),
             "--grpc-port", str(self.grpc), "--metrics-port", str(self.metrics), "--openai-port", str(self.openai),
             *extra, "--exit-timeout-secs", str(EXIT_TIMEOUT_S)],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def output(self) -> str:
        return "\n".join(self.lines[-150:])

    def count(self, text: str) -> int:
        return sum(text in line for line in list(self.lines))

    def wait_for(self, text: str, count: int = 1, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while self.count(text) < count:
            assert self.process.poll() is None, f"the launcher exited {self.process.returncode}:\n{self.output()}"
            assert time.monotonic() < deadline, f"no {count}x {text!r} within {timeout:.0f} s:\n{self.output()}"
            time.sleep(0.2)

    def wait_ready(self, count: int = 1) -> int:
        """Wait for the ``count``-th "[serve] ready" and for the frontend to serve a completion; the server's pid."""
        self.wait_for("[serve] ready", count, timeout=RESTART_BOUND_S)
        self.wait_completion()
        return _tritonserver_child(self.process.pid)

    def wait_completion(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                reply = requests.post(f"{self.openai_url}/v1/completions", json=BODY, timeout=30)
                if reply.status_code == 200:
                    assert reply.json()["usage"]["completion_tokens"] >= 1
                    return
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, f"no completion within {timeout:.0f} s:\n{self.output()}"
            time.sleep(0.5)

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)  # the launcher's own group; tritonserver dies with it
            self.process.wait(30)


class Load:
    """Two clients sending completions to the frontend, each until stopped, 200 requests or 5 minutes: whatever
    comes first. Failures are counted, not raised: a server going away fails the requests it held."""

    def __init__(self, url: str, num_clients: int = 2) -> None:
        self.url, self.done = url, threading.Event()
        self.num_ok = self.num_failed = 0
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(num_clients)]
        for thread in self.threads:
            thread.start()

    def _client(self) -> None:
        deadline = time.monotonic() + 300
        for _ in range(200):
            if self.done.is_set() or time.monotonic() > deadline:
                return
            try:
                ok = requests.post(f"{self.url}/v1/completions", json=BODY, timeout=60).status_code == 200
            except requests.RequestException:
                ok = False
            if ok:
                self.num_ok += 1
            else:
                self.num_failed += 1
                self.done.wait(0.2)

    def stop(self) -> None:
        self.done.set()
        for thread in self.threads:
            thread.join(70)


@pytest.fixture(scope="module")
def launcher(tiny_llama_dir, tmp_path_factory):
    repository = make_repository(tmp_path_factory.mktemp("hang-repository"), models=("llm_continuous",))
    launcher = Launcher(repository, tiny_llama_dir, "--max-restarts", "5")
    yield launcher
    launcher.close()


def _refused_at_once(url: str, timeout: float = 60) -> float:
    """Poll a completion until the frontend refuses it with 503; how long that refusal took."""
    deadline = time.monotonic() + timeout
    while True:
        t0 = time.monotonic()
        try:
            reply = requests.post(f"{url}/v1/completions", json=BODY, timeout=5)
            if reply.status_code == 503:
                assert reply.json()["error"]["code"] == "service_unavailable", reply.text
                return time.monotonic() - t0
        except requests.RequestException:  # a request sent before the frontend noticed waits on the hung server
            pass
        assert time.monotonic() < deadline, "the frontend never refused a request while Triton was hung"
        time.sleep(0.2)


@pytest.mark.server
@pytest.mark.timeout(600)
def test_a_stopped_server_under_load_is_killed_and_restarted_and_the_frontend_refuses_meanwhile(launcher):
    first = launcher.wait_ready()
    load = Load(launcher.openai_url)
    try:
        time.sleep(2)
        os.kill(first, signal.SIGSTOP)
        refusal_s = _refused_at_once(launcher.openai_url)
        assert refusal_s < 5, f"a refusal took {refusal_s:.1f} s"  # answered by the frontend, not by Triton
        health = requests.get(f"{launcher.openai_url}/health", timeout=30)
        # "hung" until the launcher has killed it (seconds from now), then "down or restarting"
        assert health.status_code == 503 and " it is " in health.json()["error"]["message"], health.text
        launcher.wait_for("tritonserver hung: ", timeout=RESTART_BOUND_S)
        launcher.wait_for("tritonserver was ended: it hung; restarting it (1 of 5)", timeout=60)
        second = launcher.wait_ready(count=2)
    finally:
        load.stop()
    assert second != first and group_members(first) == {}  # the hung server's stubs are gone too
    assert load.num_ok > 0, launcher.output()


@pytest.mark.server
@pytest.mark.timeout(600)
def test_a_crash_under_load_is_restarted_and_the_frontend_serves_again(launcher):
    restarts = launcher.count("; restarting it (")
    launcher.wait_for("[serve] ready")
    first = _tritonserver_child(launcher.process.pid)
    launcher.wait_completion()
    load = Load(launcher.openai_url)
    try:
        time.sleep(2)
        os.kill(first, signal.SIGSEGV)
        launcher.wait_for("tritonserver died by signal 11", timeout=120)
        launcher.wait_for("; restarting it (", count=restarts + 1, timeout=60)
        launcher.wait_for("[serve] ready", count=restarts + 2, timeout=RESTART_BOUND_S)
        launcher.wait_completion()
    finally:
        load.stop()
    assert _tritonserver_child(launcher.process.pid) != first and group_members(first) == {}


@pytest.mark.server
@pytest.mark.timeout(300)
def test_sigterm_ends_the_launcher_within_its_grace_while_tritonserver_is_stopped(launcher):
    launcher.wait_for("[serve] ready")
    server = _tritonserver_child(launcher.process.pid)
    launcher.wait_completion()
    load = Load(launcher.openai_url, num_clients=1)
    try:
        time.sleep(1)
        os.kill(server, signal.SIGSTOP)
        time.sleep(1)  # the frontend's requests now hang on it; it is stopped once /proc says so (signals are async)
        stopped_by = time.monotonic() + 10
        while processes.process_state(server) != "T" and time.monotonic() < stopped_by:
            time.sleep(0.05)
        assert processes.process_state(server) == "T", processes.process_state(server)
        t0 = time.monotonic()
        launcher.process.send_signal(signal.SIGTERM)
        # The stop's own bound, the frontend's stop (at most 15 s), and a margin for a busy machine.
        grace = EXIT_TIMEOUT_S + shutdown.KILL_MARGIN_S + 15 + 20
        launcher.process.wait(grace)
        took = time.monotonic() - t0
    finally:
        load.stop()
    output = launcher.output()
    assert took < grace, output
    assert "killed: tritonserver had not exited" in output and "(it was stopped: SIGSTOP)" in output, output
    assert launcher.process.returncode == 128 + signal.SIGKILL, output
    assert group_members(server) == {}
