"""The launcher (backend.triton.launcher.serve) and model preparation (tools.prepare_model).

Server tests start a real tritonserver on a small Python-backend repository written here: ``upper`` (one
response per request) and ``words`` (decoupled: one response per word, then an empty final response).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import requests

from backend.triton.launcher.launch_options import free_ports
from backend.triton.launcher.server import PortTaken, ServerError, TritonServer, start_on_free_ports
from tests.server_harness import LOCALHOST, REPO_ROOT
from tests.unit.test_deploy import expected_server_version, gpu_base_release
from tests.unit.test_launcher import fake_model_folder, launcher_args, run_launcher

_CONFIG = """\
name: "{name}"
backend: "python"
max_batch_size: 0
{extra}
input [ {{ name: "text_input", data_type: TYPE_STRING, dims: [ 1 ] }} ]
output [
  {{ name: "text_output", data_type: TYPE_STRING, dims: [ 1 ] }},
  {{ name: "llm_model", data_type: TYPE_STRING, dims: [ 1 ] }}
]
instance_group [ {{ kind: KIND_CPU, count: 1 }} ]
"""

_UPPER = """\
import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0].decode()
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("text_output", np.array([text.upper().encode()], dtype=np.object_)),
                pb_utils.Tensor("llm_model", np.array([os.environ.get("LLM_MODEL", "").encode()], dtype=np.object_)),
            ]))
        return responses
"""

_WORDS = """\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0].decode()
            for word in text.split():
                sender.send(pb_utils.InferenceResponse([
                    pb_utils.Tensor("text_output", np.array([word.encode()], dtype=np.object_)),
                    pb_utils.Tensor("llm_model", np.array([b""], dtype=np.object_)),
                ]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

_BROKEN = """\
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("deliberately broken model")
"""

# A model that starts a helper process of its own and whose finalize never returns: SIGTERM cannot stop its server
# within a short timeout, and the helper lives on unless the whole process group is killed.
_STUCK = _UPPER + """\

    def initialize(self, args):
        import subprocess
        self.helper = subprocess.Popen(["sleep", "600"])

    def finalize(self):
        import time
        time.sleep(600)
"""


def write_model(repository: Path, name: str, source: str, decoupled: bool = False) -> None:
    version_dir = repository / name / "1"
    version_dir.mkdir(parents=True)
    extra = "model_transaction_policy { decoupled: true }" if decoupled else ""
    (repository / name / "config.pbtxt").write_text(_CONFIG.format(name=name, extra=extra))
    (version_dir / "model.py").write_text(source)


def write_echo_repository(repository: Path) -> Path:
    write_model(repository, "upper", _UPPER)
    write_model(repository, "words", _WORDS, decoupled=True)
    return repository


def group_members(pgid: int) -> dict[int, str]:
    """``pid -> command name`` of the live processes (zombies hold no memory) in process group ``pgid``."""
    members = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
        if int(rest[2]) == pgid and rest[0] not in ("Z", "X"):
            members[int(stat.parent.name)] = name
    return members


def stub_shm_regions(pids) -> list[Path]:
    """The /dev/shm files of the Python-backend stubs among ``pids`` (the third argument of a stub names it)."""
    regions = []
    for pid in pids:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if argv[0].endswith(b"triton_python_backend_stub"):
            regions.append(Path("/dev/shm") / argv[2].decode())
    return regions


# ---------------------------------------------------------------------------------------------- serving


@pytest.fixture(scope="module")
def echo_server(triton_server_factory, tmp_path_factory, smollm2_dir) -> TritonServer:
    repository = write_echo_repository(tmp_path_factory.mktemp("echo-repository"))
    server = triton_server_factory.start(repository, model=smollm2_dir)
    yield server
    server.stop()


@pytest.mark.server
@pytest.mark.timeout(300)
def test_grpc_infer_and_llm_model_env(echo_server, smollm2_dir):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(echo_server.grpc_url)
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"hello triton"], dtype=np.object_))
    result = client.infer("upper", [text], client_timeout=30)
    assert result.as_numpy("text_output")[0] == b"HELLO TRITON"
    assert result.as_numpy("llm_model")[0].decode() == str(smollm2_dir)
    client.close()


@pytest.mark.server
@pytest.mark.timeout(120)
def test_grpc_stream_from_decoupled_model(echo_server):
    import queue

    import tritonclient.grpc as grpcclient

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(echo_server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"one two three"], dtype=np.object_))
    client.async_stream_infer("words", [text], request_id="r1", enable_empty_final_response=True)

    words = []
    while True:
        result, error = responses.get(timeout=30)
        assert error is None, error
        response = result.get_response()
        if response.parameters["triton_final_response"].bool_param:
            break
        words.append(result.as_numpy("text_output")[0].decode())
    client.stop_stream()
    client.close()
    assert words == ["one", "two", "three"]


@pytest.mark.server
@pytest.mark.timeout(120)
def test_http_client_and_generate_endpoint(echo_server):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(f"{LOCALHOST}:{echo_server.http_port}")
    assert client.is_server_ready() and client.is_model_ready("upper") and client.is_model_ready("words")
    text = httpclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"plain http"], dtype=np.object_))
    assert client.infer("upper", [text]).as_numpy("text_output")[0] == b"PLAIN HTTP"
    client.close()

    reply = requests.post(f"{echo_server.http_url}/v2/models/upper/generate", json={"text_input": "gen"}, timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.json()["text_output"] == "GEN"
    assert requests.get(echo_server.metrics_url, timeout=10).status_code == 200


@pytest.mark.server
@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_cli_serves_empty_repository_and_stops_on_sigterm(tmp_path, signum):
    """The server runs in its own session, so a terminal's Ctrl-C reaches it only through the launcher."""
    repository = tmp_path / "empty-repository"
    repository.mkdir()
    admin_key = "cli-test-key-" + os.urandom(8).hex()
    process = subprocess.Popen(
        [sys.executable, "-m", "backend.triton.launcher.serve",
         *launcher_args(repository, fake_model_folder(tmp_path / "model"))],
        cwd=REPO_ROOT,
        env={**os.environ, "TRITON_ADMIN_KEY": admin_key},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            if line.startswith("[serve] ready"):
                break
        assert any(line.startswith("[serve] ready") for line in lines), "".join(lines)
        process.send_signal(signum)
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, "".join(lines) + output
    assert f"Signal ({int(signum)}) received" in output
    output = "".join(lines) + output
    assert "need the header admin-key" in output and "the value of $TRITON_ADMIN_KEY" in output
    assert admin_key not in output


def _tritonserver_child(pid: int, timeout: float = 30) -> int:
    """The pid of the tritonserver that process ``pid`` started."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                text = stat.read_text()
            except OSError:
                continue
            if "(tritonserver)" in text and int(text[text.rindex(")") + 2 :].split()[1]) == pid:
                return int(stat.parent.name)
        time.sleep(0.1)
    raise AssertionError(f"process {pid} started no tritonserver")


@pytest.mark.server
@pytest.mark.timeout(120)
def test_stop_that_must_escalate_kills_the_whole_process_group(start_server, tmp_path):
    repository = tmp_path / "repository"
    write_model(repository, "stuck", _STUCK)
    server = start_server(repository)
    members = group_members(server.pid)
    assert sorted(members.values()) == ["sleep", "triton_python_b", "tritonserver"], members
    (region,) = stub_shm_regions(members)
    assert region.exists()

    assert server.stop(timeout=1) == -signal.SIGKILL  # finalize never returns: SIGTERM is not enough
    assert group_members(server.pid) == {}
    assert not region.exists(), "the killed stub's shared memory must not be left in /dev/shm"


@pytest.mark.server
@pytest.mark.timeout(120)
def test_normal_stop_is_graceful_and_leaves_no_process(start_server, tmp_path):
    server = start_server(write_echo_repository(tmp_path / "repository"))
    members = group_members(server.pid)
    assert sorted(members.values()) == ["triton_python_b", "triton_python_b", "tritonserver"], members
    regions = stub_shm_regions(members)

    t0 = time.monotonic()
    assert server.stop(timeout=60) == 0
    assert time.monotonic() - t0 < 30
    log = server.output_tail(40)
    assert "Signal (15) received" in log
    assert "successfully unloaded 'upper'" in log and "successfully unloaded 'words'" in log  # the stubs' finalize ran
    assert group_members(server.pid) == {}
    assert not any(region.exists() for region in regions)


@pytest.mark.server
@pytest.mark.timeout(120)
def test_cli_second_signal_kills_the_whole_process_group(tmp_path):
    repository = tmp_path / "repository"
    write_model(repository, "stuck", _STUCK)
    args = [*launcher_args(repository, fake_model_folder(tmp_path / "model")), "--exit-timeout-secs", "60"]
    process = subprocess.Popen(
        [sys.executable, "-m", "backend.triton.launcher.serve", *args],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for line in process.stdout:
            if line.startswith("[serve] ready"):
                break
        server_pid = _tritonserver_child(process.pid)
        assert sorted(group_members(server_pid).values()) == ["sleep", "triton_python_b", "tritonserver"]
        process.send_signal(signal.SIGTERM)  # the server starts draining, and waits for finalize for 60 s
        time.sleep(1.0)
        assert process.poll() is None and server_pid in group_members(server_pid)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 128 + signal.SIGKILL, output
    assert group_members(server_pid) == {}


@pytest.mark.server
@pytest.mark.timeout(180)
def test_cli_starts_a_crashed_server_again_on_the_same_ports(tmp_path):
    ports = free_ports(3)
    args = launcher_args(write_echo_repository(tmp_path / "repository"), fake_model_folder(tmp_path / "model"), ports)
    process = subprocess.Popen(
        [sys.executable, "-m", "backend.triton.launcher.serve", *args, "--max-restarts", "1"],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []

    def read_until(prefix: str) -> None:
        for line in process.stdout:
            lines.append(line)
            if line.startswith(prefix):
                return
        raise AssertionError("".join(lines))

    try:
        read_until("[serve] ready")
        first = _tritonserver_child(process.pid)
        os.kill(first, signal.SIGSEGV)  # what a crash in the server looks like from outside
        read_until("[serve] tritonserver died by signal 11")  # then where, when its stack names a function
        assert lines[-1].rstrip().endswith("; restarting it (1 of 1)"), lines[-1]
        read_until("[serve] ready")
        second = _tritonserver_child(process.pid)
        assert second != first and group_members(first) == {}  # the crashed server's stubs are gone too
        reply = requests.post(f"http://{LOCALHOST}:{ports[0]}/v2/models/upper/generate", json={"text_input": "again"},
                              timeout=30)
        assert reply.json()["text_output"] == "AGAIN"
        os.kill(second, signal.SIGSEGV)  # the one restart allowed is spent: the launcher exits
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 128 + signal.SIGSEGV, "".join(lines) + output
    assert "restarting it (2 of 1)" not in output


@pytest.mark.server
@pytest.mark.timeout(120)
def test_cli_reports_the_servers_own_error_when_a_model_fails_to_load(tmp_path):
    repository = tmp_path / "repository"
    write_model(repository, "broken", _BROKEN)
    result = run_launcher(*launcher_args(repository, fake_model_folder(tmp_path / "model")), timeout=90)
    assert result.returncode != 0
    assert "serve: error: tritonserver exited with status" in result.stderr
    error_report = result.stderr.split("serve: error:", 1)[1]
    assert "deliberately broken model" in error_report
    assert "failed to load" in error_report.lower()


@pytest.mark.server
@pytest.mark.timeout(120)
def test_api_raises_server_error_with_log(tmp_path):
    repository = tmp_path / "repository"
    write_model(repository, "broken", _BROKEN)
    http, grpc, metrics = free_ports(3)
    server = TritonServer(repository, http_port=http, grpc_port=grpc, metrics_port=metrics, log_path=tmp_path / "s.log")
    with pytest.raises(ServerError, match="deliberately broken model"):
        with server:
            pass
    assert not server.is_running
    assert "deliberately broken model" in (tmp_path / "s.log").read_text()


@pytest.mark.server
@pytest.mark.timeout(180)
def test_a_port_taken_between_choosing_and_binding_starts_the_server_again_on_new_ones(tmp_path):
    starts: list[TritonServer] = []
    holders: list[socket.socket] = []

    def take_the_metrics_port(server: TritonServer) -> None:
        # What a load test's outgoing connection once did: hold the port before tritonserver binds it (seconds
        # after the process starts). tritonserver was up on HTTP and gRPC, logged the failed bind, then exited.
        starts.append(server)
        if len(starts) == 1:
            holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            holder.bind((LOCALHOST, server.metrics_port))
            holders.append(holder)

    log = tmp_path / "server.log"
    try:
        with start_on_free_ports(write_echo_repository(tmp_path / "repository"),
                                 model=fake_model_folder(tmp_path / "model"), log_path=log,
                                 on_start=take_the_metrics_port) as server:
            assert [s is server for s in starts] == [False, True]
            assert starts[0].returncode is not None and group_members(starts[0].pid) == {}
            assert server.metrics_port != starts[0].metrics_port
            reply = requests.post(f"{server.http_url}/v2/models/upper/generate", json={"text_input": "moved"},
                                  timeout=30)
            assert reply.json()["text_output"] == "MOVED"
            assert "nv_inference_request_success" in requests.get(server.metrics_url, timeout=10).text
    finally:
        for holder in holders:
            holder.close()
    taken = f"Socket '{LOCALHOST}:{starts[0].metrics_port}' already in use"
    assert f"failed to start Metrics service: Unavailable - {taken}" in log.read_text()


@pytest.mark.server
@pytest.mark.timeout(120)
def test_a_port_taken_on_every_attempt_is_reported_as_taken(tmp_path):
    holders: list[socket.socket] = []

    def take_the_http_port(server: TritonServer) -> None:
        holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        holder.bind((LOCALHOST, server.http_port))
        holders.append(holder)

    try:
        with pytest.raises(PortTaken, match="another process took a port"):
            start_on_free_ports(write_echo_repository(tmp_path / "repository"), attempts=2,
                                model=fake_model_folder(tmp_path / "model"), log_path=tmp_path / "server.log",
                                on_start=take_the_http_port)
    finally:
        for holder in holders:
            holder.close()
    assert len(holders) == 2


# ---------------------------------------------------------------------------------------------- launcher errors


@pytest.mark.server
@pytest.mark.timeout(120)
def test_the_gpu_images_triton_release_is_the_server_version_tested_here(start_server, tmp_path):
    release = gpu_base_release()
    repository = tmp_path / "empty_repository"
    repository.mkdir()
    server = start_server(repository)
    version = requests.get(f"{server.http_url}/v2", timeout=10).json()["version"]
    assert expected_server_version(release) == version, (
        f"tritonserver:{release}-py3 is Triton {expected_server_version(release)}, the tests here run {version}"
    )
