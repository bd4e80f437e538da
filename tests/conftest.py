"""Shared fixtures: real tritonservers on free ports, the SmolLM2 folder, a tiny random Llama.

The helpers live in tests/server_harness.py; a failing test's report gets the log tail of every server it used.
"""

from __future__ import annotations

import time

from backend.engine.openmp import set_wait_policy

set_wait_policy()  # NOTE: before torch is imported: the engines built in this process run as the served ones do

import pytest  # noqa: E402

from backend.tools.prepare_model import ensure_model  # noqa: E402
from tests import server_harness  # noqa: E402

_TEST_STARTED = pytest.StashKey[float]()


@pytest.fixture(scope="session")
def triton_server_factory(tmp_path_factory) -> server_harness.ServerFactory:
    """``factory.start(model_repository, model=None, env=None, extra_args=()) -> TritonServer`` (ready)."""
    factory = server_harness.ServerFactory(tmp_path_factory.mktemp("tritonserver-logs"))
    yield factory
    factory.stop_all()


@pytest.fixture
def start_server(triton_server_factory):
    """Like ``triton_server_factory.start``, but the servers stop when the test ends."""
    started = []

    def start(model_repository, **kwargs):
        server = triton_server_factory.start(model_repository, **kwargs)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


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
