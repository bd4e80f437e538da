"""One tritonserver process, started the launcher's way and stopped gracefully: :class:`TritonServer`, and
:func:`start_on_free_ports`, the one way the tests, ``make compare`` and the soak start a server (free loopback
ports, on a copy from ``copy_model_repository`` if they change settings)::

    with start_on_free_ports("model_repository", model="models/smollm2-135m-instruct") as server:
        requests.get(f"{server.http_url}/v2/health/ready")

The server runs in its own session: ``stop()`` stops it gracefully with ``backend.triton.launcher.shutdown.stop``
(tritonserver and its stubs get the signal, the models drain, idle client connections are closed so the models can
unload at once, and a model that still cannot unload with nothing open is ended: ``stop_result.forced``) and, if it
has to escalate, SIGKILLs the whole process group, so no stub outlives it. The model
folder reaches the models as the environment variable ``LLM_MODEL``; the model repository does not depend on this
launcher.
"""

from __future__ import annotations

import collections
import ctypes
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from backend.contract.server_args import option_value
from backend.contract.settings import (
    ADMIN_KEY_ENV_VAR,
    MODEL_ENV_VAR,
    SERVER_HOME_ENV_VAR,
    SHARED_CORES_ENV_VAR,
    STOP_BOARD_ENV_VAR,
)
from backend.contract.stop_board import StopBoard
from backend.engine.shared_cores import remove_registry
from backend.triton.launcher import shutdown
from backend.triton.launcher.launch_options import (
    ADMIN_HEADER,
    GRPC_HEADER_PREFIX,
    LOOPBACK,
    PortInUse,
    check_model_folder,
    check_model_repository,
    check_ports,
    free_ports,
    restricted_api_args,
)
from backend.triton.launcher.processes import ChildProcess, kill_process_group, process_group_members
from backend.triton.launcher.server_home import DEFAULT_LAYOUT_ROOT, server_distribution, server_home

# A stub notices within about a second that tritonserver is gone, then removes its shared memory and exits.
STUB_EXIT_GRACE_S = 3.0
# The graceful stop returns within a poll of the server's exit (killing a process group waits up to 5 s).
STOP_RESULT_WAIT_S = 10.0
# Lines a CPU-only machine always prints; they are not the reason a start failed.
_NOISE = re.compile(r"CudaDriverHelper|NVML|DCGM|CUDA driver version is insufficient|pinned memory", re.I)
_ERROR = re.compile(r"^E\d{4} |error|failed|unavailable|unrecognized option|address already in use", re.I)
# tritonserver's words when a port it was given is bound by someone else: it logs this and exits (crashing on the way
# out), after the services before it in its start order are already up.
_PORT_TAKEN = re.compile(r"failed to start (\w+) service: .*already in use", re.I)


class ServerError(RuntimeError):
    """The server exited or did not become ready; the message carries the server's own error lines."""


class PortTaken(ServerError, PortInUse):
    """tritonserver could not bind a port that was free when the launcher checked it: another process took it in
    between. A caller that chose the ports may start again on new ones (:func:`start_on_free_ports` does)."""


def die_with_parent() -> None:
    # NOTE: PR_SET_PDEATHSIG stops an orphaned server if the launcher (or a test run) is killed outright.
    # Linux sends it when the *thread* that started the server exits, so start servers from a long-lived thread.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # 1 == PR_SET_PDEATHSIG


class TritonServer(ChildProcess):
    """One tritonserver process started the launcher's way.

    ``start()`` validates, lays out the binary and starts the process in its own session; ``wait_ready()`` polls
    ``/v2/health/ready``; ``stop()`` sends SIGTERM and escalates to SIGKILL for the whole process group. Output goes
    to ``log_path`` (a temporary file if not given), or with ``echo=True`` to this process's stdout. As a context
    manager it starts (unless already started), waits until ready (``ready_timeout``), and always stops.

    ``admin_key`` is ``$TRITON_ADMIN_KEY`` (from ``env``, else this process's environment) or a random key;
    ``admin_headers`` and ``admin_grpc_headers`` carry it for the restricted APIs.
    """

    def __init__(
        self,
        model_repository: str | os.PathLike,
        *,
        http_port: int = 8000,
        grpc_port: int = 8001,
        metrics_port: int = 8002,
        address: str = "127.0.0.1",
        model: str | os.PathLike | None = None,
        extra_args: Iterable[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: str | os.PathLike | None = None,
        echo: bool = False,
        python_version: str | None = None,
        layout_root: Path = DEFAULT_LAYOUT_ROOT,
        ready_timeout: float = 300.0,
    ) -> None:
        self.model_repository = Path(model_repository).absolute()
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.address = address
        self.model = None if model is None else Path(model).absolute()
        self.extra_args = list(extra_args)
        self.env = dict(env or {})
        self.admin_key = {**os.environ, **self.env}.get(ADMIN_KEY_ENV_VAR) or secrets.token_hex(32)
        self.log_path = None if log_path is None else Path(log_path)
        self.echo = echo
        self.python_version = python_version
        self.layout_root = layout_root
        self.ready_timeout = ready_timeout
        self.started_at: float | None = None
        self.stopped_at: float | None = None
        self._process: subprocess.Popen | None = None
        self._recent_lines: collections.deque[str] = collections.deque(maxlen=2000)
        self._reader: threading.Thread | None = None
        self._group_ended = False
        self._stopper: threading.Thread | None = None
        self.stop_result: shutdown.StopResult | None = None  # what the graceful stop did, once it is over
        self._shared_cores: Path | None = None  # the registry its engines share the cores through
        self._log_start = 0
        self.stop_board: StopBoard | None = None  # where a client on this host posts requests to stop early

    # -- addresses

    @property
    def _client_host(self) -> str:
        http_address = option_value(self.extra_args, "--http-address") or self.address
        return "127.0.0.1" if http_address == "0.0.0.0" else http_address

    @property
    def http_url(self) -> str:
        return f"http://{self._client_host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        """``host:port`` as tritonclient.grpc expects it."""
        return f"{self._client_host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self._client_host}:{self.metrics_port}/metrics"

    @property
    def admin_headers(self) -> dict[str, str]:
        """HTTP headers for the restricted admin APIs (when the launcher set the restriction)."""
        return {ADMIN_HEADER: self.admin_key}

    @property
    def admin_grpc_headers(self) -> dict[str, str]:
        """``headers=`` for tritonclient.grpc calls to the restricted admin APIs."""
        return {GRPC_HEADER_PREFIX + ADMIN_HEADER: self.admin_key}

    # -- process

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def returncode(self) -> int | None:
        return None if self._process is None else self._process.poll()

    @property
    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def command(self, home: Path) -> list[str]:
        args = [
            str(home / "bin" / "tritonserver"),
            "--model-repository", str(self.model_repository),
            "--backend-directory", str(home / "backends"),
            "--http-address", self.address,
            "--grpc-address", self.address,
            "--http-port", str(self.http_port),
            "--grpc-port", str(self.grpc_port),
            "--metrics-port", str(self.metrics_port),
        ]  # fmt: skip
        if option_value(self.extra_args, "--cache-directory") is None:
            args += ["--cache-directory", str(home / "caches")]
        return args + restricted_api_args(self.extra_args, self.admin_key) + self.extra_args

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        if not env.get(SERVER_HOME_ENV_VAR):  # the wheel's binary needs the wheel's shared libraries
            _, libs, _ = server_distribution()
            env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(libs), env.get("LD_LIBRARY_PATH")]))
        # NOTE: the stub finds site-packages through the `python3` first on PATH, so the venv's bin/ goes first.
        # sys.executable is not resolved: resolving a venv's python leads to the system interpreter.
        env["PATH"] = os.pathsep.join(filter(None, [str(Path(sys.executable).parent), env.get("PATH")]))
        if self.model is not None:
            env[MODEL_ENV_VAR] = str(self.model)
        if self._shared_cores is not None and SHARED_CORES_ENV_VAR not in env:  # one set by the user wins
            env[SHARED_CORES_ENV_VAR] = str(self._shared_cores)
        if self.stop_board is not None:
            env[STOP_BOARD_ENV_VAR] = str(self.stop_board.path)
        env.update(self.env)
        return env

    def start(self) -> "TritonServer":
        """Validate, lay out the binary, check the ports and start the process (does not wait for readiness)."""
        if self._process is not None:
            raise RuntimeError("this TritonServer was already started")
        check_model_repository(self.model_repository)
        if self.model is not None:
            check_model_folder(self.model)
        home = server_home(self.python_version, self.layout_root)
        check_ports({"HTTP": self.http_port, "gRPC": self.grpc_port, "metrics": self.metrics_port}, self.address)
        # NOTE: the server's model instances (one process each) see each other's forwards through this file.
        fd, name = tempfile.mkstemp(prefix="llm-shared-cores-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        os.close(fd)
        self._shared_cores = Path(name)
        # NOTE: at a place that follows from the gRPC port, so the OpenAI frontend finds it (and keeps it across a
        # restart on the same ports); cleared, as posts for a server that died mean nothing to this one.
        self.stop_board = StopBoard.for_port(self.grpc_port, {**os.environ, **self.env}).clear()

        if self.echo:
            stdout = subprocess.PIPE
        else:
            if self.log_path is None:
                fd, name = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
                os.close(fd)
                self.log_path = Path(name)
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            stdout = open(self.log_path, "ab")
            self._log_start = stdout.tell()  # a log shared with earlier starts: what this one wrote begins here
        try:
            self._process = subprocess.Popen(
                self.command(home),
                env=self.environment(),
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=subprocess.STDOUT,
                # Its own session and process group (pgid == pid): signals reach it only through us, never twice,
                # and stop() can kill the stubs with it.
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        finally:
            if stdout is not subprocess.PIPE:
                stdout.close()
        self.started_at = time.monotonic()
        if self.echo:
            self._reader = threading.Thread(target=self._echo_output, name="tritonserver-output", daemon=True)
            self._reader.start()
        return self

    def _echo_output(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for raw in self._process.stdout:
            line = raw.decode(errors="replace")
            self._recent_lines.append(line.rstrip("\n"))
            sys.stdout.write(line)
            sys.stdout.flush()

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def metrics_ready(self) -> bool:
        """Whether its metrics port answers; True for a server started with ``--allow-metrics false``."""
        if not shutdown.flag_enabled(self.extra_args, "--allow-metrics"):
            return True
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def liveness_urls(self) -> dict[str, str]:
        """``name -> url`` of what answers while tritonserver runs: ``/v2/health/live`` and its metrics page (each one
        only when it was not turned off: ``--allow-http false``, ``--allow-metrics false``)."""
        urls = {}
        if shutdown.flag_enabled(self.extra_args, "--allow-http"):
            urls["/v2/health/live"] = f"{self.http_url}/v2/health/live"
        if shutdown.flag_enabled(self.extra_args, "--allow-metrics"):
            urls["the metrics port"] = self.metrics_url
        return urls

    def wait_ready(self, timeout: float | None = None) -> float:
        """Block until ``/v2/health/ready`` answers 200 and the metrics port answers too (tritonserver opens it tens
        of milliseconds after HTTP, and the probes and watchdog read it), at most ``timeout`` (default
        ``ready_timeout``) s; return seconds since start.

        Raises :class:`ServerError` with the server's own error lines if it exits first or times out.
        """
        if self._process is None or self.started_at is None:
            raise RuntimeError("call start() first")
        timeout = self.ready_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            if self._process.poll() is not None:
                self._drain_output()
                self._raise_if_a_port_was_taken()
                raise ServerError(self._failure(f"tritonserver exited with status {self._process.returncode}"))
            if self.is_ready() and self.metrics_ready():
                # NOTE: a port another process holds may answer for it (that process's metrics page); the log says.
                self._raise_if_a_port_was_taken()
                return time.monotonic() - self.started_at
            if time.monotonic() > deadline:
                raise ServerError(self._failure(f"tritonserver was not ready after {timeout:.0f} s"))
            time.sleep(0.1)

    def _raise_if_a_port_was_taken(self) -> None:
        if self.log_path is not None and not self.echo:
            try:
                with open(self.log_path, "rb") as log:
                    log.seek(self._log_start)
                    lines = log.read().decode(errors="replace").splitlines()
            except OSError:
                lines = []
        else:
            lines = list(self._recent_lines)
        if any(_PORT_TAKEN.search(line) for line in lines):
            raise PortTaken(self._failure("another process took a port tritonserver was given"))

    def _failure(self, headline: str) -> str:
        lines = self.error_lines()
        where = f"; full log: {self.log_path}" if self.log_path else ""
        if not lines:
            return f"{headline} before it was ready{where}. Last output:\n{self.output_tail(20)}"
        return f"{headline} before it was ready{where}. Server errors:\n" + "\n".join(lines)

    def _drain_output(self) -> None:
        if self._reader is not None:
            self._reader.join(timeout=5)

    def output_lines(self) -> list[str]:
        if self.log_path is not None and not self.echo:
            try:
                return self.log_path.read_text(errors="replace").splitlines()
            except OSError:
                return []
        return list(self._recent_lines)

    def recent_output(self, max_bytes: int = 256 * 1024) -> list[str]:
        """Its last lines of output (at most the last ``max_bytes`` of a log file): what ``shutdown.stop`` reads
        tritonserver's shutdown reports from, several times a second."""
        if self.log_path is None or self.echo:
            return list(self._recent_lines)
        try:
            with open(self.log_path, "rb") as f:
                start = max(0, f.seek(0, os.SEEK_END) - max_bytes)
                f.seek(start)
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return []
        return lines[1:] if start else lines  # the first line read may be cut

    def output_tail(self, num_lines: int = 80) -> str:
        return "\n".join(self.output_lines()[-num_lines:])

    def error_lines(self, limit: int = 30) -> list[str]:
        """The server's own error lines (``E1129 ...``, "failed to load", ...), CPU-only noise left out."""
        found = [ln for ln in self.output_lines() if _ERROR.search(ln) and not _NOISE.search(ln)]
        return found[-limit:]

    def send_signal(self, sig: int) -> None:
        """Signal tritonserver alone (its stubs do not hear it: tritonserver forwards nothing). To stop the server,
        use :meth:`begin_stop` or :meth:`stop`."""
        if self.is_running:
            self._process.send_signal(sig)

    def begin_stop(self, sig: int = signal.SIGTERM) -> None:
        """Start a graceful stop (``backend.triton.launcher.shutdown.stop``) on a thread and return: tritonserver and
        its stubs get ``sig``, the models drain, and the client connections left open are closed once nothing is
        open. Once only."""
        if not self.is_running or self._stopper is not None:
            return
        self._stopper = threading.Thread(target=self._stop_and_keep_result, args=(self._process.pid, sig),
                                         name="tritonserver-stop", daemon=True)
        self._stopper.start()

    def _stop_and_keep_result(self, pid: int, sig: int) -> None:
        self.stop_result = shutdown.stop(pid, sig, host=self._client_host, log=self._log, output=self.recent_output)

    def _log(self, text: str) -> None:
        line = f"[serve] stopping: {text}"
        if self.echo:
            print(line, file=sys.stderr, flush=True)
        elif self.log_path is not None:
            with open(self.log_path, "a") as f:
                f.write(line + "\n")

    def kill(self) -> None:
        """SIGKILL tritonserver and every process of its group (the stubs, anything a model started)."""
        if self._process is not None and not self._group_ended:
            kill_process_group(self._process.pid)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the process to exit, then for its process group and the graceful stop (``stop_result``); return
        its status (negative: that signal; ``shutdown.exit_status`` says what to report).

        Group members still alive ``STUB_EXIT_GRACE_S`` after the server exited are killed.
        """
        if self._process is None:
            raise RuntimeError("call start() first")
        code = self._process.wait(timeout)
        self._end_group()
        self._drain_output()
        if self._stopper is not None:
            self._stopper.join(STOP_RESULT_WAIT_S)
        if self.stopped_at is None:
            self.stopped_at = time.monotonic()
        return code

    def _end_group(self) -> None:
        # NOTE: once only: when the group is empty its number (the server's pid) is free for reuse.
        if self._group_ended:
            return
        deadline = time.monotonic() + STUB_EXIT_GRACE_S
        while process_group_members(self._process.pid):
            if time.monotonic() > deadline:
                self.kill()
                break
            time.sleep(0.05)
        self._group_ended = True
        if self._shared_cores is not None:
            remove_registry(self._shared_cores)
        if self.stop_board is not None:
            self.stop_board.remove()

    def stop(self, timeout: float = 45.0) -> int | None:
        """Stop gracefully (:meth:`begin_stop`), wait up to ``timeout`` s for tritonserver to exit (the models drain,
        unload, and the stubs exit), then SIGKILL the whole process group. Idempotent."""
        if self._process is None:
            return None
        if self._process.poll() is None:
            self.begin_stop()
            try:
                self._process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.wait()

    def __repr__(self) -> str:
        state = "running" if self.is_running else f"exited {self.returncode}" if self._process else "not started"
        return f"TritonServer({self.model_repository}, http={self.http_port}, grpc={self.grpc_port}, {state})"


def start_on_free_ports(model_repository: str | os.PathLike, *, attempts: int = 3,
                        on_start: Callable[[TritonServer], object] | None = None, **options) -> TritonServer:
    """A :class:`TritonServer` (``options`` as its keywords) started on three :func:`free_ports` of the loopback
    address and ready, started again on new ones if another process takes one between choosing and binding
    (``attempts`` in all). ``on_start`` sees each process as it starts, before it is ready.

    A server that does not become ready is stopped and :class:`ServerError` raised. Use it as
    ``with start_on_free_ports(...) as server:`` to stop it at the end.
    """
    address = options.pop("address", LOOPBACK)
    for attempt in range(attempts):
        http_port, grpc_port, metrics_port = free_ports(3, address)
        server = TritonServer(model_repository, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                              address=address, **options)
        try:
            server.start()
            if on_start is not None:
                on_start(server)
            return server.__enter__()  # waits until ready; stops it if it is not
        except PortInUse:  # from start()'s check of the ports, or PortTaken from the wait
            if attempt == attempts - 1:
                raise
    raise ValueError(f"attempts must be at least 1, not {attempts}")
