"""The parts of backend/triton/shutdown.py and probe.py without a server: the drain grace, what the metrics say is
open, a child's client connections, and the probe and stop scripts on the standard library alone.

tests/server/test_shutdown.py stops `make serve` under a real Locust load.
"""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from backend.triton import probe, processes, shutdown
from backend.triton.launch_options import free_ports
from tests.server_harness import LOCALHOST, REPO_ROOT


def test_the_drain_grace_is_read_from_tritonservers_command_line():
    assert shutdown.exit_timeout(["tritonserver"]) == 30.0
    args = ["tritonserver", "--exit-timeout-secs", "20", "--http-port=9000", "--exit-timeout-secs=12"]
    assert shutdown.exit_timeout(args) == 12.0  # the last one wins, as in tritonserver
    assert shutdown.drain_grace(args) == 12.0 - shutdown.SHUTDOWN_MARGIN_S
    assert shutdown.drain_grace(["tritonserver", "--exit-timeout-secs", "3"]) == 0.0
    assert processes.command_line(os.getpid())[0].endswith(("python", "python3", Path(sys.executable).name))


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
    assert shutdown.open_requests(f"http://{LOCALHOST}:{free_ports(1)[0]}/metrics") is None
    assert probe.failed_engines(METRICS) == ["llm_dynamic"]

    table["/v2/health/ready"] = (200, "")
    assert "llm_dynamic" in probe.check("ready", url, f"{url}/metrics")
    assert probe.check("live", url, f"{url}/metrics") == "/v2/health/live answered 404"
    table["/metrics"] = (200, METRICS.replace('"llm_dynamic"} 0', '"llm_dynamic"} 1'))
    assert probe.check("ready", url, f"{url}/metrics") is None
    table["/v2/health/ready"] = (400, "")
    assert probe.check("ready", url, f"{url}/metrics") == "/v2/health/ready answered 400"


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
    """The containers run backend/triton/probe.py and shutdown.py as files, with no site-packages to rely on."""
    python = [sys.executable, "-I", "-S"]  # isolated, and no site-packages: the standard library alone
    nobody = f"http://{LOCALHOST}:{free_ports(1)[0]}"
    probe_run = subprocess.run([*python, str(REPO_ROOT / "backend" / "triton" / "probe.py"), "live", "--url", nobody,
                                "--metrics-url", f"{nobody}/metrics"], capture_output=True, text=True, timeout=30)
    assert (probe_run.returncode, probe_run.stdout.strip()) == (1, "/v2/health/live answered nothing"), probe_run.stderr
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stop_run = subprocess.run([*python, str(REPO_ROOT / "backend" / "triton" / "shutdown.py"), "stop", "--pid",
                               str(gone.pid)], capture_output=True, text=True, timeout=30)
    assert (stop_run.returncode, stop_run.stderr) == (0, "")
