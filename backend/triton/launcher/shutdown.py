"""Stop a tritonserver 2.51 so that its models drain, unload and it exits 0, which SIGTERM alone does not do.

What tritonserver 2.51 does on SIGTERM (measured; tests/server/test_shutdown.py runs each case against a real server):

- It tells its Python-backend stubs nothing (triton_workarounds.SHUTDOWN_NOT_FORWARDED). Our models learn of the
  shutdown only from the signal itself (``ShutdownNotice``), so it must reach the stubs too: then they refuse new
  requests, finish the running ones and end what is still running shortly before the exit timeout with "the server is
  shutting down".
- HTTP: it stops accepting connections, then waits for every connection still open to close, up to
  ``--exit-timeout-secs``, and goes on serving requests on them meanwhile. A keep-alive client that stays connected
  holds it for the whole timeout; nothing is then left for the models to unload ("Exit timeout expired. Exiting
  immediately.") and it exits with status 1.
- gRPC: a model unloads only once every stream that carried its requests is closed, so a client that keeps its
  stream open holds the model (tritonserver then even hung past its exit timeout here).
- A gRPC request cancelled right after its final response (``stop_stream(cancel_requests=True)`` once the answer is
  complete) is now and then never released by 2.51's gRPC frontend, and it keeps its model loaded for good: every
  model kind, a ten-line model too. tritonserver then finds no inference in flight, unloads the other models and
  logs "Found 1 live models" every second until the exit timeout, then exits 1
  (triton_workarounds.CANCEL_AFTER_FINAL_HOLDS_MODEL).

:func:`stop` does what is missing: it signals tritonserver and its stubs, waits until no request is open in any
model (the metrics port) or the models' drain grace is over, then shuts down the client connections still open on
the HTTP port and the idle ones on the gRPC port, so that tritonserver goes on at once to unload its models and
exit. A client still connected then sees its connection closed (every request it sent already has its final
response). If a model then cannot unload, the stop ends it: once tritonserver waits only for models to unload (its
report "Found N live models"), no request is open in any model or in Triton's queue, no client is connected, and
every stub left has sat idle for ``UNLOAD_IDLE_S``, it kills the stubs and tritonserver and logs one "forced:" line
that names the models; :func:`exit_status` reports that exit as 0. A request still open, a crash, or anything else
keeps tritonserver's own status. Whatever else happens (a hung or SIGSTOPped tritonserver that answers nothing and
cannot act on the signal), the stop is bounded: a tritonserver that has not exited ``KILL_MARGIN_S`` after its own
exit timeout is killed with its process group, with one "killed:" line, and reported as the SIGKILL it is.
"No request open" is the models' own word (their gauges count a request from
before its first step, so one whose step never returns too): Triton 2.51 counts no request of a decoupled Python
model as in flight, and goes on to unload with one stuck in execute().

``python -m backend.triton.launcher.shutdown run -- tritonserver ARGS...`` runs a server under this stop (and under
the watchdog, ``watchdog.py``). Standard library only: it runs in the container's Python without the engine's
dependencies.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

if not __package__:  # run as a file (python3 backend/triton/launcher/shutdown.py): put the project on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from backend.contract import names, prometheus  # noqa: E402
from backend.contract.server_args import command_line, drain_grace, exit_timeout, option_value  # noqa: E402
from backend.triton.launcher import watchdog  # noqa: E402
from backend.triton.launcher.processes import (  # noqa: E402
    children,
    cpu_seconds,
    is_alive,
    kill_process_group,
    process_state,
    stub_models,
)

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
# Once nothing is open, how long every stub still alive must have used (almost) no CPU before the stop takes the
# unloading for stalled: a model that can unload does so within a second of the drain (its stub busy finalizing),
# and this must fit, with the drain, inside the tests' 5-s exit timeout.
UNLOAD_IDLE_S = 2.0
# A tritonserver still there this long after its --exit-timeout-secs ran out cannot end by itself (hung, stopped):
# it is killed with its process group. Its own exit after the timeout takes a second or two.
KILL_MARGIN_S = 5.0
IDLE_CPU_S = 0.05  # CPU time within which a process still counts as idle (a stuck stub's own threads use ~2 ms/s)
POLL_S = 0.2
_SYS_PIDFD_GETFD = 438  # the same number on every Linux architecture
_TCP_ESTABLISHED = "01"

Log = Callable[[str], None]


# ---- what tritonserver was started with -----------------------------------------------------------------------


def _port(args: Sequence[str], name: str, default: int) -> int:
    value = option_value(args, name)
    return int(value) if value is not None and value.isdigit() else default


def flag_enabled(args: Sequence[str], flag: str) -> bool:
    """Whether a tritonserver ``--allow-*`` flag is on in ``args`` (it is unless turned off)."""
    return (option_value(args, flag) or "true").lower() not in ("false", "0", "no", "off")


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
    series = prometheus.read(metrics_url, timeout)
    if series is None:
        return None
    engines = sum(sum(prometheus.by_model(series, name).values()) for name in ENGINE_GAUGES)
    return engines, sum(prometheus.by_model(series, QUEUE_GAUGE).values())


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


# ---- a model that cannot unload -------------------------------------------------------------------------------

# tritonserver's once-a-second report while it shuts down: first the inferences still in flight (a decoupled Python
# model's never count), then, once none is, the models not unloaded yet.
_IN_FLIGHT = re.compile(r"Timeout \d+: Found (\d+) model versions that have in-flight inferences")
_LIVE_MODELS = re.compile(r"Timeout \d+: Found (\d+) live models and (\d+) in-flight non-inference requests")


def models_left_to_unload(output: Iterable[str]) -> int | None:
    """How many models tritonserver still waits for once it found no inference in flight (its latest report:
    "Timeout N: Found M live models and 0 in-flight non-inference requests"); None while its latest report is of
    something in flight, or it has reported nothing yet."""
    for line in reversed(list(output)):
        if (live := _LIVE_MODELS.search(line)) is not None:
            return int(live[1]) if live[2] == "0" else None
        if _IN_FLIGHT.search(line):
            return None
    return None


class IdleClock:
    """How long each process has used no more than ``IDLE_CPU_S`` of CPU: its clock restarts whenever it used more
    since the clock last started. Feed it every process's CPU seconds at each reading."""

    def __init__(self, idle_cpu_s: float = IDLE_CPU_S) -> None:
        self.idle_cpu_s = idle_cpu_s
        self._since: dict[int, tuple[float, float]] = {}  # pid -> (its CPU seconds, the time) when its clock started

    def update(self, cpu: Mapping[int, float], now: float) -> dict[int, float]:
        """``pid -> seconds idle`` for the processes in ``cpu`` (``pid -> CPU seconds used so far``)."""
        self._since = {pid: since for pid, since in self._since.items() if pid in cpu}
        for pid, used in cpu.items():
            since = self._since.get(pid)
            if since is None or used - since[0] > self.idle_cpu_s:
                self._since[pid] = (used, now)
        return {pid: now - self._since[pid][1] for pid in cpu}


@dataclass(frozen=True)
class StopResult:
    """What :func:`stop` did, in words; ``forced`` is its line when it ended tritonserver because a model could not
    unload with nothing open, ``killed`` when it ended one that outlived its exit timeout."""

    summary: str
    forced: str | None = None
    killed: str | None = None


def exit_status(code: int, stopped: StopResult | None = None) -> int:
    """The status to report for tritonserver's exit ``code`` (negative: the signal that ended it, reported as
    128 + N, as a shell does): 0 when :func:`stop` ended it because a model could not unload with nothing open."""
    if stopped is not None and stopped.forced is not None and code == -signal.SIGKILL:
        return 0
    return 128 - code if code < 0 else code


def _end_stuck_unload(pid: int, output: Callable[[], Iterable[str]], metrics_url: str, ports: Sequence[int],
                      poll: float, deadline: float) -> str | None:
    """Until tritonserver ``pid`` exits, at most until ``deadline`` (``time.monotonic()``): once its unloading stalls
    with nothing open (the module's docstring), kill it with its stubs and return the line that says so. None when it
    exited by itself, or the deadline came first."""
    clock = IdleClock()
    while is_alive(pid) and time.monotonic() < deadline:
        stubs = stub_models(pid)
        cpu = {stub: used for stub in stubs if (used := cpu_seconds(stub)) is not None}
        idle = clock.update(cpu, time.monotonic())
        if (idle and min(idle.values()) >= UNLOAD_IDLE_S and models_left_to_unload(output())
                and not client_connections(pid, ports) and open_requests(metrics_url) == (0, 0)):
            models = sorted({stubs[stub] for stub in idle})
            kill_process_group(pid)  # the stubs and tritonserver (its process group: it leads one)
            stubs_ended = "its stub" if len(idle) == 1 else f"their {len(idle)} stubs"
            return (f"forced: tritonserver could not unload {', '.join(models)} (most likely a request that "
                    "Triton 2.51's gRPC frontend never released: a client cancelled it right after its final "
                    f"response); no request was open and {stubs_ended} sat idle for {UNLOAD_IDLE_S:.0f} s; ended "
                    f"{stubs_ended} and the server")
        time.sleep(poll)
    return None


# ---- the stop -------------------------------------------------------------------------------------------------


def stop(pid: int, sig: int = signal.SIGTERM, *, host: str = "127.0.0.1", log: Log = print,
         poll: float = POLL_S, output: Callable[[], Iterable[str]] | None = None) -> StopResult:
    """Stop tritonserver ``pid`` as described at the top. Its ports and exit timeout are read from its command line.

    ``output`` returns its latest output lines (its log: the shutdown reports). With it, and a tritonserver that
    leads its own process group (as the launcher and :func:`run` start it), this returns once tritonserver has
    exited, ended here if a model could not unload; without, once its client connections are shut down. A
    tritonserver that leads its process group and is still there ``KILL_MARGIN_S`` after its exit timeout is killed
    with its group (``killed``), whatever state it is in."""
    args = command_line(pid)
    if not args:
        return StopResult("tritonserver had already exited")
    grace = drain_grace(args)
    http_port, grpc_port = _port(args, "--http-port", 8000), _port(args, "--grpc-port", 8001)
    metrics_url = f"http://{host}:{_port(args, '--metrics-port', 8002)}/metrics"
    t0 = time.monotonic()
    kill_at = t0 + exit_timeout(args) + KILL_MARGIN_S
    signal_server(pid, sig)
    log(f"draining: new requests are refused; running ones may finish for {grace:.0f} s")

    # Drained: the engines idle twice in a row (a request answered just now has had time to reach its client), and
    # Triton's queue empty or left QUEUE_SETTLE_S to empty (what it still holds arrived after the signal).
    idle_since = drained_at = last = None
    while drained_at is None and time.monotonic() - t0 < grace + 1.0:
        if not is_alive(pid):
            return StopResult("tritonserver exited while draining")
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

    # HTTP connections are closed whatever they do (tritonserver waits for each one). A gRPC connection is closed only
    # once idle: cutting a stream just after its last response is what trips 2.51's gRPC race
    # (triton_workarounds.GRPC_CANCEL_RACE), and a busy gRPC connection holds nothing up (its streams end, each new
    # request is refused).
    closed = 0
    message = None
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
            message = (f"{drained}; cannot close the {len(http) + len(grpc)} client connections still open ({exc}): "
                       "tritonserver waits for them up to its --exit-timeout-secs")
            break
        time.sleep(poll)
    if message is None:
        message = f"{drained}; closed {closed} client connection{'s' * (closed != 1)} left open" if closed else drained
    log(message)
    if output is None or not _leads_its_group(pid):
        return StopResult(message)
    forced = _end_stuck_unload(pid, output, metrics_url, [http_port, grpc_port], poll, kill_at)
    if forced is not None:
        log(forced)
        return StopResult(message, forced)
    killed = kill_if_left(pid, time.monotonic() - t0, sig)
    if killed is not None:
        log(killed)
    return StopResult(message, killed=killed)


def kill_if_left(pid: int, waited: float, sig: int) -> str | None:
    """Kill tritonserver ``pid`` and its process group if it is still there; the line that says so (``waited``: the
    seconds since ``sig`` was sent), or None when it had exited."""
    if not is_alive(pid):
        return None
    state = process_state(pid)
    kill_process_group(pid)
    how = {"T": " (it was stopped: SIGSTOP)", "t": " (it was stopped by a debugger)", "D": " (it was stuck in the "
           "kernel: uninterruptible sleep)"}.get(state or "", "")
    return (f"killed: tritonserver had not exited {waited:.0f} s after {signal.Signals(sig).name}{how}; killed "
            "it and its stubs (SIGKILL to its process group)")


def _leads_its_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except ProcessLookupError:
        return False


# ---- running a server under this stop (the container) ---------------------------------------------------------


def run(command: Sequence[str], log: Log | None = None, stall_timeout: float = watchdog.STALL_TIMEOUT_S,
        hang_timeout: float = watchdog.HANG_TIMEOUT_S) -> int:
    """Run ``command`` (tritonserver and its arguments), its output echoed; the first SIGTERM or SIGINT stops it
    with :func:`stop`, a second one kills it. A model that stalls for ``stall_timeout`` s, or a server that answers
    nothing for ``hang_timeout`` s (0: never), ends it (``watchdog.supervise``) with status 1, for the container's
    restart policy. Returns its exit status (:func:`exit_status`)."""
    log = log or (lambda text: print(f"[shutdown] {text}", file=sys.stderr, flush=True))
    metrics_port = _port(command, "--metrics-port", 8002)
    live_urls = {}
    if flag_enabled(command, "--allow-http"):
        live_urls["/v2/health/live"] = f"http://127.0.0.1:{_port(command, '--http-port', 8000)}/v2/health/live"
    if flag_enabled(command, "--allow-metrics"):
        live_urls["the metrics port"] = f"http://127.0.0.1:{metrics_port}/metrics"
    process = subprocess.Popen(list(command), start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    recent: collections.deque[str] = collections.deque(maxlen=2000)  # what stop() reads tritonserver's reports from
    echo = threading.Thread(target=_echo, args=(process.stdout, recent), name="tritonserver-output", daemon=True)
    echo.start()
    received: list[int] = []
    stopped: list[StopResult] = []

    def stop_and_keep() -> None:
        stopped.append(stop(process.pid, received[0], log=log, output=lambda: list(recent)))

    def on_signal(signum: int, _frame) -> None:
        received.append(signum)
        if len(received) == 1:
            stopper.start()
        else:
            log("second signal: killing tritonserver and its stubs")
            signal_server(process.pid, signal.SIGKILL)

    stopper = threading.Thread(target=stop_and_keep, name="tritonserver-stop", daemon=True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    watchdog.clear_stalled(metrics_port)
    try:
        stalls = []
        if stall_timeout > 0 or hang_timeout > 0:
            stalls = watchdog.supervise(process.pid, f"http://127.0.0.1:{metrics_port}/metrics", metrics_port,
                                        stall_timeout, stopping=lambda: bool(received), log=log,
                                        live_urls=live_urls, hang_timeout_s=hang_timeout)
        code = process.wait()
        echo.join(5)
        if received:
            stopper.join(10)  # it returns once tritonserver is gone
    finally:
        watchdog.clear_stalled(metrics_port)
    if stalls and not received:
        log(f"tritonserver was ended because {stalls[0].cause}: exit status 1")
        return 1
    return exit_status(code, stopped[0] if stopped else None)


def _echo(stream, recent: collections.deque[str]) -> None:
    for raw in stream:
        sys.stdout.buffer.write(raw)
        sys.stdout.buffer.flush()
        recent.append(raw.decode(errors="replace").rstrip("\n"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backend.triton.launcher.shutdown",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    run_parser = sub.add_parser("run", help="run tritonserver (the command after --) and stop it gracefully")
    run_parser.add_argument("--stall-timeout", type=float, default=watchdog.STALL_TIMEOUT_S,
                            help="end tritonserver (exit status 1) when a model has requests pending in Triton's "
                            "queue and nothing it executes moves for this many seconds (default: %(default)s; 0: "
                            "never)")
    run_parser.add_argument("--hang-timeout", type=float, default=watchdog.HANG_TIMEOUT_S,
                            help="end tritonserver (exit status 1) when /v2/health/live or its metrics port has "
                            "answered nothing for this many seconds (default: %(default)s; 0: never)")
    run_parser.add_argument("command", nargs=argparse.REMAINDER)
    stop_parser = sub.add_parser("stop", help="stop a running tritonserver gracefully")
    stop_parser.add_argument("--pid", type=int, required=True)
    args = parser.parse_args(argv)
    if args.verb == "run":
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            parser.error("run needs a command: run -- tritonserver ARGS...")
        return run(command, stall_timeout=args.stall_timeout, hang_timeout=args.hang_timeout)
    stop(args.pid, log=lambda text: print(f"[shutdown] {text}", file=sys.stderr, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
