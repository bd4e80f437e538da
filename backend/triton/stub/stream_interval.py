"""How often a stream's new tokens are sent: every N engine steps or every T milliseconds, whichever comes first
(``stream_interval`` and ``stream_interval_ms`` in config.pbtxt; ``stream_interval`` is SGLang's and vLLM's name).

Why: each response is an IPC round trip from the Python backend's stub to tritonserver, paid on the thread that
steps the engine, and a stream that gets one response per step pays it once per running sequence per step (about
0.1-0.2 ms each: 64 streams added 13-19 ms to a 45 ms step). Tokens held back go out together in the stream's next
response, so a client gets the same tokens and text, in fewer responses.

Always at once, whatever the interval: a stream's first token (time to first token does not move), its final
response (with everything held back), an error.

``stream_interval: auto`` (the default) chooses N before every step by one rule (:func:`adaptive_interval`), from
the measured cost of one response and the measured step. With share = num_streams * send_cost / step_time, what
sending every stream every step would cost as a share of the step:

    N = 1                                  below MIN_STREAMS_TO_GROUP (8) streams, or while share <= 10 %
    N = ceil(share / SEND_BUDGET (5 %))    otherwise: the fewest steps that bring sending back to 5 %

So N is 1 (every token as it is made, as before) at small batches and on slow steps, and grows only when the step is
bound by sending. Streams are sent in staggered phases (each step sends about 1/N of them), so no step pays for all.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# NOTE: the served ITL target is 1.10x the offline step for everything the server adds. Sending is let alone until it
# would take all of that (a single stream measured 5-6 % on a loaded 2-core machine, where grouping its tokens saved
# nothing measurable), and once grouped it gets half of it.
SENDING_BOUND = 0.10
SEND_BUDGET = 0.05
# NOTE: at one stream a loaded machine measured a response at over 10 % of the step, yet grouping its tokens saved
# nothing measurable (the round trip is mostly waiting for tritonserver to wake up); at 8 streams it saved 9-12 %.
MIN_STREAMS_TO_GROUP = 8
# One response's round trip until one is measured (Triton's Python backend, two small tensors, 2-core machine).
INITIAL_SEND_COST_S = 150e-6
# The moving averages' weight of the newest step: a few steps to follow a change of batch, no jump on one odd step.
SMOOTHING = 0.2

STREAM_INTERVAL = "stream_interval"
STREAM_INTERVAL_MS = "stream_interval_ms"
AUTO = "auto"


def adaptive_interval(num_streams: int, send_cost_s: float, step_s: float, budget: float = SEND_BUDGET,
                      bound: float = SENDING_BOUND) -> int:
    """Every step (1) below :data:`MIN_STREAMS_TO_GROUP` streams, or while sending ``num_streams`` streams'
    responses (at ``send_cost_s`` each) costs at most ``bound`` of a step's other work (``step_s``); otherwise the
    fewest steps between one stream's responses that keep sending within ``budget`` of it."""
    if num_streams < MIN_STREAMS_TO_GROUP or send_cost_s <= 0 or step_s <= 0:
        return 1
    share = num_streams * send_cost_s / step_s
    if share <= bound:
        return 1
    # NOTE: the small tolerance keeps a ratio of exactly 2.0 (computed as 2.0000000001) at 2.
    return max(1, math.ceil(share / budget - 1e-9))


@dataclass(frozen=True)
class StreamInterval:
    """``steps``: send a stream's tokens every this many of its steps (None: chosen by :func:`adaptive_interval`);
    ``max_ms``: and at the latest this many milliseconds after its last response."""

    steps: int | None = None
    max_ms: float = 500.0

    def __post_init__(self) -> None:
        if self.steps is not None and (isinstance(self.steps, bool) or self.steps < 1):
            raise ValueError(f"{STREAM_INTERVAL} must be '{AUTO}' or a whole number of steps >= 1; got {self.steps!r}")
        if not (math.isfinite(self.max_ms) and self.max_ms > 0):
            raise ValueError(f"{STREAM_INTERVAL_MS} must be a number of milliseconds > 0; got {self.max_ms!r}")

    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> StreamInterval:
        """From config.pbtxt's string parameters (``stream_interval``: ``auto`` or N; ``stream_interval_ms``: T)."""
        raw_steps = str(params.get(STREAM_INTERVAL, AUTO)).strip().lower()
        raw_ms = str(params.get(STREAM_INTERVAL_MS, cls.max_ms)).strip()
        try:
            steps = None if raw_steps == AUTO else int(raw_steps)
        except ValueError:
            raise ValueError(f"{STREAM_INTERVAL} must be '{AUTO}' or a whole number of steps >= 1; "
                             f"got {raw_steps!r}") from None
        try:
            max_ms = float(raw_ms)
        except ValueError:
            raise ValueError(f"{STREAM_INTERVAL_MS} must be a number of milliseconds > 0; got {raw_ms!r}") from None
        return cls(steps, max_ms)


@dataclass
class StreamState:
    """Where one stream stands: its phase (which steps of an interval send it), its steps so far, its last send."""

    phase: int
    num_steps: int = 0
    sent_at: float = 0.0


class StreamPacer:
    """Decides, for each stream's output of a step, whether it is sent now or held for the stream's next response,
    and (``auto``) chooses the interval before each step from what sending and stepping cost. Used by the one thread
    that sends: :meth:`due` for each intermediate output, :meth:`timed` around each send, :meth:`end_step` once the
    step's outputs are sent."""

    def __init__(self, config: StreamInterval | None = None, clock: Callable[[], float] = time.perf_counter,
                 budget: float = SEND_BUDGET) -> None:
        self.config = config or StreamInterval()
        self.interval = self.config.steps or 1
        self._clock, self._budget, self._max_s = clock, budget, self.config.max_ms / 1e3
        self._num_started = 0  # streams that sent their first token: the next one's phase
        self._send_cost_s = INITIAL_SEND_COST_S
        self._step_s: float | None = None  # the loop's time per step, sending left out
        # This step so far:
        self._num_streams = 0
        self._num_sent = 0
        self._sent_s = 0.0
        self._step_ended: float | None = None
        self._last_had_streams = False

    def start(self) -> StreamState:
        """A stream's state as its first token goes out (at once)."""
        self._num_started += 1
        return StreamState(phase=self._num_started, sent_at=self._clock())

    def due(self, stream: StreamState) -> bool:
        """Whether this step's output of ``stream`` goes out now (with what was held), or is held."""
        self._num_streams += 1
        stream.num_steps += 1
        now = self._clock()
        if (stream.num_steps + stream.phase) % self.interval == 0 or now - stream.sent_at >= self._max_s:
            stream.sent_at = now
            return True
        return False

    def timed(self, send: Callable[[], Any]) -> None:
        """Run ``send`` (one intermediate response), counting its time as the cost of sending."""
        started = self._clock()
        send()
        self._sent_s += self._clock() - started
        self._num_sent += 1

    def end_step(self) -> None:
        """The step's outputs are sent: update the measured costs and (``auto``) the interval for the next step."""
        now = self._clock()
        if self._num_sent:
            self._send_cost_s += SMOOTHING * (self._sent_s / self._num_sent - self._send_cost_s)
        # NOTE: only a period between two steps that both streamed is a step: one after an idle loop is not.
        if self._num_streams and self._last_had_streams and self._step_ended is not None:
            rest = max(now - self._step_ended - self._sent_s, 1e-6)
            self._step_s = rest if self._step_s is None else self._step_s + SMOOTHING * (rest - self._step_s)
        if self.config.steps is None and self._num_streams and self._step_s is not None:
            self.interval = adaptive_interval(self._num_streams, self._send_cost_s, self._step_s, self._budget)
        self._last_had_streams = self._num_streams > 0
        self._step_ended = now
        self._num_streams = self._num_sent = 0
        self._sent_s = 0.0

    @property
    def send_cost_s(self) -> float:
        return self._send_cost_s

    @property
    def step_s(self) -> float | None:
        return self._step_s
