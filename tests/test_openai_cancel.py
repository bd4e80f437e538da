"""A client that goes away frees its request's KV blocks within a step or two, through the OpenAI frontend: mid-stream,
and before a non-streamed answer (which the frontend cancels too). Measured on the tiny random Llama: the tokens the
engine still makes after the disconnect, and the time until ``llm_kv_blocks_used`` is back to 0."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import pytest

from backend.triton.launch_options import free_ports
from frontend.openai.process import FrontendProcess
from loadtest.metrics import model_sample, scrape_metrics
from tests.server_harness import make_repository

MODELS = ("llm_continuous", "llm_dynamic")
MAX_MODEL_LEN = 512
# At most this many tokens after the disconnect: the frontend's and Triton's notice plus a step or two. Polled on the
# old 0.2 s timer alone the tiny model made far more (it steps every few milliseconds).
MAX_TOKENS_AFTER = 12


@pytest.fixture(scope="module")
def triton(triton_server_factory, tiny_llama_dir, tmp_path_factory):
    repo = make_repository(tmp_path_factory.mktemp("repo") / "model_repository",
                           {"max_model_len": str(MAX_MODEL_LEN)}, models=MODELS)
    return triton_server_factory.start(repo, model=tiny_llama_dir)


@pytest.fixture(scope="module")
def frontend(triton, tiny_llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("frontend") / "frontend.log"
    with FrontendProcess(triton.grpc_url, free_ports(1)[0], tiny_llama_dir, log_path=log) as frontend:
        yield frontend


def metric(triton, name: str, model: str) -> float:
    return model_sample(scrape_metrics(triton.metrics_url), name, model)


def post_and_hang_up(frontend, triton, model: str, stream: bool) -> tuple[float, float]:
    """Send a long generation on a raw connection, close it once the request holds KV blocks (streamed: after its
    first chunk); returns (tokens generated after the close, seconds until its KV blocks were free)."""
    body = json.dumps({"model": model, "prompt": "Tell me a long story", "max_tokens": MAX_MODEL_LEN - 32,
                       "ignore_eos": True, "stream": stream}).encode()
    address = urlsplit(frontend.url)
    assert metric(triton, "llm_kv_blocks_used", model) == 0
    with socket.create_connection((address.hostname, address.port), timeout=30) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        if stream:
            assert conn.recv(4096).startswith(b"HTTP/1.1 200")
        deadline = time.monotonic() + 30
        while metric(triton, "llm_kv_blocks_used", model) == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.005)
        generated_at_close = metric(triton, "llm_generation_tokens_total", model)
    closed = time.monotonic()
    while metric(triton, "llm_kv_blocks_used", model) > 0:
        assert time.monotonic() - closed < 5, "the request's KV blocks were not freed"
        time.sleep(0.002)
    freed_after = time.monotonic() - closed
    time.sleep(0.1)  # any step still in flight has counted its tokens
    return metric(triton, "llm_generation_tokens_total", model) - generated_at_close, freed_after


@pytest.mark.server
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not-streamed"])
@pytest.mark.parametrize("model", MODELS)
def test_a_client_that_goes_away_frees_its_kv_blocks_within_a_step_or_two(frontend, triton, model, stream):
    after, freed_after = post_and_hang_up(frontend, triton, model, stream)
    print(f"{model} {'streamed' if stream else 'not streamed'}: {after:.0f} tokens after the disconnect, "
          f"KV blocks free {1000 * freed_after:.0f} ms after it")
    assert after <= MAX_TOKENS_AFTER, f"{after:.0f} tokens were generated after the client went away"
    # and the model serves the next request
    with socket.create_connection((urlsplit(frontend.url).hostname, urlsplit(frontend.url).port), timeout=30) as c:
        body = json.dumps({"model": model, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True}).encode()
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        reply = b"".join(iter(lambda: c.recv(65536), b""))
    assert reply.startswith(b"HTTP/1.1 200") and b'"completion_tokens":3' in reply
