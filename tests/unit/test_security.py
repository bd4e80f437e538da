"""The admin restriction's settings without a server: the flags, the key, and the launcher run against NVIDIA's install
layout (``TRITONSERVER_HOME``).

tests/server/test_security.py checks the restriction on a real tritonserver.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from backend.contract.settings import ADMIN_KEY_ENV_VAR, SERVER_HOME_ENV_VAR
from backend.triton.launcher.launch_options import free_ports
from backend.triton.launcher.serve import TritonServer, restricted_api_args
from tests.server_harness import REPO_ROOT


def test_flags_restrict_the_admin_apis_unless_the_user_gives_their_own():
    setting = "shared-memory,trace,logging:admin-key=K"
    assert restricted_api_args([], "K") == [f"--http-restricted-api={setting}", f"--grpc-restricted-protocol={setting}"]
    for mode in (["--model-control-mode=explicit"], ["--model-control-mode", "poll"]):
        assert restricted_api_args(mode, "K") == [
            "--http-restricted-api=shared-memory,model-repository,trace,logging:admin-key=K",
            "--grpc-restricted-protocol=shared-memory,model-repository,trace,logging:admin-key=K",
        ]
    # A user's own flag replaces ours for that protocol only.
    only_grpc, only_http = [f"--grpc-restricted-protocol={setting}"], [f"--http-restricted-api={setting}"]
    assert restricted_api_args(["--http-restricted-api=logging:mine=x"], "K") == only_grpc
    assert restricted_api_args(["--grpc-restricted-protocol", "trace:mine=x"], "K") == only_http
    assert restricted_api_args(["--http-restricted-api=a:b=c", "--grpc-restricted-protocol=a:b=c"], "K") == []


def test_key_comes_from_the_environment_or_is_random_per_launch(monkeypatch, tmp_path):
    monkeypatch.delenv(ADMIN_KEY_ENV_VAR, raising=False)
    first, second = TritonServer(tmp_path), TritonServer(tmp_path)
    assert first.admin_key != second.admin_key and len(first.admin_key) == 64
    assert f"--http-restricted-api=shared-memory,trace,logging:admin-key={first.admin_key}" in first.command(tmp_path)

    monkeypatch.setenv(ADMIN_KEY_ENV_VAR, "from-process-env")
    assert TritonServer(tmp_path).admin_key == "from-process-env"
    assert TritonServer(tmp_path, env={ADMIN_KEY_ENV_VAR: "from-server-env"}).admin_key == "from-server-env"
    monkeypatch.setenv(ADMIN_KEY_ENV_VAR, "")
    assert len(TritonServer(tmp_path).admin_key) == 64  # an empty key would stop tritonserver from starting

    mine = TritonServer(tmp_path, extra_args=["--http-restricted-api=logging:mine=x"])
    command = mine.command(tmp_path)
    assert [a for a in command if a.startswith("--http-restricted-api")] == ["--http-restricted-api=logging:mine=x"]


def fake_install(root: Path) -> Path:
    """A folder laid out like NVIDIA's /opt/tritonserver whose ``tritonserver`` prints its arguments and exits."""
    (root / "backends" / "python").mkdir(parents=True)
    (root / "bin").mkdir()
    binary = root / "bin" / "tritonserver"
    binary.write_text('#!/bin/sh\nprintf "arg:%s\\n" "$@"\n')
    binary.chmod(0o755)
    return root


def run_launcher(tmp_path: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    ports = [str(p) for p in free_ports(3)]
    command = [sys.executable, "-m", "backend.triton.launcher.serve", "--model-repository", str(tmp_path),
               "--model", str(model), "--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2],
               "--address", "127.0.0.1", "--max-restarts", "0", "--ready-timeout", "20", "--openai-port", "0", *extra]
    return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_the_gpu_image_runs_nvidias_server_with_the_launchers_flags(tmp_path):
    """docker/Dockerfile's gpu flavor sets TRITONSERVER_HOME=/opt/tritonserver: the launcher runs that binary with its
    backends and the admin restriction, needing nothing from the nvidia-pytriton wheel."""
    home = fake_install(tmp_path / "opt-tritonserver")
    env = {**os.environ, SERVER_HOME_ENV_VAR: str(home), ADMIN_KEY_ENV_VAR: "K"}
    result = run_launcher(tmp_path, env, "--", "--exit-timeout-secs=30")
    args = [line[4:] for line in result.stdout.splitlines() if line.startswith("arg:")]
    assert args, result.stdout + result.stderr
    assert args[args.index("--backend-directory") + 1] == str(home / "backends")
    assert restricted_api_args([], "K") == [a for a in args if a.startswith(("--http-restricted", "--grpc-restricted"))]
    assert args[-1] == "--exit-timeout-secs=30"
    # The fake exits at once: the launcher says so and fails.
    assert result.returncode != 0 and "exited with status 0 before it was ready" in result.stderr


def test_a_tritonserver_home_that_is_not_an_install_is_refused(tmp_path):
    env = {**os.environ, SERVER_HOME_ENV_VAR: str(tmp_path / "nothing")}
    result = run_launcher(tmp_path, env)
    assert result.returncode == 2
    assert f"${SERVER_HOME_ENV_VAR} is {tmp_path / 'nothing'}, which has no bin/tritonserver" in result.stderr
