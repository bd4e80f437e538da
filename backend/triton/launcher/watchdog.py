"""Notice a model whose queue stops moving, or a tritonserver that stops answering, say so, and end the server so
that it can start again.

A model is stalled when Triton holds requests for it (``nv_inference_pending_request_count`` > 0) and nothing it does
has moved for longer than a bound: no batch executed (``nv_inference_exec_count``), no engine step
(``llm_batch_size``'s count), no request started, ended or left the engine's waiting queue (``llm_num_requests_*``,
``llm_request_success_total``). Triton's queue is where a model that stopped executing shows: a batcher model's
execute() that never returns keeps every later request there, and /v2/health/ready still answers 200. The bound
(``STALL_TIMEOUT_S``) must be longer than anything a healthy busy model does without moving one of these: a
batcher's queue delay (1 s for llm_static) and the longest engine step (a prefill chunk of
``max_num_batched_tokens``; seconds on a CPU).

The launcher (``serve.py``, and ``python -m backend.triton.launcher.shutdown run``) runs :func:`supervise`: every
second it reads the metrics port; on a stall it writes a marker file, logs why, and kills tritonserver with its stubs,
so every call the server held ends with an error at once; ``serve.py``'s restart loop then starts it again on the
same ports.

A tritonserver that no longer answers at all (a crash whose signal handler deadlocked: "Signal (11) received.",
"malloc(): ... corrupted", then every thread asleep; or a SIGSTOPped process) moves no metric, and no reading of the
metrics port comes back, so the stall watchdog cannot see it. :func:`supervise` therefore also probes liveness on
threads of its own: ``/v2/health/live`` and the metrics port, each asked every ``PROBE_INTERVAL_S`` with a generous
``PROBE_TIMEOUT_S``. When one of them has answered nothing for ``HANG_TIMEOUT_S`` (``MIN_FAILED_PROBES`` probes in a
row at least), the server is hung (:class:`Hang`): marked, logged and killed like a stall, and restarted.

The health probe (``probe.py``) reads the marker: the server reads not ready, with the reason, from the stall until
the restarted server is ready. A marker, because the probe is one short call with one reading of the metrics: it
cannot see that nothing moved for 30 s, and the one place that watches the metrics all along is the launcher.

Standard library only: ``probe.py`` and ``shutdown.py`` import this module when they run as files in a container.
"""

from __future__ import annotations

import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from backend.contract import names, prometheus
from backend.triton.launcher.processes import is_alive, kill_process_group

STALL_TIMEOUT_S = 30.0
INTERVAL_S = 1.0
# A tritonserver is hung when one of its liveness probes has answered nothing for HANG_TIMEOUT_S, at least
# MIN_FAILED_PROBES probes in a row. Each probe waits PROBE_TIMEOUT_S: a busy server on two cores answers health and
# metrics in milliseconds, so only a server that answers nothing at all fails three 5-s probes in a row.
HANG_TIMEOUT_S = 15.0
PROBE_TIMEOUT_S = 5.0
PROBE_INTERVAL_S = 1.0
MIN_FAILED_PROBES = 3
# What moves while a model works through its requests.
PROGRESS = (names.EXEC_COUNT, f"{names.BATCH_SIZE}_count", names.NUM_REQUESTS_RUNNING, names.NUM_REQUESTS_WAITING,
            names.REQUEST_SUCCESS)


@dataclass(frozen=True)
class Ending:
    """Why the watchdog ended tritonserver: ``cause`` in the launcher's words ("tritonserver was ended because ..."),
    ``str()`` the line it logs and marks (``message`` filled in with the fields)."""

    cause: ClassVar[str]
    message: ClassVar[str]

    def __str__(self) -> str:
        return self.message.format_map(vars(self))


@dataclass(frozen=True)
class Stall(Ending):
    """``model`` held ``num_pending`` requests in Triton's queue and executed nothing for ``seconds``."""

    cause = "a model stalled"
    message = ("{model} stalled: {num_pending} requests pending in Triton's queue and nothing executed for "
               "{seconds:.0f} s")

    model: str
    num_pending: int
    seconds: float


@dataclass(frozen=True)
class Hang(Ending):
    """tritonserver's ``probe`` (what was asked: ``/v2/health/live``, the metrics port) answered nothing for
    ``seconds``, ``num_failed`` probes in a row."""

    cause = "it hung"
    message = "tritonserver hung: {probe} answered nothing for {seconds:.0f} s ({num_failed} probes in a row)"

    probe: str
    seconds: float
    num_failed: int


class Liveness:
    """Feed it the outcome of every probe of one endpoint (``probe``: its name); it says when the endpoint, once it
    has answered (a server still loading its models has not), has answered nothing for longer than ``bound_s``,
    ``min_failed`` probes in a row at least. Thread-safe: one thread observes, another asks."""

    def __init__(self, probe: str, bound_s: float = HANG_TIMEOUT_S, min_failed: int = MIN_FAILED_PROBES) -> None:
        self.probe, self.bound_s, self.min_failed = probe, bound_s, min_failed
        self._failing: tuple[float, int] | None = None  # (when the first failed probe of the run began, how many)
        self._answered = False

    def observe(self, answered: bool, started: float) -> None:
        """One probe's outcome; ``started``: when it was sent (``time.monotonic()``)."""
        failing = self._failing
        if answered:
            self._failing, self._answered = None, True
        elif self._answered:
            self._failing = (started, 1) if failing is None else (failing[0], failing[1] + 1)

    def hang(self, now: float) -> Hang | None:
        failing = self._failing  # NOTE: one read: the probing thread replaces the tuple, never edits it
        if failing is None or failing[1] < self.min_failed or now - failing[0] < self.bound_s:
            return None
        return Hang(self.probe, now - failing[0], failing[1])


def answers(url: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether ``url`` answers 200 within ``timeout`` s (a new connection each time)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            response.read()
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def probe_liveness(urls: Mapping[str, str], bound_s: float, done: threading.Event,
                   timeout: float = PROBE_TIMEOUT_S, interval: float = PROBE_INTERVAL_S) -> list[Liveness]:
    """Probe every ``name -> url`` on a daemon thread of its own until ``done`` is set, each probe at most ``timeout``
    s, one every ``interval`` s; returns their :class:`Liveness`, to be asked for a hang."""
    watched = []
    for name, url in urls.items():
        liveness = Liveness(name, bound_s)

        def loop(url: str = url, liveness: Liveness = liveness) -> None:
            while not done.is_set():
                started = time.monotonic()
                answered = answers(url, timeout)
                if done.is_set():
                    return
                liveness.observe(answered, started)
                done.wait(max(0.0, interval - (time.monotonic() - started)))

        threading.Thread(target=loop, name=f"liveness {name}", daemon=True).start()
        watched.append(liveness)
    return watched


class Watchdog:
    """Feed it readings of the metrics port; it names the models stalled for longer than ``bound_s``."""

    def __init__(self, bound_s: float = STALL_TIMEOUT_S) -> None:
        self.bound_s = bound_s
        # model -> (what had moved at the reading, when it last moved or nothing was pending)
        self._last: dict[str, tuple[tuple[float, ...], float]] = {}

    def observe(self, series: list[prometheus.Series], now: float) -> list[Stall]:
        """The models stalled at this reading (``now``: ``time.monotonic()``)."""
        pending = prometheus.by_model(series, names.PENDING_REQUESTS)
        moved = [prometheus.by_model(series, name) for name in PROGRESS]
        stalls = []
        for model, num_pending in sorted(pending.items()):
            reading = tuple(values.get(model, 0.0) for values in moved)
            last = self._last.get(model)
            if num_pending == 0 or last is None or last[0] != reading:
                self._last[model] = (reading, now)
            elif now - last[1] > self.bound_s:
                stalls.append(Stall(model, int(num_pending), now - last[1]))
        return stalls

    def poll(self, metrics_url: str) -> list[Stall]:
        """Read the metrics port now; a port that does not answer stalls nobody (tritonserver may be exiting)."""
        series = prometheus.read(metrics_url)
        return [] if series is None else self.observe(series, time.monotonic())


# ---- the marker the probe reads -------------------------------------------------------------------------------


def marker_path(metrics_port: int) -> Path:
    """Where the launcher of the server on ``metrics_port`` says which models stalled (one file per server)."""
    return Path(tempfile.gettempdir()) / f"llm-serve-{metrics_port}.stalled"


def mark_stalled(metrics_port: int, stalls: Sequence[Stall | Hang]) -> None:
    marker_path(metrics_port).write_text("; ".join(map(str, stalls)) + "\n")


def clear_stalled(metrics_port: int) -> None:
    marker_path(metrics_port).unlink(missing_ok=True)


def stalled(metrics_port: int) -> str | None:
    """What the launcher wrote when the server stalled; None when it serves (or no launcher watches it)."""
    try:
        return marker_path(metrics_port).read_text().strip() or None
    except OSError:
        return None


# ---- the launcher's part --------------------------------------------------------------------------------------


def supervise(pid: int, metrics_url: str, metrics_port: int, bound_s: float, stopping: Callable[[], bool],
              log: Callable[[str], None], live_urls: Mapping[str, str] | None = None,
              hang_timeout_s: float = HANG_TIMEOUT_S) -> list[Stall | Hang]:
    """Watch tritonserver ``pid`` (the leader of its process group) until it exits or ``stopping()``; on a stall
    (``bound_s``; 0: not watched), or when one of ``live_urls`` (``name -> url``; none: not probed) has answered
    nothing for ``hang_timeout_s`` (0: not probed), mark it not ready, log why and kill it with its stubs. Returns what
    ended it (empty: it exited, or a stop began)."""
    watchdog = Watchdog(bound_s)
    done = threading.Event()
    probes = probe_liveness(live_urls, hang_timeout_s, done) if live_urls and hang_timeout_s > 0 else []
    try:
        while is_alive(pid) and not stopping():
            time.sleep(INTERVAL_S)
            if stopping():  # NOTE: a draining server refuses what it still gets, and its queue may look stuck
                break
            now = time.monotonic()
            ended: list[Stall | Hang] = [hang for probe in probes if (hang := probe.hang(now)) is not None]
            if not ended and bound_s > 0:
                ended = watchdog.poll(metrics_url)
            if ended and is_alive(pid) and not stopping():
                mark_stalled(metrics_port, ended)
                for reason in ended:
                    log(str(reason))
                kill_process_group(pid)  # every call it held ends now, with an error
                return ended
    finally:
        done.set()
    return []
