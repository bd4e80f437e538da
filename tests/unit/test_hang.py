"""A hung tritonserver without a server: the launcher's liveness bound (backend/triton/launcher/watchdog.py), the
bounded stop of a process that cannot act on its signal (shutdown.py), the probe's budget (probe.py) and the OpenAI
frontend's view of Triton (frontend/openai/triton_health.py). tests/server/test_hang.py runs them against real
servers.
"""

from __future__ import annotations

import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from backend.triton.launcher import probe, processes, shutdown, watchdog
from backend.triton.launcher.launch_options import free_ports
from frontend.openai.triton_health import TritonHealth
from tests.server_harness import LOCALHOST


def test_liveness_names_a_probe_silent_for_longer_than_the_bound_and_several_probes_in_a_row():
    live = watchdog.Liveness("/v2/health/live", bound_s=15, min_failed=3)
    for t in range(0, 60, 5):  # still loading its models: it has never answered
        live.observe(False, float(t))
    assert live.hang(60.0) is None
    live.observe(True, 0.0)
    live.observe(False, 1.0)
    live.observe(False, 6.0)
    assert live.hang(30.0) is None  # long enough, but two failed probes only
    live.observe(False, 11.0)
    assert live.hang(15.9) is None  # three, but not 15 s yet
    hang = live.hang(16.0)
    assert (hang.probe, hang.seconds, hang.num_failed) == ("/v2/health/live", 15.0, 3)
    assert str(hang) == "tritonserver hung: /v2/health/live answered nothing for 15 s (3 probes in a row)"
    live.observe(True, 17.0)  # one answer starts the count again
    live.observe(False, 18.0)
    assert live.hang(60.0) is None


def _sleeper() -> subprocess.Popen:
    """A process leading its own group, standing in for tritonserver."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)


class _AnswersOnce(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.end_headers()
        self.server.answered.set()

    def log_message(self, *args):
        pass


@pytest.mark.timeout(60)
def test_supervise_kills_a_server_whose_probes_fail_after_it_answered_and_marks_it(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    metrics = http.server.ThreadingHTTPServer((LOCALHOST, 0), _AnswersOnce)
    metrics.answered = threading.Event()
    threading.Thread(target=metrics.serve_forever, daemon=True).start()
    port = metrics.server_address[1]
    url = f"http://{LOCALHOST}:{port}/metrics"

    def go_away() -> None:  # once it has answered, nothing listens any more
        metrics.answered.wait(30)
        metrics.shutdown()
        metrics.server_close()

    threading.Thread(target=go_away, daemon=True).start()
    server = _sleeper()
    logged: list[str] = []
    try:
        t0 = time.monotonic()
        ended = watchdog.supervise(server.pid, url, port, 0, stopping=lambda: False, log=logged.append,
                                   live_urls={"the metrics port": url}, hang_timeout_s=2.0)
        assert server.wait(10) == -signal.SIGKILL
    finally:
        server.kill()
        server.wait()
    assert metrics.answered.is_set() and time.monotonic() - t0 < 30
    (hang,) = ended
    assert isinstance(hang, watchdog.Hang) and hang.num_failed >= watchdog.MIN_FAILED_PROBES
    assert logged == [str(hang)] and "the metrics port answered nothing" in logged[0]
    assert watchdog.stalled(port) == str(hang)  # the probe reads not ready until the restart


@pytest.mark.timeout(60)
def test_supervise_leaves_a_server_alone_once_a_stop_began():
    server = _sleeper()
    try:
        (port,) = free_ports(1)
        ended = watchdog.supervise(server.pid, f"http://{LOCALHOST}:{port}/metrics", port, 0, stopping=lambda: True,
                                   log=print, live_urls={"x": f"http://{LOCALHOST}:{port}/"}, hang_timeout_s=0.1)
        assert ended == [] and server.poll() is None
    finally:
        server.kill()
        server.wait()


@pytest.mark.timeout(60)
def test_the_stop_kills_a_stopped_server_with_its_group_after_its_exit_timeout():
    http, grpc, metrics = free_ports(3)
    # A stand-in whose command line reads like tritonserver's: ports and a 1-s exit timeout.
    # It starts a child of its own (a stub), in its process group.
    script = "import subprocess, time; subprocess.Popen(['sleep', '120']); time.sleep(120)"
    server = subprocess.Popen([sys.executable, "-c", script, "--http-port", str(http), "--grpc-port", str(grpc),
                               "--metrics-port", str(metrics), "--exit-timeout-secs", "1"], start_new_session=True)
    logged: list[str] = []
    try:
        deadline = time.monotonic() + 20
        while len(processes.process_group_members(server.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(processes.process_group_members(server.pid)) == 2
        # A stop takes effect only once the process is scheduled: until then a SIGTERM sent after it is pending beside
        # it and delivered first (the lower number): the stand-in would just exit. Wait until /proc shows it stopped.
        server.send_signal(signal.SIGSTOP)
        while processes.process_state(server.pid) != "T" and time.monotonic() < deadline + 10:
            time.sleep(0.01)
        assert processes.process_state(server.pid) == "T"
        t0 = time.monotonic()
        result = shutdown.stop(server.pid, log=logged.append, output=lambda: [])
        took = time.monotonic() - t0
        assert server.wait(10) == -signal.SIGKILL
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    assert 1 + shutdown.KILL_MARGIN_S - 0.5 <= took < 1 + shutdown.KILL_MARGIN_S + 20
    assert result.killed is not None and result.forced is None
    assert result.killed.startswith("killed: tritonserver had not exited")
    assert "(it was stopped: SIGSTOP)" in result.killed
    assert logged[-1] == result.killed
    assert processes.process_group_members(server.pid) == []
    assert shutdown.exit_status(-signal.SIGKILL, result) == 128 + signal.SIGKILL  # a kill, not a clean stop


@pytest.mark.timeout(30)
def test_the_probe_reports_a_server_that_accepts_and_never_answers_within_its_budget():
    listener = socket.socket()
    listener.bind((LOCALHOST, 0))
    listener.listen(8)  # connections are accepted by the kernel; nobody reads them: a hung server
    port = listener.getsockname()[1]
    try:
        t0 = time.monotonic()
        problem = probe.check("live", f"http://{LOCALHOST}:{port}", f"http://{LOCALHOST}:{port}/metrics",
                              timeout=1.0, budget=1.5)
        assert time.monotonic() - t0 < 1.5 + 1.0
    finally:
        listener.close()
    assert problem == "/v2/health/live answered nothing"


def test_the_frontend_sees_triton_away_at_a_refused_connection_or_after_two_timeouts_and_back_at_an_answer():
    refused, timed_out = "StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED"
    health = TritonHealth("127.0.0.1:1", timeout=2.0)
    assert not health.away and health.observe(None, 0.0) is False
    assert health.observe(timed_out, 1.0) is False and not health.away  # one slow answer refuses nothing
    health.observe(timed_out, 4.0)
    assert health.away and health.away_since == 1.0 and "answers nothing within 2 s: it is hung" in health.why_away()
    health.observe(refused, 7.0)  # the launcher killed it
    assert "refuses connections" in health.why_away()
    assert health.observe(None, 30.0) is True and not health.away  # back as a new process: a new channel
    health.observe(timed_out, 31.0)
    assert not health.away
    health.observe(timed_out, 34.0)
    assert health.away
    assert health.observe(None, 37.0) is False  # back, the same process: its streams and channel still hold
    assert health.observe(refused, 38.0) is False and health.away  # a refusal counts at once
