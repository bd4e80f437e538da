"""The models of one server share the cores (``backend/engine/shared_cores.py``): the launcher gives the server its
registry, two models under load at once see each other (``llm_engines_busy``), both finish their requests, and the
registry goes when the server stops. The tiny Llama, on 127.0.0.1."""

from __future__ import annotations

import threading

import pytest

from backend.contract.settings import SHARED_CORES_ENV_VAR
from client.grpc_stream import generate
from loadtest.metrics import parse_prometheus, scrape
from tests.server_harness import make_repository

MODELS = ("llm_dynamic", "llm_continuous")


@pytest.mark.server
@pytest.mark.timeout(300)
def test_two_models_under_load_at_once_see_each_other_and_both_finish(start_server, tiny_llama_dir, tmp_path):
    server = start_server(make_repository(tmp_path / "repo", models=MODELS), model=tiny_llama_dir)
    registry = server._shared_cores
    assert registry is not None and registry.exists()
    assert server.environment()[SHARED_CORES_ENV_VAR] == str(registry)
    busiest: dict[str, float] = dict.fromkeys(MODELS, 0.0)
    streams = []
    done = threading.Event()

    def user(model: str) -> None:
        for _ in range(3):
            streams.append(generate(server.grpc_url, model, "Once upon a time", timeout=120, max_tokens=96,
                                    ignore_eos=True, stream=True))

    def watch() -> None:
        while not done.wait(0.1):
            for s in parse_prometheus(scrape(server.metrics_url)):
                if s.name == "llm_engines_busy" and s.labels.get("model") in busiest:
                    busiest[s.labels["model"]] = max(busiest[s.labels["model"]], s.value)

    users = [threading.Thread(target=user, args=(m,)) for m in MODELS for _ in range(2)]
    watcher = threading.Thread(target=watch)
    watcher.start()
    for thread in users:
        thread.start()
    for thread in users:
        thread.join()
    done.set()
    watcher.join()
    assert len(streams) == 12 and all(s.error is None and len(s.token_ids) == 96 for s in streams)
    assert busiest == dict.fromkeys(MODELS, 2.0)  # each stepped while the other did, and saw it
    server.stop()
    assert not registry.exists()
