"""Structured output (backend/engine/structured_output.py): every answer parses and validates against its schema,
whatever the model would have said, over many schemas and prompts; choices, regexes and grammars hold; rows without
a grammar are untouched; bad specifications are that request's error and the engine keeps serving.

The many-schemas test samples (temperature 1) from the tiny random Llama, whose unconstrained text is noise: only the
grammar can make it valid JSON. The schemas are pydantic models', and pydantic validates each answer. Every string,
list and number in them is bounded: a random model fills an unbounded one until max_tokens, and an answer cut there
is not JSON (as with any model).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field

from backend.contract.errors import InvalidRequest
from backend.engine.config import EngineConfig
from backend.engine.llm_engine import LLMEngine
from backend.engine.sampling_params import SamplingParams
from backend.engine.structured_output import StructuredOutputs, StructuredOutputsParams


class Closed(BaseModel):
    """No properties beyond the declared ones (a schema that allows any other key allows an unbounded one)."""

    model_config = ConfigDict(extra="forbid")


class Point(Closed):
    x: int = Field(ge=-100, le=100)
    y: int = Field(ge=-100, le=100)


class Person(Closed):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    admin: bool


class Order(Closed):
    item: Literal["apple", "pear", "plum"]
    quantity: int = Field(ge=1, le=9)
    notes: list[Annotated[str, Field(max_length=8)]] = Field(max_length=2)


class Shape(Closed):
    kind: Literal["circle", "square"]
    at: Point
    tags: list[Literal["red", "blue"]] = Field(max_length=3)


class Reading(Closed):
    sensor: str = Field(max_length=6)
    value: Annotated[int, Field(ge=-999, le=999)] | None
    ok: bool


SCHEMAS = (Point, Person, Order, Shape, Reading)
PROMPTS = ("Give me JSON.", "The answer is", "{", "Hello, world", "Return an object describing something")


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_threads=2, max_model_len=512,
                                  block_size=16, num_kv_blocks=256, max_num_seqs=16))


def structured(max_tokens=300, **spec) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, structured_outputs=spec)


def test_every_answer_parses_and_validates_against_its_schema(engine):
    cases = [(model, prompt, seed) for model in SCHEMAS for prompt in PROMPTS for seed in range(2)]
    params = [SamplingParams(max_tokens=300, temperature=1.0, seed=seed,
                             structured_outputs={"json": model.model_json_schema()}) for model, _, seed in cases]
    outputs = engine.generate([prompt for _, prompt, _ in cases], params)
    for (model, prompt, seed), out in zip(cases, outputs):
        assert out.finish_reason == "stop", (model.__name__, prompt, seed, out.text)
        model.model_validate_json(out.text)  # raises on an answer that does not fit


def test_json_object_is_any_json_object(engine):
    outputs = engine.generate(list(PROMPTS), [structured(json_object=True) for _ in PROMPTS])
    for out in outputs:
        if out.finish_reason == "stop":  # an open-ended object may run to max_tokens; what was closed parses
            assert isinstance(json.loads(out.text), dict)
    assert any(out.finish_reason == "stop" for out in outputs)


def test_choice_regex_and_grammar_hold(engine):
    choices = ["positive", "negative", "neutral"]
    outs = engine.generate(list(PROMPTS), [structured(choice=choices) for _ in PROMPTS])
    assert all(out.text in choices and out.finish_reason == "stop" for out in outs)
    outs = engine.generate(list(PROMPTS), [structured(regex=r"[0-9]{3}-[0-9]{4}") for _ in PROMPTS])
    assert all(re.fullmatch(r"[0-9]{3}-[0-9]{4}", out.text) for out in outs), [o.text for o in outs]
    lark = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[1-9]/'
    outs = engine.generate(list(PROMPTS), [structured(grammar=lark, max_tokens=200) for _ in PROMPTS])
    assert all(re.fullmatch(r"\([1-9](\+[1-9])*\)", out.text) for out in outs if out.finish_reason == "stop")


def test_rows_without_a_grammar_are_untouched_by_their_batch_mates(engine):
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = engine.generate(["Hello, world"], plain)[0].token_ids
    mixed = engine.generate(["Hello, world", "Give me JSON."],
                            [plain, structured(json={"type": "object", "properties": {"a": {"type": "integer"}}})])
    assert mixed[0].token_ids == alone


def test_min_tokens_and_ignore_eos_do_not_hold_a_request_past_its_complete_grammar(engine):
    params = SamplingParams(max_tokens=50, min_tokens=40, ignore_eos=True, temperature=1.0,
                            structured_outputs={"choice": ["yes", "no"]})
    out = engine.generate(["Answer:"], params)[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


@pytest.mark.parametrize("spec, message", [
    ({"regex": "("}, "cannot be compiled"),
    ({"grammar": "start: undefined_rule"}, "cannot be compiled"),
    ({"json": {"type": "no-such-type"}}, "cannot be compiled"),
])
def test_a_bad_specification_is_that_requests_error_and_the_engine_keeps_serving(engine, spec, message):
    with pytest.raises(InvalidRequest, match=message):
        engine.add_request("bad", "Hi", structured(**spec))
    assert not engine.has_unfinished() and "bad" not in engine.structured
    assert engine.generate(["Hi"], structured(choice=["a", "b"]))[0].text in ("a", "b")


@pytest.mark.parametrize("value, message", [
    ({}, "exactly one of"),
    ({"json": {"type": "object"}, "regex": "a"}, "exactly one of"),
    ({"json": "[1, 2]"}, "must be a JSON schema"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"choice": []}, "list of 1 to"),
    ({"choice": ["a", 3]}, "list of 1 to"),
    ({"regex": ""}, "non-empty string"),
    ({"guided_json": {}}, "unknown key"),
    ("json", "must be an object"),
])
def test_structured_outputs_params_validate_themselves(value, message):
    with pytest.raises(InvalidRequest, match=message):
        SamplingParams.from_dict({"structured_outputs": value})


def test_params_come_from_what_a_request_sends():
    params = SamplingParams.from_dict({"structured_outputs": {"choice": ["a", "b"]}})
    assert params.structured_outputs == StructuredOutputsParams(choice=("a", "b"))
    assert SamplingParams().structured_outputs is None


def test_the_mask_leaves_only_what_continues_the_grammar(tiny_llama_dir):
    from backend.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_llama_dir)
    vocab = len(tokenizer.hf)
    outputs = StructuredOutputs(tokenizer.hf, vocab, tokenizer.eos_token_ids)
    outputs.add("r", StructuredOutputsParams(choice=("yes", "no")))
    logits = torch.zeros(2, vocab)
    outputs.mask(logits, ["other", "r"])
    assert torch.equal(logits[0], torch.zeros(vocab))  # no grammar: untouched
    allowed = (logits[1] > float("-inf")).nonzero().flatten().tolist()
    texts = [tokenizer.hf.decode([t]) for t in allowed]
    assert allowed and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    token = tokenizer.hf.encode("yes")
    done = [outputs.accept("r", t) for t in token]
    assert done[-1] and not any(done[:-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_mask_write_equals_the_numpy_one(tiny_llama_dir, monkeypatch, dtype):
    """cpu_apply_token_bitmask and the numpy write it replaces give the same logits, for any mask (words all
    allowed, all forbidden, mixed; a vocabulary that ends inside a word) on strided rows among rows without one."""
    import ctypes

    import numpy as np

    from backend.engine.tokenizer import load_tokenizer
    from backend.kernels import cpu_kernels

    if not cpu_kernels.supports_sampling(torch.zeros(1, 8)):
        pytest.skip("no C kernels: the numpy write is the only one")
    tokenizer = load_tokenizer(tiny_llama_dir)
    vocab = 1000 + 7  # not a multiple of 32
    outputs = StructuredOutputs(tokenizer.hf, vocab, tokenizer.eos_token_ids)
    words = (vocab + 31) // 32
    gen = np.random.default_rng(0)
    masks = gen.integers(-(2**31), 2**31, size=(2, words), dtype=np.int64).astype(np.int32)
    masks[:, ::3] = -1  # every token allowed
    masks[:, 1::3] = 0  # none

    class Stub:  # the matcher's one call mask() makes: its row of the bitmask
        def __init__(self, row):
            self.row = row

        def unsafe_compute_mask_ptr(self, address, size):
            np.ctypeslib.as_array((ctypes.c_int32 * words).from_address(address))[:] = self.row

    outputs._matchers = {"a": Stub(masks[0]), "b": Stub(masks[1])}
    base = torch.randn(4, vocab + 9).to(dtype)[:, :vocab]  # strided rows
    c_written = base.clone()
    outputs.mask(c_written, ["a", "none", "b", "none2"])
    monkeypatch.setattr(cpu_kernels, "supports_sampling", lambda logits: False)
    numpy_written = base.clone()
    outputs.mask(numpy_written, ["a", "none", "b", "none2"])
    assert torch.equal(c_written, numpy_written)
    assert torch.equal(c_written[1], base[1]) and torch.equal(c_written[3], base[3])
    forbidden = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")[:, :vocab] == 0
    assert torch.equal(torch.isneginf(c_written[[0, 2]]), torch.from_numpy(forbidden))
