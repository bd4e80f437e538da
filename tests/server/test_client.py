"""The client library and CLI (client/), against a stand-in model on a real tritonserver, then the real models.

The stand-in implements the models' I/O schema trivially: it "generates" the prompt's words again, one word per
token (id 100 + position in the prompt), honours max_tokens, stop, ignore_eos and stream, answers an empty prompt
with an error response, and stops when the client cancels. It is served twice, like the real models: batched by
Triton's dynamic batcher (``max_batch_size: 8``) and unbatched (``max_batch_size: 0``).
"""

from __future__ import annotations

import json

import pytest

from client import GenerationError, GenerationRequest, GenerationResult, LLMClient, ModelNotServed
from tests.server_harness import REPO_ROOT
from tests.unit.test_client import BOTH_PROTOCOLS, run_cli

STAND_IN_MODEL = '''
import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.batched = config.get("max_batch_size", 0) > 0
        self.delay_s = float(config["parameters"]["token_delay_s"]["string_value"])

    def _tensor(self, name, values, dtype):
        array = np.array(values, dtype=dtype)
        return pb_utils.Tensor(name, array[None] if self.batched else array)

    def _response(self, text, ids, finish_reason, num_input, num_output):
        return pb_utils.InferenceResponse(output_tensors=[
            self._tensor("text_output", [text.encode()], np.object_),
            self._tensor("output_ids", ids, np.int32),
            self._tensor("finish_reason", [finish_reason.encode()], np.object_),
            self._tensor("num_input_tokens", [num_input], np.int32),
            self._tensor("num_output_tokens", [num_output], np.int32),
        ])

    @staticmethod
    def _input(request, name, default):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return default if tensor is None else list(tensor.as_numpy().reshape(-1))

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            words = self._input(request, "text_input", [b""])[0].decode().split()
            if not words:
                error = pb_utils.TritonError("text_input is empty")
                sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
                continue
            max_tokens = int(self._input(request, "max_tokens", [16])[0])
            stream = bool(self._input(request, "stream", [False])[0])
            ignore_eos = bool(self._input(request, "ignore_eos", [False])[0])
            stop = {s.decode() for s in self._input(request, "stop", [])}
            limit = max_tokens if ignore_eos else min(max_tokens, len(words))
            out_words = [words[i % len(words)] for i in range(limit)]
            out_words = out_words[:next((i for i, w in enumerate(out_words) if w in stop), None)]
            ids = [100 + i % len(words) for i in range(len(out_words))]
            finish = "length" if len(out_words) == max_tokens else "stop"
            if not stream:
                time.sleep(self.delay_s * len(out_words))
                sender.send(self._response(" ".join(out_words), ids, finish, len(words), len(ids)), flags=FINAL)
                continue
            if not out_words:
                sender.send(self._response("", [], finish, len(words), 0), flags=FINAL)
            for i, word in enumerate(out_words):
                if sender.is_cancelled():
                    sender.send(flags=FINAL)  # a final flag without a response
                    break
                time.sleep(self.delay_s)
                last = i == len(out_words) - 1
                text = word if i == 0 else " " + word
                response = self._response(text, [ids[i]], finish if last else "", len(words), i + 1)
                sender.send(response, flags=FINAL if last else 0)
        return None
'''

STAND_IN_CONFIG = """
backend: "python"
max_batch_size: {max_batch_size}
model_transaction_policy {{ decoupled: true }}
{batching}
input [
  {{ name: "text_input", data_type: TYPE_STRING, dims: [ 1 ] }},
  {{ name: "max_tokens", data_type: TYPE_INT32, dims: [ 1 ], optional: true }},
  {{ name: "temperature", data_type: TYPE_FP32, dims: [ 1 ], optional: true }},
  {{ name: "top_p", data_type: TYPE_FP32, dims: [ 1 ], optional: true }},
  {{ name: "top_k", data_type: TYPE_INT32, dims: [ 1 ], optional: true }},
  {{ name: "seed", data_type: TYPE_UINT64, dims: [ 1 ], optional: true }},
  {{ name: "stop", data_type: TYPE_STRING, dims: [ -1 ], optional: true }},
  {{ name: "ignore_eos", data_type: TYPE_BOOL, dims: [ 1 ], optional: true }},
  {{ name: "stream", data_type: TYPE_BOOL, dims: [ 1 ], optional: true }},
  {{ name: "sampling_parameters", data_type: TYPE_STRING, dims: [ 1 ], optional: true }},
  {{ name: "exclude_input_in_output", data_type: TYPE_BOOL, dims: [ 1 ], optional: true }}
]
output [
  {{ name: "text_output", data_type: TYPE_STRING, dims: [ 1 ] }},
  {{ name: "output_ids", data_type: TYPE_INT32, dims: [ -1 ] }},
  {{ name: "finish_reason", data_type: TYPE_STRING, dims: [ 1 ] }},
  {{ name: "num_input_tokens", data_type: TYPE_INT32, dims: [ 1 ] }},
  {{ name: "num_output_tokens", data_type: TYPE_INT32, dims: [ 1 ] }}
]
instance_group [ {{ count: 1, kind: KIND_CPU }} ]
parameters: {{ key: "token_delay_s", value: {{ string_value: "0.01" }} }}
{parameters}
"""

STAND_INS = {
    "echo_dynamic": dict(max_batch_size=8, batching="dynamic_batching { max_queue_delay_microseconds: 1000 }"),
    "echo_continuous": dict(
        max_batch_size=0,
        batching="",
        parameters='parameters: { key: "batching", value: { string_value: "continuous" } }',
    ),
}
BOTH = pytest.mark.parametrize("model", sorted(STAND_INS))
@pytest.fixture(scope="module")
def stand_in_server(triton_server_factory, tmp_path_factory):
    repository = tmp_path_factory.mktemp("stand-in-repository")
    for name, settings in STAND_INS.items():
        (repository / name / "1").mkdir(parents=True)
        (repository / name / "1" / "model.py").write_text(STAND_IN_MODEL)
        (repository / name / "config.pbtxt").write_text(STAND_IN_CONFIG.format(**{"parameters": "", **settings}))
    server = triton_server_factory.start(repository, ready_timeout=120)
    yield server
    server.stop()


def make_client(server, protocol: str = "grpc") -> LLMClient:
    return LLMClient(server.grpc_url, server.http_url, protocol=protocol, timeout=60)


def server_flags(server) -> list[str]:
    return ["--url", server.grpc_url, "--http-url", server.http_url]


def check_timings(result: GenerationResult) -> None:
    """Timings exist and are ordered: 0 < ttft <= first gap sums <= e2e."""
    assert result.ttft_s is not None and 0 < result.ttft_s <= result.e2e_s
    assert len(result.itl_s) == result.num_output_tokens - 1
    assert all(gap >= 0 for gap in result.itl_s)
    assert result.ttft_s + sum(result.itl_s) <= result.e2e_s + 1e-6
    if result.itl_s:
        assert result.tpot_s == pytest.approx(sum(result.itl_s) / len(result.itl_s))


# ---------------------------------------------------------------------------------------------- stand-in model


@pytest.mark.server
@pytest.mark.timeout(120)
@BOTH
def test_grpc_stream_chunks_final_and_timings(stand_in_server, model):
    with make_client(stand_in_server) as client:
        generation = client.stream(model, GenerationRequest("one two three four five six", max_tokens=4))
        chunks = list(generation)
        result = generation.result()
    assert [c.text for c in chunks] == ["one", " two", " three", " four"]
    assert [c.output_ids for c in chunks] == [(100,), (101,), (102,), (103,)]
    assert [c.finish_reason for c in chunks] == [None, None, None, "length"]
    assert [c.num_output_tokens for c in chunks] == [1, 2, 3, 4]
    assert all(a.time_s <= b.time_s for a, b in zip(chunks, chunks[1:]))
    assert (result.text, result.finish_reason, result.num_input_tokens, result.num_output_tokens) == (
        "one two three four", "length", 6, 4
    )  # fmt: skip
    assert not result.cancelled and result.num_responses == 4
    check_timings(result)


@pytest.mark.server
@pytest.mark.timeout(120)
@BOTH
@BOTH_PROTOCOLS
def test_stream_false_gives_one_response(stand_in_server, model, protocol):
    """gRPC sends stream=false on the stream; HTTP uses /generate (one JSON answer)."""
    with make_client(stand_in_server, protocol) as client:
        result = client.generate(model, GenerationRequest("a b c", max_tokens=8, stream=False, temperature=0.0))
    assert (result.text, result.output_ids, result.finish_reason) == ("a b c", [100, 101, 102], "stop")
    assert result.num_responses == 1 and result.num_output_tokens == 3
    assert result.tpot_s is None and result.itl_s == [] and 0 < result.ttft_s <= result.e2e_s


@pytest.mark.server
@pytest.mark.timeout(120)
@BOTH
def test_http_generate_stream_sse(stand_in_server, model):
    with make_client(stand_in_server, "http") as client:
        generation = client.stream(model, GenerationRequest("x y z w", max_tokens=3, stop=["nope"], seed=1))
        texts = [chunk.text for chunk in generation]
        result = generation.result()
    assert texts == ["x", " y", " z"]
    assert (result.text, result.output_ids, result.finish_reason) == ("x y z", [100, 101, 102], "length")
    check_timings(result)


@pytest.mark.server
@pytest.mark.timeout(120)
@BOTH_PROTOCOLS
def test_stop_string_ends_generation(stand_in_server, protocol):
    with make_client(stand_in_server, protocol) as client:
        result = client.generate("echo_continuous", GenerationRequest("a b STOP c", stop=["STOP", "zz"]))
    assert (result.text, result.finish_reason) == ("a b", "stop")


@pytest.mark.server
@pytest.mark.timeout(120)
@BOTH
@BOTH_PROTOCOLS
@pytest.mark.parametrize("stream", [True, False])
def test_server_error_becomes_generation_error(stand_in_server, model, protocol, stream):
    with make_client(stand_in_server, protocol) as client:
        with pytest.raises(GenerationError, match=f"'{model}': text_input is empty"):
            client.generate(model, GenerationRequest("", stream=stream))
        generation = client.stream(model, GenerationRequest("", stream=stream))
        for _ in range(2):  # the error stays the generation's answer
            with pytest.raises(GenerationError, match="text_input is empty"):
                generation.result()
        # The error was this request's only: the next one is served.
        assert client.generate(model, GenerationRequest("still here", stream=stream)).text == "still here"


@pytest.mark.server
@pytest.mark.timeout(120)
@BOTH_PROTOCOLS
def test_unknown_model_names_the_served_ones(stand_in_server, protocol):
    with make_client(stand_in_server, protocol) as client:
        served = "model 'nope' is not served; served models: echo_continuous, echo_dynamic"
        with pytest.raises(ModelNotServed, match=served):
            client.generate("nope", GenerationRequest("hi"))


@pytest.mark.server
@pytest.mark.timeout(120)
@BOTH
def test_grpc_cancel_stops_the_request(stand_in_server, model):
    with make_client(stand_in_server) as client:
        generation = client.stream(model, GenerationRequest("a b c", max_tokens=500, ignore_eos=True))
        for i, _ in enumerate(generation):
            if i == 2:
                generation.cancel()
        result = generation.result()
        assert result.cancelled and 3 <= result.num_output_tokens < 500
        # The stand-in saw the cancellation and is free again (500 tokens would take 5 s).
        assert client.generate(model, GenerationRequest("next", max_tokens=1)).text == "next"


@pytest.mark.server
@pytest.mark.timeout(120)
def test_http_cancel_closes_the_stream(stand_in_server):
    with make_client(stand_in_server, "http") as client:
        generation = client.stream("echo_continuous", GenerationRequest("a b c", max_tokens=30, ignore_eos=True))
        next(generation)
        generation.cancel()
        result = generation.result()
        assert result.cancelled and 1 <= result.num_output_tokens < 30
        assert client.generate("echo_continuous", GenerationRequest("next", max_tokens=1)).text == "next"


@pytest.mark.server
@pytest.mark.timeout(120)
@BOTH_PROTOCOLS
def test_models_lists_batching_and_readiness(stand_in_server, protocol):
    with make_client(stand_in_server, protocol) as client:
        infos = {info.name: info for info in client.models()}
    assert sorted(infos) == ["echo_continuous", "echo_dynamic"]
    assert all(info.is_ready for info in infos.values())
    assert infos["echo_dynamic"].batching == "dynamic batcher (max_batch_size 8, max_queue_delay 1000 µs)"
    assert infos["echo_continuous"].batching == "decoupled, engine-side continuous batching"


@pytest.mark.server
@pytest.mark.timeout(120)
def test_cli_generate_streams_text(stand_in_server):
    done = run_cli("generate", *server_flags(stand_in_server), "--model", "echo_dynamic", "--max-tokens", "3",
                   "Tell me a story")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "Tell me a\n"
    assert done.stderr.startswith("[length] 4 prompt + 3 generated tokens; ttft ")


@pytest.mark.server
@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra", [[], ["--protocol", "http"], ["--protocol", "http", "--no-stream"], ["--no-stream"]])
def test_cli_generate_json(stand_in_server, extra):
    done = run_cli(
        "generate", *server_flags(stand_in_server), *extra, "--json", "--model", "echo_continuous",
        "--stop", "x", "--stop", "story", "--temperature", "0", "--top-p", "0.9", "--top-k", "5", "--seed", "3",
        "Tell me a story",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert sorted(result) == sorted(["ttft_s", "tpot_s", "e2e_s", "num_input_tokens", "num_output_tokens",
                                     "finish_reason", "text"])
    assert (result["text"], result["finish_reason"], result["num_input_tokens"], result["num_output_tokens"]) == (
        "Tell me a", "stop", 4, 3
    )  # fmt: skip
    assert 0 < result["ttft_s"] <= result["e2e_s"]
    assert (result["tpot_s"] is None) == ("--no-stream" in extra)


@pytest.mark.server
@pytest.mark.timeout(120)
def test_cli_models_and_errors(stand_in_server):
    done = run_cli("models", *server_flags(stand_in_server))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["MODEL", "STATE", "BATCHING"]
    assert lines[1].split(None, 2) == ["echo_continuous", "READY", "decoupled, engine-side continuous batching"]
    batching = "dynamic batcher (max_batch_size 8, max_queue_delay 1000 µs)"
    assert lines[2].split(None, 2) == ["echo_dynamic", "READY", batching]

    done = run_cli("generate", *server_flags(stand_in_server), "--model", "nope", "hi")
    assert done.returncode == 1
    assert done.stderr == "client: error: model 'nope' is not served; served models: echo_continuous, echo_dynamic\n"
    done = run_cli("generate", *server_flags(stand_in_server), "--protocol", "http", "--model", "echo_dynamic", "")
    assert done.returncode == 1
    assert done.stderr == "client: error: 'echo_dynamic': text_input is empty\n"


# ---------------------------------------------------------------------------------------------- the real models


@pytest.fixture(scope="module")
def llm_server(triton_server_factory, smollm2_dir):
    """model_repository/ (llm_dynamic, llm_continuous) serving the real SmolLM2."""
    server = triton_server_factory.start(REPO_ROOT / "model_repository", model=smollm2_dir)
    yield server
    server.stop()


@pytest.mark.server
@pytest.mark.smollm2
@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", ["llm_dynamic", "llm_continuous"])
def test_cli_generate_on_the_real_models(llm_server, model):
    """Greedy, exactly 8 tokens (min_tokens: EOS cannot cut it short on any CPU): streamed over gRPC and answered
    whole by HTTP /generate, the same text."""
    greedy = ["--model", model, "--max-tokens", "8", "--min-tokens", "8", "--temperature", "0", "--json",
              "The capital of France is"]
    streamed = run_cli("generate", *server_flags(llm_server), *greedy, timeout=300)
    assert streamed.returncode == 0, streamed.stderr
    result = json.loads(streamed.stdout)
    assert result["text"] and result["finish_reason"] == "length"
    assert result["num_input_tokens"] > 0 and result["num_output_tokens"] == 8
    assert 0 < result["ttft_s"] <= result["e2e_s"]

    whole = run_cli("generate", *server_flags(llm_server), "--protocol", "http", "--no-stream", *greedy, timeout=300)
    assert whole.returncode == 0, whole.stderr
    assert json.loads(whole.stdout)["text"] == result["text"]


@pytest.mark.server
@pytest.mark.smollm2
@pytest.mark.timeout(600)
def test_cli_models_on_the_real_models(llm_server):
    done = run_cli("models", *server_flags(llm_server))
    assert done.returncode == 0, done.stderr
    rows = [line.split(None, 2) for line in done.stdout.splitlines()[1:]]
    assert rows == [
        ["llm_continuous", "READY", "decoupled, engine-side continuous batching"],
        ["llm_dynamic", "READY", "dynamic batcher (max_batch_size 8, max_queue_delay 2000 µs)"],
        ["llm_iterative", "READY", "decoupled, Triton's iterative sequence batcher (max_batch_size 8)"],
        ["llm_static", "READY", "dynamic batcher (max_batch_size 8, max_queue_delay 1000000 µs)"],
    ]
