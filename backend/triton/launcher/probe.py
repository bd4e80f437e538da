"""Health probes for Kubernetes and Docker that also see a dead engine and a stalled model.

    python3 backend/triton/launcher/probe.py ready  # no model stalled, /v2/health/ready answers 200, no engine failed
    python3 backend/triton/launcher/probe.py live   # /v2/health/live answers 200 and no model's engine has failed
    python3 backend/triton/launcher/probe.py ready --openai-url http://127.0.0.1:9000   # and the OpenAI frontend's too

Triton 2.51 keeps a Python model READY after its engine failed (triton_workarounds.READY_AFTER_ENGINE_FAILURE): the
model then refuses every request with "the engine failed ...; restart the server" and sets ``llm_engine_healthy`` to 0
on the metrics port, but it cannot mark itself unready, so ``/v2/health/ready`` stays 200. These probes read that gauge
too. Nor does Triton see a model whose queue stopped moving; the launcher's watchdog does (``watchdog.py``), and marks
the server stalled until it has restarted it: ``ready`` reads that mark. Exit status 0 when healthy, 1 otherwise, with
the reason on stdout (``kubectl describe pod`` shows it). With ``--openai-url`` the OpenAI-compatible frontend that the
launcher starts beside tritonserver must answer too (``/health/ready`` or ``/health``: 200 while it reaches a ready or
live Triton): a router that sends OpenAI requests to this server needs both. New connections only: during a shutdown
tritonserver refuses them, so the probes fail at once. A hung tritonserver (a crash that never exited, a stopped
process) accepts connections and answers nothing: every request waits at most ``--timeout``, and the whole probe at most
``--budget`` (``PROBE_BUDGET_S``, under Docker's and Kubernetes' 5-s probe timeouts), so it reports the hang rather than
being cut off. Standard library only; run it as a file.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path

if not __package__:  # run as a file (backend/triton/launcher/probe.py, the containers' probe): the project on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from backend.contract.names import ENGINE_HEALTHY  # noqa: E402
from backend.contract.prometheus import parse_prometheus  # noqa: E402
from backend.triton.launcher.watchdog import stalled  # noqa: E402

REQUEST_TIMEOUT_S = 3.0
PROBE_BUDGET_S = 4.0  # all requests together: under the containers' probe timeouts (5 s)


def get(url: str, timeout: float) -> tuple[int, str]:
    """``(status, body)``; status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (urllib.error.URLError, OSError):
        return 0, ""


def failed_engines(metrics_text: str) -> list[str]:
    """Models whose ``llm_engine_healthy`` gauge is 0 (on any of their instances)."""
    series = parse_prometheus(metrics_text)
    return sorted({s.labels.get("model", s.name) for s in series if s.name == ENGINE_HEALTHY and s.value == 0})


def check(kind: str, url: str, metrics_url: str, timeout: float = REQUEST_TIMEOUT_S, openai_url: str = "",
          budget: float = PROBE_BUDGET_S) -> str | None:
    """None when healthy, else why not. ``openai_url``: the OpenAI frontend's base URL, to check it too ("": none).
    Each request waits at most ``timeout`` s, all of them together at most ``budget`` s."""
    metrics_port = urllib.parse.urlsplit(metrics_url).port
    if kind == "ready" and metrics_port is not None and (stall := stalled(metrics_port)) is not None:
        return f"{stall}; the launcher restarts the server"
    deadline = time.monotonic() + budget

    def get_within(url: str) -> tuple[int, str]:
        return get(url, max(0.1, min(timeout, deadline - time.monotonic())))

    status, _ = get_within(f"{url.rstrip('/')}/v2/health/{kind}")
    if status != 200:
        return f"/v2/health/{kind} answered {status or 'nothing'}"
    status, text = get_within(metrics_url)
    if status != 200:
        return f"the metrics port ({metrics_url}) answered {status or 'nothing'}: cannot tell whether the engines run"
    failed = failed_engines(text)
    if failed:
        return (f"the engine of {', '.join(failed)} failed ({ENGINE_HEALTHY} 0); it refuses every request until "
                "restarted")
    if openai_url:
        path = "/health/ready" if kind == "ready" else "/health"
        status, _ = get_within(f"{openai_url.rstrip('/')}{path}")
        if status != 200:
            return f"the OpenAI frontend's {path} answered {status or 'nothing'}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="probe.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=("ready", "live"))
    # The ports the server was given (backend/triton/launcher/serve.py reads the same variables).
    http_port, metrics_port = os.environ.get("HTTP_PORT") or "8000", os.environ.get("METRICS_PORT") or "8002"
    parser.add_argument("--url", default=f"http://127.0.0.1:{http_port}",
                        help="Triton's HTTP endpoint (default: %(default)s, from $HTTP_PORT)")
    parser.add_argument("--metrics-url", default=f"http://127.0.0.1:{metrics_port}/metrics",
                        help="default: %(default)s, from $METRICS_PORT")
    parser.add_argument("--openai-url", default="",
                        help="the OpenAI frontend's base URL, to check it too (default: not checked)")
    parser.add_argument("--timeout", type=float, default=REQUEST_TIMEOUT_S,
                        help="seconds per request (default: %(default)s)")
    parser.add_argument("--budget", type=float, default=PROBE_BUDGET_S,
                        help="seconds for all requests together (default: %(default)s)")
    args = parser.parse_args(argv)
    problem = check(args.kind, args.url, args.metrics_url, args.timeout, args.openai_url, args.budget)
    print(problem or f"{args.kind}: ok")
    return 1 if problem else 0


if __name__ == "__main__":
    sys.exit(main())
