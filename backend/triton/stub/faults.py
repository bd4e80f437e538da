"""Test-only engine faults, armed by a model parameter and an environment variable together."""

from __future__ import annotations

import json
import logging
import os
import threading
import time

from backend.contract.settings import FAULTS_ENV_VAR, FAULTS_RELEASE_ENV_VAR

log = logging.getLogger(__name__)

# A model parameter that is read only when FAULTS_ENV_VAR is "1" (tests inject engine faults).
FAULTS_PARAMETER = "fault_injection"


class InjectedFatalError(BaseException):
    """Test-only: a fault the engine cannot recover from. Not an ``Exception``, so no step's handler catches it."""


class FaultInjector:
    """Test-only engine faults for requests whose prompt contains a marker; the engine's ``fault_hook``.

    Active only when config.pbtxt has the parameter ``fault_injection`` (a JSON object such as
    ``{"step_error": "<<fail-step>>", "fatal_error": "<<kill-engine>>"}``) *and* the server runs with
    ``LLM_TEST_FAULTS=1``. ``step_error`` makes the step that runs the request raise, as a failing forward would:
    that step's requests fail and serving goes on. ``fatal_error`` raises past the step's error handling, as a
    broken engine would: the model must fail every open request and refuse new ones. ``stall`` blocks the step that
    runs the request for good, as a hung forward would: the thread that steps the engine stops (execute() of the
    batcher models, so Triton's queue in front of it grows; llm_continuous's loop) until the process is killed.
    ``slow_step`` makes the step take ``SLOW_STEP_S`` longer, as a long prefill on a busy machine would (longer than
    Triton's sequence idle time in tests of llm_iterative: Triton then ends the sequence while the model holds it).
    ``held_step`` holds the step until the test lets it go: it creates ``<file>.held`` (the step is held) and waits
    until the file ``$LLM_TEST_RELEASE`` names exists, for at most ``HOLD_LIMIT_S``; a test then orders what happens
    during a step by events, not by sleeps that a loaded machine outlasts.
    """

    KINDS = ("step_error", "fatal_error", "stall", "slow_step", "held_step")
    SLOW_STEP_S = 1.0
    HOLD_LIMIT_S = 120.0
    HOLD_POLL_S = 0.01

    def __init__(self, markers: dict[str, str]) -> None:
        unknown = sorted(set(markers) - set(self.KINDS))
        if unknown or not all(isinstance(m, str) and m for m in markers.values()):
            raise ValueError(f"{FAULTS_PARAMETER} must map {' / '.join(self.KINDS)} to non-empty marker strings")
        self.markers = markers
        self._armed: dict[str, str] = {}  # request id -> kind; written by execute(), read by the engine thread
        self._lock = threading.Lock()
        self._never = threading.Event()  # what a stalled step waits for

    @classmethod
    def from_config(cls, model_config: dict) -> FaultInjector | None:
        raw = model_config.get("parameters", {}).get(FAULTS_PARAMETER, {}).get("string_value", "")
        if not raw:
            return None
        if os.environ.get(FAULTS_ENV_VAR) != "1":
            log.warning("ignoring the %s parameter: it is read only when %s=1", FAULTS_PARAMETER, FAULTS_ENV_VAR)
            return None
        try:
            markers = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{FAULTS_PARAMETER} is not valid JSON: {exc.msg}") from None
        return cls(markers)

    def watch(self, request_id: str, prompt: str) -> None:
        for kind, marker in self.markers.items():
            if marker in prompt:
                with self._lock:
                    self._armed[request_id] = kind

    def __call__(self, requests: list) -> None:
        with self._lock:
            hits = {r.request_id: self._armed.pop(r.request_id) for r in requests if r.request_id in self._armed}
        if "stall" in hits.values():
            log.warning("injected stall: this step never returns (requests %s)", sorted(hits))
            self._never.wait()
        if "slow_step" in hits.values():
            time.sleep(self.SLOW_STEP_S)
        if "held_step" in hits.values():
            self._hold(sorted(hits))
        hits = {rid: kind for rid, kind in hits.items() if kind not in ("slow_step", "held_step")}
        if "fatal_error" in hits.values():
            raise InjectedFatalError(f"injected fatal engine fault (requests {sorted(hits)})")
        if hits:
            raise RuntimeError(f"injected step fault (requests {sorted(hits)})")

    def _hold(self, request_ids: list[str]) -> None:
        release = os.environ.get(FAULTS_RELEASE_ENV_VAR, "")
        if not release:
            log.warning("held_step without %s: the step goes on at once", FAULTS_RELEASE_ENV_VAR)
            return
        with open(release + ".held", "w"):
            pass
        deadline = time.monotonic() + self.HOLD_LIMIT_S
        while not os.path.exists(release):
            if time.monotonic() > deadline:
                log.warning("held_step: %s did not appear within %.0f s; the step goes on (requests %s)",
                            release, self.HOLD_LIMIT_S, request_ids)
                return
            time.sleep(self.HOLD_POLL_S)
