"""OpenAI tool calling (frontend/openai/tools.py) through the official SDK, on all four models.

The tiny random Llama's own text is noise: only the grammar that tool_choice asks for makes its answers valid calls,
so every test checks validity and structure (pydantic validates each call's arguments), never the words; the one
exact comparison is a streamed answer against the whole one with the same seed on the same model. The schemas are
pydantic models sent with ``openai.pydantic_function_tool``; every string, list and number in them is bounded, so an
answer ends well within max_tokens. SmolLM2's chat template takes no tools, so they go in the system turn: the tiny
model here is given a longer context (1,024 tokens) than the other tests' so that five tools fit.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from backend.triton.launcher.launch_options import free_ports
from frontend.openai.process import FrontendProcess
from tests.server_harness import make_repository

pytestmark = pytest.mark.server
MODELS = ("llm_static", "llm_dynamic", "llm_iterative", "llm_continuous")
MAX_MODEL_LEN = 1024
THREADS = 4


class Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GetWeather(Closed):
    """The weather of a city."""

    city: str = Field(max_length=10)
    unit: Literal["celsius", "fahrenheit"]


class Point(Closed):
    x: int = Field(ge=-99, le=99)
    y: int = Field(ge=-99, le=99)


class MoveTo(Closed):
    """Move the robot (a nested model: its schema has $defs)."""

    to: Point
    fast: bool


class AddPerson(Closed):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    admin: bool


class PlaceOrder(Closed):
    item: Literal["apple", "pear", "plum"]
    quantity: int = Field(ge=1, le=9)
    notes: list[Annotated[str, Field(max_length=6)]] = Field(max_length=2)


class SetAlarm(Closed):
    hour: int = Field(ge=0, le=23)
    minute: int = Field(ge=0, le=59)
    label: str | None = Field(max_length=8)


SCHEMAS = {model.__name__: model for model in (GetWeather, MoveTo, AddPerson, PlaceOrder, SetAlarm)}
TOOLS = [openai.pydantic_function_tool(model) for model in SCHEMAS.values()]
TWO_TOOLS = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(MoveTo)]
PROMPTS = ["What is the weather in Paris?", "Move to the door, quickly.", "Add Ann, 34, not an admin.",
           "Two pears, please.", "Wake me at 7:30."]
SEEDS = (1, 2)
SAMPLED = {"temperature": 1.0, "max_tokens": 200}
HISTORY = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "GetWeather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C."},
]


@pytest.fixture(scope="module")
def long_llama_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny random Llama with room for five tools' schemas in its prompt."""
    model_dir = tmp_path_factory.mktemp("tiny-llama-1k") / "model"
    shutil.copytree(tiny_llama_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": MAX_MODEL_LEN}))
    return model_dir


@pytest.fixture(scope="module")
def sdk(triton_server_factory, long_llama_dir, tmp_path_factory):
    repo = make_repository(tmp_path_factory.mktemp("repo") / "model_repository",
                           {"max_model_len": str(MAX_MODEL_LEN), "num_kv_blocks": "512"}, models=MODELS)
    triton = triton_server_factory.start(repo, model=long_llama_dir)
    log = tmp_path_factory.mktemp("frontend") / "frontend.log"
    with FrontendProcess(triton.grpc_url, free_ports(1)[0], long_llama_dir, log_path=log) as frontend:
        yield openai.OpenAI(base_url=f"{frontend.url}/v1", api_key="unused", max_retries=0, timeout=300)


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def calls_of(choice) -> list[tuple[str, str]]:
    return [(call.function.name, call.function.arguments) for call in choice.message.tool_calls or ()]


def assert_valid_calls(choice, names=SCHEMAS) -> None:
    """A tool-call answer: content null, finish reason tool_calls, each call a known tool whose arguments validate."""
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    assert choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names, call
        SCHEMAS[call.function.name].model_validate_json(call.function.arguments)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("model", MODELS)
def test_a_named_functions_arguments_validate_against_its_schema_every_time(sdk, model):
    def ask(case):
        name, prompt, seed = case
        answer = sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                             tools=TOOLS, tool_choice=named(name), seed=seed, **SAMPLED)
        return name, answer.choices[0]

    cases = [(name, prompt, seed) for name in SCHEMAS for prompt in PROMPTS for seed in SEEDS]
    with ThreadPoolExecutor(THREADS) as pool:
        answers = list(pool.map(ask, cases))
    for name, choice in answers:
        assert_valid_calls(choice, names=[name])
        assert len(choice.message.tool_calls) == 1


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", MODELS)
def test_required_and_auto_answer_with_valid_calls_or_text_and_parallel_false_calls_once(sdk, model):
    names = [tool["function"]["name"] for tool in TWO_TOOLS]

    def ask(case):
        tool_choice, parallel, seed = case
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        answer = sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[seed % 5]}],
                                             tools=TWO_TOOLS, tool_choice=tool_choice, seed=seed, **extra,
                                             **{**SAMPLED, "max_tokens": 400})
        return case, answer.choices[0]

    cases = [(choice, parallel, seed) for choice in ("required", "auto") for parallel in (None, False)
             for seed in (1, 2, 3)]
    with ThreadPoolExecutor(THREADS) as pool:
        answers = list(pool.map(ask, cases))
    for (tool_choice, parallel, seed), choice in answers:
        where = f"{tool_choice} parallel_tool_calls={parallel} seed={seed}: {choice}"
        if tool_choice == "required" or choice.finish_reason == "tool_calls":
            assert_valid_calls(choice, names)
        elif choice.finish_reason == "stop":  # auto chose text: the string the model wrote, out of its JSON
            assert choice.message.tool_calls is None and isinstance(choice.message.content, str), where
        else:  # auto's text, cut by max_tokens: the raw answer, never a crash
            assert choice.finish_reason == "length" and choice.message.content.startswith("{"), where
        if parallel is False:
            assert len(choice.message.tool_calls or ()) <= 1, where


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", MODELS)
def test_a_streamed_tool_answer_equals_the_whole_one(sdk, model):
    messages = [{"role": "user", "content": PROMPTS[1]}]
    for tool_choice, n in ((named("MoveTo"), 2), ("required", 1), ("auto", 1)):
        kwargs = dict(model=model, messages=messages, tools=TWO_TOOLS, tool_choice=tool_choice, seed=5, n=n,
                      **{**SAMPLED, "max_tokens": 400})
        whole = sdk.chat.completions.create(**kwargs)
        chunks = list(sdk.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        with sdk.chat.completions.stream(**kwargs) as stream:  # the SDK's own helper reassembles the calls
            assembled = stream.get_final_completion()
        for choice in whole.choices:
            deltas = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == choice.index]
            assert deltas[-1].finish_reason == choice.finish_reason, (tool_choice, deltas)
            again = assembled.choices[choice.index]
            assert again.finish_reason == choice.finish_reason
            assert calls_of(again) == calls_of(choice) and (again.message.content or None) == choice.message.content
            if choice.finish_reason == "tool_calls":
                assert_valid_calls(choice, [tool["function"]["name"] for tool in TWO_TOOLS])
                for call in again.message.tool_calls:  # strict tools: the helper parsed them into the models
                    assert call.function.parsed_arguments == \
                        SCHEMAS[call.function.name].model_validate_json(call.function.arguments)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", MODELS)
def test_a_history_with_a_call_and_its_result_is_rendered_and_answered(sdk, model):
    calls = sdk.chat.completions.create(model=model, messages=HISTORY, tools=TWO_TOOLS, tool_choice="required",
                                        seed=4, **SAMPLED)
    assert_valid_calls(calls.choices[0], ["GetWeather", "MoveTo"])
    text = sdk.chat.completions.create(model=model, messages=HISTORY, tools=TWO_TOOLS, tool_choice="none",
                                       max_tokens=8, seed=4, temperature=1.0, extra_body={"min_tokens": 8})
    assert text.choices[0].message.tool_calls is None and text.choices[0].message.content
    assert text.usage.completion_tokens == 8 and text.usage.prompt_tokens < calls.usage.prompt_tokens  # no tools
