"""The parts of backend/triton/launcher/shutdown.py, watchdog.py and probe.py without a server: the drain grace, what
the metrics say is open, a child's client connections, when a model that cannot unload may be ended, when a model's
queue counts as stalled, and the probe and stop scripts on the standard library alone.

tests/server/test_shutdown.py stops `make serve` under a real Locust load, after cancels of finished requests and
with a request that never ends, and has the watchdog restart a server whose model stopped executing.
"""

from __future__ import annotations

import http.server
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from backend.contract import prometheus, server_args
from backend.triton.launcher import probe, processes, shutdown, watchdog
from tests.fakes import closed_port
from tests.server_harness import LOCALHOST, REPO_ROOT


def test_the_drain_grace_is_read_from_tritonservers_command_line():
    assert server_args.exit_timeout(["tritonserver"]) == 30.0
    args = ["tritonserver", "--exit-timeout-secs", "20", "--http-port=9000", "--exit-timeout-secs=12"]
    assert server_args.exit_timeout(args) == 12.0  # the last one wins, as in tritonserver
    assert server_args.drain_grace(args) == 12.0 - server_args.SHUTDOWN_MARGIN_S
    assert server_args.drain_grace(["tritonserver", "--exit-timeout-secs", "3"]) == 0.0
    assert server_args.command_line(os.getpid())[0].endswith(("python", "python3", Path(sys.executable).name))


class _Pages(http.server.BaseHTTPRequestHandler):
    pages: dict[str, tuple[int, str]] = {}

    def do_GET(self):  # noqa: N802
        status, body = self.pages.get(self.path, (404, ""))
        self.send_response(status)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def pages():
    """A loopback HTTP server answering ``pages[path] = (status, body)``; yields ``(base_url, pages)``."""
    server = http.server.ThreadingHTTPServer((LOCALHOST, 0), _Pages)
    _Pages.pages = {}
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://{LOCALHOST}:{server.server_address[1]}", _Pages.pages
    server.shutdown()
    server.server_close()


METRICS = """# HELP llm_num_requests_running x
llm_num_requests_running{model="llm_continuous"} 2
llm_num_requests_waiting{model="llm_continuous"} 1
nv_inference_pending_request_count{model="llm_dynamic",version="1"} 3
llm_kv_blocks_used{model="llm_continuous"} 40
llm_engine_healthy{model="llm_continuous"} 1
llm_engine_healthy{model="llm_dynamic"} 0
"""


def test_open_requests_and_failed_engines_are_read_from_the_metrics(pages):
    url, table = pages
    table["/metrics"] = (200, METRICS)
    assert shutdown.open_requests(f"{url}/metrics") == (3, 3)  # running + waiting; Triton's own queue
    with closed_port(LOCALHOST) as port:
        assert shutdown.open_requests(f"http://{LOCALHOST}:{port}/metrics") is None
    assert probe.failed_engines(METRICS) == ["llm_dynamic"]

    table["/v2/health/ready"] = (200, "")
    assert "llm_dynamic" in probe.check("ready", url, f"{url}/metrics")
    assert probe.check("live", url, f"{url}/metrics") == "/v2/health/live answered 404"
    table["/metrics"] = (200, METRICS.replace('"llm_dynamic"} 0', '"llm_dynamic"} 1'))
    assert probe.check("ready", url, f"{url}/metrics") is None
    table["/v2/health/ready"] = (400, "")
    assert probe.check("ready", url, f"{url}/metrics") == "/v2/health/ready answered 400"


def test_the_probe_checks_the_openai_frontend_only_when_given_its_url(pages):
    url, table = pages
    table.update({"/metrics": (200, "llm_engine_healthy{model=\"llm_continuous\"} 1\n"), "/v2/health/ready": (200, ""),
                  "/v2/health/live": (200, "")})
    assert probe.check("ready", url, f"{url}/metrics") is None
    assert probe.check("ready", url, f"{url}/metrics", openai_url=url) == (
        "the OpenAI frontend's /health/ready answered 404")
    table["/health/ready"] = (503, "")  # the frontend while Triton drains
    assert probe.check("ready", url, f"{url}/metrics", openai_url=url) == (
        "the OpenAI frontend's /health/ready answered 503")
    table["/health/ready"] = (200, "")
    assert probe.check("ready", url, f"{url}/metrics", openai_url=url) is None
    assert probe.check("live", url, f"{url}/metrics", openai_url=url) == "the OpenAI frontend's /health answered 404"
    table["/health"] = (200, "")
    assert probe.check("live", url, f"{url}/metrics", openai_url=url) is None


HOLDER = """
import socket, sys, time
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
conn, _ = listener.accept()
print("accepted", flush=True)
print("read", conn.recv(10), flush=True)  # b"" once the connection is shut down
time.sleep(30)
"""


@pytest.mark.timeout(30)
def test_a_childs_client_connections_are_found_and_shut_down():
    """What shutdown.stop does to the keep-alive connections tritonserver waits for: found by port, shut down from
    outside; the child's next read ends and the client sees the connection closed."""
    child = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        client = socket.create_connection((LOCALHOST, port), timeout=10)
        assert child.stdout.readline().strip() == "accepted"
        fds = shutdown.client_connections(child.pid, [port])
        assert len(fds) == 1 and shutdown.client_connections(child.pid, [port + 1]) == []
        assert shutdown.shut_down_connections(child.pid, fds, min_idle_s=60) == 0  # not idle for that long
        assert shutdown.shut_down_connections(child.pid, fds) == 1
        assert child.stdout.readline().strip() == "read b''"
        assert client.recv(10) == b""
        client.close()
    finally:
        child.kill()
        child.wait()


@pytest.mark.timeout(60)
def test_probe_and_stop_run_as_files_on_the_standard_library_alone():
    """The containers run the launcher's probe.py and shutdown.py as files, with no site-packages to rely on."""
    python = [sys.executable, "-I", "-S"]  # isolated, and no site-packages: the standard library alone
    launcher = REPO_ROOT / "backend" / "triton" / "launcher"
    with closed_port(LOCALHOST) as port:
        nobody = f"http://{LOCALHOST}:{port}"
        probe_run = subprocess.run([*python, str(launcher / "probe.py"), "live", "--url", nobody,
                                    "--metrics-url", f"{nobody}/metrics"], capture_output=True, text=True, timeout=30)
    assert (probe_run.returncode, probe_run.stdout.strip()) == (1, "/v2/health/live answered nothing"), probe_run.stderr
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stop_run = subprocess.run([*python, str(launcher / "shutdown.py"), "stop", "--pid",
                               str(gone.pid)], capture_output=True, text=True, timeout=30)
    assert (stop_run.returncode, stop_run.stderr) == (0, "")


# ---- a model that cannot unload ---------------------------------------------------------------------------------

# tritonserver 2.51's shutdown reports, as it logged them when a cancelled request kept llm_dynamic loaded.
REPORTS = [
    'I1202 18:39:20.233962 131 server.cc:321] "Timeout 10: Found 1 model versions that have in-flight inferences"',
    "I1202 18:39:20.233970 131 server.cc:334] \"Model 'llm_dynamic' (version 1) has 1 in-flight inferences\"",
    'I1202 18:39:21.233962 131 server.cc:321] "Timeout 9: Found 0 model versions that have in-flight inferences"',
    'I1202 18:39:21.234372 131 server.cc:345] "Timeout 9: Found 4 live models and 0 in-flight non-inference requests"',
    "I1202 18:39:21.576230 131 model_lifecycle.cc:624] \"successfully unloaded 'llm_iterative' version 1\"",
    'I1202 18:39:22.234663 131 server.cc:345] "Timeout 8: Found 1 live models and 0 in-flight non-inference requests"',
]


def test_only_tritonservers_report_of_live_models_with_nothing_in_flight_counts_as_waiting_to_unload():
    assert shutdown.models_left_to_unload([]) is None
    assert shutdown.models_left_to_unload(REPORTS[:2]) is None  # an inference in flight: nothing may be ended
    assert shutdown.models_left_to_unload(REPORTS[:3]) is None  # none in flight, no model reported yet
    assert shutdown.models_left_to_unload(REPORTS[:4]) == 4
    assert shutdown.models_left_to_unload(REPORTS + ["[serve] an echoed line"]) == 1
    busy = REPORTS[-1].replace("and 0 in-flight non-inference", "and 2 in-flight non-inference")
    assert shutdown.models_left_to_unload([*REPORTS, busy]) is None  # e.g. a model load or a metadata call


def test_the_idle_clock_restarts_whenever_a_process_uses_cpu():
    clock = shutdown.IdleClock(idle_cpu_s=0.05)
    assert clock.update({10: 1.0, 11: 5.0}, now=100.0) == {10: 0.0, 11: 0.0}
    assert clock.update({10: 1.01, 11: 5.5}, now=101.0) == {10: 1.0, 11: 0.0}  # 11 is busy
    assert clock.update({10: 1.04, 11: 5.5}, now=102.5) == {10: 2.5, 11: 1.5}  # 40 ms over 2.5 s: still idle
    assert clock.update({10: 1.2}, now=103.0) == {10: 0.0}  # 11 is gone, 10 ran
    assert clock.update({10: 1.2, 11: 9.0}, now=104.0) == {10: 1.0, 11: 0.0}  # a new process (or pid) starts afresh


def test_only_a_forced_stop_turns_the_kill_into_status_0():
    forced = shutdown.StopResult("drained in 0.2 s", forced="forced: ...")
    clean = shutdown.StopResult("drained in 0.2 s")
    assert shutdown.exit_status(-signal.SIGKILL, forced) == 0
    assert shutdown.exit_status(-signal.SIGSEGV, forced) == 128 + signal.SIGSEGV  # it crashed before the kill
    assert shutdown.exit_status(1, forced) == 1  # it gave up by itself first
    assert shutdown.exit_status(-signal.SIGKILL, clean) == 128 + signal.SIGKILL
    assert shutdown.exit_status(-signal.SIGKILL) == 128 + signal.SIGKILL
    assert shutdown.exit_status(0, clean) == 0


@pytest.mark.timeout(30)
def test_a_stubs_model_and_cpu_time_are_read_from_proc():
    """What the forced stop names and watches: tritonserver's children that run a stub, by the model.py they run."""
    script = "import sys, time; sum(range(30_000_000)); sys.stdout.write('up\\n'); sys.stdout.flush(); time.sleep(30)"
    stub = subprocess.Popen([f"/opt/backends/python/{processes.STUB_NAME}", "-c", script,
                             "/srv/repository/llm_dynamic/1/model.py"], executable=sys.executable,
                            stdout=subprocess.PIPE, text=True)
    other = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert stub.stdout.readline() == other.stdout.readline() == "up\n"
        assert processes.stub_models(os.getpid()) == {stub.pid: "llm_dynamic"}
        used = processes.cpu_seconds(stub.pid)
        assert used is not None and 0.05 < used < 20  # it counted to thirty million
    finally:
        for child in (stub, other):
            child.kill()
            child.wait()
    assert processes.cpu_seconds(stub.pid) is None


# ---- the watchdog ------------------------------------------------------------------------------------------------


def reading(pending: int, executed: int = 0, steps: int = 0, running: int = 0, model: str = "llm_dynamic",
            ) -> list[prometheus.Series]:
    """One reading of the metrics port for ``model``, as Triton and our models write it."""
    return prometheus.parse_prometheus(f"""
nv_inference_pending_request_count{{model="{model}",version="1"}} {pending}
nv_inference_exec_count{{model="{model}",version="1"}} {executed}
llm_batch_size_count{{model="{model}"}} {steps}
llm_num_requests_running{{model="{model}"}} {running}
llm_num_requests_waiting{{model="{model}"}} 0
llm_request_success_total{{model="{model}",finish_reason="length"}} {steps // 10}
""")


def test_the_watchdog_names_a_model_whose_queue_does_not_move_for_longer_than_the_bound():
    dog = watchdog.Watchdog(bound_s=30)
    assert dog.observe(reading(0, executed=4, steps=100), 0.0) == []
    for t in range(1, 31):  # 9, then 10 requests pending and nothing moves: the stall seen on llm_iterative
        assert dog.observe(reading(9 + t // 20, executed=4, steps=100), float(t)) == []
    (stall,) = dog.observe(reading(10, executed=4, steps=100) + reading(0, model="llm_continuous"), 31.0)
    assert (stall.model, stall.num_pending, stall.seconds) == ("llm_dynamic", 10, 31.0)
    assert str(stall) == "llm_dynamic stalled: 10 requests pending in Triton's queue and nothing executed for 31 s"
    assert dog.observe(reading(10, executed=5, steps=100), 32.0) == []  # it moved: the clock starts again


def test_the_watchdog_leaves_a_busy_or_idle_model_alone():
    busy, batching, idle = (watchdog.Watchdog(bound_s=30) for _ in range(3))
    for t in range(300):
        # llm_dynamic runs one long batch: Triton's queue waits for minutes, while the engine steps
        assert busy.observe(reading(8, executed=1, steps=t * 20, running=8), float(t)) == []
        # llm_static waits up to a second for a full batch, again and again
        assert batching.observe(reading(t % 2 * 3, executed=t // 2), float(t)) == []
        # nothing to do: nothing moves, and nothing is pending
        assert idle.observe(reading(0), float(t)) == []
    # A reading without the model (unloaded, or the port did not answer) is no evidence either way.
    assert busy.observe([], 400.0) == []


def test_the_probe_reads_not_ready_while_the_launcher_marks_a_model_stalled(pages, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the launcher's markers, for this test only
    url, table = pages
    table["/v2/health/ready"] = table["/v2/health/live"] = (200, "")
    table["/metrics"] = (200, METRICS.replace('"llm_dynamic"} 0', '"llm_dynamic"} 1'))
    port, metrics_url = int(url.rsplit(":", 1)[1]), f"{url}/metrics"
    assert probe.check("ready", url, metrics_url) is None
    watchdog.mark_stalled(port, [watchdog.Stall("llm_dynamic", 3, 31.0)])
    assert watchdog.marker_path(port).parent == tmp_path
    assert probe.check("ready", url, metrics_url) == (
        "llm_dynamic stalled: 3 requests pending in Triton's queue and nothing executed for 31 s; the launcher "
        "restarts the server")
    assert probe.check("live", url, metrics_url) is None  # restarting is the launcher's job, not the orchestrator's
    assert watchdog.stalled(port + 1) is None  # one marker per server, by its metrics port
    watchdog.clear_stalled(port)
    assert probe.check("ready", url, metrics_url) is None
