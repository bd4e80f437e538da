"""Stop a tritonserver 2.51 so that its models drain, unload and it exits 0, which SIGTERM alone does not do.

What tritonserver 2.51 does on SIGTERM (measured; tests/server/test_shutdown.py runs each case against a real server):

- It tells its Python-backend stubs nothing. Our models learn of the shutdown only from the signal itself
  (``ShutdownNotice``), so it must reach the stubs too: then they refuse new requests, finish the running ones and
  end what is still running shortly before the exit timeout with "the server is shutting down".
- HTTP: it stops accepting connections, then waits for every connection still open to close, up to
  ``--exit-timeout-secs``, and goes on serving requests on them meanwhile. A keep-alive client that stays connected
  holds it for the whole timeout; nothing is then left for the models to unload ("Exit timeout expired. Exiting
  immediately.") and it exits with status 1.
- gRPC: a model unloads only once every stream that carried its requests is closed, so a client that keeps its
  stream open holds the model (tritonserver then even hung past its exit timeout here).
- A gRPC stream cancelled right after its final response (``stop_stream(cancel_requests=True)`` once the answer is
  complete) now and then leaves the model it used unable to unload at all, a race in 2.51's gRPC frontend (seen
  with a ten-line model too). Nothing here can release it: that shutdown ends at the exit timeout with status 1.
  Clients should cancel only requests that are still running (``client/`` and the Locust users do).

:func:`stop` does what is missing: it signals tritonserver and its stubs, waits until no request is open in any
model (the metrics port) or the models' drain grace is over, then shuts down the client connections still open on
the HTTP port and the idle ones on the gRPC port, so that tritonserver goes on at once to unload its models and
exit. A client still connected then sees its connection closed (every request it sent already has its final
response).

``python -m backend.triton.shutdown run -- tritonserver ARGS...`` runs a server under this stop (the container's entry).
Standard library only: it runs in the container's Python without the engine's dependencies.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

if not __package__:  # run as a file (python3 backend/triton/shutdown.py): put the project on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from backend.triton import names  # noqa: E402
from backend.triton.processes import children, command_line, is_alive  # noqa: E402

# tritonserver's default --exit-timeout-secs, and how long before it the models end what is still running: the
# final responses, the connections closing and the models unloading must all fit in this margin.
TRITON_EXIT_TIMEOUT_S = 30.0
SHUTDOWN_MARGIN_S = 5.0
# Gauges that count the requests our engines have accepted and not answered yet, and Triton's own queue in front of
# execute() (a dynamic batcher holds a request there up to its max_queue_delay: 1 s for llm_static).
ENGINE_GAUGES = (names.NUM_REQUESTS_RUNNING, names.NUM_REQUESTS_WAITING)
QUEUE_GAUGE = names.PENDING_REQUESTS
# Once the engines are idle, how long Triton's queue may take to empty. After the signal every request that reaches
# execute() is refused at once, so a queue that does not empty is a client still sending new requests.
QUEUE_SETTLE_S = 1.5
# A gRPC connection is closed only after it has sent and received nothing for this long (see stop()): longer than
# any batcher holds a request (1 s for llm_static), so no request is waiting on a connection closed.
GRPC_IDLE_S = 2.5
POLL_S = 0.2
_SYS_PIDFD_GETFD = 438  # the same number on every Linux architecture
_TCP_ESTABLISHED = "01"

Log = Callable[[str], None]


# ---- what tritonserver was started with -----------------------------------------------------------------------


def option_value(args: Sequence[str], name: str) -> str | None:
    """Last value of ``--name X`` or ``--name=X`` in a tritonserver argument list (the server keeps the last)."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def exit_timeout(args: Sequence[str]) -> float:
    value = option_value(args, "--exit-timeout-secs")
    try:
        return float(value) if value is not None else TRITON_EXIT_TIMEOUT_S
    except ValueError:
        return TRITON_EXIT_TIMEOUT_S


def drain_grace(args: Sequence[str]) -> float:
    """Seconds the models keep serving what they accepted after the signal: the exit timeout less a margin."""
    return max(0.0, exit_timeout(args) - SHUTDOWN_MARGIN_S)


def _port(args: Sequence[str], name: str, default: int) -> int:
    value = option_value(args, name)
    return int(value) if value is not None and value.isdigit() else default


# ---- the signal -----------------------------------------------------------------------------------------------


def signal_server(pid: int, sig: int = signal.SIGTERM) -> None:
    """Send ``sig`` to tritonserver and to its stubs (tritonserver forwards nothing to them)."""
    for target in (pid, *children(pid)):
        try:
            os.kill(target, sig)
        except ProcessLookupError:
            pass


# ---- open requests (the metrics port) -------------------------------------------------------------------------


def open_requests(metrics_url: str, timeout: float = 2.0) -> tuple[float, float] | None:
    """``(in the engines, in Triton's queue)``: requests accepted and not answered yet, summed over the models;
    None when the metrics port does not answer."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=timeout) as response:
            text = response.read().decode(errors="replace")
    except (urllib.error.URLError, OSError):
        return None
    engines = queued = 0.0
    for line in text.splitlines():
        if line.startswith((*ENGINE_GAUGES, QUEUE_GAUGE)):
            try:
                value = float(line.rsplit(" ", 1)[1])
            except ValueError:
                continue
            if line.startswith(QUEUE_GAUGE):
                queued += value
            else:
                engines += value
    return engines, queued


# ---- client connections ---------------------------------------------------------------------------------------


def client_connections(pid: int, ports: Iterable[int]) -> list[int]:
    """File descriptors, in process ``pid``, of established TCP connections whose local port is one of ``ports``."""
    ports = set(ports)
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()  # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            if fields[3] == _TCP_ESTABLISHED and int(fields[1].rsplit(":", 1)[1], 16) in ports:
                inodes.add(fields[9])
    fds = []
    try:
        entries = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    for fd in entries:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            fds.append(int(fd))
    return sorted(fds)


def shut_down_connections(pid: int, fds: Iterable[int], min_idle_s: float = 0.0) -> int:
    """``shutdown(SHUT_RDWR)`` the sockets ``fds`` of process ``pid`` that have sent and received nothing for
    ``min_idle_s``; returns how many were shut down.

    The sockets are reached through ``pidfd_getfd`` (Linux 5.6+; allowed on one's own child process, and under a
    container's seccomp profile only where that profile permits it: Docker's does with CAP_SYS_PTRACE). Raises
    ``OSError`` when that is refused. Bytes already written still reach the client; the server's next read ends.
    """
    fds = list(fds)
    if not fds:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    done = 0
    try:
        for fd in fds:
            copy = libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
            if copy < 0:
                err = ctypes.get_errno()
                if err == 9:  # EBADF: closed meanwhile
                    continue
                raise OSError(err, f"pidfd_getfd: {os.strerror(err)}")
            sock = socket.socket(fileno=copy)
            try:
                if min_idle_s <= 0 or idle_seconds(sock) >= min_idle_s:
                    sock.shutdown(socket.SHUT_RDWR)
                    done += 1
            except OSError:  # already closed by the peer
                pass
            finally:
                sock.close()  # our copy only; the shutdown holds for tritonserver's descriptor too
    finally:
        os.close(pidfd)
    return done


def idle_seconds(sock: socket.socket) -> float:
    """Seconds since the connection last sent or received data (Linux ``struct tcp_info``: ``tcpi_last_data_sent``
    at byte 44, ``tcpi_last_data_recv`` at byte 52, both in ms)."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    return min(int.from_bytes(info[44:48], sys.byteorder), int.from_bytes(info[52:56], sys.byteorder)) / 1000


# ---- the stop -------------------------------------------------------------------------------------------------


def stop(pid: int, sig: int = signal.SIGTERM, *, host: str = "127.0.0.1", log: Log = print,
         poll: float = POLL_S) -> str:
    """Stop tritonserver ``pid`` as described at the top; returns once its client connections are shut down (or
    it has exited). Its ports and exit timeout are read from its command line. Returns what was done, in words."""
    args = command_line(pid)
    if not args:
        return "tritonserver had already exited"
    grace = drain_grace(args)
    http_port, grpc_port = _port(args, "--http-port", 8000), _port(args, "--grpc-port", 8001)
    metrics_url = f"http://{host}:{_port(args, '--metrics-port', 8002)}/metrics"
    t0 = time.monotonic()
    signal_server(pid, sig)
    log(f"draining: new requests are refused; running ones may finish for {grace:.0f} s")

    # Drained: the engines idle twice in a row (a request answered just now has had time to reach its client), and
    # Triton's queue empty or left QUEUE_SETTLE_S to empty (what it still holds arrived after the signal).
    idle_since = drained_at = last = None
    while drained_at is None and time.monotonic() - t0 < grace + 1.0:
        if not is_alive(pid):
            return "tritonserver exited while draining"
        last = open_requests(metrics_url)
        if last is None or last[0] > 0:
            idle_since = None
        elif idle_since is None:
            idle_since = time.monotonic()
        elif last[1] == 0 or time.monotonic() - idle_since >= QUEUE_SETTLE_S:
            drained_at = time.monotonic()
        time.sleep(poll)
    if drained_at is not None:
        drained = f"drained in {drained_at - t0:.1f} s"
    else:
        left = "?" if last is None else f"{last[0]:.0f} in the engines, {last[1]:.0f} queued"
        drained = f"drain ended at its {grace:.0f}-s limit (requests open: {left})"

    # HTTP connections are closed whatever they do (tritonserver waits for each one). A gRPC connection is closed
    # only once idle: cutting a stream just after its last response is what trips 2.51's gRPC race (top of this
    # module), and a busy gRPC connection holds nothing up (its streams end, each new request is refused).
    closed = 0
    deadline = time.monotonic() + GRPC_IDLE_S + 2.0
    while is_alive(pid) and time.monotonic() < deadline:
        http, grpc = client_connections(pid, [http_port]), client_connections(pid, [grpc_port])
        if not http and not grpc:
            break
        try:
            closed += shut_down_connections(pid, http) + shut_down_connections(pid, grpc, min_idle_s=GRPC_IDLE_S)
        except ProcessLookupError:  # it exited meanwhile
            break
        except OSError as exc:
            log(f"{drained}; cannot close the {len(http) + len(grpc)} client connections still open ({exc}): "
                "tritonserver waits for them up to its --exit-timeout-secs")
            return drained
        time.sleep(poll)
    message = f"{drained}; closed {closed} client connection{'s' * (closed != 1)} left open" if closed else drained
    log(message)
    return message


# ---- running a server under this stop (the container) ---------------------------------------------------------


def run(command: Sequence[str], log: Log | None = None) -> int:
    """Run ``command`` (tritonserver and its arguments); the first SIGTERM or SIGINT stops it with :func:`stop`,
    a second one kills it. Returns its exit status (128 + N for a signal N, as a shell reports it)."""
    log = log or (lambda text: print(f"[shutdown] {text}", file=sys.stderr, flush=True))
    process = subprocess.Popen(list(command), start_new_session=True)
    received: list[int] = []

    def on_signal(signum: int, _frame) -> None:
        received.append(signum)
        if len(received) == 1:
            threading.Thread(target=stop, args=(process.pid, signum), kwargs={"log": log}, daemon=True).start()
        else:
            log("second signal: killing tritonserver and its stubs")
            signal_server(process.pid, signal.SIGKILL)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    code = process.wait()
    return 128 - code if code < 0 else code


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backend.triton.shutdown", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    run_parser = sub.add_parser("run", help="run tritonserver (the command after --) and stop it gracefully")
    run_parser.add_argument("command", nargs=argparse.REMAINDER)
    stop_parser = sub.add_parser("stop", help="stop a running tritonserver gracefully")
    stop_parser.add_argument("--pid", type=int, required=True)
    args = parser.parse_args(argv)
    if args.verb == "run":
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            parser.error("run needs a command: run -- tritonserver ARGS...")
        return run(command)
    stop(args.pid, log=lambda text: print(f"[shutdown] {text}", file=sys.stderr, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
