"""NVIDIA's benchmark clients in their OpenAI modes against the OpenAI frontend: aiperf in its default mode (chat)
and genai-perf ``--endpoint-type chat``, each asked for fixed output lengths, which the server's own count must show
exactly (the tools re-tokenize the text they get, and may count a token more or less). On the tiny random Llama
(SmolLM2's tokenizer and chat template), so that lengths, not text, are what is checked.

aiperf comes from ``make aiperf-venv`` (.venv-aiperf), genai-perf from ``make genai-perf-venv`` (.venv-genai-perf;
``make test`` builds both). Where genai-perf could not be built, its test skips with the reason the build gave.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from backend.triton.launch_options import free_ports
from frontend.openai.process import FrontendProcess
from loadtest.metrics import scrape_metrics
from tests.server_harness import REPO_ROOT, make_repository

pytestmark = [pytest.mark.server, pytest.mark.slow]
MODELS = ("llm_dynamic", "llm_continuous")  # a run-to-completion batcher and an iteration-level one
AIPERF = REPO_ROOT / ".venv-aiperf" / "bin" / "aiperf"
GENAI_PERF_VENV = REPO_ROOT / ".venv-genai-perf"
REQUESTS, CONCURRENCY, INPUT_TOKENS, OUTPUT_TOKENS = 8, 2, 16, 12
# vLLM's extra parameters, which the frontend honours: every answer is exactly OUTPUT_TOKENS long.
EXACT_LENGTH = [f"ignore_eos:true", f"min_tokens:{OUTPUT_TOKENS}"]


@pytest.fixture(scope="module")
def server(triton_server_factory, tiny_llama_dir, tmp_path_factory):
    repo = make_repository(tmp_path_factory.mktemp("repo") / "model_repository", models=MODELS)
    return triton_server_factory.start(repo, model=tiny_llama_dir)


@pytest.fixture(scope="module")
def frontend(server, tiny_llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("frontend") / "frontend.log"
    with FrontendProcess(server.grpc_url, free_ports(1)[0], tiny_llama_dir, log_path=log) as frontend:
        yield frontend


def generated_tokens(server, model: str) -> float:
    return scrape_metrics(server.metrics_url).get(f'llm_generation_tokens_total{{model="{model}"}}', 0.0)


def run_tool(command: list[str], server, model: str) -> float:
    """Run ``command``; returns the tokens the model generated meanwhile (the server's own count)."""
    before = generated_tokens(server, model)
    # NOTE: both tools refuse a local tokenizer folder while the Hugging Face offline switches are set.
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=500, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return generated_tokens(server, model) - before


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", MODELS)
def test_aiperf_in_its_default_chat_mode_gets_exact_output_lengths(frontend, server, model, smollm2_dir, tmp_path):
    assert AIPERF.exists(), "aiperf is not installed: `make aiperf-venv` (make test does it) creates .venv-aiperf"
    extra = [arg for value in EXACT_LENGTH for arg in ("--extra-inputs", value)]
    command = [str(AIPERF), "profile", "-m", model, "-u", frontend.url, "--streaming", "--tokenizer", str(smollm2_dir),
               "--isl", str(INPUT_TOKENS), "--isl-stddev", "0", "--osl", str(OUTPUT_TOKENS), "--osl-stddev", "0",
               "--concurrency", str(CONCURRENCY), "--request-count", str(REQUESTS),
               "--num-dataset-entries", str(REQUESTS), "--random-seed", "0", *extra,
               "--no-server-metrics", "--no-gpu-telemetry", "--ui", "simple", "--artifact-dir", str(tmp_path)]
    assert run_tool(command, server, model) == REQUESTS * OUTPUT_TOKENS  # exactly --osl tokens each
    summary = json.loads((tmp_path / "profile_export_aiperf.json").read_text())
    assert summary["request_count"]["avg"] == REQUESTS and summary.get("error_request_count", {}).get("avg", 0) == 0
    assert abs(summary["output_sequence_length"]["avg"] - OUTPUT_TOKENS) <= 1  # re-tokenized by aiperf
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
    assert abs(summary["output_sequence_length"]["avg"] - OUTPUT_TOKENS) <= 1  # re-tokenized by genai-perf
