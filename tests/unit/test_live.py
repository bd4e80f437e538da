"""The live view's parts (loadtest/live.py) without a server: a metrics sample to a point, the latency table, the
records follower, and the page when the metrics port does not answer (in headless Chromium).

tests/server/test_live.py runs Locust and the live tab against a real server.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from loadtest import live
from tests.fakes import closed_port

MODELS = ("llm_dynamic", "llm_continuous")


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


def wait_for_data(url: str, ready, timeout: float = 60.0) -> dict:
    """The page's data once ``ready(data)`` holds, polled: the view reads on its own thread, which a loaded machine
    may hold back for seconds."""
    deadline = time.monotonic() + timeout
    while True:
        data = json.loads(urllib.request.urlopen(url + "data", timeout=10).read())
        if ready(data):
            return data
        assert time.monotonic() < deadline, f"the live view's data was not ready after {timeout:.0f} s: {data}"
        time.sleep(0.1)


def page_state(dom: str) -> str:
    return dom.split('<body data-state="', 1)[1].split('"', 1)[0] if '<body data-state="' in dom else ""


def chart_points(dom: str) -> dict[str, dict[str, int]]:
    """Per chart, the points each of its lines has (the page writes them as ``data-points``: a model, or a model and
    a priority level as ``model/level``)."""
    out = {}
    for part in dom.split('<section class="chart" id="chart-')[1:]:
        chart, rest = part.split('"', 1)
        points = rest.split('data-points="', 1)[1].split('"', 1)[0]
        out[chart] = {m: int(n) for m, n in (item.split(":") for item in points.split())}
    return out


def record(t_start=100.0, ok=True, ttft=50.0, tpot=10.0, e2e=500.0, cut=False, **extra) -> dict:
    return {"t_start": t_start, "ok": ok, "cut": cut, "ttft_ms": ttft, "tpot_ms": tpot, "itl_max_ms": tpot and 2 * tpot,
            "e2e_ms": e2e, "error": None if ok else "error: no", **extra}  # fmt: skip


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
    assert [(r["Model"], r["Class"]) for r in rows] == [("llm_dynamic", ""), ("llm_continuous", "")]
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


@pytest.mark.timeout(120)
def test_page_says_so_when_the_metrics_port_cannot_be_reached(tmp_path):
    with closed_port() as closed:
        view = live.LiveView(live.LatencyBook(2000, 100), f"http://127.0.0.1:{closed}/metrics", models=list(MODELS))
        with live.serve(view) as page:
            data = wait_for_data(page.url, lambda d: d["metrics"]["ok"] is not None)  # it has tried the port
            assert data["metrics"]["ok"] is False and "refused" in data["metrics"]["error"].lower()
            assert data["models"] == list(MODELS) and all(v is None for v in data["series"]["llm_dynamic"]["batch"])
            dom = browse(page.url, tmp_path, "--dump-dom")
    assert page_state(dom) == "unreachable"
    assert f"Cannot reach the metrics port at http://127.0.0.1:{closed}/metrics" in dom
    # Every server chart, the five of each model and the four by priority level, not a flat line.
    assert dom.count("No data: cannot reach the metrics port") == 9


# ---- per priority level: the mixed workload's classes apart ---------------------------------------------------------


def by_level(level: int, ended: float, ttft_s: float, queue_s: float, preempted: float) -> dict[str, float]:
    """A model's ``*_by_priority`` series of ``level`` as a sample keeps them: ``ended`` requests so far, each with
    this TTFT and queue time (and a TPOT of 50 ms), and ``preempted`` preemptions."""
    key = lambda name: f'{name}{{priority="{level}"}}'  # noqa: E731
    values = {key("llm_preemptions_by_priority_total"): preempted}
    for name, seconds in (("llm_queue_time_by_priority_seconds", queue_s),
                          ("llm_time_to_first_token_by_priority_seconds", ttft_s),
                          ("llm_time_per_output_token_by_priority_seconds", 0.05)):  # fmt: skip
        values.update({key(f"{name}_count"): ended, key(f"{name}_sum"): ended * seconds})
    return values


@pytest.mark.timeout(10)
def test_a_level_point_is_the_mean_of_that_levels_requests_that_ended_in_the_window():
    history = [
        {"t": 70.0, "values": by_level(1, 2, 9.0, 9.0, 0)},  # before the window: left out
        {"t": 81.0, "values": {**by_level(1, 10, 0.1, 0.01, 0)}},  # no batch job had ended yet
        {"t": 95.0, "values": {**by_level(1, 15, 0.1, 0.01, 0), **by_level(3, 1, 2.0, 1.0, 0)}},
    ]
    # Since 81 s: ten more interactive requests, at 200 ms each (the mean moves from 100 ms); three batch jobs.
    now = {"t": 100.0, "values": {**by_level(1, 20, 0.15, 0.01, 0), **by_level(3, 3, 2.0, 1.0, 2)}}
    points = live.level_points(history, now, window_s=20.0)
    assert list(points) == ["1", "3"]
    interactive, batch = points["1"], points["3"]
    assert interactive["ttft_ms"] == pytest.approx(1000 * (20 * 0.15 - 10 * 0.1) / 10)  # 200 ms
    assert (interactive["queue_ms"], interactive["tpot_ms"]) == (pytest.approx(10.0), pytest.approx(50.0))
    assert (interactive["preempt"], interactive["ended_total"]) == (0, 20)
    # The batch level's series did not exist at 81 s: they were zero there.
    assert (batch["ttft_ms"], batch["queue_ms"]) == (pytest.approx(2000.0), pytest.approx(1000.0))
    assert (batch["preempt"], batch["preempt_total"]) == (2, 2)
    quiet = live.level_points([now], {**now, "t": 101.0}, window_s=20.0)  # nothing ended since: gaps, not zeros
    assert quiet["1"]["ttft_ms"] is None and quiet["3"]["preempt"] == 0 and quiet["3"]["ended_total"] == 3
    assert live.level_points([], now)["1"]["ttft_ms"] is None  # no sample before: no window
    assert live.level_points(history, {"t": 100.0, "values": {"llm_kv_blocks_total": 5}}) == {}


class LevelsMetrics:
    """A metrics port of llm_continuous whose interactive (level 1) and batch (level 3) requests end at every read:
    two interactive requests of 100 ms TTFT and one batch job of 2 s, preempted once."""

    def __init__(self) -> None:
        self.reads = 0

    def text(self) -> str:
        self.reads += 1
        values = {**by_level(1, 2 * self.reads, 0.1, 0.01, 0), **by_level(3, self.reads, 2.0, 1.5, self.reads),
                  "llm_kv_blocks_total": 64, "llm_batch_size_count": 10 * self.reads,
                  "llm_batch_size_sum": 30 * self.reads}  # fmt: skip
        return "".join(f"{labelled(key)} {value}\n" for key, value in values.items())


def labelled(key: str, model: str = "llm_continuous") -> str:
    """A sample's series key as the metrics port prints it, with its model's label."""
    return key.replace("{", f'{{model="{model}",', 1) if "{" in key else f'{key}{{model="{model}"}}'


@pytest.mark.timeout(120)
def test_page_shows_each_priority_level_apart(tmp_path, monkeypatch):
    """The live page of a mixed run with priorities: each chart by priority level has a line per level, and the
    table a row per level, named by its class."""
    fake = LevelsMetrics()
    monkeypatch.setattr(live, "scrape", lambda url, timeout=2.0: fake.text())
    view = live.LiveView(live.LatencyBook(2000, 100, window_s=5.0), "http://127.0.0.1:1/metrics",
                         models=["llm_continuous"], interval_s=0.25)  # fmt: skip
    for i in range(10):  # what the clients measured, each request with its class
        view.book.add("llm_continuous", record(ttft=100.0 + i, **{"class": "interactive"}), t_end=1000.0 + i)
    view.book.add("llm_continuous", record(ttft=3000.0, **{"class": "batch"}), t_end=1010.0)
    with live.serve(view) as page:
        data = wait_for_data(page.url, lambda d: len(d["t"]) >= 8)  # two seconds' reads on an idle machine
        dom = browse(page.url, tmp_path, "--dump-dom")
    assert [(r["class"], r["requests"], r["ttft_p99_ms"]) for r in data["summary"]] == [
        (None, 11, pytest.approx(2710.9)),
        ("interactive", 10, pytest.approx(108.9)),
        ("batch", 1, 3000.0),
    ]
    assert 'data-class="interactive"><td>&nbsp;&nbsp;interactive</td>' in dom and 'data-class="batch">' in dom
    assert data["levels"] == {"1": "interactive", "3": "batch"}
    series = data["series"]["llm_continuous"]
    assert series["ttft_ms@1"][-1] == pytest.approx(100.0) and series["ttft_ms@3"][-1] == pytest.approx(2000.0)
    assert series["queue_ms@3"][-1] == pytest.approx(1500.0)
    assert series["preempt_total@3"][-1] == len(data["t"])  # one read a point, a preemption a read
    assert series["preempt@3"][-1] > 0 and series["preempt@1"][-1] == 0
    assert page_state(dom) == "live"
    points = chart_points(dom)
    for chart in ("level-queue", "level-ttft", "level-tpot", "level-preempt"):
        assert set(points[chart]) == {"llm_continuous/1", "llm_continuous/3"}, (chart, points[chart])
        assert min(points[chart].values()) >= 3, (chart, points[chart])
    assert 'data-level="1"><td><span class="swatch"' in dom and "<td>interactive (1)</td>" in dom
    assert "<td>batch (3)</td>" in dom and "batch (level 3)" in dom  # the table and the legend
