"""The test-only fault injector: ``held_step`` holds a step until the release file exists, and says it is held."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from backend.contract.settings import FAULTS_RELEASE_ENV_VAR
from backend.triton.stub.faults import FaultInjector


def step_on_thread(faults: FaultInjector, request_id: str) -> threading.Thread:
    thread = threading.Thread(target=faults, args=([SimpleNamespace(request_id=request_id)],), daemon=True)
    thread.start()
    return thread


def test_a_held_step_waits_for_the_release_file_and_only_for_its_own_request(tmp_path, monkeypatch):
    release = tmp_path / "release"
    monkeypatch.setenv(FAULTS_RELEASE_ENV_VAR, str(release))
    faults = FaultInjector({"held_step": "<<hold>>"})
    faults.watch("other", "an ordinary prompt")
    step_on_thread(faults, "other").join(timeout=10)  # a step without the marker is not held
    assert not (tmp_path / "release.held").exists()

    faults.watch("held", "please <<hold>>")
    thread = step_on_thread(faults, "held")
    deadline = time.monotonic() + 30
    while not (tmp_path / "release.held").exists():  # it says it is held...
        assert time.monotonic() < deadline, "the step never said it was held"
        time.sleep(0.01)
    thread.join(timeout=0.2)
    assert thread.is_alive()  # ...and stays held
    release.touch()  # ...until the release file exists; then the step goes on without an error
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_a_held_step_without_a_release_file_named_goes_on_at_once(monkeypatch):
    monkeypatch.delenv(FAULTS_RELEASE_ENV_VAR, raising=False)
    faults = FaultInjector({"held_step": "<<hold>>"})
    faults.watch("held", "<<hold>>")
    faults([SimpleNamespace(request_id="held")])  # returns, and raises nothing


def test_unknown_fault_kinds_are_refused():
    with pytest.raises(ValueError, match="held_step"):
        FaultInjector({"hold": "<<x>>"})
