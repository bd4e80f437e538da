"""What a launch is given, checked before tritonserver starts: the model repository and the model folder, the
ports, and the flags that put the admin APIs behind a key. Every refusal is a :class:`LauncherError` that says what
to fix.

The admin APIs (shared-memory registration, trace and log settings, and model load/unload when model control is
on) answer only requests that carry the header ``admin-key`` (gRPC: ``triton-grpc-protocol-admin-key``) with the
value of ``$TRITON_ADMIN_KEY``, or of a random key made for each launch when that is unset.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from backend.contract.server_args import option_value
from backend.contract.settings import DEFAULT_MODEL

REPO_ROOT = Path(__file__).resolve().parents[3]
LOOPBACK = "127.0.0.1"

ADMIN_HEADER = "admin-key"
# NOTE: Triton prefixes a gRPC restriction's header with this; "admin-key" alone is refused over gRPC.
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"
# Requests to these could make the server open a name or a path (shared-memory regions, trace and log files) or
# change what it logs. "model-repository" (load, unload, index) joins them when model control is on.
ADMIN_APIS = ("shared-memory", "trace", "logging")


class LauncherError(Exception):
    """Something the user must fix before the server can start (bad path, busy port, no stub)."""


class PortInUse(LauncherError):
    """A port the server needs is taken (callers that picked the port themselves may retry with another)."""


# ---- the model repository and the model ------------------------------------------------------------------------


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
            f"(python -m tools.prepare_model --out {DEFAULT_MODEL})"
        )
    return path


def copy_model_repository(
    dst: str | os.PathLike,
    models: Iterable[str],
    parameters: Mapping[str, str] | None = None,
    source: str | os.PathLike = REPO_ROOT / "model_repository",
) -> Path:
    """A copy of ``models`` from ``source`` in ``dst``, each config.pbtxt with the string ``parameters`` set
    (replaced where the config has the key, added where it does not); without ``parameters``, the files as they
    are. For servers that need other settings than the shipped ones."""
    # NOTE: imported here: protobuf and tritonclient load only for a copy, not for every launch.
    from backend.triton.launcher import config_text

    dst = Path(dst)
    for model in models:
        shutil.copytree(Path(source) / model, dst / model, ignore=shutil.ignore_patterns("__pycache__"))
        with config_text.edit(dst / model / "config.pbtxt") as config:
            # NOTE: a relative model folder is read against the folder holding the repository
            # (stub/model_config.py): the copy names the source's folder, wherever the copy lies.
            folder = config_text.parameter(config, "model")
            if folder and not Path(folder).expanduser().is_absolute():
                config_text.set_parameters(config, {"model": str(Path(source).resolve().parent / folder)})
            config_text.set_parameters(config, parameters or {})
    return dst


# ---- ports -------------------------------------------------------------------------------------------------


def port_is_free(port: int, address: str = LOOPBACK) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # SO_REUSEADDR: a port left in TIME_WAIT by a server that just stopped is free; a listener is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError:
            return False
    return True


# NOTE: below the kernel's ephemeral range when there is room. A port from bind(0) is one the kernel may also hand
# to any outgoing connection (a load test's clients make thousands) in the moment between choosing it and the
# server binding it; seen once: tritonserver's metrics port taken so, and the server exiting after it was up.
_LOWEST_CHOSEN_PORT = 10000
_MIN_SPARE_PORTS = 2000
_chooser = random.Random()  # its own: a test that seeds the random module must not make two processes agree


def ephemeral_port_range() -> tuple[int, int]:
    """The ports the kernel gives outgoing connections (``ip_local_port_range``; Linux's default if unreadable)."""
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(count: int, address: str = LOOPBACK) -> list[int]:
    """``count`` distinct ports free on ``address`` right now (all held open together, so never duplicates), chosen
    outside the kernel's ephemeral range when it leaves room, so no outgoing connection takes one before the
    server binds it."""
    low, high = ephemeral_port_range()
    spans = [(first, last) for first, last in ((_LOWEST_CHOSEN_PORT, low - 1), (high + 1, 65535))
             if last - first + 1 >= _MIN_SPARE_PORTS]
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sockets.append(_bound_socket(address, spans))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _bound_socket(address: str, spans: list[tuple[int, int]], tries: int = 50) -> socket.socket:
    """A socket bound to a random free port of ``spans`` (to one the kernel picks when there are none, or no free
    one was found in ``tries``)."""
    for _ in range(tries if spans else 0):
        first, last = _chooser.choice(spans)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((address, _chooser.randint(first, last)))
            return sock
        except OSError:
            sock.close()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((address, 0))
    return sock


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


# ---- the OpenAI frontend --------------------------------------------------------------------------------


def frontend_command(triton_grpc_url: str, host: str, port: int, model_dir: str | os.PathLike,
                     triton_metrics_url: str | None = None) -> list[str]:
    """The command that runs the OpenAI-compatible frontend (``frontend/openai``) in front of Triton's gRPC port
    (``triton_metrics_url``: the metrics page its ``/get_load`` reads; default: the frontend's own).

    NOTE: a command, not an import: the frontend is a client of the server, a layer above this glue. Its one owner,
    for the launcher (``serve.py``) and for ``frontend.openai.process`` alike."""
    metrics = ["--triton-metrics", triton_metrics_url] if triton_metrics_url else []
    return [sys.executable, "-m", "frontend.openai", "--triton-grpc", triton_grpc_url, "--host", host,
            "--port", str(port), "--model-dir", str(model_dir), *metrics]


# ---- the admin APIs --------------------------------------------------------------------------------------


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
