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


@pytest.fixture(scope="session")
def openai_triton(triton_server_factory, tiny_llama_dir, tmp_path_factory):
    """The server behind the OpenAI frontend's tests (test_openai.py, test_openai_responses.py): started once for
    both modules, which run one after the other."""
    from tests.server.test_openai import openai_repository  # NOTE: here: the server's settings are that module's

    repo = openai_repository(tmp_path_factory.mktemp("openai-repo") / "model_repository")
    return triton_server_factory.start(repo, model=tiny_llama_dir)


@pytest.fixture(scope="module")
def frontend(triton, tiny_llama_dir, tmp_path_factory):
    """The OpenAI frontend (its own process, as the CLI starts it) in front of the module's ``triton`` server."""
    from tests.server.test_openai import start_frontend  # NOTE: here: the unit tier never imports the SDK tests

    frontend = start_frontend(triton.grpc_url, tiny_llama_dir, tmp_path_factory.mktemp("frontend"))
    yield frontend
    assert frontend.stop() == 0, "SIGTERM must stop the frontend cleanly"


@pytest.fixture(scope="module")
def sdk(frontend):
    """The official ``openai`` SDK on ``frontend``, without retries (a retry would hide an error)."""
    import openai

    return openai.OpenAI(base_url=f"{frontend.url}/v1", api_key="unused", max_retries=0, timeout=120)
