"""The launcher (backend.triton.launcher.serve) and model preparation (tools.prepare_model), without a server:
the errors a user gets before tritonserver starts, the wheel's layout, the fixtures' models.

tests/server/test_launcher.py starts real tritonservers.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backend.contract.settings import DEFAULT_MODEL
from backend.triton.launcher import launch_options
from backend.triton.launcher.launch_options import LauncherError, free_ports
from backend.triton.launcher.processes import ChildProcess
from backend.triton.launcher.server_home import find_stub, prepare_server_home, server_distribution, stub_versions
from tests.server_harness import LOCALHOST, REPO_ROOT
from tools import prepare_model


def fake_model_folder(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    return path


def run_launcher(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "backend.triton.launcher.serve", *args],
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


def test_make_prepares_and_runs_the_default_model():
    # The Makefile cannot import it: its own copy is held equal to the one the code reads.
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert f"\nDEFAULT_MODEL := {DEFAULT_MODEL}\n" in makefile
    assert "\nMODEL ?= $(DEFAULT_MODEL)\n" in makefile and "prepare_model --out $(DEFAULT_MODEL)\n" in makefile
    assert prepare_model.DEFAULT_OUT == Path(DEFAULT_MODEL)


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


def test_free_ports_are_outside_the_range_outgoing_connections_take_theirs(monkeypatch):
    low, high = launch_options.ephemeral_port_range()
    ports = free_ports(40)
    assert len(set(ports)) == 40
    assert not any(low <= port <= high for port in ports), (low, high, ports)
    # A kernel that lends every port to outgoing connections leaves no room: the kernel chooses, as bind(0) does.
    monkeypatch.setattr(launch_options, "ephemeral_port_range", lambda: (1024, 65535))
    kernels = free_ports(5)
    assert len(set(kernels)) == 5 and all(low <= port <= high for port in kernels), (low, high, kernels)


@pytest.mark.timeout(60)
def test_port_in_use(tmp_path):
    repository = tmp_path / "repository"
    repository.mkdir()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind((LOCALHOST, 0))  # NOTE: a port found free and bound after could be taken in between
        busy.listen()
        grpc = busy.getsockname()[1]
        http, metrics = free_ports(2)
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
    # The stand-in has no tensors to keep: its quantized blocks are test_quantized_model.py's subject.
    monkeypatch.setattr(prepare_model, "ensure_gguf_blocks", lambda out, source: out / prepare_model.GGUF_BLOCKS)
    return conversions


def test_prepare_model_skips_a_complete_folder(tmp_path, fake_gguf, capsys):
    out = tmp_path / "models" / "m"
    assert prepare_model.main(["--out", str(out)]) == 0
    assert len(fake_gguf) == 1 and json.loads((out / ".complete").read_text())["dtype"] == "bfloat16"
    assert not list(out.parent.glob(".m.tmp-*"))

    t0 = time.thread_time()  # NOTE: CPU time, which a loaded machine does not stretch as it does the wall clock
    assert prepare_model.main(["--out", str(out)]) == 0
    assert time.thread_time() - t0 < 0.5
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
    from backend.triton.launcher.serve import parse_args

    monkeypatch.setenv("HTTP_PORT", "18080")
    monkeypatch.setenv("MODEL", "models/other")
    args, extra = parse_args(
        ["--grpc-port", "18081", "--model-control-mode", "explicit", "--load-model=upper", "--", "--log-verbose", "1"]
    )
    assert (args.http_port, args.grpc_port, args.metrics_port, args.model) == (18080, 18081, 8002, "models/other")
    assert extra == ["--model-control-mode", "explicit", "--load-model=upper", "--log-verbose", "1"]


def test_served_repository_copies_only_the_named_models_with_their_parameters_set(monkeypatch):
    from backend.triton.launcher import config_text
    from backend.triton.launcher.serve import parse_args, served_repository

    assert served_repository("model_repository", "", []) == Path("model_repository")  # nothing asked: no copy
    monkeypatch.setenv("LLM_SERVED_MODELS", "llm_continuous")
    monkeypatch.setenv("LLM_MODEL_PARAMETERS", "enable_prefix_caching=true max_num_seqs=4")
    args, _ = parse_args(["--parameter", "block_size=32"])
    copy = served_repository("model_repository", args.models, args.parameter)
    try:
        assert sorted(p.name for p in copy.iterdir()) == ["llm_continuous"]
        config = config_text.load(copy / "llm_continuous" / "config.pbtxt")
        assert [config_text.parameter(config, key) for key in ("enable_prefix_caching", "max_num_seqs", "block_size")] \
            == ["true", "4", "32"]
        shipped = config_text.load(Path("model_repository") / "llm_continuous" / "config.pbtxt")
        assert config_text.parameter(shipped, "enable_prefix_caching") == "false"  # the shipped file is untouched
    finally:
        shutil.rmtree(copy)
    with pytest.raises(LauncherError, match="no model llm_nope"):
        served_repository("model_repository", "llm_continuous,llm_nope", [])
    with pytest.raises(LauncherError, match="expected KEY=VALUE"):
        served_repository("model_repository", "", ["enable_prefix_caching"])


class _Launched(ChildProcess):
    def __init__(self, pid: int | None = None, ready: bool = True) -> None:
        self.pid, self.ready, self.calls = pid, ready, []

    def start(self) -> "_Launched":
        self.calls.append("start")
        self.pid = 1
        return self

    def wait_ready(self) -> None:
        self.calls.append("wait_ready")
        if not self.ready:
            raise RuntimeError("not ready")

    def stop(self) -> None:
        self.calls.append("stop")


def test_a_child_process_block_starts_once_waits_and_always_stops():
    with _Launched() as child:
        assert child.calls == ["start", "wait_ready"]
    assert child.calls == ["start", "wait_ready", "stop"]
    with _Launched(pid=7) as started_before:
        pass
    assert started_before.calls == ["wait_ready", "stop"]
    never_ready = _Launched(ready=False)
    with pytest.raises(RuntimeError, match="not ready"), never_ready:
        pass
    assert never_ready.calls == ["start", "wait_ready", "stop"]
