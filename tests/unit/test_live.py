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

from backend.triton.launcher.launch_options import free_ports
from loadtest import live

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


def page_state(dom: str) -> str:
    return dom.split('<body data-state="', 1)[1].split('"', 1)[0] if '<body data-state="' in dom else ""


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
