"""The live view: what each model's batcher decides while a load runs, beside what the clients measure.

One page, a point a second over the last five minutes, every model on shared time axes: sequences in each forward
step (``llm_batch_size``: the mean per step), requests running and waiting (the engine's queue plus Triton's own,
``nv_inference_pending_request_count``, where the batcher models' requests wait), KV blocks used out of the pool,
output tokens per second, and the clients' TTFT and TPOT p50/p99. Per priority level (the ``llm_*_by_priority_*``
series: the mixed workload's interactive class at level 1, its batch class at 3, a request that says nothing at 2), the
mean queue time, TTFT and TPOT of the requests that ended in the last 20 s and their preemptions, so a mixed run
shows each class apart. The load-test process reads the metrics port
itself (:class:`LiveView`) and serves the page and its data from its own web server, so a browser talks to that one
port only:

- ``make locust``: a tab in Locust's web UI beside its charts (:func:`attach_to_locust`; the page alone is at
  ``/llm-live/``), and the latency table's CSV among Locust's downloads.
- ``make compare``: :func:`serve` on a free 127.0.0.1 port; the clients' latencies come from the records files that
  its headless Locust runs write (:class:`RecordsFollower`).

The page (``loadtest/live_page/``) draws with uPlot, vendored in ``loadtest/live_page/vendor/`` (version and
licence there): nothing is fetched from anywhere but the web server that serves the page.
"""

from __future__ import annotations

import collections
import contextlib
import csv
import io
import json
import math
import threading
import time
from pathlib import Path
from typing import NamedTuple

from backend.contract import names
from backend.contract.priority import DEFAULT_PRIORITY_LEVEL
from loadtest.colors import color
from loadtest.measure import meets_slo
from loadtest.metrics import (
    counter_delta,
    histogram_rate,
    models_under_load,
    parse_prometheus,
    scrape,
    select,
    steps_by_model,
)
from loadtest.stats import percentile
from loadtest.workloads import MIXED

PAGE_DIR = Path(__file__).with_name("live_page")
WINDOW_S = 300.0  # the page shows the last five minutes
INTERVAL_S = 1.0  # a point a second
LATENCY_WINDOW_S = 20.0  # a client percentile point: the requests that ended in the last 20 s
# Output tokens are counted as each request ends (llm_generation_tokens_total), so a rate over one second jumps
# with every request that ends in it: the rate is taken over the last five samples.
TOKEN_RATE_SAMPLES = 5
TAB_KEY = "llm-live"
TAB_TITLE = "LLM batching (live)"
# The per-point series the data endpoint serves: from the metrics port, then from the clients' records.
SERVER_KEYS = (
    "batch", "steps_per_s", "running", "waiting", "queued_in_triton", "kv_used", "kv_total", "tok_s",
    "tokens_total", "steps_total", "seqs_total",
)  # fmt: skip
CLIENT_KEYS = ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")
# Per priority level, from the ``*_by_priority`` families: the means (ms) of the requests of the level that ended in
# the last LATENCY_WINDOW_S, their preemptions there, and the counters as read. A level's series is ``<key>@<level>``.
LEVEL_HISTOGRAMS = {
    "queue_ms": names.QUEUE_TIME_BY_PRIORITY,
    "ttft_ms": names.TIME_TO_FIRST_TOKEN_BY_PRIORITY,
    "tpot_ms": names.TIME_PER_OUTPUT_TOKEN_BY_PRIORITY,
}
LEVEL_KEYS = (*LEVEL_HISTOGRAMS, "preempt", "preempt_total", "ended_total")
# What each level carries in this project's load tests: the mixed workload's classes, and the default level.
LEVEL_NAMES = {DEFAULT_PRIORITY_LEVEL: "default", **{c.priority: c.name for c in MIXED.classes}}
# The latency table (the page's, and its CSV's columns): key -> title.
SUMMARY_COLUMNS = {
    "model": "Model",
    "class": "Class",  # the mixed workload's: a row of the model's requests of one class (empty: all of them)
    "requests": "Requests",
    "failures": "Failures",
    "slo_met": "SLO met",
    "slo_met_pct": "SLO met %",
    "ttft_p50_ms": "TTFT p50 (ms)",
    "ttft_p99_ms": "TTFT p99 (ms)",
    "tpot_p50_ms": "TPOT p50 (ms)",
    "tpot_p99_ms": "TPOT p99 (ms)",
    "itl_max_p99_ms": "ITL max p99 (ms)",
    "e2e_p50_ms": "E2E p50 (ms)",
    "e2e_p99_ms": "E2E p99 (ms)",
}


def _number(value, digits: int = 4):
    """JSON-safe: None for a missing or non-finite value (the page draws a gap, not a zero)."""
    if value is None or not math.isfinite(value):
        return None
    return round(value, digits)


# ---- what the clients measured --------------------------------------------------------------------------------


class Finished(NamedTuple):
    t_end: float
    ok: bool
    ttft_ms: float | None
    tpot_ms: float | None
    itl_max_ms: float | None
    e2e_ms: float | None
    slo_met: bool
    traffic_class: str | None = None  # the mixed workload's class of the request


class LatencyBook:
    """Every finished request's client-side latencies, per model: the percentiles that Locust's stats cannot hold
    (a request is one Locust event, timed end to end) and that cannot be summed across requests."""

    def __init__(self, slo_ttft_ms: float, slo_tpot_ms: float, window_s: float = LATENCY_WINDOW_S) -> None:
        self.slo_ttft_ms, self.slo_tpot_ms, self.window_s = slo_ttft_ms, slo_tpot_ms, window_s
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._finished: dict[str, list[Finished]] = collections.defaultdict(list)
            self._recent: dict[str, collections.deque] = collections.defaultdict(collections.deque)

    def add(self, model: str, record: dict, t_end: float | None = None) -> None:
        """One request's record (``Measurement.record()``, a records-file line). A stream cut off by the end of the
        run is left out, as Locust leaves it out."""
        if record.get("cut"):
            return
        if t_end is None:
            t_end = record["t_start"] + (record["e2e_ms"] or 0.0) / 1000
        ok = bool(record["ok"])
        finished = Finished(
            t_end, ok, record["ttft_ms"], record["tpot_ms"], record["itl_max_ms"], record["e2e_ms"],
            meets_slo(record, self.slo_ttft_ms, self.slo_tpot_ms), record.get("class"),
        )  # fmt: skip
        with self._lock:
            self._finished[model].append(finished)
            self._recent[model].append(finished)

    def recent_percentiles(self, now: float) -> dict[str, dict]:
        """Per model, TTFT and TPOT p50/p99 (ms) over the successful requests that ended in the last ``window_s``."""
        out = {}
        with self._lock:
            for model, recent in self._recent.items():
                while recent and recent[0].t_end < now - self.window_s:
                    recent.popleft()
                ok = [f for f in recent if f.ok]
                ttft = [f.ttft_ms for f in ok if f.ttft_ms is not None]
                tpot = [f.tpot_ms for f in ok if f.tpot_ms is not None]
                out[model] = {f"{name}_p{q}": percentile(values, q) for name, values in (("ttft", ttft), ("tpot", tpot))
                              for q in (50, 99)}  # fmt: skip
        return out

    def summary(self) -> list[dict]:
        """One row per model over every request so far (the keys of :data:`SUMMARY_COLUMNS`), then, in a mixed
        workload, one row per class of its requests (``class`` set; the model's own row has None)."""
        with self._lock:
            finished = {model: list(entries) for model, entries in self._finished.items()}
        rows = []
        for model in sorted(finished, key=names.model_order):
            entries = finished[model]
            rows.append(self._row(model, None, entries))
            for name in [c.name for c in MIXED.classes if any(f.traffic_class == c.name for f in entries)]:
                rows.append(self._row(model, name, [f for f in entries if f.traffic_class == name]))
        return rows

    @staticmethod
    def _row(model: str, traffic_class: str | None, entries: list[Finished]) -> dict:
        ok = [f for f in entries if f.ok]
        met = sum(f.slo_met for f in entries)
        row = {"model": model, "class": traffic_class, "requests": len(entries), "failures": len(entries) - len(ok),
               "slo_met": met, "slo_met_pct": _number(100 * met / len(entries), 1) if entries else None}  # fmt: skip
        for name in ("ttft", "tpot", "e2e"):
            values = [getattr(f, f"{name}_ms") for f in ok if getattr(f, f"{name}_ms") is not None]
            for q in (50, 99):
                row[f"{name}_p{q}_ms"] = _number(percentile(values, q), 1)
        row["itl_max_p99_ms"] = _number(percentile([f.itl_max_ms for f in ok if f.itl_max_ms is not None], 99), 1)
        return row

    def to_csv(self) -> str:
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(SUMMARY_COLUMNS.values())
        for row in self.summary():
            writer.writerow("" if row[key] is None else row[key] for key in SUMMARY_COLUMNS)
        return out.getvalue()


class RecordsFollower:
    """The records files (``*_requests.jsonl``) that headless Locust runs append to, read as they grow.

    A file's model is its ``test_start`` event's (or a record's own ``model``); only complete lines are read.
    """

    def __init__(self, folder: Path, pattern: str = "*_requests.jsonl") -> None:
        self.folder, self.pattern = Path(folder), pattern
        self._read: dict[Path, tuple[int, int]] = {}  # path -> (inode, bytes read)
        self._models: dict[Path, str] = {}

    def poll(self, book: LatencyBook) -> None:
        for path in sorted(self.folder.glob(self.pattern)):
            try:
                stat = path.stat()
                inode, offset = self._read.get(path, (stat.st_ino, 0))
                if inode != stat.st_ino or stat.st_size < offset:  # written anew
                    offset = 0
                with open(path, "rb") as f:
                    f.seek(offset)
                    chunk = f.read(stat.st_size - offset)
            except OSError:
                continue
            end = chunk.rfind(b"\n") + 1
            self._read[path] = (stat.st_ino, offset + end)
            for line in chunk[:end].splitlines():
                self._take(path, line, book)

    def _take(self, path: Path, line: bytes, book: LatencyBook) -> None:
        try:
            record = json.loads(line)
        except ValueError:
            return
        if record.get("event") == "test_start":
            self._models[path] = record.get("model", "")
        elif "event" not in record:
            model = record.get("model") or self._models.get(path)
            if model:
                book.add(model, record)


# ---- what the server decided ----------------------------------------------------------------------------------


def server_point(history: list[dict], sample: dict) -> dict:
    """One point of a model's series from its metrics sample (``{"t", "values"}`` as ``metrics.select`` gives them)
    and the samples before it (``history``, oldest first): gauges as sampled, the mean batch per step since the last
    sample, output tokens/s since the oldest one."""
    values = sample["values"]
    point = {
        "running": values.get(names.NUM_REQUESTS_RUNNING),
        "waiting": values.get(names.NUM_REQUESTS_WAITING),
        "queued_in_triton": values.get(names.PENDING_REQUESTS),
        "kv_used": values.get(names.KV_BLOCKS_USED),
        "kv_total": values.get(names.KV_BLOCKS_TOTAL),
        "tokens_total": values.get(names.GENERATION_TOKENS),
        "steps_total": values.get(f"{names.BATCH_SIZE}_count"),
        "seqs_total": values.get(f"{names.BATCH_SIZE}_sum"),
        "batch": None,
        "steps_per_s": None,
        "tok_s": None,
    }
    if not history or sample["t"] <= history[-1]["t"]:
        return point
    pair = [history[-1], sample]
    if all(f"{names.BATCH_SIZE}_count" in s["values"] for s in pair):
        steps = histogram_rate(pair, names.BATCH_SIZE)
        # NOTE: no forward step in the interval means no sequence was in a batch: a zero, not a gap.
        point["steps_per_s"], point["batch"] = (steps[0][1], steps[0][2]) if steps else (0.0, 0.0)
    oldest = history[-TOKEN_RATE_SAMPLES:][0]
    tokens = counter_delta([oldest, sample], names.GENERATION_TOKENS)
    if tokens is not None and tokens >= 0:  # a counter that went back: the server restarted
        point["tok_s"] = tokens / (sample["t"] - oldest["t"])
    return point


def _level_key(name: str, level: str) -> str:
    """The key of a ``*_by_priority`` series of ``level`` in a sample (``metrics.series_key``)."""
    return f'{name}{{priority="{level}"}}'


def levels_in(values: dict) -> list[str]:
    """The priority levels a model's sample has ``*_by_priority`` series of (a level's appear as its first request
    ends), in order."""
    families = (*LEVEL_HISTOGRAMS.values(), names.PREEMPTIONS_BY_PRIORITY)
    found = {key.split('{priority="', 1)[1].split('"', 1)[0] for key in values
             if key.startswith(families) and '{priority="' in key}  # fmt: skip
    return sorted(found, key=int)


def level_points(history: list[dict], sample: dict, window_s: float = LATENCY_WINDOW_S) -> dict[str, dict]:
    """Per priority level, one point from a model's sample and the samples before it (oldest first): the mean queue
    time, TTFT and TPOT (ms) of the level's requests that ended in the last ``window_s`` (None: none ended), their
    preemptions there (counted as a preempted request ends), and the counters as read (``preempt_total``, and
    ``ended_total``: the requests of the level that had a first token)."""
    values = sample["values"]
    base = next((s for s in history if sample["t"] - window_s <= s["t"] < sample["t"]), None)
    before = base["values"] if base is not None else None
    points = {}
    for level in levels_in(values):
        point = {key: None for key in LEVEL_KEYS}
        preempted = _level_key(names.PREEMPTIONS_BY_PRIORITY, level)
        point["preempt_total"] = values.get(preempted)
        point["ended_total"] = values.get(_level_key(f"{names.TIME_TO_FIRST_TOKEN_BY_PRIORITY}_count", level))
        if before is not None:
            # NOTE: a level's series are made when its first request ends: absent before, they were zero.
            if preempted in values and values[preempted] >= before.get(preempted, 0.0):
                point["preempt"] = values[preempted] - before.get(preempted, 0.0)
            for key, name in LEVEL_HISTOGRAMS.items():
                count, total = _level_key(f"{name}_count", level), _level_key(f"{name}_sum", level)
                ended = values.get(count, 0.0) - before.get(count, 0.0)
                if ended > 0:  # none ended: a gap; fewer than before: the server restarted
                    point[key] = 1000 * (values.get(total, 0.0) - before.get(total, 0.0)) / ended
        points[level] = point
    return points


def llm_models(series) -> set[str]:
    """The models that export the engine's metrics (every model of this project does)."""
    return {s.labels["model"] for s in series if s.name == names.KV_BLOCKS_TOTAL and "model" in s.labels}


class LiveView:
    """The page's data: each second, a point per model from the metrics port and the clients' latency percentiles.

    ``models``: the models to show (None: every model the metrics port has ``llm_*`` series for). ``metrics_url``
    may be set later (``make compare`` learns it once its server is up). :meth:`start` ticks on a thread (a
    greenlet under Locust's gevent); :meth:`data` is what the page fetches.
    """

    def __init__(
        self,
        book: LatencyBook,
        metrics_url: str | None = None,
        models: list[str] | None = None,
        window_s: float = WINDOW_S,
        interval_s: float = INTERVAL_S,
    ) -> None:
        self.book, self.metrics_url, self.models = book, metrics_url, models
        self.window_s, self.interval_s = window_s, interval_s
        self.followers: list[RecordsFollower] = []
        self._ticks: collections.deque = collections.deque(maxlen=int(window_s / interval_s) + 1)
        # NOTE: enough samples for the tokens/s and for the priority levels' window.
        kept = max(TOKEN_RATE_SAMPLES, math.ceil(self.book.window_s / interval_s) + 1)
        self._history: dict[str, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=kept))
        self._status: dict = {"url": None, "ok": None, "error": None, "since": None, "last_ok": None}
        self._steps: dict[str, float] | None = None  # every model's forward steps at the last read
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "LiveView":
        self._thread = threading.Thread(target=self._run, name="llm-live", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.tick()
            self._stop.wait(max(0.05, self.interval_s - (time.monotonic() - started)))

    def tick(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        for follower in self.followers:
            follower.poll(self.book)
        server, under_load = self._read_server(now)
        client = self.book.recent_percentiles(now)
        with self._lock:
            self._ticks.append({"t": now, "server": server, "client": client, "under_load": under_load})

    def _read_server(self, now: float) -> tuple[dict | None, list[str]]:
        """Per model, this second's point (None when the metrics port could not be read: a gap on the page), and
        the models under load since the last read (every model of the server, shown or not)."""
        url = self.metrics_url
        if not url:
            self._set_status(url, ok=None, error="waiting for the server to start", now=now)
            return None, []
        try:
            series = parse_prometheus(scrape(url, timeout=2.0))
        except (OSError, ValueError) as exc:
            self._set_status(url, ok=False, error=f"{type(exc).__name__}: {exc}", now=now)
            self._history.clear()  # NOTE: no rate across the gap
            self._steps = None
            return None, []
        steps = steps_by_model(series)
        under_load = models_under_load(self._steps, steps) if self._steps is not None else []
        self._steps = steps
        points = {}
        for model in self.models or sorted(llm_models(series)):
            sample = {"t": now, "values": select(series, model, buckets=False)}
            if sample["values"]:
                history = list(self._history[model])
                points[model] = server_point(history, sample)
                points[model]["levels"] = level_points(history, sample, self.book.window_s)
                self._history[model].append(sample)
        self._set_status(url, ok=True, error=None, now=now)
        return points, under_load

    def _set_status(self, url: str | None, ok: bool | None, error: str | None, now: float) -> None:
        with self._lock:
            status = self._status
            if status["ok"] != ok or status["url"] != url:
                status["since"] = now
            status.update(url=url, ok=ok, error=error)
            if ok:
                status["last_ok"] = now

    def data(self, since: float | None = None) -> dict:
        """What the page draws: the ticks after ``since`` (all of the window when None), every model's series
        aligned on their times, the metrics port's status, and the latency table."""
        with self._lock:
            ticks = [t for t in self._ticks if since is None or t["t"] > since]
            status = dict(self._status)
        seen = set(self.models or ())
        for tick in ticks:
            seen.update(tick["server"] or (), tick["client"])
        models = sorted(seen, key=names.model_order)
        series, levels = {}, set()
        for model in models:
            server = [(tick["server"] or {}).get(model) or {} for tick in ticks]
            client = [tick["client"].get(model) or {} for tick in ticks]
            series[model] = {key: [_number(p.get(key)) for p in server] for key in SERVER_KEYS}
            series[model].update({key: [_number(c.get(key), 2) for c in client] for key in CLIENT_KEYS})
            seen = sorted({level for p in server for level in p.get("levels", {})}, key=int)
            levels.update(seen)
            for level in seen:
                at = [p.get("levels", {}).get(level) or {} for p in server]
                series[model].update({f"{key}@{level}": [_number(a.get(key), 2) for a in at] for key in LEVEL_KEYS})
        return {
            "now": time.time(),
            "window_s": self.window_s,
            "interval_s": self.interval_s,
            "latency_window_s": self.book.window_s,
            "slo": {"ttft_ms": self.book.slo_ttft_ms, "tpot_ms": self.book.slo_tpot_ms},
            "metrics": status,
            "models": models,
            "colors": {model: color(model) for model in models},
            # The priority levels any shown model has series of, each with what it carries here.
            "levels": {level: LEVEL_NAMES.get(int(level), f"level {level}") for level in sorted(levels, key=int)},
            "t": [round(tick["t"], 3) for tick in ticks],
            "series": series,
            # NOTE: models under load in the same second share the cores (backend/engine/shared_cores.py): the page
            # says so, as each one's latencies then include the others' load.
            "under_load": [tick["under_load"] for tick in ticks],
            "summary": self.book.summary(),
            "summary_columns": SUMMARY_COLUMNS,
        }


# ---- the web pages ----------------------------------------------------------------------------------------------


def blueprint(view: LiveView, wrap=lambda f: f):
    """The page at ``/llm-live/``, its data (``data?since=<t>``), the latency CSV and the page's files; ``wrap``
    guards each view (Locust's login, where it is on)."""
    from flask import Blueprint, Response, request, send_from_directory

    bp = Blueprint("llm_live", __name__, url_prefix="/llm-live")

    def page():
        return send_from_directory(PAGE_DIR, "index.html")

    def data():
        return Response(json.dumps(view.data(request.args.get("since", type=float))), mimetype="application/json")

    def latency_csv():
        disposition = f"attachment; filename=llm_latency_{time.strftime('%Y%m%d-%H%M%S')}.csv"
        return Response(view.book.to_csv(), mimetype="text/csv", headers={"Content-Disposition": disposition})

    def static(name: str):
        return send_from_directory(PAGE_DIR, name)

    routes = {"/": page, "/data": data, "/latency.csv": latency_csv, "/static/<path:name>": static}
    for rule, function in routes.items():
        bp.add_url_rule(rule, function.__name__, wrap(function))
    return bp


def attach_to_locust(web_ui, view: LiveView) -> None:
    """The live view in Locust's web UI: the page at ``/llm-live/``, a tab beside Locust's charts that shows it
    (Locust's ``extended_tabs``; ``tab.js``, added to Locust's page, puts the page in the tab), and the latency CSV
    among Locust's downloads (``extended_csv_files``)."""
    from flask import request

    web_ui.app.register_blueprint(blueprint(view, web_ui.auth_required_if_enabled))
    web_ui.template_args["extended_tabs"] = [{"title": TAB_TITLE, "key": TAB_KEY}]
    web_ui.template_args["extended_csv_files"] = [
        {"href": "llm-live/latency.csv", "title": "Download LLM latency CSV (TTFT, TPOT, ITL max, E2E, SLO met)"}
    ]
    script = f'<script src="llm-live/static/tab.js" data-title="{TAB_TITLE}"></script></body>'

    @web_ui.app.after_request
    def _add_tab_script(response):
        if request.endpoint == "locust.index" and response.mimetype == "text/html":
            response.set_data(response.get_data(as_text=True).replace("</body>", script, 1))
        return response


class LivePage:
    """The page served on its own (``make compare``): a small threaded web server on 127.0.0.1 and the view's
    ticking thread; :attr:`url` is the page's address."""

    def __init__(self, view: LiveView, port: int = 0) -> None:
        from flask import Flask
        from werkzeug.serving import WSGIRequestHandler, make_server

        class QuietHandler(WSGIRequestHandler):
            def log_request(self, *args, **kwargs) -> None:  # a line a second per open page would bury the log
                pass

        app = Flask(__name__)
        app.register_blueprint(blueprint(view))
        self.view = view
        self._server = make_server("127.0.0.1", port, app, threaded=True, request_handler=QuietHandler)
        self.url = f"http://127.0.0.1:{self._server.server_port}/llm-live/"
        self._thread = threading.Thread(target=self._server.serve_forever, name="llm-live-web", daemon=True)

    def start(self) -> "LivePage":
        self.view.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join(timeout=5)
        self._server.server_close()
        self.view.stop()


@contextlib.contextmanager
def serve(view: LiveView, port: int = 0):
    """The page served on its own while the block runs; yields the :class:`LivePage` (``page.url``)."""
    page = LivePage(view, port).start()
    try:
        yield page
    finally:
        page.stop()
