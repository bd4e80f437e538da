"""Stopping the server under load: `make serve`'s launcher, a real Locust run, SIGTERM or Ctrl-C.

Each case runs the launcher's CLI (``python -m backend.triton.serve``, what ``make serve`` runs) on the three models
with the tiny Llama, Locust against llm_continuous (``--config loadtest/locust.conf``, gRPC and HTTP users, as a user
would run it) and against llm_dynamic and llm_static, then signals. It checks what a user and a Kubernetes grace
period rely on: exit status 0 well inside the exit timeout (30 s, Triton's default), every model unloaded, KV blocks
and open requests back to 0 in every model, and every request a model accepted answered: the server's count of
finished requests equals what the clients saw finish, none was cut off, and every request that had streamed a token
ended with its last token or with "the server is shutting down".

What tritonserver 2.51 does by itself on SIGTERM, and what backend/triton/shutdown.py adds, is written at the top of
that module; tests/unit/test_shutdown.py checks its parts without a server.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import requests

from backend.triton.launch_options import free_ports
from tests.server_harness import LOCALHOST, REPO_ROOT, make_repository

LOCUSTFILE = REPO_ROOT / "loadtest" / "locustfile.py"
MODELS = ("llm_continuous", "llm_dynamic", "llm_static")
# The tiny model's settings (tests/server_harness.py) with a 512-token context (the tiny Llama's).
CONTEXT = {"max_model_len": "512"}
SHUTTING_DOWN = "the server is shutting down"
# Generous for a loaded 2-core machine (about 5 s here), and still short of the 20 s stall the issue saw.
SHUTDOWN_BOUND_S = 15.0


# ---- the real server, the real Locust ---------------------------------------------------------------------------


class MetricsTrail:
    """Scrapes the metrics port every 0.1 s until it stops answering; keeps each model's last sample."""

    NAMES = ("llm_kv_blocks_used", "llm_num_requests_running", "llm_num_requests_waiting", "llm_request_success_total")

    def __init__(self, url: str) -> None:
        self.url = url
        self.last: dict[str, dict[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set() and failures < 20:
            try:
                text = requests.get(self.url, timeout=2).text
            except requests.RequestException:
                failures += 1
                time.sleep(0.1)
                continue
            sample: dict[str, dict[str, float]] = {}
            for line in text.splitlines():
                if line.startswith(self.NAMES):
                    key, value = line.rsplit(" ", 1)
                    model = re.search(r'model="([^"]+)"', key)[1]
                    name = key.split("{", 1)[0]
                    sample.setdefault(model, Counter())[name] += float(value)
            self.last.update(sample)
            time.sleep(0.1)

    def stop(self) -> dict[str, dict[str, float]]:
        self._stop.set()
        self._thread.join(10)
        return self.last


def start_locust(server_urls: tuple[str, str], model: str, users: int, out: Path) -> subprocess.Popen:
    http_url, grpc_url = server_urls
    command = [
        sys.executable, "-m", "locust", "--config", "loadtest/locust.conf", "-f", str(LOCUSTFILE), "--headless",
        "--only-summary", "-u", str(users), "-r", str(users), "--run-time", "60s", "--stop-timeout", "30",
        "--host", http_url, "--grpc-url", grpc_url, "--model", model, "--length-scale", "0.25",
        "--max-requests", "1500", "--request-timeout", "60", "--records-file", str(out / f"{model}.jsonl"),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONFAULTHANDLER": "1"}
    log = open(out / f"locust-{model}.log", "w")
    return subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def unload_times(log_lines: list[str], signalled_at: str) -> dict[str, float]:
    """Seconds from the first log line after the signal to each "successfully unloaded" line."""
    def seconds(line: str) -> float | None:
        m = re.match(r"[IWE]\d{4} (\d\d):(\d\d):(\d\d\.\d+)", line)
        return int(m[1]) * 3600 + int(m[2]) * 60 + float(m[3]) if m else None

    # NOTE: tritonserver's "Signal (15) received." shares the log with the stubs' and the launcher's output and has
    # been seen glued to another line's end on CI, so it is searched anywhere in a line; the launcher's own
    # "[serve] stopping" line (written just before it signals tritonserver) stands in if it is missing.
    marks = [i for i, line in enumerate(log_lines) if signalled_at in line]
    marks = marks or [i for i, line in enumerate(log_lines) if line.startswith("[serve] stopping")]
    assert marks, "no sign of the signal in the log:\n" + "\n".join(log_lines[-40:])
    after = log_lines[marks[0]:]
    t0 = next(seconds(line) for line in after if seconds(line) is not None)
    return {m[1]: round(seconds(line) - t0, 1) for line in after if (m := re.search(r"unloaded '(\w+)'", line))}


def requests_of(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if "index" in r] if path.exists() else []


# NOTE: the three ways the issue stopped `make serve` under load. Locust's own SIGTERM lets its users finish the
# request they are in (--stop-timeout), so in the first two cases the clients wait for their answers; in the third
# they go on sending (and meet refusals, then closed connections) until their request budget is spent.
CASES = {
    "locust_stopped_1s_before": (signal.SIGTERM, 1.0),
    "locust_and_server_together": (signal.SIGINT, 0.0),  # Ctrl-C
    "locust_left_running": (signal.SIGTERM, None),
}


@pytest.mark.server
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", list(CASES))
def test_stopping_make_serve_under_locust_load(case, tiny_llama_dir, tmp_path):
    sig, locust_lead = CASES[case]
    http_port, grpc_port, metrics_port = free_ports(3)
    repo = make_repository(tmp_path / "model_repository", CONTEXT, models=MODELS)
    command = [sys.executable, "-m", "backend.triton.serve", "--model-repository", str(repo),
               "--model", str(tiny_llama_dir), "--address", LOCALHOST, "--http-port", str(http_port),
               "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port), "--max-restarts", "0",
               "--openai-port", "0"]
    serve_log = tmp_path / "serve.log"
    serve = subprocess.Popen(command, cwd=REPO_ROOT, stdout=open(serve_log, "w"), stderr=subprocess.STDOUT)
    locusts: dict[str, subprocess.Popen] = {}
    try:
        deadline = time.monotonic() + 180
        while "[serve] ready" not in serve_log.read_text():
            assert serve.poll() is None and time.monotonic() < deadline, serve_log.read_text()[-3000:]
            time.sleep(0.2)
        urls = (f"http://{LOCALHOST}:{http_port}", f"{LOCALHOST}:{grpc_port}")
        for model, users in (("llm_continuous", 4), ("llm_dynamic", 2), ("llm_static", 2)):
            locusts[model] = start_locust(urls, model, users, tmp_path)
        time.sleep(6)  # load: the engines are busy and keep-alive connections are open
        assert all(p.poll() is None for p in locusts.values()), "a Locust run ended before the signal"
        trail = MetricsTrail(f"http://{LOCALHOST}:{metrics_port}/metrics")

        if locust_lead is not None:
            for locust in locusts.values():
                locust.send_signal(signal.SIGTERM)
            time.sleep(locust_lead)
        t0 = time.monotonic()
        serve.send_signal(sig)
        code = serve.wait(60)
        shutdown_s = time.monotonic() - t0
        last = trail.stop()
        for model, locust in locusts.items():
            # NOTE: a Locust process has been seen to print its summary (every user had ended and written its
            # records) and then hang at interpreter exit, closing a gRPC channel while garbage-collecting (the
            # locustfile now drops its clients earlier). That is the load generator's problem, not the server's:
            # end it, leaving its stacks in its log.
            try:
                locust.wait(20)
            except subprocess.TimeoutExpired:
                locust.send_signal(signal.SIGABRT)
                locust.wait(10)
                assert "Response time percentiles" in (tmp_path / f"locust-{model}.log").read_text(), model
    finally:
        for process in (serve, *locusts.values()):
            if process.poll() is None:
                process.kill()
                process.wait()

    lines = serve_log.read_text().splitlines()
    unloaded = unload_times(lines, "Signal (")
    print(f"\n{case}: exit status {code}, stopped {shutdown_s:.1f} s after the signal; unloaded {unloaded}; "
          + "; ".join(line for line in lines if line.startswith("[serve] stopping")))
    assert code == 0, "\n".join(lines[-40:])
    assert shutdown_s < SHUTDOWN_BOUND_S, "\n".join(lines[-40:])
    assert set(unloaded) == set(MODELS), unloaded

    for model in MODELS:
        records = requests_of(tmp_path / f"{model}.jsonl")
        final = last[model]
        outcomes = Counter("ok" if r["ok"] else "cut" if r["cut"] else "shutting down" if SHUTTING_DOWN in
                           (r["error"] or "") else "other error" for r in records)
        print(f"  {model}: {dict(outcomes)}; server at unload: {dict(final)}")
        assert final["llm_kv_blocks_used"] == final["llm_num_requests_running"] == 0, (model, final)
        assert final["llm_num_requests_waiting"] == 0, (model, final)
        assert outcomes["ok"] > 0 and outcomes["cut"] == 0, (model, outcomes)
        streamed = [r for r in records if r["num_output_tokens"] > 0]
        unanswered = [r for r in streamed if not r["ok"] and SHUTTING_DOWN not in (r["error"] or "")]
        assert not unanswered, (model, unanswered[:3])
        # Every request a model accepted was answered once: the model's count of finished requests is what the
        # clients saw finish (a request that ran must have streamed a token: the tiny model makes one in ms).
        assert final["llm_request_success_total"] == len(streamed), (model, final, len(streamed))
