"""The server a soak or a storm plays against: tritonserver started the launcher's way on free loopback ports, the
OpenAI frontend beside it when asked, started again on the same ports after a crash or a hang (as ``make serve``
does), and stopped the launcher's way, with what that stop had to do: tritonserver's exit status, and the models
whose stubs it had to end by force (``backend/triton/launcher/shutdown.py``, ``StopResult.forced``)."""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import requests

from backend.contract.names import KV_BLOCKS_USED, NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING, PENDING_REQUESTS
from backend.contract.settings import ADMIN_KEY_ENV_VAR, DEFAULT_MODEL
from backend.triton.launcher import crash
from backend.triton.launcher.launch_options import LOOPBACK, PortInUse, free_ports
from backend.triton.launcher.server import TritonServer, start_on_free_ports
from backend.triton.launcher.shutdown import exit_status
from frontend.openai.process import FrontendProcess
from loadtest.metrics import parse_prometheus, scrape, select

REPO_ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 600.0
PORTS_FREE_TIMEOUT_S = 30.0  # how long a restart waits for the dead server's ports
# The models named in the stop's "forced: tritonserver could not unload llm_dynamic, llm_static (most likely ..." line.
FORCED_MODELS = re.compile(r"could not unload (.+?) \(")
# What a model must be back to once its clients are done: Triton's queue, the engine's requests, the KV cache.
GAUGES = (PENDING_REQUESTS, NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING, KV_BLOCKS_USED)


def forced_models(line: str | None) -> tuple[str, ...]:
    """The models a forced stop ended (its ``forced`` line), sorted; none when it ended nothing."""
    found = FORCED_MODELS.search(line or "")
    return tuple(sorted(name.strip() for name in found[1].split(","))) if found else ()


def read_gauges(metrics_url: str, models) -> dict[str, dict[str, float]]:
    """``{model: {gauge: value}}`` from one scrape of the metrics port (a gauge the model does not export: NaN)."""
    series = parse_prometheus(scrape(metrics_url, timeout=10))
    out = {}
    for model in models:
        values = select(series, model, buckets=False)
        out[model] = {name: values.get(name, float("nan")) for name in GAUGES}
    return out


def settle(metrics_url: str, models: list[str], timeout: float, alive: Callable[[], bool]) -> dict:
    """Poll the models' gauges until all are 0 or ``timeout`` passes (or ``alive()`` is false); the last reading,
    ``{"gauges": {model: {gauge: value}}, "seconds": ...}`` (``{model: {"metrics_error": ...}}`` when the metrics
    port did not answer)."""
    started = time.monotonic()
    while True:
        try:
            gauges = read_gauges(metrics_url, models)
        except (OSError, requests.RequestException) as exc:
            gauges = {model: {"metrics_error": str(exc)} for model in models}
        idle = all(g.get(name) == 0 for g in gauges.values() for name in GAUGES)
        if idle or time.monotonic() - started > timeout or not alive():
            return {"gauges": gauges, "seconds": round(time.monotonic() - started, 2)}
        time.sleep(0.25)


@dataclass(frozen=True)
class Stopped:
    """How a server's stop went: tritonserver's exit status as ``make serve`` reports it (0 also after a forced
    unload with nothing open), seconds from the signal to its exit (None: it had exited before the stop), the
    grace it had (its exit timeout), the stop's ``forced`` line and the models it names, and the frontend's exit."""

    exit_status: int | None
    exited_after_s: float | None
    grace_s: float
    forced: str | None
    forced_models: tuple[str, ...]
    frontend_exit: int | str | None

    @property
    def clean(self) -> bool:
        """Exit status 0 within the grace, and the frontend (if any) exited 0."""
        return (self.exit_status == 0 and self.exited_after_s is not None and self.exited_after_s <= self.grace_s
                and self.frontend_exit in (0, "not started"))


def add_served_args(parser: argparse.ArgumentParser) -> None:
    """The options of the server a soak or a storm starts (what :meth:`Served.from_args` reads)."""
    parser.add_argument("--model", default=None, help="HF model folder (default: the repository's own setting)")
    parser.add_argument("--model-repository", default=str(REPO_ROOT / "model_repository"))
    parser.add_argument("--exit-timeout", type=float, default=30.0,
                        help="tritonserver's --exit-timeout-secs, the grace SIGTERM must end within (default: "
                        "Triton's and make serve's, %(default)s)")
    parser.add_argument("--server-arg", action="append", default=[], help="extra tritonserver argument (repeatable)")


class Served:
    """tritonserver serving ``model_repository`` (and, with ``openai``, the OpenAI frontend beside it), its logs in
    ``out`` named after ``name``. ``start()``, ``restart()`` after it died or was killed, ``stop()``."""

    def __init__(self, model_repository: str | Path, *, model: str | Path | None, out: Path, exit_timeout: float,
                 openai: bool = False, server_args: tuple[str, ...] | list[str] = (), name: str = "server") -> None:
        self.model_repository, self.model = Path(model_repository), model
        self.out, self.name, self.openai = Path(out), name, openai
        self.exit_timeout = exit_timeout
        self.server_args = ["--exit-timeout-secs", f"{exit_timeout:g}", *server_args]
        self.server: TritonServer | None = None
        self.frontend: FrontendProcess | None = None
        self.num_starts = 0

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, out: Path, openai: bool, name: str) -> Served:
        """The server :func:`add_served_args`' options describe."""
        return cls(args.model_repository, model=args.model, out=out, exit_timeout=args.exit_timeout, openai=openai,
                   server_args=args.server_arg, name=name)

    # -- addresses

    @property
    def grpc_url(self) -> str:
        return self.server.grpc_url

    @property
    def http_url(self) -> str:
        return self.server.http_url

    @property
    def metrics_url(self) -> str:
        return self.server.metrics_url

    @property
    def openai_url(self) -> str | None:
        return self.frontend.url if self.frontend else None

    @property
    def pid(self) -> int | None:
        return self.server.pid if self.server else None

    @property
    def is_running(self) -> bool:
        return self.server is not None and self.server.is_running

    def _log_path(self, what: str) -> Path:
        return self.out / f"{self.name}-{what}-{self.num_starts}.log"

    # -- start, restart

    def start(self) -> float:
        """Start tritonserver on free ports and the frontend (if asked), both ready; the seconds it took."""
        started = time.monotonic()
        self.num_starts += 1
        # ready; a server that is not is stopped and ServerError raised
        self.server = start_on_free_ports(self.model_repository, model=self.model, log_path=self._log_path("triton"),
                                          extra_args=self.server_args, ready_timeout=READY_TIMEOUT_S)
        if self.openai:
            self.frontend = FrontendProcess(self.server.grpc_url, free_ports(1)[0],
                                            self.model or REPO_ROOT / DEFAULT_MODEL,
                                            log_path=self.out / f"{self.name}-frontend.log").__enter__()
            self.frontend.wait_ready(READY_TIMEOUT_S, ready=True)
        return time.monotonic() - started

    def restart(self) -> float:
        """After tritonserver died (or was killed): start it again on the same ports with the same admin key, as
        ``make serve`` does, so that the frontend finds it again; the seconds until it and the frontend are ready."""
        old = self.server
        old.kill()
        old.wait(timeout=30)
        started = time.monotonic()
        self.num_starts += 1
        while True:
            server = TritonServer(self.model_repository, http_port=old.http_port, grpc_port=old.grpc_port,
                                  metrics_port=old.metrics_port, address=LOOPBACK, model=self.model,
                                  extra_args=self.server_args, env={ADMIN_KEY_ENV_VAR: old.admin_key},
                                  log_path=self._log_path("triton"), ready_timeout=READY_TIMEOUT_S)
            self.server = server
            try:
                server.__enter__()  # ready; a server that is not is stopped and ServerError raised
                break
            except PortInUse:  # the dead server's sockets are not released yet, or another process took one
                if time.monotonic() - started > PORTS_FREE_TIMEOUT_S:
                    raise
                time.sleep(0.5)
        if self.frontend is not None:
            self.frontend.wait_ready(READY_TIMEOUT_S, ready=True)
        return time.monotonic() - started

    def restart_frontend(self) -> float:
        """After the frontend died: start it again on its port; the seconds until it is ready."""
        started = time.monotonic()
        port = int(self.frontend.url.rsplit(":", 1)[1])
        self.frontend.stop()
        self.frontend = FrontendProcess(self.server.grpc_url, port, self.model or REPO_ROOT / DEFAULT_MODEL,
                                        log_path=self.out / f"{self.name}-frontend.log").__enter__()
        self.frontend.wait_ready(READY_TIMEOUT_S, ready=True)
        return time.monotonic() - started

    # -- what happened

    def crash_site(self) -> str | None:
        """Where tritonserver crashed (``crash.crash_site`` of its log), once it has exited; None when unknown."""
        return crash.crash_site(self.log_tail())

    def log_tail(self, count: int = 12) -> list[str]:
        """Its log's last lines, from its last "Signal (N) received." on if it has one."""
        return crash.crash_lines(self.server.output_lines(), count) if self.server else []

    # -- stop

    def stop(self) -> Stopped:
        """The frontend, then tritonserver, stopped the launcher's way (SIGTERM; the drain; idle connections closed;
        a model that cannot unload with nothing open ended by force)."""
        frontend_exit = self.frontend.stop() if self.frontend else "not started"
        server, grace = self.server, self.exit_timeout
        if server is None:
            return Stopped(None, None, grace, None, (), frontend_exit)
        if not server.is_running:  # it had died: its own status
            code = server.wait(timeout=30)
            return Stopped(exit_status(code), None, grace, None, (), frontend_exit)
        started = time.monotonic()
        server.begin_stop()
        while server.is_running and time.monotonic() - started < grace + 30:
            time.sleep(0.05)
        exited_after = time.monotonic() - started
        code = server.stop(timeout=1)  # collects it; SIGKILLs the group if it is still running
        stopped = server.stop_result
        forced = stopped.forced if stopped else None
        return Stopped(exit_status(code, stopped), round(exited_after, 2), grace, forced, forced_models(forced),
                       frontend_exit)
