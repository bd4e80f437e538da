"""The live view (loadtest/live.py) and Locust's own numbers: one request event per request.

The parts alone (a metrics sample to a point, the latency table, the records follower, the page when the metrics port
does not answer), then against a real server with the tiny Llama: headless Locust counts each request once, and
Locust's web UI serves the live tab, loaded in headless Chromium, whose data agree with the metrics port. Locust runs
as a subprocess, as everywhere in the tests, so gevent never patches the test process. Everything is on 127.0.0.1.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from backend.triton.launch_options import free_ports
from loadtest import live
from loadtest.metrics import parse_prometheus, scrape, select
from loadtest.runner import LOCUSTFILE, REPO_ROOT
from tests.server_harness import make_repository

MODELS = ("llm_dynamic", "llm_continuous")
SCREENSHOT = REPO_ROOT / "reports" / "live-view.png"


def record(t_start=100.0, ok=True, ttft=50.0, tpot=10.0, e2e=500.0, cut=False, **extra) -> dict:
    return {"t_start": t_start, "ok": ok, "cut": cut, "ttft_ms": ttft, "tpot_ms": tpot, "itl_max_ms": tpot and 2 * tpot,
            "e2e_ms": e2e, "error": None if ok else "error: no", **extra}  # fmt: skip


# ---- the parts --------------------------------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_a_point_is_the_mean_batch_since_the_last_sample_and_tokens_per_second_since_the_oldest():
    before = {"t": 10.0, "values": {"llm_batch_size_count": 100, "llm_batch_size_sum": 300,
                                    "llm_generation_tokens_total": 1000, "llm_kv_blocks_total": 64}}  # fmt: skip
    after = {"t": 12.0, "values": {"llm_batch_size_count": 110, "llm_batch_size_sum": 370,
                                   "llm_generation_tokens_total": 1070, "llm_kv_blocks_total": 64,
                                   "llm_kv_blocks_used": 9, "llm_num_requests_running": 7,
                                   "nv_inference_pending_request_count": 3}}  # fmt: skip
    point = live.server_point([before], after)
    assert (point["batch"], point["steps_per_s"], point["tok_s"]) == (7.0, 5.0, 35.0)
    assert (point["running"], point["queued_in_triton"], point["kv_used"], point["kv_total"]) == (7, 3, 9, 64)
    idle = live.server_point([before, after], {**after, "t": 13.0})
    assert (idle["batch"], idle["steps_per_s"]) == (0.0, 0.0)  # no step: nothing batched
    assert idle["tok_s"] == pytest.approx(70 / 3)  # tokens counted as requests end: over the oldest sample's span
    first = live.server_point([], after)
    assert first["batch"] is None and first["tok_s"] is None and first["kv_total"] == 64
    restarted = live.server_point([after], {"t": 14.0, "values": {"llm_generation_tokens_total": 5}})
    assert restarted["tok_s"] is None and restarted["batch"] is None


@pytest.mark.timeout(10)
def test_latency_table_counts_requests_once_and_keeps_percentiles_apart(tmp_path):
    book = live.LatencyBook(slo_ttft_ms=100, slo_tpot_ms=19, window_s=20)
    for i in range(10):
        book.add("llm_continuous", record(ttft=10.0 * (i + 1), tpot=2.0 * (i + 1)), t_end=1000.0 + i)
    book.add("llm_continuous", record(ok=False, ttft=None, tpot=None), t_end=1009.0)
    book.add("llm_continuous", record(cut=True, ok=False), t_end=1009.0)  # Locust leaves it out: so does the table
    book.add("llm_dynamic", record(ttft=300.0), t_end=900.0)
    (dynamic, continuous) = book.summary()  # the order of docs/batching.md
    assert dynamic["model"] == "llm_dynamic" and dynamic["slo_met"] == 0
    # The last request's TPOT (20 ms) is over the SLO, and the failed one is not within it.
    assert (continuous["requests"], continuous["failures"], continuous["slo_met"]) == (11, 1, 9)
    assert continuous["ttft_p50_ms"] == 55.0 and continuous["tpot_p99_ms"] == pytest.approx(19.8)
    recent = book.recent_percentiles(now=1010.0)
    assert recent["llm_continuous"]["ttft_p50"] == 55.0 and recent["llm_dynamic"]["ttft_p50"] is None
    rows = list(csv.DictReader(book.to_csv().splitlines()))
    assert [r["Model"] for r in rows] == ["llm_dynamic", "llm_continuous"]
    assert rows[1]["Requests"] == "11" and rows[1]["SLO met %"] == "81.8" and rows[1]["TTFT p99 (ms)"] == "99.1"
    book.reset()
    assert book.summary() == []


@pytest.mark.timeout(10)
def test_records_follower_reads_complete_lines_as_the_files_grow(tmp_path):
    book = live.LatencyBook(2000, 100)
    follower = live.RecordsFollower(tmp_path)
    path = tmp_path / "llm_dynamic_u4_requests.jsonl"
    path.write_text(json.dumps({"event": "test_start", "model": "llm_dynamic"}) + "\n" + json.dumps(record()) + "\n"
                    + json.dumps(record())[:20])  # fmt: skip
    follower.poll(book)
    assert book.summary()[0]["requests"] == 1  # the half-written line waits
    with open(path, "a") as f:
        f.write(json.dumps(record())[20:] + "\n" + json.dumps({"event": "test_stop"}) + "\n")
    follower.poll(book)
    follower.poll(book)
    assert book.summary()[0]["requests"] == 2


# ---- the page in a browser ----------------------------------------------------------------------------------------


def chromium() -> str:
    """Debian's chromium (``make chromium`` installs it): skipped with the reason where it is missing, never on CI."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        reason = ("headless Chromium is not installed: `make chromium` installs Debian's chromium package "
                  "(apt-get, as root)")  # fmt: skip
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}; on CI it must be")
        pytest.skip(reason)
    return path


def browse(url: str, tmp_path: Path, *flags: str, budget_ms: int = 4000) -> str:
    """Load ``url`` in headless Chromium for ``budget_ms`` of page time; its stdout (``--dump-dom``: the DOM)."""
    command = [
        chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
        f"--user-data-dir={tmp_path / 'chromium-profile'}", f"--virtual-time-budget={budget_ms}", *flags, url,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def page_state(dom: str) -> str:
    return dom.split('<body data-state="', 1)[1].split('"', 1)[0] if '<body data-state="' in dom else ""


def chart_points(dom: str) -> dict[str, dict[str, int]]:
    """Per chart, the points each model's series has (the page writes them as ``data-points``)."""
    out = {}
    for part in dom.split('<section class="chart" id="chart-')[1:]:
        chart, rest = part.split('"', 1)
        points = rest.split('data-points="', 1)[1].split('"', 1)[0]
        out[chart] = {m: int(n) for m, n in (item.split(":") for item in points.split())}
    return out


@pytest.mark.timeout(120)
def test_page_says_so_when_the_metrics_port_cannot_be_reached(tmp_path):
    (closed,) = free_ports(1)  # nothing listens there
    view = live.LiveView(live.LatencyBook(2000, 100), f"http://127.0.0.1:{closed}/metrics", models=list(MODELS))
    with live.serve(view) as page:
        time.sleep(2.5)
        data = json.loads(urllib.request.urlopen(page.url + "data", timeout=10).read())
        assert data["metrics"]["ok"] is False and "refused" in data["metrics"]["error"].lower()
        assert data["models"] == list(MODELS) and all(v is None for v in data["series"]["llm_dynamic"]["batch"])
        dom = browse(page.url, tmp_path, "--dump-dom")
    assert page_state(dom) == "unreachable"
    assert f"Cannot reach the metrics port at http://127.0.0.1:{closed}/metrics" in dom
    assert dom.count("No data: cannot reach the metrics port") == 5  # every server chart, not a flat line


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
    assert set(points) == {"batch", "running", "waiting", "kv", "tok_s", "ttft", "tpot"}
    for chart in ("batch", "kv", "tok_s", "ttft", "tpot"):
        assert all(points[chart][m] >= 3 for m in MODELS), (chart, points[chart])

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
    assert data["metrics"]["ok"] is True and data["models"] == list(MODELS)
    for model in MODELS:
        series, values = data["series"][model], port[model]
        for key, name in (("tokens_total", "llm_generation_tokens_total"), ("steps_total", "llm_batch_size_count"),
                          ("seqs_total", "llm_batch_size_sum"), ("kv_total", "llm_kv_blocks_total"),
                          ("kv_used", "llm_kv_blocks_used"), ("running", "llm_num_requests_running")):  # fmt: skip
            assert series[key][-1] == pytest.approx(values[name]), (model, key)
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
