"""The cancel storm's bookkeeping (loadtest/storm.py) against a fake server: every request accounted for once, a crash
or a hang noticed, the server started again and the recovery kept; the record's row. No server: milliseconds."""

from __future__ import annotations

import threading

import pytest

from backend.triton.launcher import watchdog
from loadtest import storm

KNOWN_SITE = "triton::server::grpc::ModelStreamInferHandler::Process(bool)"


class FakeTriton:
    def __init__(self) -> None:
        self.returncode: int | None = None
        self.hung = False
        self.metrics_url = "http://127.0.0.1:1/metrics"

    @property
    def is_running(self) -> bool:
        return self.returncode is None

    def liveness_urls(self) -> dict[str, str]:
        return {"/v2/health/live": "http://127.0.0.1:1/v2/health/live"}

    def kill(self) -> None:
        self.returncode = -9

    def wait(self, timeout=None) -> int | None:
        return self.returncode


class FakeServed:
    """What the storm asks of ``loadtest.served.Served``."""

    def __init__(self) -> None:
        self.server, self.frontend = FakeTriton(), None
        self.grpc_url, self.openai_url = "127.0.0.1:1", None
        self.restarts = 0

    @property
    def is_running(self) -> bool:
        return self.server.is_running

    def restart(self) -> float:
        self.restarts += 1
        self.server = FakeTriton()
        return 0.01

    def crash_site(self) -> str:
        return KNOWN_SITE


class FakeProbe:
    """A liveness probe that reports a hang while its server is hung."""

    def __init__(self, served: FakeServed) -> None:
        self.served = served

    def hang(self, now: float):
        return watchdog.Hang("/v2/health/live", 16.0, 3) if self.served.server.hung else None


def run_storm(monkeypatch, fall: str, num_requests: int = 60) -> tuple[storm.Storm, FakeServed]:
    """A storm of ``num_requests`` fake requests whose 20th makes the server ``fall`` ("crash" or "hang")."""
    served = FakeServed()
    monkeypatch.setattr(watchdog, "INTERVAL_S", 0.02)
    monkeypatch.setattr(watchdog, "probe_liveness", lambda urls, bound, done: [FakeProbe(served)])
    args = storm.parse_args(["--requests", str(num_requests), "--clients", "4", "--stall-timeout", "0",
                             "--request-timeout", "5"])
    the_storm = storm.Storm(served, args)
    numbers, lock = iter(range(num_requests)), threading.Lock()

    def request(sdk, model, prompt, num_chunks):
        with lock:
            number = next(numbers)
        if number == 20:
            if fall == "crash":
                served.server.returncode = -11
            else:
                served.server.hung = True
        if not served.server.is_running or served.server.hung:
            return "lost", "StatusCode.UNAVAILABLE: Socket closed"
        return ("completed", "") if num_chunks == 8 else ("disconnected", "")

    monkeypatch.setattr(the_storm, "grpc_request", request)
    monkeypatch.setattr(storm, "FALL_GRACE_S", 2.0)
    the_storm.run()
    return the_storm, served


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fall", ["crash", "hang"])
def test_a_fall_is_noticed_the_server_restarted_and_every_request_accounted_for(monkeypatch, fall):
    the_storm, served = run_storm(monkeypatch, fall)
    totals = the_storm.ledger.totals()
    assert the_storm.ledger.sent == 60 and sum(totals.values()) == 60 and the_storm.clients_still_running == 0
    assert totals["lost"] == 0 and totals["server_fell"] >= 1 and totals["disconnected"] >= 1
    assert served.restarts == 1 and the_storm.failed is None
    [incident] = the_storm.incidents
    assert incident.kind == fall and incident.recovery_s is not None and 20 <= incident.after_requests <= 25
    assert incident.known_frontend_crash == (fall == "crash")
    assert (KNOWN_SITE in incident.detail) if fall == "crash" else ("answered nothing" in incident.detail)


def report(**changes) -> dict:
    return {"protocol": "grpc", "models": ["llm_continuous"], "clients": 8, "requests": 100, "duration_s": 10.0,
            "req_per_s": 10.0, "outcomes": {"disconnected": 90, "completed": 2, "errors": 3, "server_fell": 5,
                                            "lost": 0},
            "incidents": [{"kind": "crash", "at_s": 4.0, "after_requests": 40, "detail": "exit status -11",
                           "known_frontend_crash": True, "recovery_s": 12.5}],
            "after": {"llm_continuous": {"nv_inference_pending_request_count": 0.0, "llm_kv_blocks_used": 0.0}},
            "stop": {"exit_status": 0, "forced_models": []}, "clients_still_running": 0, **changes}


def test_the_storms_row_and_verdict():
    row = storm.storm_row(report())
    assert row["crashes"] == 1 and row["hangs"] == 0 and row["crash_rate"] == "1 in 90"
    assert row["recovery_s"] == 12.5 and row["pending_after"] == 0 and row["forced"] == "none"
    checks = storm.verdict(report())
    assert [name for name, ok in checks.items() if not ok] == ["no_crash"]
    calm = report(incidents=[], outcomes={**report()["outcomes"], "server_fell": 0, "disconnected": 95})
    assert all(storm.verdict(calm).values()) and storm.storm_row(calm)["crash_rate"] == "none in 95"
    short = report(outcomes={**report()["outcomes"], "lost": 1, "disconnected": 88})
    assert not storm.verdict(short)["every_request_accounted_for"] and not storm.verdict(short)["no_request_lost"]
