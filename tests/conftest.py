"""Fixtures of both tiers: the SmolLM2 folder and a tiny random Llama; a failing test's report gets the log tail of
every server it used (tests/server_harness.py).

The tiers are folders: tests/unit/ starts no server (`make test-unit`), tests/server/ starts real tritonservers on
free loopback ports (its conftest.py has those fixtures), tests/server/test_containers.py a Docker engine.
"""

from __future__ import annotations

import time

from backend.engine.openmp import set_wait_policy

set_wait_policy()  # NOTE: before torch is imported: the engines built in this process run as the served ones do

import pytest  # noqa: E402

from tests import server_harness  # noqa: E402
from tools.prepare_model import ensure_model  # noqa: E402

_TEST_STARTED = pytest.StashKey[float]()


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real SmolLM2-135M-Instruct HF folder (converted from the GGUF on first use, ~20 s)."""
    return ensure_model(server_harness.SMOLLM2_DIR)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_dir):
    """A deterministic tiny random Llama (float32, SmolLM2 tokenizer and vocabulary) for fast engine tests."""
    return server_harness.make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_dir)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_TEST_STARTED] = time.monotonic()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for title, text in server_harness.log_sections(item.stash.get(_TEST_STARTED, 0.0)):
            report.sections.append((title, text))
