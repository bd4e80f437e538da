"""Whether Triton answers, known before a request is sent: a probe in the background, so that while Triton is away
(dead, or hung: a crashed process whose threads all sleep, a SIGSTOPped one) a new request is refused with 503 at
once instead of waiting on a server that will never answer, and served again as soon as Triton is back.

Every ``PROBE_INTERVAL_S`` the probe asks Triton's gRPC ``ServerLive`` with a ``PROBE_TIMEOUT_S`` deadline. A refused
connection (nothing listens: the process is gone or restarting) makes Triton away at once; a probe that times out
only after ``MIN_TIMED_OUT`` in a row, so that one slow answer on a busy machine refuses nothing. The first answer
after that makes Triton present again.

NOTE: gRPC's channel reconnects by itself after its peer went away, but with exponential backoff: measured here, a
channel polled every second through a 27-s restart answered again only 17 s after the server was back. So the probe
uses a channel of its own, made anew after every failure, and a Triton that came back from a refused connection (a
new process) gets a new :class:`TritonBridge` too (``on_back``): its old channel's streams died with the old process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import grpc
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

log = logging.getLogger("frontend.openai")

PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 2.0
MIN_TIMED_OUT = 2
_REFUSED = str(grpc.StatusCode.UNAVAILABLE)


class TritonHealth:
    """What the background probe of Triton at ``url`` found last: :attr:`away` (None while Triton answers), why
    (:attr:`reason`), and since when."""

    def __init__(self, url: str, interval: float = PROBE_INTERVAL_S, timeout: float = PROBE_TIMEOUT_S,
                 min_timed_out: int = MIN_TIMED_OUT) -> None:
        self.url, self.interval, self.timeout, self.min_timed_out = url, interval, timeout, min_timed_out
        self.away_since: float | None = None  # time.monotonic() of the first failed probe, while Triton is away
        self.reason = ""
        self._num_timed_out = 0
        self._failing_since: float | None = None  # the first failed probe of the run
        self._refused = False  # a connection was refused while away: Triton is back as a new process

    @property
    def away(self) -> bool:
        return self.away_since is not None

    def why_away(self) -> str:
        seconds = 0.0 if self.away_since is None else time.monotonic() - self.away_since
        return f"Triton at {self.url} {self.reason} (for {seconds:.0f} s)"

    def observe(self, failure: str | None, started: float) -> bool:
        """One probe's outcome (``failure``: None when Triton answered, else its gRPC status); True when Triton has
        just come back as a new process (its connections must be made anew)."""
        if failure is None:
            back = self.away and self._refused
            if self.away:
                log.warning("Triton at %s answers again after %.0f s", self.url, time.monotonic() - self.away_since)
            self.away_since, self.reason, self._num_timed_out, self._refused = None, "", 0, False
            self._failing_since = None
            return back
        refused = failure == _REFUSED
        if self._failing_since is None:
            self._failing_since = started
        self._num_timed_out = 0 if refused else self._num_timed_out + 1
        self._refused |= refused
        if not self.away and (refused or self._num_timed_out >= self.min_timed_out):
            self.away_since = self._failing_since
            log.warning("Triton at %s is away (%s): new requests are answered 503 until it is back", self.url,
                        failure)
        if self.away:
            self.reason = ("refuses connections: it is down or restarting" if refused else
                           f"answers nothing within {self.timeout:g} s: it is hung")
        return False

    async def run(self, on_back: Callable[[], Awaitable[None]]) -> None:
        """Probe until cancelled; await ``on_back()`` whenever Triton came back as a new process."""
        client = None
        try:
            while True:
                started = time.monotonic()
                client = client or grpcclient.InferenceServerClient(self.url)
                failure = await self._probe(client)
                if failure is not None:  # NOTE: a new channel next time, so its reconnection backoff never delays us
                    await _close(client)
                    client = None
                if self.observe(failure, started):
                    await on_back()
                await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))
        finally:
            if client is not None:
                await _close(client)

    async def _probe(self, client) -> str | None:
        try:
            return None if await client.is_server_live(client_timeout=self.timeout) else "not live"
        except InferenceServerException as exc:
            return exc.status() or str(exc)


async def _close(client) -> None:
    try:
        await client.close()
    except Exception:  # noqa: BLE001 (a channel that failed may fail to close; it is dropped either way)
        pass
