"""Launch a real Triton Inference Server on a model repository, without Docker.

    python -m backend.triton.serve --model-repository model_repository --model models/smollm2-135m-instruct \\
        --http-port 8000 --grpc-port 8001 --metrics-port 8002 [-- extra tritonserver args]

The ``tritonserver`` binary comes from the nvidia-pytriton wheel (only the binary; PyTriton's Python API is not
used). It is laid out once in ``.triton/tritonserver-<wheel version>-py<XY>/`` with the Python-backend stub for
the running interpreter, then started with the environment the stub needs. ``$TRITONSERVER_HOME`` names an
installed server instead (NVIDIA's tritonserver image: ``/opt/tritonserver``, with ``bin/`` and ``backends/``).
The model folder reaches the models as the environment variable ``LLM_MODEL``; the model repository does not
depend on this launcher.

The admin APIs (shared-memory registration, trace and log settings, and model load/unload when model control is
on) answer only requests that carry the header ``admin-key`` (gRPC: ``triton-grpc-protocol-admin-key``) with the
value of ``$TRITON_ADMIN_KEY``, or of a random key made for each launch when that is unset.

The server runs in its own session: ``stop()`` (and Ctrl-C or SIGTERM to the CLI) stops it gracefully with
``backend.triton.shutdown.stop`` (tritonserver and its stubs get the signal, the models drain, idle client connections are
closed so the models can unload at once) and, if it has to escalate, SIGKILLs the whole process group, so no stub
outlives it.

:class:`TritonServer` is the same code path as a small API, and :func:`start_on_free_ports` the one way the tests,
``make compare`` and the soak start a server (free loopback ports, on a copy from :func:`copy_model_repository` if
they change settings)::

    with start_on_free_ports("model_repository", model="models/smollm2-135m-instruct") as server:
        requests.get(f"{server.http_url}/v2/health/ready")
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import importlib.metadata
import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterable, Mapping, Sequence


from backend.triton import shutdown
from backend.triton.shutdown import option_value

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_LAYOUT_ROOT = REPO_ROOT / ".triton"
DEFAULT_MODEL = "models/smollm2-135m-instruct"
MODEL_ENV_VAR = "LLM_MODEL"
SERVER_HOME_ENV_VAR = "TRITONSERVER_HOME"
LAYOUT_MARKER = ".complete"
STUB_NAME = "triton_python_backend_stub"
LOOPBACK = "127.0.0.1"

ADMIN_KEY_ENV_VAR = "TRITON_ADMIN_KEY"
ADMIN_HEADER = "admin-key"
# NOTE: Triton 2.51 prefixes a gRPC restriction's header with this; "admin-key" alone is refused over gRPC.
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"
# Requests to these could make the server open a name or a path (shared-memory regions, trace and log files) or
# change what it logs. "model-repository" (load, unload, index) joins them when model control is on.
ADMIN_APIS = ("shared-memory", "trace", "logging")
# A stub notices within about a second that tritonserver is gone, then removes its shared memory and exits.
STUB_EXIT_GRACE_S = 3.0
_SHM_REGION = re.compile(r"triton_python_backend_shm_region_[0-9a-f-]+")

# Lines a CPU-only machine always prints; they are not the reason a start failed.
_NOISE = re.compile(r"CudaDriverHelper|NVML|DCGM|CUDA driver version is insufficient|pinned memory", re.I)
_ERROR = re.compile(r"^E\d{4} |error|failed|unavailable|unrecognized option|address already in use", re.I)


class LauncherError(Exception):
    """Something the user must fix before the server can start (bad path, busy port, no stub)."""


class PortInUse(LauncherError):
    """A port the server needs is taken (callers that picked the port themselves may retry with another)."""


class ServerError(RuntimeError):
    """The server exited or did not become ready; the message carries the server's own error lines."""


# ---------------------------------------------------------------------------------------------- the binary


def _pytriton_dir() -> Path:
    # NOTE: find_spec on the top-level package locates it without importing PyTriton's Python API.
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise LauncherError("nvidia-pytriton is not installed (it ships the tritonserver binary); run `make venv`")
    return Path(next(iter(spec.submodule_search_locations)))


def server_distribution() -> tuple[Path, Path, str]:
    """``(tritonserver tree, shared-library folder, wheel version)`` of the installed nvidia-pytriton wheel."""
    package_dir = _pytriton_dir()
    tree = package_dir / "tritonserver"
    libs = package_dir.parent / "nvidia_pytriton.libs"
    if not (tree / "bin" / "tritonserver").is_file():
        raise LauncherError(f"no tritonserver binary in {tree}; reinstall nvidia-pytriton")
    return tree, libs, importlib.metadata.version("nvidia-pytriton")


def python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def stub_versions(tree: Path) -> list[str]:
    """Python versions that have a Python-backend stub in the wheel, oldest first."""
    stubs = tree / "python_backend_stubs"
    found = [p.parent.name for p in stubs.glob(f"*/{STUB_NAME}")]
    return sorted(found, key=lambda v: tuple(int(part) for part in v.split(".") if part.isdigit()))


def find_stub(tree: Path, version: str) -> Path:
    stub = tree / "python_backend_stubs" / version / STUB_NAME
    if not stub.is_file():
        raise LauncherError(
            f"the Triton Python backend has no stub for Python {version}; "
            f"stubs exist for Python {', '.join(stub_versions(tree)) or '(none)'}. "
            "Recreate the virtual environment with one of those (`make clean venv PYTHON=python3.X`)."
        )
    return stub


def prepare_server_home(version: str | None = None, layout_root: Path = DEFAULT_LAYOUT_ROOT) -> Path:
    """Lay the wheel's tritonserver tree out once, with the stub for ``version``; return that folder.

    The tree is copied into a temporary sibling and renamed into place with its marker already written, so a
    folder without the marker is a leftover of an interrupted copy and is redone. Site-packages is never written.
    """
    version = version or python_version()
    tree, _, wheel_version = server_distribution()
    stub = find_stub(tree, version)
    home = layout_root / f"tritonserver-{wheel_version}-py{version.replace('.', '')}"
    wanted = {"source": str(tree), "nvidia_pytriton": wheel_version, "python": version}
    if _read_json(home / LAYOUT_MARKER) == wanted:
        return home

    t0 = time.perf_counter()
    if home.exists():
        shutil.rmtree(home)
    layout_root.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_copies(layout_root, home.name)
    tmp = layout_root / f".{home.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        shutil.copytree(tree, tmp, ignore=shutil.ignore_patterns("python_backend_stubs", "__pycache__"))
        shutil.copy2(stub, tmp / "backends" / "python" / STUB_NAME)
        (tmp / LAYOUT_MARKER).write_text(json.dumps(wanted, indent=2) + "\n")
        try:
            tmp.rename(home)
        except OSError:
            if _read_json(home / LAYOUT_MARKER) != wanted:  # not just another launcher finishing first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"[serve] laid out tritonserver in {home} ({time.perf_counter() - t0:.2f} s)", flush=True)
    return home


def server_home(version: str | None = None, layout_root: Path = DEFAULT_LAYOUT_ROOT) -> Path:
    """The tritonserver install to run: ``$TRITONSERVER_HOME`` as it is, else the wheel's, laid out once."""
    installed = os.environ.get(SERVER_HOME_ENV_VAR)
    if not installed:
        return prepare_server_home(version, layout_root)
    home = Path(installed)
    for part in ("bin/tritonserver", "backends/python"):
        if not (home / part).exists():
            raise LauncherError(f"${SERVER_HOME_ENV_VAR} is {home}, which has no {part}: not a tritonserver install")
    return home


def _remove_abandoned_copies(layout_root: Path, name: str) -> None:
    """Remove half-made copies left by launchers that were killed mid-copy."""
    for leftover in layout_root.glob(f".{name}.tmp-*"):
        pid = leftover.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------- checks


def check_model_repository(path: str | os.PathLike) -> Path:
    path = Path(path).absolute()
    if not path.is_dir():
        raise LauncherError(f"model repository {path} does not exist (or is not a folder)")
    return path


def check_model_folder(path: str | os.PathLike) -> Path:
    path = Path(path).absolute()
    if not (path / "config.json").is_file():
        what = "does not exist" if not path.exists() else "has no config.json"
        raise LauncherError(
            f"model folder {path} {what}; prepare it with `make model` "
            f"(python -m backend.tools.prepare_model --out {DEFAULT_MODEL})"
        )
    return path


def copy_model_repository(
    dst: str | os.PathLike,
    models: Iterable[str],
    parameters: Mapping[str, str] | None = None,
    source: str | os.PathLike = REPO_ROOT / "model_repository",
) -> Path:
    """A copy of ``models`` from ``source`` in ``dst``, each config.pbtxt with ``parameters`` set (replaced where the
    config has the key, appended where it does not). For servers that need other settings than the shipped ones."""
    dst = Path(dst)
    for model in models:
        shutil.copytree(Path(source) / model, dst / model, ignore=shutil.ignore_patterns("__pycache__"))
        path = dst / model / "config.pbtxt"
        text = path.read_text()
        for key, value in (parameters or {}).items():
            line = f'parameters: {{ key: "{key}", value: {{ string_value: "{value}" }} }}\n'
            text, found = re.subn(rf'parameters: \{{ key: "{key}", value: \{{ string_value: "[^"]*" \}} \}}\n',
                                  line.replace("\\", "\\\\"), text)
            if not found:
                text += line
        path.write_text(text)
    return dst


def port_is_free(port: int, address: str = LOOPBACK) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # SO_REUSEADDR: a port left in TIME_WAIT by a server that just stopped is free; a listener is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError:
            return False
    return True


def free_ports(count: int, address: str = LOOPBACK) -> list[int]:
    """``count`` distinct ports free on ``address`` right now (all held open together, so never duplicates)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((address, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def check_ports(ports: Mapping[str, int], address: str) -> None:
    """Refuse duplicate or busy ports. ``ports`` maps a protocol name ("HTTP") to its port."""
    seen: dict[int, str] = {}
    for name, port in ports.items():
        if not 0 < port < 65536:
            raise LauncherError(f"{name} port {port} is not a valid port number")
        if port in seen:
            raise LauncherError(f"{name} and {seen[port]} were both given port {port}; each needs its own")
        seen[port] = name
        if not port_is_free(port, address):
            raise PortInUse(
                f"{name} port {port} on {address} is already in use (another server?); "
                f"free it or pick another with --{name.lower()}-port / {name.upper()}_PORT"
            )


def restricted_api_args(extra_args: Sequence[str], key: str) -> list[str]:
    """Triton's own flags that put the admin APIs behind the ``admin-key`` header, for what ``extra_args`` lacks.

    A user's own ``--http-restricted-api`` replaces ours for HTTP only, and ``--grpc-restricted-protocol`` for gRPC
    only, so restricting one protocol differently never opens the other.
    """
    apis = list(ADMIN_APIS)
    if (option_value(extra_args, "--model-control-mode") or "none") != "none":
        apis.insert(1, "model-repository")  # explicit or poll: the API can load and unload models
    setting = f"{','.join(apis)}:{ADMIN_HEADER}={key}"
    args = []
    if option_value(extra_args, "--http-restricted-api") is None:
        args.append(f"--http-restricted-api={setting}")
    if option_value(extra_args, "--grpc-restricted-protocol") is None:
        args.append(f"--grpc-restricted-protocol={setting}")
    return args


# ---------------------------------------------------------------------------------------------- process groups


def process_group_members(pgid: int) -> list[int]:
    """Live processes (zombies left out) whose process group is ``pgid``, read from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(stat.parent.name))
    return members


def _process_tree(pid: int) -> list:
    # NOTE: imported here: the launcher itself needs only the standard library (tests/conftest.py loads it in the
    # Python 3.10 environment too, which has no psutil).
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def tree_rss(pid: int) -> dict[int, int]:
    """Resident bytes of a process and all its descendants (tritonserver and its Python-backend stubs)."""
    import psutil

    out = {}
    for proc in _process_tree(pid):
        try:
            out[proc.pid] = proc.memory_info().rss
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            pass
    return out


def process_names(pid: int) -> dict[int, str]:
    """``pid -> what it is`` for a process and its descendants: "tritonserver", or the model a stub serves."""
    import psutil

    names = {}
    for proc in _process_tree(pid):
        try:
            cmdline = proc.cmdline()
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        stub = next((part for part in cmdline if part.endswith("model.py")), None)
        names[proc.pid] = Path(stub).parent.parent.name if stub else Path(cmdline[0]).name if cmdline else "?"
    return names


def _stub_shm_regions(pids: Iterable[int]) -> list[str]:
    """Shared-memory regions of the Python-backend stubs among ``pids`` (each stub's third argument names it)."""
    regions = []
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if len(argv) > 2 and argv[0].endswith(STUB_NAME) and _SHM_REGION.fullmatch(argv[2]):
            regions.append(argv[2])
    return regions


def kill_process_group(pgid: int, timeout: float = 5.0) -> None:
    """SIGKILL every process in group ``pgid``, wait until none is left, then remove the shared memory of the
    stubs among them (killed processes cannot remove it themselves)."""
    regions = _stub_shm_regions(process_group_members(pgid))
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + timeout
    while process_group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    for region in regions:
        try:
            os.unlink(f"/dev/shm/{region}")
        except FileNotFoundError:  # the stub removed it before the signal
            pass


# ---------------------------------------------------------------------------------------------- the server


def _die_with_parent() -> None:
    # NOTE: PR_SET_PDEATHSIG stops an orphaned server if the launcher (or a test run) is killed outright.
    # Linux sends it when the *thread* that started the server exits, so start servers from a long-lived thread.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # 1 == PR_SET_PDEATHSIG


class TritonServer:
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

        if self.echo:
            stdout = subprocess.PIPE
        else:
            if self.log_path is None:
                fd, name = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
                os.close(fd)
                self.log_path = Path(name)
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            stdout = open(self.log_path, "ab")
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
                preexec_fn=_die_with_parent,
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

    def wait_ready(self, timeout: float | None = None) -> float:
        """Block until ``/v2/health/ready`` answers 200 (at most ``timeout``, default ``ready_timeout`` s); return
        seconds since start.

        Raises :class:`ServerError` with the server's own error lines if it exits first or times out.
        """
        if self._process is None or self.started_at is None:
            raise RuntimeError("call start() first")
        timeout = self.ready_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            if self._process.poll() is not None:
                self._drain_output()
                raise ServerError(self._failure(f"tritonserver exited with status {self._process.returncode}"))
            if self.is_ready():
                return time.monotonic() - self.started_at
            if time.monotonic() > deadline:
                raise ServerError(self._failure(f"tritonserver was not ready after {timeout:.0f} s"))
            time.sleep(0.1)

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
        """Start a graceful stop (``backend.triton.shutdown.stop``) on a thread and return: tritonserver and its stubs get
        ``sig``, the models drain, and the client connections left open are closed once nothing is open. Once only."""
        if not self.is_running or self._stopper is not None:
            return
        self._stopper = threading.Thread(target=shutdown.stop, args=(self._process.pid, sig),
                                         kwargs={"host": self._client_host, "log": self._log}, name="tritonserver-stop",
                                         daemon=True)
        self._stopper.start()

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
        """Wait for the process to exit, then for its process group; return its status (negative: that signal).

        Group members still alive ``STUB_EXIT_GRACE_S`` after the server exited are killed.
        """
        if self._process is None:
            raise RuntimeError("call start() first")
        code = self._process.wait(timeout)
        self._end_group()
        self._drain_output()
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

    def __enter__(self) -> "TritonServer":
        if self._process is None:
            self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.is_running else f"exited {self.returncode}" if self._process else "not started"
        return f"TritonServer({self.model_repository}, http={self.http_port}, grpc={self.grpc_port}, {state})"


def start_on_free_ports(model_repository: str | os.PathLike, *, attempts: int = 3, **options) -> TritonServer:
    """A :class:`TritonServer` (``options`` as its keywords) started on three :func:`free_ports` of the loopback
    address, and on new ones if another process takes one between choosing and binding (``attempts`` in all).

    Returns once the process is started; ``with start_on_free_ports(...) as server:`` waits until it is ready (or
    stops it and raises :class:`ServerError`) and always stops it.
    """
    address = options.pop("address", LOOPBACK)
    for attempt in range(attempts):
        http_port, grpc_port, metrics_port = free_ports(3, address)
        server = TritonServer(model_repository, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                              address=address, **options)
        try:
            return server.start()
        except PortInUse:
            if attempt == attempts - 1:
                raise
    raise ValueError(f"attempts must be at least 1, not {attempts}")


# ---------------------------------------------------------------------------------------------- CLI


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip() else default


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Our options, plus everything else (unknown options, and all after ``--``) for tritonserver."""
    argv = list(argv)
    after_dashes: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, after_dashes = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(
        prog="python -m backend.triton.serve",
        description="Serve a model repository on a real Triton Inference Server. "
        "Options it does not know (and anything after --) go to tritonserver unchanged.",
        allow_abbrev=False,
    )
    parser.add_argument("--model-repository", default="model_repository", help="default: %(default)s")
    parser.add_argument(
        "--model",
        default=os.environ.get("MODEL") or os.environ.get(MODEL_ENV_VAR) or DEFAULT_MODEL,
        help=f"HF model folder, exported to the models as {MODEL_ENV_VAR} "
        f"(default: $MODEL, else ${MODEL_ENV_VAR}, else %(default)s)",
    )
    parser.add_argument("--http-port", type=int, default=_env_int("HTTP_PORT", 8000))
    parser.add_argument("--grpc-port", type=int, default=_env_int("GRPC_PORT", 8001))
    parser.add_argument("--metrics-port", type=int, default=_env_int("METRICS_PORT", 8002))
    parser.add_argument("--address", default="0.0.0.0", help="address to listen on (default: %(default)s)")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds (default: %(default)s)")
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=_env_int("MAX_RESTARTS", 3),
        help="start tritonserver again when it dies by a signal nobody sent it, at most this many times "
        "(default: $MAX_RESTARTS or %(default)s; 0: never)",
    )
    # Which stub to look up; only for testing the "no stub for this Python" path.
    parser.add_argument("--python-version", default=None, help=argparse.SUPPRESS)
    args, unknown = parser.parse_known_args(argv)
    return args, unknown + after_dashes


def main(argv: Sequence[str] | None = None) -> int:
    args, extra_args = parse_args(sys.argv[1:] if argv is None else argv)
    # Every option but --max-restarts (this loop's own) is one of TritonServer's keywords, under the same name.
    options = {name: value for name, value in vars(args).items() if name != "max_restarts"}

    def new_server(env: Mapping[str, str] | None = None) -> TritonServer:
        return TritonServer(**options, extra_args=extra_args, env=env, echo=True)

    server = new_server()
    try:
        server.start()
    except LauncherError as exc:
        print(f"serve: error: {exc}", file=sys.stderr)
        return 2

    signals_received: list[int] = []

    def forward(signum: int, _frame) -> None:
        # NOTE: the server has its own session, so the terminal's Ctrl-C reaches only us; we pass it on, to the stubs
        # too. First signal: let the server shut down cleanly. Second: stop waiting for it, stubs included.
        signals_received.append(signum)
        if len(signals_received) == 1:
            server.begin_stop(signum)
        else:
            server.kill()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)

    restarts = 0
    while True:
        try:
            seconds = server.wait_ready()
        except ServerError as exc:
            if signals_received:
                print("[serve] stopped before the server was ready", file=sys.stderr)
                return _exit_status(server.wait())
            print(f"serve: error: {exc}", file=sys.stderr)
            server.stop()
            return _exit_status(server.wait()) or 1
        if restarts == 0:
            _print_admin_key_hint(extra_args, server)
        print(
            f"[serve] ready in {seconds:.1f} s: HTTP {server.http_url}  gRPC {server.grpc_url}  "
            f"metrics {server.metrics_url}  (model {server.model}; Ctrl+C stops)",
            flush=True,
        )
        code = server.wait()
        # NOTE: a signal nobody here sent is a crash (the bundled Triton's gRPC frontend can crash under heavy
        # stream cancellation; docs/server.md). Come back on the same ports with the same admin key.
        if signals_received or code >= 0 or restarts >= args.max_restarts:
            break
        restarts += 1
        print(
            f"[serve] tritonserver died by signal {-code}; restarting it ({restarts} of {args.max_restarts})",
            file=sys.stderr,
            flush=True,
        )
        server = new_server(env={ADMIN_KEY_ENV_VAR: server.admin_key})
        try:
            server.start()
        except LauncherError as exc:
            print(f"serve: error: {exc}", file=sys.stderr)
            return 2
    status = _exit_status(code)
    print(f"[serve] tritonserver exited with status {status}", file=sys.stderr)
    if status and any("Exit timeout expired" in line for line in server.output_lines()[-50:]):
        print("[serve] tritonserver gave up waiting at --exit-timeout-secs: a model could not unload (a gRPC client "
              "that cancels a stream right after its final response can cause that in Triton 2.51), or a client "
              "connection could not be closed; see docs/server.md, \"Stopping the server\"", file=sys.stderr)
    return status


def _print_admin_key_hint(extra_args: Sequence[str], server: TritonServer) -> None:
    if restricted_api_args(extra_args, server.admin_key):
        # NOTE: never print the key itself; the log may be shared.
        where = (
            f"the value of ${ADMIN_KEY_ENV_VAR}"
            if os.environ.get(ADMIN_KEY_ENV_VAR)
            else f"a random key made for this run (set {ADMIN_KEY_ENV_VAR} to choose one)"
        )
        print(
            "[serve] admin APIs (shared memory, trace, logging; model load/unload under model control) need the "
            f"header {ADMIN_HEADER} (gRPC: {GRPC_HEADER_PREFIX}{ADMIN_HEADER}) set to {where}",
            flush=True,
        )


def _exit_status(code: int) -> int:
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
