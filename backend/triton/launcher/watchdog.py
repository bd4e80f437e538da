"""Notice a model whose queue stops moving, say so, and end the server so that it can start again.

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
The health probe (``probe.py``) reads the marker: the server reads not ready, with the reason, from the stall until
the restarted server is ready. A marker, because the probe is one short call with one reading of the metrics: it
cannot see that nothing moved for 30 s, and the one place that watches the metrics all along is the launcher.

Standard library only: ``probe.py`` and ``shutdown.py`` import this module when they run as files in a container.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from backend.contract import names, prometheus
from backend.triton.launcher.processes import is_alive, kill_process_group

STALL_TIMEOUT_S = 30.0
INTERVAL_S = 1.0
# What moves while a model works through its requests.
PROGRESS = (names.EXEC_COUNT, f"{names.BATCH_SIZE}_count", names.NUM_REQUESTS_RUNNING, names.NUM_REQUESTS_WAITING,
            names.REQUEST_SUCCESS)


@dataclass(frozen=True)
class Stall:
    model: str
    num_pending: int
    seconds: float

    def __str__(self) -> str:
        return (f"{self.model} stalled: {self.num_pending} requests pending in Triton's queue and nothing executed "
                f"for {self.seconds:.0f} s")


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


def mark_stalled(metrics_port: int, stalls: Sequence[Stall]) -> None:
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
              log: Callable[[str], None]) -> list[Stall]:
    """Watch tritonserver ``pid`` (the leader of its process group) until it exits or ``stopping()``; on a stall,
    mark it not ready, log why and kill it with its stubs. Returns the stalls (none: it exited, or a stop began)."""
    watchdog = Watchdog(bound_s)
    while is_alive(pid) and not stopping():
        time.sleep(INTERVAL_S)
        if stopping():  # NOTE: a draining server refuses what it still gets, and its queue may look stuck
            break
        stalls = watchdog.poll(metrics_url)
        if stalls:
            mark_stalled(metrics_port, stalls)
            for stall in stalls:
                log(str(stall))
            kill_process_group(pid)  # every call it held ends now, with an error
            return stalls
    return []
