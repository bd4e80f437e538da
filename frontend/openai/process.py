"""The frontend as a child process, for whoever starts it beside tritonserver (the tests, the benchmark, a launcher).

    with FrontendProcess("127.0.0.1:8001", port=9000, model_dir="models/smollm2-135m-instruct") as frontend:
        requests.get(f"{frontend.url}/v1/models")

``start()`` runs ``python -m frontend.openai``; ``wait_ready()`` polls ``GET /health`` until the frontend answers
(it answers 503 while Triton is not live, 200 once it is; ``ready=True`` polls ``/health/ready`` for a 200);
``stop()`` sends SIGTERM and returns the exit status (0: a clean stop).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Sequence

from backend.contract.settings import API_KEY_ENV_VAR
from backend.triton.launcher.launch_options import REPO_ROOT, frontend_command
from backend.triton.launcher.processes import ChildProcess


class FrontendProcess(ChildProcess):
    def __init__(
        self,
        triton_grpc_url: str,
        port: int,
        model_dir: str | os.PathLike,
        *,
        host: str = "127.0.0.1",
        api_key: str | None = None,
        extra_args: Sequence[str] = (),
        log_path: str | os.PathLike | None = None,
    ) -> None:
        self.url = f"http://{host}:{port}"
        self.command = [*frontend_command(triton_grpc_url, host, port, model_dir), *extra_args]
        self.api_key = api_key
        self.log_path = Path(log_path) if log_path else None
        self.process: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def start(self) -> "FrontendProcess":
        env = dict(os.environ)
        env.pop(API_KEY_ENV_VAR, None)
        if self.api_key is not None:
            env[API_KEY_ENV_VAR] = self.api_key
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.process = subprocess.Popen(self.command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        finally:
            if self.log_path:
                log.close()
        return self

    def status(self, path: str) -> int:
        """The HTTP status of ``GET path`` (0: nothing answered)."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except (urllib.error.URLError, OSError):
            return 0

    def wait_ready(self, timeout: float = 120.0, ready: bool = False) -> None:
        """Until the frontend answers (``ready``: until ``/health/ready`` is 200); RuntimeError if it exits or the
        time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"the frontend exited with status {self.process.returncode}: {self.log_tail()}")
            code = self.status("/health/ready" if ready else "/health")
            if code == 200 or (code and not ready):
                return
            time.sleep(0.2)
        raise RuntimeError(f"the frontend did not answer within {timeout:g} s: {self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then wait; SIGKILL if it does not exit in ``timeout`` s. Returns its exit status."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def log_tail(self, num_lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
