"""The launcher (backend.triton.serve) and model preparation (backend.tools.prepare_model).

Server tests start a real tritonserver on a small Python-backend repository written here: ``upper`` (one
response per request) and ``words`` (decoupled: one response per word, then an empty final response).
"""

from __future__ import annotations

import json
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

from backend.tools import prepare_model
from backend.triton.launch_options import LauncherError, free_ports
from backend.triton.server import ServerError, TritonServer
from backend.triton.server_home import find_stub, prepare_server_home, server_distribution, stub_versions
from tests.server_harness import LOCALHOST, REPO_ROOT

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


def fake_model_folder(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    return path


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


def run_launcher(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "backend.triton.serve", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def launcher_args(repository: Path, model: Path, ports: list[int] | None = None) -> list[str]:
    http, grpc, metrics = ports or free_ports(3)
    return [
        "--model-repository", str(repository), "--model", str(model), "--address", LOCALHOST,
        "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--openai-port", "0",
    ]  # fmt: skip


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
        [sys.executable, "-m", "backend.triton.serve", *launcher_args(repository, fake_model_folder(tmp_path / "model"))],
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
        [sys.executable, "-m", "backend.triton.serve", *args],
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
        [sys.executable, "-m", "backend.triton.serve", *args, "--max-restarts", "1"],
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
        read_until("[serve] tritonserver died by signal 11; restarting it (1 of 1)")
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


# ---------------------------------------------------------------------------------------------- launcher errors


@pytest.mark.timeout(60)
def test_missing_model_folder(tmp_path):
    repository = tmp_path / "repository"
    repository.mkdir()
    result = run_launcher(*launcher_args(repository, tmp_path / "no-such-model"))
    assert result.returncode != 0
    assert "no-such-model does not exist" in result.stderr and "make model" in result.stderr


@pytest.mark.timeout(60)
def test_model_folder_without_config(tmp_path):
    repository = tmp_path / "repository"
    repository.mkdir()
    (tmp_path / "model").mkdir()
    result = run_launcher(*launcher_args(repository, tmp_path / "model"))
    assert result.returncode != 0
    assert "has no config.json" in result.stderr and "make model" in result.stderr


@pytest.mark.timeout(60)
def test_missing_model_repository(tmp_path):
    result = run_launcher(*launcher_args(tmp_path / "no-such-repository", fake_model_folder(tmp_path / "model")))
    assert result.returncode != 0
    assert "no-such-repository does not exist" in result.stderr


@pytest.mark.timeout(60)
def test_port_in_use(tmp_path):
    repository = tmp_path / "repository"
    repository.mkdir()
    http, grpc, metrics = free_ports(3)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind((LOCALHOST, grpc))
        busy.listen()
        result = run_launcher(*launcher_args(repository, fake_model_folder(tmp_path / "model"), [http, grpc, metrics]))
    assert result.returncode != 0
    assert f"gRPC port {grpc} on {LOCALHOST} is already in use" in result.stderr


@pytest.mark.timeout(60)
def test_python_version_without_stub(tmp_path):
    repository = tmp_path / "repository"
    repository.mkdir()
    args = launcher_args(repository, fake_model_folder(tmp_path / "model"))
    result = run_launcher(*args, "--python-version", "3.7")
    assert result.returncode != 0
    assert "no stub for Python 3.7" in result.stderr
    tree, _, _ = server_distribution()
    for version in stub_versions(tree):
        assert version in result.stderr


def test_stub_lookup():
    tree, _, _ = server_distribution()
    versions = stub_versions(tree)
    assert f"{sys.version_info.major}.{sys.version_info.minor}" in versions
    assert versions == sorted(versions, key=lambda v: tuple(map(int, v.split("."))))
    assert find_stub(tree, versions[0]).is_file()
    with pytest.raises(LauncherError, match="stubs exist for Python"):
        find_stub(tree, "2.7")


@pytest.mark.timeout(60)
def test_layout_is_reused_and_a_half_copy_redone(tmp_path):
    home = prepare_server_home(layout_root=tmp_path)
    stub = home / "backends" / "python" / "triton_python_backend_stub"
    assert stub.is_file() and os.access(stub, os.X_OK) and (home / ".complete").is_file()
    copied_at = (home / ".complete").stat().st_mtime_ns
    assert prepare_server_home(layout_root=tmp_path) == home
    assert (home / ".complete").stat().st_mtime_ns == copied_at  # reused, not copied again

    (home / ".complete").unlink()  # as if the copy had been interrupted
    (home / "leftover").write_text("x")
    assert prepare_server_home(layout_root=tmp_path) == home
    assert (home / ".complete").is_file() and not (home / "leftover").exists()
    assert [p.name for p in tmp_path.iterdir()] == [home.name]


# ---------------------------------------------------------------------------------------------- prepare_model


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """Point prepare_model at a tiny stand-in GGUF and count conversions (which write a fake folder)."""
    gguf = tmp_path / "package" / prepare_model.GGUF_NAME
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + bytes(60))
    conversions = []

    def fake_convert(source, dest, dtype):
        conversions.append(dest)
        dest.mkdir(parents=True)
        for name in prepare_model.REQUIRED_FILES:
            (dest / name).write_text("{}")
        return {"converted_with": "test"}

    monkeypatch.setattr(prepare_model, "find_gguf", lambda: gguf)
    monkeypatch.setattr(prepare_model, "convert", fake_convert)
    return conversions


def test_prepare_model_skips_a_complete_folder(tmp_path, fake_gguf, capsys):
    out = tmp_path / "models" / "m"
    assert prepare_model.main(["--out", str(out)]) == 0
    assert len(fake_gguf) == 1 and json.loads((out / ".complete").read_text())["dtype"] == "bfloat16"
    assert not list(out.parent.glob(".m.tmp-*"))

    t0 = time.perf_counter()
    assert prepare_model.main(["--out", str(out)]) == 0
    assert time.perf_counter() - t0 < 0.5
    assert len(fake_gguf) == 1
    assert "already complete; skipped" in capsys.readouterr().out

    assert prepare_model.ensure_model(out, dtype="float32") == out  # another dtype is another conversion
    assert len(fake_gguf) == 2


def test_prepare_model_redoes_a_half_written_folder(tmp_path, fake_gguf):
    out = tmp_path / "m"
    out.mkdir()
    (out / "config.json").write_text("{}")  # a previous run died before writing the marker
    (out / "stale.bin").write_bytes(b"x")
    assert prepare_model.ensure_model(out) == out
    assert len(fake_gguf) == 1
    assert (out / ".complete").is_file() and not (out / "stale.bin").exists()


@pytest.mark.timeout(300)
def test_model_fixtures(smollm2_dir, tiny_llama_dir):
    assert json.loads((smollm2_dir / ".complete").read_text())["dtype"] == "bfloat16"
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    assert config["vocab_size"] == json.loads((smollm2_dir / "config.json").read_text())["vocab_size"]
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["tie_word_embeddings"]) == (2, 2, True)
    assert (tiny_llama_dir / "tokenizer.json").is_file()


def test_cli_passes_unknown_options_and_everything_after_dashes_to_tritonserver(monkeypatch):
    from backend.triton.serve import parse_args

    monkeypatch.setenv("HTTP_PORT", "18080")
    monkeypatch.setenv("MODEL", "models/other")
    args, extra = parse_args(
        ["--grpc-port", "18081", "--model-control-mode", "explicit", "--load-model=upper", "--", "--log-verbose", "1"]
    )
    assert (args.http_port, args.grpc_port, args.metrics_port, args.model) == (18080, 18081, 8002, "models/other")
    assert extra == ["--model-control-mode", "explicit", "--load-model=upper", "--log-verbose", "1"]
