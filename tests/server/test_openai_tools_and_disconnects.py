"""The OpenAI frontend with clients people already have, and with clients that go away, on the tiny random Llama
(SmolLM2's tokenizer and chat template) behind llm_dynamic and llm_continuous:

- NVIDIA's benchmark clients in their OpenAI modes: aiperf in its default mode (chat) and genai-perf
  ``--endpoint-type chat``, each asked for fixed output lengths, which the server's own count must show exactly. aiperf
  is told to count with the server's ``usage`` (``--use-server-token-count``), so its count is exact too; genai-perf
  re-tokenizes the text it gets, and the tiny random model's text re-tokenizes to a CPU-dependent count (13.1 tokens
  per 12 once), so only a sanity bound is asserted on its count. aiperf comes from ``make aiperf-venv``
  (.venv-aiperf), genai-perf from ``make genai-perf-venv`` (.venv-genai-perf; ``make test`` builds both); where
  genai-perf could not be built, its test skips with the reason the build gave.
- genai-perf in its kserve mode against llm_iterative: perf_analyzer's own sequences of several requests get an error
  at once (Triton 2.51 cannot serve them there): the model's, which says what to send, or Triton's own refusal of a
  request without START, when the client sends it after Triton has closed the sequence (a race the load on the
  machine decides); one request per sequence is served.
- A client that goes away frees its request's KV blocks within a step or two: mid-stream, and before a non-streamed
  answer (which the frontend cancels too). Measured as the engine steps the model still runs after the disconnect
  (``llm_batch_size_count``: the request is alone, so one step is one of its tokens), and the time until
  ``llm_kv_blocks_used`` is back to 0. (Not ``llm_generation_tokens_total``: a request's tokens are counted when it
  finishes, those it made before the disconnect included.)
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from backend.triton.launcher.launch_options import free_ports
from frontend.openai.process import FrontendProcess
from tests.metrics_port import model_sample, scrape_metrics
from tests.server_harness import REPO_ROOT, make_repository

pytestmark = pytest.mark.server
MODELS = ("llm_dynamic", "llm_continuous")  # a run-to-completion batcher and an iteration-level one
SERVED = (*MODELS, "llm_iterative")
AIPERF = REPO_ROOT / ".venv-aiperf" / "bin" / "aiperf"
GENAI_PERF_VENV = REPO_ROOT / ".venv-genai-perf"
REQUESTS, CONCURRENCY, INPUT_TOKENS, OUTPUT_TOKENS = 8, 2, 16, 12
# vLLM's extra parameters, which the frontend honours: every answer is exactly OUTPUT_TOKENS long.
EXACT_LENGTH = ["ignore_eos:true", f"min_tokens:{OUTPUT_TOKENS}"]
MAX_MODEL_LEN = 512
TOOL_TIMEOUT_S = 240  # a tool's run here takes seconds to a minute on a loaded machine
# At most this many engine steps after a disconnect: a tenth of the 480 tokens the request asks for, so a request that
# is not cancelled fails. How soon the cancel lands (a step or two here) is a timing, printed, not asserted.
MAX_STEPS_AFTER = 48


@pytest.fixture(scope="module")
def server(triton_server_factory, tiny_llama_dir, tmp_path_factory):
    repo = make_repository(tmp_path_factory.mktemp("repo") / "model_repository",
                           {"max_model_len": str(MAX_MODEL_LEN)}, models=SERVED)
    return triton_server_factory.start(repo, model=tiny_llama_dir)


@pytest.fixture(scope="module")
def frontend(server, tiny_llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("frontend") / "frontend.log"
    with FrontendProcess(server.grpc_url, free_ports(1)[0], tiny_llama_dir, log_path=log) as frontend:
        yield frontend


def generated_tokens(server, model: str) -> float:
    return scrape_metrics(server.metrics_url).get(f'llm_generation_tokens_total{{model="{model}"}}', 0.0)


def run_tool(command: list[str], server, model: str, expect_ok: bool = True) -> float:
    """Run ``command`` (``expect_ok``: it must succeed); returns the tokens the model generated meanwhile (the
    server's own count), and the tool's output as ``run_tool.output``."""
    before = generated_tokens(server, model)
    # NOTE: both tools refuse a local tokenizer folder while the Hugging Face offline switches are set.
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env["PATH"] = f"{Path(command[0]).parent}{os.pathsep}{env.get('PATH', '')}"  # genai-perf runs perf_analyzer
    # A session of its own: on a timeout the tool's children (genai-perf's perf_analyzer) end with it.
    tool = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        stdout, stderr = tool.communicate(timeout=TOOL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(tool.pid, signal.SIGKILL)
        stdout, stderr = tool.communicate()
        # Whose hang it was: the server's, when it still holds a request (its gauges), or the tool's own.
        held = ("pending_request_count", "num_requests", "kv_blocks_used")
        gauges = {name: value for name, value in scrape_metrics(server.metrics_url).items()
                  if f'model="{model}"' in name and any(gauge in name for gauge in held)}
        pytest.fail(f"{Path(command[0]).name} did not end within {TOOL_TIMEOUT_S} s; the server's gauges then: "
                    f"{gauges}\n{stdout[-3000:]}{stderr[-3000:]}")
    run_tool.output = stdout + stderr
    assert (tool.returncode == 0) == expect_ok, stdout[-3000:] + stderr[-3000:]
    return generated_tokens(server, model) - before


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", MODELS)
def test_aiperf_in_its_default_chat_mode_gets_exact_output_lengths(frontend, server, model, smollm2_dir, tmp_path):
    assert AIPERF.exists(), "aiperf is not installed: `make aiperf-venv` (make test does it) creates .venv-aiperf"
    extra = [arg for value in EXACT_LENGTH for arg in ("--extra-inputs", value)]
    command = [str(AIPERF), "profile", "-m", model, "-u", frontend.url, "--streaming", "--tokenizer", str(smollm2_dir),
               "--isl", str(INPUT_TOKENS), "--isl-stddev", "0", "--osl", str(OUTPUT_TOKENS), "--osl-stddev", "0",
               "--concurrency", str(CONCURRENCY), "--request-count", str(REQUESTS),
               "--num-dataset-entries", str(REQUESTS), "--random-seed", "0", *extra,
               "--use-server-token-count", "--no-server-metrics", "--no-gpu-telemetry", "--ui", "simple",
               "--artifact-dir", str(tmp_path)]
    assert run_tool(command, server, model) == REQUESTS * OUTPUT_TOKENS  # exactly --osl tokens each
    summary = json.loads((tmp_path / "profile_export_aiperf.json").read_text())
    assert summary["request_count"]["avg"] == REQUESTS and summary.get("error_request_count", {}).get("avg", 0) == 0
    assert summary["output_sequence_length"]["avg"] == OUTPUT_TOKENS  # the server's usage, read by aiperf
    assert summary["time_to_first_token"]["avg"] > 0


def genai_perf() -> str:
    unavailable = GENAI_PERF_VENV / "UNAVAILABLE"
    if unavailable.exists():
        reason = f"genai-perf could not be built here: {unavailable.read_text().strip()}"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    binary = GENAI_PERF_VENV / "bin" / "genai-perf"
    assert binary.exists(), "genai-perf is not installed: `make genai-perf-venv` (make test does it)"
    return str(binary)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", MODELS)
def test_genai_perf_chat_gets_exact_output_lengths(frontend, server, model, smollm2_dir, tmp_path):
    binary = genai_perf()
    extra = [arg for value in EXACT_LENGTH for arg in ("--extra-inputs", value)]
    command = [binary, "profile", "-m", model, "--endpoint-type", "chat", "--streaming",
               "-u", frontend.url.removeprefix("http://"), "--tokenizer", str(smollm2_dir),
               "--synthetic-input-tokens-mean", str(INPUT_TOKENS), "--synthetic-input-tokens-stddev", "0",
               "--output-tokens-mean", str(OUTPUT_TOKENS), "--output-tokens-stddev", "0",
               "--concurrency", str(CONCURRENCY), "--request-count", str(REQUESTS), "--warmup-request-count", "0",
               "--random-seed", "0", *extra, "--artifact-dir", str(tmp_path)]
    assert run_tool(command, server, model) == REQUESTS * OUTPUT_TOKENS
    exports = list(tmp_path.rglob("*genai_perf.json"))
    assert exports, f"no genai-perf export in {tmp_path}"
    summary = json.loads(exports[0].read_text())
    assert summary["request_count"]["avg"] == REQUESTS
    # Re-tokenized by genai-perf: decoded text does not always split back into the tokens it came from.
    assert OUTPUT_TOKENS / 2 <= summary["output_sequence_length"]["avg"] <= OUTPUT_TOKENS * 2


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_genai_perf_kserve_on_llm_iterative_one_request_per_sequence(server, smollm2_dir, tmp_path):
    """perf_analyzer's default sequences (about 20 requests, START on the first, END on the last) get an error at
    once; with one request per sequence every answer is whole."""
    base = [genai_perf(), "profile", "-m", "llm_iterative", "--endpoint-type", "kserve", "--backend", "vllm",
            "--streaming", "--output-tokens-mean-deterministic", "-u", server.grpc_url, "--tokenizer", str(smollm2_dir),
            "--synthetic-input-tokens-mean", str(INPUT_TOKENS), "--synthetic-input-tokens-stddev", "0",
            "--output-tokens-mean", str(OUTPUT_TOKENS), "--concurrency", str(CONCURRENCY),
            "--request-count", str(REQUESTS), "--warmup-request-count", "0", "--random-seed", "0"]
    started = time.monotonic()
    run_tool([*base, "--artifact-dir", str(tmp_path / "sequences")], server, "llm_iterative", expect_ok=False)
    refusals = ("--sequence-length 1", "must specify the START flag on the first request of the sequence")
    assert any(refusal in run_tool.output for refusal in refusals), run_tool.output[-4000:]
    assert time.monotonic() - started < 120  # an error at once, not a hang until a timeout
    served = run_tool([*base, "--artifact-dir", str(tmp_path / "single"), "--", "--sequence-length", "1"], server,
                      "llm_iterative")
    assert served == REQUESTS * OUTPUT_TOKENS


# ---- clients that go away ---------------------------------------------------------------------------------------


STEPS = "llm_batch_size_count"  # one observation per forward step


def metric(server, name: str, model: str) -> float:
    return model_sample(scrape_metrics(server.metrics_url), name, model)


def post_and_hang_up(frontend, server, model: str, stream: bool) -> tuple[float, float]:
    """Send a long generation on a raw connection, close it once the request holds KV blocks (streamed: after its
    first chunk); returns (engine steps after the close, seconds until its KV blocks were free)."""
    body = json.dumps({"model": model, "prompt": "Tell me a long story", "max_tokens": MAX_MODEL_LEN - 32,
                       "ignore_eos": True, "stream": stream}).encode()
    address = urlsplit(frontend.url)
    # NOTE: the request before may have been answered before the step that ended it published the gauge.
    idle_by = time.monotonic() + 5
    while metric(server, "llm_kv_blocks_used", model) != 0:
        assert time.monotonic() < idle_by, "the model still holds KV blocks from an earlier request"
        time.sleep(0.01)
    with socket.create_connection((address.hostname, address.port), timeout=30) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        if stream:
            assert conn.recv(4096).startswith(b"HTTP/1.1 200")
        deadline = time.monotonic() + 30
        while metric(server, "llm_kv_blocks_used", model) == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.005)
        steps_at_close = metric(server, STEPS, model)
    closed = time.monotonic()
    while metric(server, "llm_kv_blocks_used", model) > 0:
        assert time.monotonic() - closed < 5, "the request's KV blocks were not freed"
        time.sleep(0.002)
    freed_after = time.monotonic() - closed
    time.sleep(0.1)  # any step still in flight has been counted
    return metric(server, STEPS, model) - steps_at_close, freed_after


@pytest.mark.server
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not-streamed"])
@pytest.mark.parametrize("model", MODELS)
def test_a_client_that_goes_away_frees_its_kv_blocks_within_a_step_or_two(frontend, server, model, stream):
    after, freed_after = post_and_hang_up(frontend, server, model, stream)
    print(f"{model} {'streamed' if stream else 'not streamed'}: {after:.0f} steps after the disconnect, "
          f"KV blocks free {1000 * freed_after:.0f} ms after it")
    assert after <= MAX_STEPS_AFTER, f"the engine ran {after:.0f} steps after the client went away"
    # and the model serves the next request
    with socket.create_connection((urlsplit(frontend.url).hostname, urlsplit(frontend.url).port), timeout=30) as c:
        body = json.dumps({"model": model, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True}).encode()
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        reply = b"".join(iter(lambda: c.recv(65536), b""))
    assert reply.startswith(b"HTTP/1.1 200") and b'"completion_tokens":3' in reply
