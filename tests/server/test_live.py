"""The live view (loadtest/live.py) and Locust's own numbers: one request event per request.

Against a real server with the tiny Llama (tests/unit/test_live.py has the parts alone): headless Locust counts each
request once, and Locust's web UI serves the live tab, loaded in headless Chromium, whose data agree with the metrics
port. Locust runs as a subprocess, as everywhere in the tests, so gevent never patches the test process. Everything
is on 127.0.0.1.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from backend.triton.launcher.launch_options import free_ports
from loadtest import live
from loadtest.metrics import parse_prometheus, scrape, select
from loadtest.runner import LOCUSTFILE, REPO_ROOT
from tests.server_harness import make_repository
from tests.unit.test_live import MODELS, browse, chart_points, chromium, page_state

SCREENSHOT = REPO_ROOT / "reports" / "live-view.png"


# ---- against a real server ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_server(triton_server_factory, tiny_llama_dir, tmp_path_factory):
    repository = make_repository(tmp_path_factory.mktemp("live") / "repo", models=MODELS)
    return triton_server_factory.start(repository, model=tiny_llama_dir)


def locust_command(server, *options: str) -> list[str]:
    return [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--host", server.http_url, "--grpc-url",
        server.grpc_url, "--metrics-url", server.metrics_url, "--model", ",".join(MODELS), *options, "GrpcStreamUser",
    ]  # fmt: skip


LOCUST_ENV = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}


@pytest.mark.server
@pytest.mark.timeout(180)
def test_locust_counts_each_request_once(tiny_server, tmp_path):
    """5 requests per model: Locust's stats say 10 requests, not one per latency measured; the latencies are in
    their own CSV, and each model got the same request sequence."""
    prefix = tmp_path / "run"
    command = locust_command(
        tiny_server, "--headless", "--only-summary", "-u", "4", "-r", "4", "--run-time", "60s", "--stop-timeout", "30",
        "--csv", str(prefix), "--workload", "constant", "--length-scale", "0.1", "--max-requests", "5",
        "--records-file", f"{prefix}_requests.jsonl",
    )  # fmt: skip
    done = subprocess.run(command, cwd=REPO_ROOT, env=LOCUST_ENV, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]

    with open(f"{prefix}_stats.csv") as f:
        stats = {row["Name"]: row for row in csv.DictReader(f)}
    assert set(stats) == {"llm_dynamic (e2e)", "llm_continuous (e2e)", "Aggregated"}
    assert int(stats["Aggregated"]["Request Count"]) == 10 and int(stats["Aggregated"]["Failure Count"]) == 0
    for model in MODELS:
        assert stats[f"{model} (e2e)"]["Type"] == "grpc" and int(stats[f"{model} (e2e)"]["Request Count"]) == 5
    with open(f"{prefix}_llm_latency.csv") as f:
        latency = {row["Model"]: row for row in csv.DictReader(f)}
    assert set(latency) == set(MODELS)
    assert all(row["Requests"] == "5" and row["Failures"] == "0" and float(row["TTFT p99 (ms)"]) > 0
               for row in latency.values())  # fmt: skip
    lines = Path(f"{prefix}_requests.jsonl").read_text().splitlines()
    requests = [r for r in map(json.loads, lines) if "index" in r]
    for model in MODELS:
        assert sorted(r["index"] for r in requests if r["model"] == model) == [0, 1, 2, 3, 4]


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def wait_for(check, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def last(values: list):
    return next((v for v in reversed(values) if v is not None), None)


@pytest.mark.server
@pytest.mark.timeout(300)
def test_live_tab_in_locust_web_ui_shows_every_model_and_agrees_with_the_metrics_port(tiny_server, tmp_path):
    """Locust's web UI with the live tab, 24 requests per model (2 users each), loaded in headless Chromium; the
    screenshot of the tab goes to reports/live-view.png."""
    chromium()  # before any load: skip (or fail on CI) at once
    (web_port,) = free_ports(1)
    web = f"http://127.0.0.1:{web_port}"
    command = locust_command(
        tiny_server, "--web-host", "127.0.0.1", "--web-port", str(web_port), "--autostart", "--autoquit", "90",
        "-u", "4", "-r", "4", "--run-time", "60s", "--stop-timeout", "20", "--workload", "constant",
        "--max-requests", "24",
    )  # fmt: skip
    log_path = tmp_path / "locust.log"
    with open(log_path, "wb") as log:
        locust = subprocess.Popen(command, cwd=REPO_ROOT, env=LOCUST_ENV, stdout=log, stderr=subprocess.STDOUT)
    try:
        check_live_tab(tiny_server, web, tmp_path)
    except BaseException:
        print(log_path.read_text(errors="replace")[-3000:])
        raise
    finally:
        locust.terminate()
        try:
            locust.wait(timeout=30)
        except subprocess.TimeoutExpired:
            locust.kill()
            locust.wait(timeout=10)


def check_live_tab(server, web: str, tmp_path: Path) -> None:
    def busy_points():
        try:
            data = get_json(f"{web}/llm-live/data")
        except OSError:
            return None
        counts = {m: sum(1 for b in data["series"].get(m, {}).get("batch", []) if b) for m in MODELS}
        return data if min(counts.values()) >= 3 else None

    wait_for(busy_points, 90, "three busy points of each model's batch on the live page")
    # While the load runs: the page in Locust's tab, and alone.
    SCREENSHOT.parent.mkdir(exist_ok=True)
    tab = f"{web}/?tab={live.TAB_KEY}"
    browse(tab, tmp_path, f"--screenshot={SCREENSHOT}", "--window-size=1366,1200", budget_ms=6000)
    assert SCREENSHOT.stat().st_size > 30_000
    assert 'id="llm-live-frame"' in browse(tab, tmp_path, "--dump-dom", budget_ms=6000)
    dom = browse(f"{web}/llm-live/", tmp_path, "--dump-dom")
    assert page_state(dom) == "live"
    points = chart_points(dom)
    level_charts = {"level-queue", "level-ttft", "level-tpot", "level-preempt"}
    assert set(points) == {"batch", "running", "waiting", "kv", "tok_s", "ttft", "tpot", *level_charts}
    for chart in ("batch", "kv", "tok_s", "ttft", "tpot"):
        assert all(points[chart][m] >= 3 for m in MODELS), (chart, points[chart])
    # No request says its priority: every one is at the default level, a line per model.
    assert all(set(points[chart]) == {f"{m}/2" for m in MODELS} for chart in level_charts), points
    assert sum(points["level-ttft"].values()) >= 3, points["level-ttft"]

    # Locust counts requests once: 24 per model, and the tab's table agrees.
    def stopped():
        stats = get_json(f"{web}/stats/requests")
        return stats if stats["state"] == "stopped" else None

    stats = wait_for(stopped, 120, "the request budget to be spent")
    counts = {row["name"]: row["num_requests"] for row in stats["stats"]}
    assert counts == {"llm_dynamic (e2e)": 24, "llm_continuous (e2e)": 24, "Aggregated": 48}

    # The server is idle now (its metrics no longer change): the page's next point must say exactly what they say.
    def idle_metrics():
        before = {m: select(parse_prometheus(scrape(server.metrics_url)), m, buckets=False) for m in MODELS}
        time.sleep(1.0)
        after = {m: select(parse_prometheus(scrape(server.metrics_url)), m, buckets=False) for m in MODELS}
        return after if after == before else None

    port = wait_for(idle_metrics, 30, "the metrics port to settle")
    read_at = time.time()
    data = wait_for(lambda: (d := get_json(f"{web}/llm-live/data")) and d["t"][-1] > read_at + 0.1 and d, 10,
                    "a point after the server went idle")  # fmt: skip
    assert data["metrics"]["ok"] is True and data["models"] == list(MODELS) and data["levels"] == {"2": "default"}
    for model in MODELS:
        series, values = data["series"][model], port[model]
        for key, name in (("tokens_total", "llm_generation_tokens_total"), ("steps_total", "llm_batch_size_count"),
                          ("seqs_total", "llm_batch_size_sum"), ("kv_total", "llm_kv_blocks_total"),
                          ("kv_used", "llm_kv_blocks_used"), ("running", "llm_num_requests_running")):  # fmt: skip
            assert series[key][-1] == pytest.approx(values[name]), (model, key)
        ended = 'llm_time_to_first_token_by_priority_seconds_count{priority="2"}'
        assert series["ended_total@2"][-1] == values[ended] >= 24, model  # and the earlier tests' requests
        check_rates(data["t"], series)
        summary = next(row for row in data["summary"] if row["model"] == model)
        assert summary["requests"] == 24 and summary["failures"] == 0
    assert all(port[m]["llm_kv_blocks_used"] == 0 and last(data["series"][m]["batch"]) == 0 for m in MODELS)


def check_rates(t: list[float], series: dict) -> None:
    """Every rate on the page is its counters' difference over its interval: the mean batch since the point before,
    the tokens/s since the point ``TOKEN_RATE_SAMPLES`` before (the page's points start with the run)."""
    checked = 0
    for i in range(1, len(t)):
        j = max(0, i - live.TOKEN_RATE_SAMPLES)
        tokens = (series["tokens_total"][j], series["tokens_total"][i])
        if None in tokens or series["tok_s"][i] is None:
            continue
        span = t[i] - t[j]
        assert series["tok_s"][i] == pytest.approx((tokens[1] - tokens[0]) / span, rel=0.01, abs=0.5)
        steps = series["steps_total"][i] - series["steps_total"][i - 1]
        seqs = series["seqs_total"][i] - series["seqs_total"][i - 1]
        assert series["batch"][i] == pytest.approx(seqs / steps if steps else 0.0, rel=1e-3)
        checked += 1
    assert checked >= 5
