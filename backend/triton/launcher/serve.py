"""Serve a model repository on a real Triton Inference Server, without Docker: the launcher's command line.

    python -m backend.triton.launcher.serve --model-repository model_repository --model models/smollm2-135m-instruct \\
        --http-port 8000 --grpc-port 8001 --metrics-port 8002 [-- extra tritonserver args]

It starts one :class:`~backend.triton.launcher.server.TritonServer` (the binary from
``backend.triton.launcher.server_home``, the checks and admin flags of ``backend.triton.launcher.launch_options``),
echoes its output, and starts it again on the same ports when it dies by a signal nobody sent it, or when the
watchdog ended it because a model's queue stopped moving (``--stall-timeout``) or because it answered nothing
(``--hang-timeout``: a hung or SIGSTOPped tritonserver; ``backend.triton.launcher.watchdog``); all count toward
``--max-restarts``. Ctrl-C or SIGTERM stops it gracefully, within its exit timeout and a margin whatever state
tritonserver is in (``shutdown.stop`` then kills its process group); a second one kills it with its stubs at once.

The launcher's parts are also importable from here, as they were before it was split by job: ``server_home`` (the
Docker image calls it), ``TritonServer``, ``start_on_free_ports`` and ``copy_model_repository``.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from backend.contract.settings import (
    ADMIN_KEY_ENV_VAR,
    DEFAULT_MODEL,
    DRAIN_DELAY_ENV_VAR,
    DRAINING_SIGNAL,
    HANG_TIMEOUT_ENV_VAR,
    MODEL_DIR_ENV_VAR,
    MODEL_ENV_VAR,
    MODEL_PARAMETERS_ENV_VAR,
    OPENAI_PORT_ENV_VAR,
    SERVED_MODELS_ENV_VAR,
    STALL_TIMEOUT_ENV_VAR,
)
from backend.triton.launcher import crash, shutdown, watchdog
from backend.triton.launcher.launch_options import (
    ADMIN_HEADER,
    GRPC_HEADER_PREFIX,
    REPO_ROOT,
    LauncherError,
    check_ports,
    copy_model_repository,
    frontend_command,
    restricted_api_args,
)
from backend.triton.launcher.server import ServerError, TritonServer, die_with_parent, start_on_free_ports
from backend.triton.launcher.server_home import server_home

__all__ = ["copy_model_repository", "main", "parse_args", "server_home", "start_on_free_ports", "TritonServer"]


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip() else default


def _env_list(name: str) -> list[str]:
    return os.environ.get(name, "").split()


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Our options, plus everything else (unknown options, and all after ``--``) for tritonserver."""
    argv = list(argv)
    after_dashes: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, after_dashes = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(
        prog="python -m backend.triton.launcher.serve",
        description="Serve a model repository on a real Triton Inference Server. "
        "Options it does not know (and anything after --) go to tritonserver unchanged.",
        allow_abbrev=False,
    )
    parser.add_argument("--model-repository", default="model_repository", help="default: %(default)s")
    parser.add_argument(
        "--model",
        default=os.environ.get(MODEL_DIR_ENV_VAR) or os.environ.get(MODEL_ENV_VAR) or DEFAULT_MODEL,
        help=f"HF model folder, exported to the models as {MODEL_ENV_VAR} "
        f"(default: $MODEL, else ${MODEL_ENV_VAR}, else %(default)s)",
    )
    parser.add_argument("--http-port", type=int, default=_env_int("HTTP_PORT", 8000))
    parser.add_argument("--grpc-port", type=int, default=_env_int("GRPC_PORT", 8001))
    parser.add_argument("--metrics-port", type=int, default=_env_int("METRICS_PORT", 8002))
    parser.add_argument("--address", default="0.0.0.0", help="address to listen on (default: %(default)s)")
    parser.add_argument(
        "--openai-port",
        type=int,
        default=_env_int(OPENAI_PORT_ENV_VAR, 9000),
        help="port of the OpenAI-compatible frontend (frontend/openai), started beside tritonserver and stopped "
        "after it (default: $OPENAI_PORT or %(default)s; 0: no frontend)",
    )
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds (default: %(default)s)")
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=_env_int("MAX_RESTARTS", 3),
        help="start tritonserver again when it dies by a signal nobody sent it, at most this many times "
        "(default: $MAX_RESTARTS or %(default)s; 0: never)",
    )
    # Seconds, each from its environment variable when that is set and not empty.
    for flag, env_var, default, help_text in (
        ("--stall-timeout", STALL_TIMEOUT_ENV_VAR, watchdog.STALL_TIMEOUT_S,
         "restart tritonserver when a model has requests pending in Triton's queue and nothing it executes "
         "moves for this many seconds; longer than the longest engine step (default: $STALL_TIMEOUT or "
         "%(default)s; 0: never)"),
        ("--hang-timeout", HANG_TIMEOUT_ENV_VAR, watchdog.HANG_TIMEOUT_S,
         "restart tritonserver when /v2/health/live or its metrics port has answered nothing for this many "
         f"seconds ({watchdog.MIN_FAILED_PROBES} probes in a row at least, {watchdog.PROBE_TIMEOUT_S:g} s each): a "
         "hung or stopped process (default: $HANG_TIMEOUT or %(default)s; 0: never)"),
        ("--drain-delay", DRAIN_DELAY_ENV_VAR, 0,
         "on SIGTERM, seconds the OpenAI frontend answers 503 on /health/ready while it still serves, before "
         "the stop begins: a router in front stops sending here first (default: $DRAIN_DELAY or %(default)s)"),
    ):
        parser.add_argument(flag, type=float, default=float(os.environ.get(env_var) or default), help=help_text)
    parser.add_argument(
        "--models",
        default=os.environ.get(SERVED_MODELS_ENV_VAR, ""),
        help="serve only these models of the repository, comma-separated (default: $LLM_SERVED_MODELS, else all)",
    )
    parser.add_argument(
        "--parameter",
        action="append",
        default=_env_list(MODEL_PARAMETERS_ENV_VAR),
        metavar="KEY=VALUE",
        help="set a parameter of every served model's config.pbtxt, e.g. enable_prefix_caching=true; repeatable "
        "(default: $LLM_MODEL_PARAMETERS, space-separated)",
    )
    # Which stub to look up; only for testing the "no stub for this Python" path.
    parser.add_argument("--python-version", default=None, help=argparse.SUPPRESS)
    args, unknown = parser.parse_known_args(argv)
    return args, unknown + after_dashes


def main(argv: Sequence[str] | None = None) -> int:
    args, extra_args = parse_args(sys.argv[1:] if argv is None else argv)
    # Every option but this loop's own (--max-restarts, --openai-port, --stall-timeout, ...) is one of TritonServer's
    # keywords.
    own = ("max_restarts", "openai_port", "stall_timeout", "hang_timeout", "models", "parameter", "drain_delay")
    shipped = args.model_repository
    try:
        args.model_repository = str(served_repository(shipped, args.models, args.parameter))
    except (LauncherError, ValueError) as exc:
        print(f"serve: error: {exc}", file=sys.stderr)
        return 2
    if args.model_repository != shipped:
        atexit.register(shutil.rmtree, args.model_repository, ignore_errors=True)
    options = {name: value for name, value in vars(args).items() if name not in own}

    def new_server(env: Mapping[str, str] | None = None) -> TritonServer:
        return TritonServer(**options, extra_args=extra_args, env=env, echo=True)

    server = new_server()
    try:
        if args.openai_port:
            check_ports({"OpenAI": args.openai_port}, args.address)
        server.start()
    except LauncherError as exc:
        print(f"serve: error: {exc}", file=sys.stderr)
        return 2
    watchdog.clear_stalled(args.metrics_port)  # left by a launcher that was killed: the port is this one's now
    try:
        return _serve(server, new_server, args, extra_args)
    finally:
        watchdog.clear_stalled(args.metrics_port)


def _serve(server: TritonServer, new_server: Callable[..., TritonServer], args: argparse.Namespace,
           extra_args: Sequence[str]) -> int:
    """Supervise the started ``server`` until it is stopped, or exits and may not be restarted; its exit status."""
    frontend = start_frontend(server, args.address, args.openai_port) if args.openai_port else None

    signals_received: list[int] = []
    delayed_stop: list[threading.Timer] = []

    def forward(signum: int, _frame) -> None:
        # NOTE: the server has its own session, so the terminal's Ctrl-C reaches only us; we pass it on, to the stubs
        # too. First signal: let the server shut down cleanly. Second: stop waiting for it, stubs included.
        signals_received.append(signum)
        if len(signals_received) > 1:
            for timer in delayed_stop:
                timer.cancel()
            server.kill()
        elif frontend is not None and args.drain_delay > 0:
            # Leave the router's rotation first: the frontend answers 503 on /health/ready from now on, while every
            # request still gets served; the drain starts once routers have seen it, so none is refused meanwhile.
            _log(f"leaving the rotation: /health/ready answers 503 for {args.drain_delay:g} s, then the stop")
            frontend.send_signal(DRAINING_SIGNAL)
            timer = threading.Timer(args.drain_delay, lambda: server.begin_stop(signum))
            timer.daemon = True
            delayed_stop.append(timer)
            timer.start()
        else:
            server.begin_stop(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)

    restarts = 0
    while True:
        try:
            seconds = server.wait_ready()
        except ServerError as exc:
            if signals_received:
                print("[serve] stopped before the server was ready", file=sys.stderr)
                return shutdown.exit_status(server.wait(), server.stop_result)
            print(f"serve: error: {exc}", file=sys.stderr)
            server.stop()
            return shutdown.exit_status(server.wait(), server.stop_result) or 1
        watchdog.clear_stalled(args.metrics_port)  # a restarted server serves again
        if restarts == 0:
            _print_admin_key_hint(extra_args, server)
        if frontend is not None and frontend.poll() is not None:
            print(f"[serve] the OpenAI frontend exited with status {frontend.returncode} (its output is above)",
                  file=sys.stderr, flush=True)
        openai = f"  OpenAI {server.http_url.rsplit(':', 1)[0]}:{args.openai_port}/v1" if frontend else ""
        print(
            f"[serve] ready in {seconds:.1f} s: HTTP {server.http_url}  gRPC {server.grpc_url}  "
            f"metrics {server.metrics_url}{openai}  (model {server.model}; Ctrl+C stops)",
            flush=True,
        )
        stalls = []
        if args.stall_timeout > 0 or args.hang_timeout > 0:
            stalls = watchdog.supervise(server.pid, server.metrics_url, args.metrics_port, args.stall_timeout,
                                        stopping=lambda: bool(signals_received), log=_log,
                                        live_urls=server.liveness_urls(), hang_timeout_s=args.hang_timeout)
        code = server.wait()
        # NOTE: a signal nobody here sent is a crash (the bundled Triton's gRPC frontend can crash under heavy
        # stream cancellation; docs/server.md), and a stalled or hung server was killed here. Come back on the same
        # ports with the same admin key.
        if signals_received or code >= 0 or restarts >= args.max_restarts:
            break
        restarts += 1
        _log(f"tritonserver {_why_it_ended(server, code, stalls)}; restarting it ({restarts} of {args.max_restarts})")
        server = new_server(env={ADMIN_KEY_ENV_VAR: server.admin_key})
        try:
            server.start()
        except LauncherError as exc:
            print(f"serve: error: {exc}", file=sys.stderr)
            return 2
        if signals_received:  # a stop asked for while no server ran: this one stops too
            server.begin_stop(signals_received[0])
    status = shutdown.exit_status(code, server.stop_result)
    if server.stop_result is not None and server.stop_result.forced is not None and status == 0:
        _log("the stop ended tritonserver (the forced line above): exit status 0")
    elif server.stop_result is not None and server.stop_result.killed is not None:
        _log(f"the stop killed tritonserver (the killed line above): exit status {status}")
    elif stalls and not signals_received:
        _log(f"tritonserver was ended because {stalls[0].cause}, and no restart is left (--max-restarts "
             f"{args.max_restarts}): exit status {status}")
    else:
        _log(f"tritonserver exited with status {status}")
    if frontend is not None:
        stop_frontend(frontend)
    if status and any("Exit timeout expired" in line for line in server.output_lines()[-50:]):
        _log("tritonserver gave up waiting at --exit-timeout-secs: a request was still open (a model that does not "
             "answer), or a client connection could not be closed, so the stop could not end a model that would not "
             "unload; see docs/server.md, \"Stopping the server\"")
    return status


def _why_it_ended(server: TritonServer, code: int, ended: Sequence[watchdog.Ending]) -> str:
    """Why tritonserver ended (``ended``: what the watchdog killed it for, if it did), in words, with the function
    that crashed when its output holds a crash's stack."""
    if ended:
        why = f"was ended: {ended[0].cause}"
    else:
        why = f"died by signal {-code}"
    site = crash.crash_site(crash.crash_lines(server.output_lines()))
    if site is not None:
        why += f" in {site}" if not ended else f" (after a crash in {site})"
    if crash.is_known_frontend_crash(site):
        why += " (Triton 2.51's known gRPC-frontend race: docs/server.md)"  # triton_workarounds.GRPC_CANCEL_RACE
    return why


def served_repository(repository: str, models: str, parameters: Sequence[str]) -> Path:
    """The repository to serve: ``repository`` itself, or, when only some models or changed parameters are asked
    for, a copy with just those (a replica of a scale-out stack serving one model with prefix caching, say). The
    copy lies in a fresh temporary folder: the shipped files are never edited."""
    source = Path(repository)
    if not models and not parameters:
        return source
    available = sorted(path.parent.name for path in source.glob("*/config.pbtxt"))
    names = [name.strip() for name in models.split(",") if name.strip()] or available
    unknown = sorted(set(names) - set(available))
    if unknown:
        raise LauncherError(f"--models: no model {', '.join(unknown)} in {source} (it has {', '.join(available)})")
    settings = {}
    for item in parameters:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise LauncherError(f"--parameter {item!r}: expected KEY=VALUE")
        settings[key.strip()] = value.strip()
    return copy_model_repository(tempfile.mkdtemp(prefix="llm-model-repository-"), names, settings, source=source)


def _log(text: str) -> None:
    print(f"[serve] {text}", file=sys.stderr, flush=True)


def start_frontend(server: TritonServer, address: str, port: int) -> subprocess.Popen:
    """The OpenAI-compatible frontend (``python -m frontend.openai``), a gRPC client of this server, on ``port``.

    It outlives restarts of tritonserver (each request opens its own stream) and is stopped after tritonserver has
    drained, so streams still running through it end with their last token."""
    command = frontend_command(server.grpc_url, address, port, server.model, server.metrics_url)
    return subprocess.Popen(command, cwd=REPO_ROOT, stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=die_with_parent)


def stop_frontend(frontend: subprocess.Popen, timeout: float = 15.0) -> None:
    if frontend.poll() is None:
        frontend.send_signal(signal.SIGTERM)
        try:
            frontend.wait(timeout)
        except subprocess.TimeoutExpired:
            frontend.kill()
            frontend.wait()
    print(f"[serve] the OpenAI frontend exited with status {frontend.returncode}", file=sys.stderr)


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


if __name__ == "__main__":
    sys.exit(main())
