"""Both Triton models on a real server with the real SmolLM2: the schema, streaming, and the defining behaviours.

Everything is observed from the client side, over tritonclient gRPC streaming and Triton's HTTP generate endpoints.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient

from client.schema import INPUT_TYPES
from tests.server_harness import REPO_ROOT

pytestmark = [pytest.mark.server, pytest.mark.smollm2]
MODELS = ("llm_dynamic", "llm_continuous")
BATCHED = {"llm_dynamic": True, "llm_continuous": False, "llm_static": True}


@pytest.fixture(scope="module")
def server(triton_server_factory, smollm2_dir):
    return triton_server_factory.start(REPO_ROOT / "model_repository", model=smollm2_dir)


# ---- a minimal gRPC streaming caller (the tests check the server, not the client library) -------------------


@dataclass
class Stream:
    chunks: list = field(default_factory=list)  # (perf_counter, text, ids, finish_reason)
    sent_at: float = 0.0  # perf_counter when the request left, after the stream was open
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def text(self) -> str:
        return "".join(c[1] for c in self.chunks)

    @property
    def token_ids(self) -> list[int]:
        return [t for c in self.chunks for t in c[2]]

    @property
    def finish_reason(self) -> str:
        return self.chunks[-1][3] if self.chunks else ""


def make_inputs(model: str, prompt: str, **values) -> list:
    lead = (1,) if BATCHED[model] else ()
    tensors = [("text_input", "BYTES", np.array([prompt.encode()], dtype=np.object_))]
    for name, value in values.items():
        dtype, np_type = INPUT_TYPES[name]
        tensors.append((name, dtype, np.array([value], dtype=np_type)))
    inputs = []
    for name, dtype, array in tensors:
        array = array.reshape(lead + array.shape)
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def start_stream(server, model: str, prompt: str, **values) -> tuple[grpcclient.InferenceServerClient, Stream]:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    stream = Stream()

    def callback(result, error):
        if error is not None:
            stream.error = str(error)
            stream.done.set()
            return
        response = result.get_response()
        final = response.parameters["triton_final_response"].bool_param
        if result.as_numpy("text_output") is not None:
            text = result.as_numpy("text_output").reshape(-1)[0].decode()
            ids = result.as_numpy("output_ids").reshape(-1).tolist()
            reason = result.as_numpy("finish_reason").reshape(-1)[0].decode()
            stream.chunks.append((time.perf_counter(), text, ids, reason))
        if final:
            stream.done.set()

    client.start_stream(callback=callback)
    stream.sent_at = time.perf_counter()
    client.async_stream_infer(model, make_inputs(model, prompt, **values), enable_empty_final_response=True)
    return client, stream


def generate(server, model: str, prompt: str, timeout: float = 300, **values) -> Stream:
    client, stream = start_stream(server, model, prompt, **values)
    try:
        assert stream.done.wait(timeout), f"{model}: no final response within {timeout} s"
    finally:
        client.stop_stream()
        client.close()
    return stream


def metrics(server) -> dict[str, float]:
    """The ``llm_*`` samples on the metrics port, keyed by their full name with labels."""
    text = requests.get(server.metrics_url, timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith("llm_"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def metric(server, name: str, model: str) -> float:
    return metrics(server).get(f'{name}{{model="{model}"}}', float("nan"))


# ---- the schema over every protocol -------------------------------------------------------------------------


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
    assert all(e["finish_reason"] == "" for e in events[:-1])


@pytest.mark.timeout(300)
def test_same_greedy_text_from_both_models(server):
    # NOTE: min_tokens, not a prompt chosen for its first token: in bf16 whether the first greedy token is EOS can
    # depend on the CPU's rounding (a near-tie), so the test asks for the tokens it compares.
    prompt = "Write a haiku about the sea."
    streams = {m: generate(server, m, prompt, max_tokens=24, min_tokens=24, temperature=0.0) for m in MODELS}
    assert all(len(s.token_ids) == 24 and s.finish_reason == "length" for s in streams.values())
    assert streams["llm_dynamic"].token_ids == streams["llm_continuous"].token_ids
    assert streams["llm_dynamic"].text == streams["llm_continuous"].text


@pytest.mark.timeout(300)
def test_sampling_parameters_json_as_genai_perf_sends_it(server):
    for model in MODELS:
        body = {"text_input": "Hi", "sampling_parameters": json.dumps({"max_tokens": "5", "ignore_eos": "true"})}
        answer = requests.post(f"{server.http_url}/v2/models/{model}/generate", json=body, timeout=60).json()
        assert answer["num_output_tokens"] == 5, answer


# ---- the defining behaviours ----------------------------------------------------------------------------------


def wait_tokens(stream: Stream, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while len(stream.chunks) < count:
        assert stream.error is None and time.monotonic() < deadline, f"stream stalled: {stream.error}"
        time.sleep(0.005)


@pytest.mark.timeout(300)
def test_continuous_admits_a_short_request_into_the_running_batch(server):
    long_client, long = start_stream(server, "llm_continuous", "Tell me a long story.", max_tokens=160,
                                     ignore_eos=True, stream=True)
    wait_tokens(long, 5)
    short = generate(server, "llm_continuous", "Hi", max_tokens=4, ignore_eos=True, stream=True)
    first_short = short.chunks[0][0]
    # NOTE: counted in steps of the long stream, not seconds: the step in flight, the short's prefill, slack for a
    # busy client machine.
    steps_waited = sum(1 for t, *_ in long.chunks if short.sent_at < t < first_short)
    assert steps_waited <= 4, f"the short request waited {steps_waited} steps of the long one for its first token"
    assert not long.done.is_set(), "the short request should finish while the long one is still generating"
    assert long.done.wait(120) and len(long.token_ids) == 160
    long_client.stop_stream()
    long_client.close()


@pytest.mark.timeout(300)
def test_dynamic_queues_a_request_until_the_running_batch_finishes(server):
    long_client, long = start_stream(server, "llm_dynamic", "Tell me a long story.", max_tokens=48,
                                     ignore_eos=True, stream=True)
    wait_tokens(long, 5)
    short = generate(server, "llm_dynamic", "Hi", max_tokens=4, ignore_eos=True, stream=True)
    assert long.done.wait(120) and len(long.token_ids) == 48
    assert short.chunks[0][0] > long.chunks[-1][0], "the short request got a token before the batch finished"
    long_client.stop_stream()
    long_client.close()


@pytest.mark.timeout(300)
def test_static_waits_for_a_full_batch_then_runs_it_together(server):
    # Alone, a request waits out the batcher's max_queue_delay (1 s) for batch-mates that never come.
    alone = generate(server, "llm_static", "Hi", max_tokens=2, ignore_eos=True, stream=True)
    assert alone.error is None and alone.chunks[0][0] - alone.sent_at >= 0.9
    # Eight at once fill the preferred batch: one batch, so every first token comes before anyone's second.
    streams = [start_stream(server, "llm_static", f"Request {i}: count.", max_tokens=4 + 4 * i, ignore_eos=True,
                            stream=True) for i in range(8)]
    try:
        for i, (_, stream) in enumerate(streams):
            assert stream.done.wait(120) and stream.error is None and len(stream.token_ids) == 4 + 4 * i
        last_first = max(stream.chunks[0][0] for _, stream in streams)
        first_second = min(stream.chunks[1][0] for _, stream in streams)
        assert last_first < first_second, "the eight requests did not run as one batch"
    finally:
        for client, _ in streams:
            client.stop_stream()
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
        assert stream.chunks[-1][3] == "length"


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
    client, stream = start_stream(server, model, "Tell me a long story.", max_tokens=1000, ignore_eos=True,
                                  stream=True)
    wait_tokens(stream, 3)
    assert metric(server, "llm_kv_blocks_used", model) > 0
    client.stop_stream(cancel_requests=True)
    client.close()
    assert wait_metric(server, "llm_kv_blocks_used", model, lambda v: v == 0) == 0
    assert wait_metric(server, "llm_num_requests_running", model, lambda v: v == 0) == 0
    assert len(stream.token_ids) < 1000
    after = generate(server, model, "Hello", max_tokens=3, ignore_eos=True)
    assert after.error is None and len(after.token_ids) == 3


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", MODELS)
def test_bad_requests_fail_alone_while_a_good_stream_completes(server, model):
    good_client, good = start_stream(server, model, "Count to twenty.", max_tokens=40, ignore_eos=True, stream=True)
    wait_tokens(good, 2)
    empty = generate(server, model, "", max_tokens=4)
    assert empty.error is not None and "text_input is empty" in empty.error
    negative = generate(server, model, "Hi", max_tokens=-3)
    assert negative.error is not None and "max_tokens must be a positive integer" in negative.error
    bad_json = requests.post(f"{server.http_url}/v2/models/{model}/generate", timeout=60,
                             json={"text_input": "Hi", "sampling_parameters": "{not json"})
    assert bad_json.status_code >= 400 and "sampling_parameters is not valid JSON" in bad_json.text
    assert good.done.wait(120) and good.error is None and len(good.token_ids) == 40
    good_client.stop_stream()
    good_client.close()
    assert requests.get(f"{server.http_url}/v2/health/ready", timeout=10).status_code == 200


@pytest.mark.timeout(300)
def test_metrics_after_traffic(server):
    for model in MODELS:
        generate(server, model, "Hello there", max_tokens=6, ignore_eos=True)
    samples = metrics(server)
    for model in MODELS:
        label = f'{{model="{model}"}}'
        assert samples[f"llm_generation_tokens_total{label}"] >= 6
        assert samples[f"llm_prompt_tokens_total{label}"] >= 2
        assert samples[f"llm_kv_blocks_total{label}"] > 0
        assert samples[f"llm_batch_size_count{label}"] >= 6  # at least one forward per generated token
        assert samples[f"llm_time_to_first_token_seconds_count{label}"] >= 1
        assert 0 < samples[f"llm_e2e_request_latency_seconds_sum{label}"] < 600
        assert samples[f'llm_request_success_total{{finish_reason="length",model="{model}"}}'] >= 1
