"""One streamed request's measurements, as the Locust users record them (no Locust or gevent import here).

Times are seconds since the request was sent (``time.perf_counter``), one entry per token as it arrived, so time to
first token, time per output token, inter-token gaps and end-to-end latency all come from the same clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from client.schema import Chunk


class StreamError(Exception):
    """The server said no, or the stream broke or ended early: a Locust failure, with this message."""


@dataclass
class Measurement:
    index: int  # the workload's request number
    max_tokens: int
    t_start_unix: float  # when it was sent (time.time), to line requests up with the metrics samples
    token_s: list = field(default_factory=list)  # arrival of each token, seconds since sent
    num_input_tokens: int = 0
    finish_reason: str = ""
    e2e_s: float = 0.0
    error: str | None = None
    cut: bool = False  # the run ended before the stream did (not a failure: its latency is only a lower bound)
    traffic_class: str | None = None  # the mixed workload's class of the request's user (None: not mixed)
    priority: int | None = None  # the Triton priority level it was sent at (None: none)

    def add(self, chunk: Chunk) -> None:
        self.token_s += [chunk.time_s] * chunk.num_tokens
        if chunk.num_input_tokens:
            self.num_input_tokens = chunk.num_input_tokens
        if chunk.finish_reason:
            self.finish_reason = chunk.finish_reason

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_s)

    @property
    def ttft_s(self) -> float | None:
        return self.token_s[0] if self.token_s else None

    @property
    def tpot_s(self) -> float | None:
        n = len(self.token_s)
        return (self.token_s[-1] - self.token_s[0]) / (n - 1) if n > 1 else None

    @property
    def itl_max_s(self) -> float | None:
        """The longest gap between two tokens: a stall, e.g. while a batch-mate's prompt was prefilled."""
        gaps = [b - a for a, b in zip(self.token_s, self.token_s[1:])]
        return max(gaps) if gaps else None

    def check_complete(self) -> None:
        """A stream that ended early is a failure even when the server flagged nothing."""
        if not self.finish_reason:
            raise StreamError(f"truncated: stream ended without finish_reason after {self.num_output_tokens} tokens")
        if self.num_output_tokens < self.max_tokens:
            raise StreamError(f"truncated: {self.num_output_tokens} of {self.max_tokens} tokens (ignore_eos is set)")

    def record(self) -> dict:
        """One line of the records file: what loadtest.stats needs, in milliseconds (with the class and the priority
        level in a mixed workload)."""

        def ms(seconds):
            return None if seconds is None else round(1000 * seconds, 3)

        return {
            "index": self.index,
            "t_start": self.t_start_unix,
            "ok": self.error is None and not self.cut,
            "error": self.error,
            "cut": self.cut,
            "max_tokens": self.max_tokens,
            "num_input_tokens": self.num_input_tokens,
            "num_output_tokens": self.num_output_tokens,
            "finish_reason": self.finish_reason,
            "ttft_ms": ms(self.ttft_s),
            "tpot_ms": ms(self.tpot_s),
            "itl_max_ms": ms(self.itl_max_s),
            "e2e_ms": ms(self.e2e_s),
            "token_ms": [round(1000 * t, 1) for t in self.token_s],
            **({"class": self.traffic_class, "priority": self.priority} if self.traffic_class else {}),
        }


def meets_slo(record: dict, slo_ttft_ms: float, slo_tpot_ms: float) -> bool:
    """Whether a finished request (a :meth:`Measurement.record`) is within both SLOs: the goodput's requests."""
    return bool(
        record["ok"]
        and record["ttft_ms"] is not None
        and record["ttft_ms"] <= slo_ttft_ms
        and (record["tpot_ms"] or 0.0) <= slo_tpot_ms
    )
