"""Fixtures that start real tritonservers on free loopback ports (tests/server_harness.py); the unit tier has none."""

from __future__ import annotations

import pytest

from tests import server_harness


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
