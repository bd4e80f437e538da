"""NVIDIA's benchmark clients against every model: the exact requests genai-perf and aiperf send, and aiperf itself.

The tensors and bodies below are what genai-perf 0.0.16 (perf_analyzer 2.60.0) and aiperf 0.13.0 were seen sending
to this server (names, datatypes, shapes, string-valued numbers); README.md's "Benchmark with NVIDIA's tools" shows
the commands. Runs on the tiny random Llama (SmolLM2's tokenizer) so that lengths, not text, are what is checked.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import threading

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient

from tests.metrics_port import scrape_metrics
from tests.server_harness import REPO_ROOT, make_repository

pytestmark = pytest.mark.server
MODELS = ("llm_static", "llm_dynamic", "llm_iterative", "llm_continuous")
BATCHED = {"llm_static": True, "llm_dynamic": True, "llm_iterative": True, "llm_continuous": False}
# perf_analyzer sends every request to a sequence-batched model (llm_iterative) as a sequence of its own: a
# correlation id (counting from 1, --sequence-id-range) with the START and END flags.
SEQUENCE_MODELS = {"llm_iterative"}
_sequence_ids = itertools.count(1)
OUTPUTS = ("finish_reason", "num_input_tokens", "num_output_tokens", "output_ids", "text_output")
PROMPT = " heavy bier NURSE O Tybalt Tybalt the best friend I had O courteous Tybalt honest gentleman"
AIPERF = REPO_ROOT / ".venv-aiperf" / "bin" / "aiperf"


@pytest.fixture(scope="module")
def server(triton_server_factory, tiny_llama_dir, tmp_path_factory):
    repo = make_repository(tmp_path_factory.mktemp("repo") / "model_repository", models=MODELS)
    return triton_server_factory.start(repo, model=tiny_llama_dir)


# ---- perf_analyzer's gRPC stream, tensor by tensor ---------------------------------------------------------------


def stream_infer(server, model: str, tensors: list[tuple[str, str, list]],
                 connected: threading.Barrier | None = None) -> dict:
    """One request on a gRPC stream as perf_analyzer sends it: ``tensors`` are (name, datatype, values) with the
    model's batch dimension added, all five outputs requested, empty final response on, and to a sequence-batched
    model a sequence of its own (a correlation id, START and END). Returns what came back. With ``connected``, the
    request goes out once every thread that shares the barrier has its stream open."""
    lead = (1,) if BATCHED[model] else ()
    dtypes = {"BYTES": np.object_, "BOOL": np.bool_, "INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32}
    inputs = []
    for name, datatype, values in tensors:
        array = np.array([v.encode() if isinstance(v, str) else v for v in values], dtype=dtypes[datatype])
        array = array.reshape(lead + array.shape)
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    responses, errors, done = [], [], threading.Event()

    def callback(result, error):
        if error is not None:
            errors.append(str(error))
            done.set()
            return
        present = {name: result.as_numpy(name) for name in OUTPUTS if result.as_numpy(name) is not None}
        if present:
            responses.append({name: value.reshape(-1) for name, value in present.items()})
        if result.get_response().parameters["triton_final_response"].bool_param:
            done.set()

    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.start_stream(callback=callback)
        if connected is not None:
            assert client.is_server_live()  # the channel is connected
            connected.wait(60)
        sequence = {}
        if model in SEQUENCE_MODELS:
            sequence = {"sequence_id": next(_sequence_ids), "sequence_start": True, "sequence_end": True}
        client.async_stream_infer(model, inputs, outputs=[grpcclient.InferRequestedOutput(n) for n in OUTPUTS],
                                  request_id="0", enable_empty_final_response=True, **sequence)
        assert done.wait(120), f"{model}: no final response"
    finally:
        client.stop_stream()
        client.close()
    assert not errors, errors
    ids = [int(i) for r in responses for i in r["output_ids"]]
    last = responses[-1]
    return {
        "responses": responses,
        "output_ids": ids,
        "text": "".join(r["text_output"][0].decode() for r in responses),
        "finish_reason": last["finish_reason"][0].decode() if "finish_reason" in last else None,
        "num_output_tokens": int(last["num_output_tokens"][0]) if "num_output_tokens" in last else None,
    }


def genai_perf_vllm(max_tokens: int, deterministic: bool) -> list:
    """``genai-perf profile --endpoint-type kserve --backend vllm --streaming [--output-tokens-mean-deterministic]``."""
    params = {"max_tokens": str(max_tokens), **({"min_tokens": str(max_tokens)} if deterministic else {})}
    return [
        ("exclude_input_in_output", "BOOL", [True]),
        ("sampling_parameters", "BYTES", [json.dumps(params, separators=(",", ":"))]),
        ("stream", "BOOL", [True]),
        ("text_input", "BYTES", [PROMPT]),
    ]


def genai_perf_tensorrtllm(max_tokens: int, deterministic: bool) -> list:
    """``genai-perf profile --endpoint-type kserve --backend tensorrtllm --streaming [...-deterministic]``."""
    return [
        ("exclude_input_in_output", "BOOL", [True]),
        ("max_tokens", "INT32", [max_tokens]),
        *([("min_length", "INT32", [max_tokens])] if deterministic else []),
        ("stream", "BOOL", [True]),
        ("text_input", "BYTES", [PROMPT]),
    ]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("backend", [genai_perf_vllm, genai_perf_tensorrtllm], ids=["vllm", "tensorrtllm"])
def test_genai_perf_kserve_gets_exactly_the_deterministic_lengths(server, model, backend):
    for max_tokens in (7, 24):
        got = stream_infer(server, model, backend(max_tokens, deterministic=True))
        assert len(got["output_ids"]) == got["num_output_tokens"] == max_tokens
        assert got["finish_reason"] == "length"
        assert len(got["responses"]) == max_tokens  # streaming: one response per token
    plain = stream_infer(server, model, backend(9, deterministic=False))
    assert 1 <= len(plain["output_ids"]) <= 9 and plain["finish_reason"] in ("stop", "length")


@pytest.mark.timeout(300)
def test_perf_analyzers_sequences_are_served_side_by_side_on_llm_iterative(server):
    """genai-perf --concurrency 4 against llm_iterative: four streams, each request a sequence of its own (START and
    END). Each gets exactly its length, the relayed requests share forward steps as any others do, and nothing stays
    open afterwards."""
    model = "llm_iterative"
    before = scrape_metrics(server.metrics_url)
    results: dict[int, dict] = {}
    # NOTE: the streams are opened first, then the four requests go out together: on a loaded machine, opening a
    # connection can take longer than a whole request of 12 tokens, and staggered requests never share a step.
    connected = threading.Barrier(4)

    def stream(i: int) -> None:
        results[i] = stream_infer(server, model, genai_perf_vllm(12 + i, deterministic=True), connected)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    assert sorted(results) == [0, 1, 2, 3]
    for i, got in results.items():
        assert len(got["output_ids"]) == got["num_output_tokens"] == 12 + i and got["finish_reason"] == "length"
    after = scrape_metrics(server.metrics_url)
    steps = {f"{k}": after[k] - before.get(k, 0.0) for k in after if k.startswith('llm_batch_size_') and model in k}
    batched = steps[f'llm_batch_size_sum{{model="{model}"}}'] / steps[f'llm_batch_size_count{{model="{model}"}}']
    assert batched > 1.5, f"the relayed requests ran one at a time: {batched:.2f} sequences per step"
    assert after[f'llm_kv_blocks_used{{model="{model}"}}'] == 0
    assert after[f'llm_num_requests_running{{model="{model}"}}'] == 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", MODELS)
def test_min_length_and_min_tokens_hold_back_what_would_stop_the_request(server, model):
    """A stop token that ends the request at once is not sampled before min_tokens (either name)."""
    greedy = {"temperature": 0.0, "ignore_eos": True}
    first = stream_infer(server, model, [("text_input", "BYTES", [PROMPT]), ("max_tokens", "INT32", [8]),
                                         ("sampling_parameters", "BYTES", [json.dumps(greedy)])])["output_ids"][0]
    stopping = json.dumps({**greedy, "stop_token_ids": [first]})
    base = [("text_input", "BYTES", [PROMPT]), ("max_tokens", "INT32", [8]),
            ("sampling_parameters", "BYTES", [stopping])]
    stopped = stream_infer(server, model, base)
    assert stopped["output_ids"] == [first] and stopped["finish_reason"] == "stop"
    for extra in (("min_length", "INT32", [8]), ("min_tokens", "INT32", [8])):
        held = stream_infer(server, model, [*base, extra])
        assert len(held["output_ids"]) == 8 and first not in held["output_ids"] and held["finish_reason"] == "length"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", MODELS)
def test_genai_perf_extra_inputs(server, model):
    """``--extra-inputs temperature:0.0 seed:7 top_k:5 ignore_eos:true return_num_input_tokens:false ...``: each becomes
    one tensor of the model's declared type (perf_analyzer reads the model metadata; seed is UINT64)."""
    base = genai_perf_tensorrtllm(6, deterministic=False)
    greedy = [stream_infer(server, model, [*base, ("temperature", "FP32", [0.0]), ("ignore_eos", "BOOL", [True])])
              for _ in range(2)]
    assert greedy[0]["output_ids"] == greedy[1]["output_ids"] and len(greedy[0]["output_ids"]) == 6
    seeded = [stream_infer(server, model, [*base, ("seed", "UINT64", [seed]), ("top_k", "INT32", [5]),
                                           ("ignore_eos", "BOOL", [True])]) for seed in (7, 7, 2**64 - 1)]
    assert seeded[0]["output_ids"] == seeded[1]["output_ids"] and len(seeded[2]["output_ids"]) == 6
    switches = [("return_num_input_tokens", "BOOL", [False]), ("return_finish_reason", "BOOL", [False]),
                ("return_num_output_tokens", "BOOL", [True])]
    trimmed = stream_infer(server, model, [*base, ("ignore_eos", "BOOL", [True]), *switches])
    assert all(set(r) == {"text_output", "output_ids", "num_output_tokens"} for r in trimmed["responses"])
    assert trimmed["num_output_tokens"] == 6


# ---- HTTP generate_stream: genai-perf's generate endpoint and aiperf's template ---------------------------------


def sse_events(server, model: str, body: dict) -> list[dict]:
    answer = requests.post(f"{server.http_url}/v2/models/{model}/generate_stream", json=body, stream=True, timeout=120)
    assert answer.status_code == 200, answer.text
    return [json.loads(line[len(b"data: "):]) for line in answer.iter_lines() if line.startswith(b"data: ")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", MODELS)
def test_http_generate_stream_bodies_as_the_tools_send_them(server, model):
    # genai-perf --endpoint-type generate --endpoint v2/models/M/generate_stream --streaming: text_input as a list.
    events = sse_events(server, model, {"text_input": [PROMPT], "stream": True, "max_tokens": 12})
    assert 1 <= len(events) <= 12 and events[-1]["finish_reason"] in ("stop", "length")
    # aiperf with loadtest/aiperf/triton_generate_stream.jinja: min_tokens = max_tokens gives exact lengths.
    template = (REPO_ROOT / "loadtest" / "aiperf" / "triton_generate_stream.jinja").read_text()
    jinja2 = pytest.importorskip("jinja2")
    body = json.loads(jinja2.Template(template).render(text=PROMPT, max_tokens=12, stream=True))
    assert body == {"text_input": PROMPT, "max_tokens": 12, "min_tokens": 12, "stream": True}
    events = sse_events(server, model, {**body, "temperature": 0})  # aiperf --extra-inputs temperature:0
    assert len(events) == events[-1]["num_output_tokens"] == 12 and events[-1]["finish_reason"] == "length"


# ---- aiperf itself -----------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", MODELS)
def test_aiperf_profiles_the_model_with_exact_output_lengths(server, model, smollm2_dir, tmp_path):
    """``make aiperf``'s command, small and bounded: 8 requests, 2 at a time, 16 tokens in and 12 out each."""
    assert AIPERF.exists(), "aiperf is not installed: `make aiperf-venv` (make test does it) creates .venv-aiperf"
    port = server.http_url.rsplit(":", 1)[1]
    make = ["make", "--no-print-directory", "-s", "aiperf", f"AIPERF_MODEL={model}", f"HTTP_PORT={port}",
            f"MODEL={smollm2_dir}", f"AIPERF_ARTIFACTS={tmp_path}",  # the tiny model's tokenizer is SmolLM2's
            "ARGS=--isl 16 --isl-stddev 0 --osl 12 --concurrency 2 --request-count 8 --num-dataset-entries 8 "
            "--random-seed 0"]
    generated = f'llm_generation_tokens_total{{model="{model}"}}'
    before = scrape_metrics(server.metrics_url).get(generated, 0.0)
    done = subprocess.run(make, cwd=REPO_ROOT, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert scrape_metrics(server.metrics_url)[generated] - before == 8 * 12  # exactly --osl tokens each
    records = [json.loads(line) for line in (tmp_path / "profile_export.jsonl").read_text().splitlines()]
    assert len(records) == 8
    summary = json.loads((tmp_path / "profile_export_aiperf.json").read_text())
    assert summary["request_count"]["avg"] == 8 and summary.get("error_request_count", {}).get("avg", 0) == 0
    # NOTE: aiperf counts output tokens by re-tokenizing the streamed text (the tiny model's random tokens re-tokenize
    # to other counts); the server's own count, checked above, is exact.
    assert all(r["metrics"]["output_sequence_length"]["value"] > 0 for r in records)
    assert summary["time_to_first_token"]["avg"] > 0 and summary["inter_token_latency"]["avg"] > 0
