"""Both Triton models on a real server with the real SmolLM2: the schema, streaming, and the defining behaviours.

Everything is observed from the client side, over tritonclient gRPC streaming and Triton's HTTP generate endpoints.
"""

from __future__ import annotations

import json
import queue
import threading
import time

import pytest
import requests
from tritonclient.grpc import InferenceServerClient

from backend.contract import io_schema
from backend.triton.launcher.launch_options import copy_model_repository
from client import grpc_stream
from client.grpc_stream import GrpcStream, start_stream
from client.schema import input_tensors, raw_input_values
from tests.metrics_port import model_sample, scrape_metrics

pytestmark = [pytest.mark.server, pytest.mark.smollm2]
MODELS = ("llm_dynamic", "llm_continuous", "llm_iterative")


@pytest.fixture(scope="module")
def server(triton_server_factory, smollm2_dir, tmp_path_factory):
    # NOTE: these tests count a stream's steps by its responses, so every token gets its own (stream_interval 1);
    # the shipped "auto" groups tokens once sending binds the step (tests/server/test_stream_interval_served.py).
    models = ("llm_static", *MODELS)
    repository = copy_model_repository(tmp_path_factory.mktemp("every-step"), models, {"stream_interval": "1"})
    return triton_server_factory.start(repository, model=smollm2_dir)


# ---- gRPC streams read with client/grpc_stream.py, bare requests (the tests check the server, not LLMClient) ---


def generate(server, model: str, prompt: str, timeout: float = 300, **values) -> GrpcStream:
    stream = grpc_stream.generate(server.grpc_url, model, prompt, timeout=timeout, **values)
    assert stream.final, f"{model}: no final response within {timeout} s"
    return stream


def metric(server, name: str, model: str) -> float:
    return model_sample(scrape_metrics(server.metrics_url), name, model)


# ---- the schema over every protocol -------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_every_model_serves_the_declared_schema_and_its_max_model_len(server):
    """config.pbtxt declares no inputs or outputs: each model adds backend/contract/io_schema.py's when it loads, and
    the max_model_len its engine resolved (the shipped 2048), which Triton serves in the model's config."""
    client = InferenceServerClient(server.grpc_url)
    for model in ("llm_static", *MODELS):
        config = client.get_model_config(model, as_json=True)["config"]
        served = {t["name"]: (t["data_type"], [int(d) for d in t["dims"]], t.get("optional", False))
                  for t in config["input"]}
        assert served == {t.name: (t.data_type, list(t.dims), t.optional) for t in io_schema.INPUTS}, model
        assert [t["name"] for t in config["output"]] == list(io_schema.OUTPUT_NAMES), model
        assert io_schema.served_max_model_len(config) == 2048, model


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", MODELS)
def test_grpc_stream_and_http_generate_agree(server, model):
    prompt = "The capital of France is"
    streamed = generate(server, model, prompt, max_tokens=12, temperature=0.0, ignore_eos=True, stream=True)
    assert streamed.error is None
    assert len(streamed.token_ids) == len(streamed.chunks) == 12  # one response per token
    assert streamed.finish_reason == "length"
    whole = generate(server, model, prompt, max_tokens=12, temperature=0.0, ignore_eos=True, stream=False)
    assert len(whole.chunks) == 1 and whole.text == streamed.text and whole.token_ids == streamed.token_ids

    body = {"text_input": prompt, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    answer = requests.post(f"{server.http_url}/v2/models/{model}/generate", json=body, timeout=120).json()
    assert answer["text_output"] == streamed.text
    assert answer["finish_reason"] == streamed.finish_reason

    sse = requests.post(f"{server.http_url}/v2/models/{model}/generate_stream", json={**body, "stream": True},
                        timeout=120, stream=True)
    events = [json.loads(line[len(b"data: "):]) for line in sse.iter_lines() if line.startswith(b"data: ")]
    assert "".join(e["text_output"] for e in events) == streamed.text
    assert events[-1]["finish_reason"] == streamed.finish_reason
    # counts and finish reason come in the final response only (unless a return_* switch asks for them in each)
    assert all(not {"finish_reason", "num_input_tokens", "num_output_tokens"} & set(e) for e in events[:-1])


@pytest.mark.timeout(300)
def test_same_greedy_text_from_both_models(server):
    # NOTE: min_tokens, not a prompt chosen for its first token: in bf16 whether the first greedy token is EOS can
    # depend on the CPU's rounding (a near-tie), so the test asks for the tokens it compares.
    prompt = "Write a haiku about the sea."
    streams = {m: generate(server, m, prompt, max_tokens=24, min_tokens=24, temperature=0.0) for m in MODELS}
    assert all(len(s.token_ids) == 24 and s.finish_reason == "length" for s in streams.values())
    assert streams["llm_dynamic"].token_ids == streams["llm_continuous"].token_ids == streams["llm_iterative"].token_ids
    assert streams["llm_dynamic"].text == streams["llm_continuous"].text == streams["llm_iterative"].text


@pytest.mark.timeout(300)
def test_sampling_parameters_json_as_genai_perf_sends_it(server):
    for model in MODELS:
        body = {"text_input": "Hi", "sampling_parameters": json.dumps({"max_tokens": "5", "ignore_eos": "true"})}
        answer = requests.post(f"{server.http_url}/v2/models/{model}/generate", json=body, timeout=60).json()
        assert answer["num_output_tokens"] == 5, answer


# ---- the defining behaviours ----------------------------------------------------------------------------------


def wait_tokens(stream: GrpcStream, count: int, timeout: float = 60) -> None:
    assert stream.wait_tokens(count, timeout), f"stream stalled: {stream.error}"


def short_during_long(server, model: str, long_tokens: int) -> tuple[GrpcStream, GrpcStream]:
    """A long stream, and once it has 5 tokens a short request run to its end: ``(long, short)``."""
    long = start_stream(server.grpc_url, model, "Tell me a long story.", max_tokens=long_tokens, ignore_eos=True,
                        stream=True)
    wait_tokens(long, 5)
    return long, generate(server, model, "Hi", max_tokens=4, ignore_eos=True, stream=True)


def steps_of_more_than_one(server, model: str) -> float:
    samples = scrape_metrics(server.metrics_url)
    label = f'model="{model}"'
    return samples[f"llm_batch_size_count{{{label}}}"] - samples[f'llm_batch_size_bucket{{{label},le="1"}}']


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["llm_continuous", "llm_iterative"])
def test_continuous_admits_a_short_request_into_the_running_batch(server, model):
    # llm_continuous: the engine's loop re-forms the batch every step; llm_iterative: Triton's iterative sequence
    # batcher re-forms it every iteration. Either way the short request joins the long one's batch and leaves it.
    shared_before = steps_of_more_than_one(server, model)
    long, short = short_during_long(server, model, 160)
    first_short = short.arrival_times[0]
    # NOTE: counted in steps of the long stream, not seconds: the step in flight, the short's prefill, slack for a
    # busy client machine.
    steps_waited = sum(1 for t in long.arrival_times if short.sent_at < t < first_short)
    assert steps_waited <= 4, f"the short request waited {steps_waited} steps of the long one for its first token"
    assert not long.final, "the short request should finish while the long one is still generating"
    assert long.wait(120) and len(long.token_ids) == 160
    long.close()
    assert steps_of_more_than_one(server, model) > shared_before, "the two never ran in one step"


@pytest.mark.timeout(300)
def test_dynamic_queues_a_request_until_the_running_batch_finishes(server):
    long, short = short_during_long(server, "llm_dynamic", 48)
    assert long.wait(120) and len(long.token_ids) == 48
    assert short.arrival_times[0] > long.arrival_times[-1], "the short request got a token before the batch finished"
    long.close()


@pytest.mark.timeout(300)
def triton_counter(server, name: str, model: str) -> float:
    """One of Triton's own per-model counters (labelled with the model and its version)."""
    lines = requests.get(server.metrics_url, timeout=10).text.splitlines()
    found = [float(line.rsplit(" ", 1)[1]) for line in lines
             if line.startswith(name + "{") and f'model="{model}"' in line]
    assert found, f"{name} for {model} is not on the metrics port"
    return sum(found)


def test_static_waits_for_a_full_batch_then_runs_it_together(server):
    # Alone, a request waits out the batcher's max_queue_delay (1 s) for batch-mates that never come.
    alone = generate(server, "llm_static", "Hi", max_tokens=2, ignore_eos=True, stream=True)
    assert alone.error is None and alone.chunks[0].time_s >= 0.9
    # Eight at once fill the preferred batch: Triton runs them in one execution. NOTE: on a loaded 2-core machine
    # opening eight gRPC connections can take longer than the 1 s the batcher waits, so the connections and the
    # tensors are made first and the eight requests then sent back to back; Triton's own execution counter says
    # how the batch was formed (client-side arrival times can be reordered by a busy machine).
    batch = grpc_stream.max_batch_size(server.grpc_url, "llm_static")
    inputs = [input_tensors(raw_input_values(f"Request {i}: count.", max_tokens=4 + 4 * i, ignore_eos=True,
                                             stream=True), batch) for i in range(8)]
    clients = [InferenceServerClient(server.grpc_url) for _ in range(8)]
    for client in clients:
        assert client.is_server_live()  # the connection is up before the requests go out
    executions, inferences = (triton_counter(server, name, "llm_static")
                              for name in ("nv_inference_exec_count", "nv_inference_count"))
    streams = [GrpcStream.start(client, "llm_static", tensors) for client, tensors in zip(clients, inputs)]
    try:
        for i, stream in enumerate(streams):
            assert stream.wait(120) and stream.error is None and len(stream.token_ids) == 4 + 4 * i
        # NOTE: Triton counts a decoupled request when it releases it, which can come just after its final response.
        deadline = time.monotonic() + 10
        while triton_counter(server, "nv_inference_count", "llm_static") - inferences < 8:
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert triton_counter(server, "nv_inference_count", "llm_static") - inferences == 8
        assert triton_counter(server, "nv_inference_exec_count", "llm_static") - executions == 1, \
            "the eight requests did not run as one batch"
    finally:
        for stream in streams:
            stream.close()
        for client in clients:
            client.close()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", MODELS)
def test_sixteen_concurrent_streams_of_mixed_lengths(server, model):
    lengths = [4, 8, 16, 32, 6, 12, 24, 48, 5, 10, 20, 40, 3, 7, 14, 28]
    results: queue.Queue = queue.Queue()

    def run(i: int, n: int) -> None:
        results.put((n, generate(server, model, f"Request {i}: count to ten.", max_tokens=n, ignore_eos=True,
                                 temperature=0.8, seed=i, stream=True)))

    threads = [threading.Thread(target=run, args=(i, n)) for i, n in enumerate(lengths)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(500)
    done = [results.get_nowait() for _ in range(results.qsize())]
    assert len(done) == len(lengths)
    for n, stream in done:
        assert stream.error is None
        assert len(stream.token_ids) == n and stream.finish_reason == "length"
        assert stream.chunks[-1].finish_reason == "length"


# ---- cancellation, errors, metrics -----------------------------------------------------------------------------


def wait_metric(server, name: str, model: str, predicate, timeout: float = 30) -> float:
    deadline = time.monotonic() + timeout
    while True:
        value = metric(server, name, model)
        if predicate(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", MODELS)
def test_cancellation_frees_kv_blocks_and_the_model_keeps_serving(server, model):
    stream = start_stream(server.grpc_url, model, "Tell me a long story.", max_tokens=1000, ignore_eos=True,
                          stream=True)
    wait_tokens(stream, 3)
    assert metric(server, "llm_kv_blocks_used", model) > 0
    stream.cancel()
    stream.close()
    assert wait_metric(server, "llm_kv_blocks_used", model, lambda v: v == 0) == 0
    assert wait_metric(server, "llm_num_requests_running", model, lambda v: v == 0) == 0
    assert len(stream.token_ids) < 1000
    after = generate(server, model, "Hello", max_tokens=3, ignore_eos=True)
    assert after.error is None and len(after.token_ids) == 3


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", MODELS)
def test_cancelling_a_request_with_n_frees_the_blocks_of_all_its_sequences(server, model):
    stream = start_stream(server.grpc_url, model, "Tell me a long story.", max_tokens=1000, ignore_eos=True,
                          stream=True, n=4)
    wait_tokens(stream, 12)  # the four sequences are running
    assert metric(server, "llm_kv_blocks_used", model) > 0
    stream.cancel()
    stream.close()
    assert wait_metric(server, "llm_kv_blocks_used", model, lambda v: v == 0) == 0
    assert wait_metric(server, "llm_num_requests_running", model, lambda v: v == 0) == 0
    after = generate(server, model, "Hello", max_tokens=3, ignore_eos=True, n=2)
    assert after.error is None and len(after.token_ids) == 6 and after.finish_reason == "length"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", MODELS)
def test_bad_requests_fail_alone_while_a_good_stream_completes(server, model):
    good = start_stream(server.grpc_url, model, "Count to twenty.", max_tokens=40, ignore_eos=True, stream=True)
    wait_tokens(good, 2)
    empty = generate(server, model, "", max_tokens=4)
    assert empty.error is not None and "text_input is empty" in empty.error
    negative = generate(server, model, "Hi", max_tokens=-3)
    assert negative.error is not None and "max_tokens must be a positive integer" in negative.error
    bad_json = requests.post(f"{server.http_url}/v2/models/{model}/generate", timeout=60,
                             json={"text_input": "Hi", "sampling_parameters": "{not json"})
    assert bad_json.status_code >= 400 and "sampling_parameters is not valid JSON" in bad_json.text
    assert good.wait(120) and good.error is None and len(good.token_ids) == 40
    good.close()
    assert requests.get(f"{server.http_url}/v2/health/ready", timeout=10).status_code == 200


@pytest.mark.timeout(300)
def test_metrics_after_traffic(server):
    for model in MODELS:
        generate(server, model, "Hello there", max_tokens=6, ignore_eos=True)
    samples = scrape_metrics(server.metrics_url)
    for model in MODELS:
        label = f'{{model="{model}"}}'
        assert samples[f"llm_generation_tokens_total{label}"] >= 6
        assert samples[f"llm_prompt_tokens_total{label}"] >= 2
        assert samples[f"llm_kv_blocks_total{label}"] > 0
        assert samples[f"llm_batch_size_count{label}"] >= 6  # at least one forward per generated token
        assert samples[f"llm_time_to_first_token_seconds_count{label}"] >= 1
        assert 0 < samples[f"llm_e2e_request_latency_seconds_sum{label}"] < 600
        assert samples[f'llm_request_success_total{{finish_reason="length",model="{model}"}}'] >= 1
    # llm_iterative hands its requests back to Triton after each step: what that costs is measured per iteration.
    label = '{model="llm_iterative"}'
    assert samples[f"llm_iteration_gap_seconds_count{label}"] >= 5  # 6 tokens: handed back 5 times at least
    assert 0 < samples[f"llm_iteration_gap_seconds_sum{label}"] < samples[f"llm_iteration_gap_seconds_count{label}"]
