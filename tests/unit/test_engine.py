"""The whole engine on the real SmolLM2-135M in float32: greedy text equals HF ``generate`` and does not depend on
batching, token budget, preemption, prefix caching or the way of batching; stop strings, lengths, streaming
deltas and failing steps behave as documented.

One engine per configuration (module-scoped), and the reference generations are computed once.
"""

from __future__ import annotations

import pytest
import torch

from backend.contract import errors
from backend.contract.errors import ErrorKind
from backend.engine.config import EngineConfig
from backend.engine.llm_engine import LLMEngine
from backend.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.smollm2

NEW_TOKENS = 32
PROMPTS = [
    "The history of the printing press begins",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who",
    "Paris is the capital of",
]
# Filler prompts that make up a batch of 16 with mixed lengths (1 to ~110 tokens).
FILLER = [
    "Hi",
    "1, 2, 3, 4,",
    "Water boils at",
    "A list of fruits: apple, banana,",
    "The mitochondria is the powerhouse of the cell. It produces energy in the form of ATP through a process "
    "called cellular respiration, which takes place in",
    "Translate to French: good morning ->",
    "Roses are red, violets are blue,",
    "In 1969, the first humans landed on",
    "import numpy as np\nx = np.arange(10)\n",
    "The three laws of thermodynamics are",
    "Q: What is the largest planet in our solar system?\nA:",
    ("Machine learning is a field of study in artificial intelligence concerned with the development and study of "
     "statistical algorithms that can learn from data and generalise to unseen data, and thus perform tasks "
     "without explicit instructions. Within a subdiscipline of machine learning, advances in the field of deep "
     "learning have allowed neural networks to surpass many previous approaches in performance. Applications"),
]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
BASE = dict(dtype="float32", num_threads=2, max_model_len=512, block_size=16)


def kind_of(message: str | None) -> ErrorKind | None:
    parsed = None if message is None else errors.parse(message)
    return None if parsed is None else parsed.kind


def make_engine(smollm2_dir, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(smollm2_dir), **{**BASE, "num_kv_blocks": 256, **overrides}))


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    return make_engine(smollm2_dir, max_num_seqs=16, max_num_batched_tokens=2048)


@pytest.fixture(scope="module")
def reference(engine):
    """Each prompt generated alone: token ids per prompt."""
    return [engine.generate([p], GREEDY)[0].token_ids for p in PROMPTS]


def test_greedy_matches_hf_generate(smollm2_dir, engine, reference):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    for prompt, ours in zip(PROMPTS, reference):
        input_ids = torch.tensor([engine.tokenizer.encode(prompt)])
        with torch.inference_mode():
            out = hf.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                pad_token_id=engine.tokenizer.hf.pad_token_id,
            )
        theirs = out[0, input_ids.shape[1]:].tolist()
        assert len(theirs) >= 8, "HF stopped almost at once: pick a prompt that does not end in EOS"
        # HF stops at EOS; the engine ignores it, so only the common prefix is comparable.
        assert ours[: len(theirs)] == theirs, prompt
        assert len(ours) == NEW_TOKENS


def test_batch_of_16_mixed_lengths_equals_alone(engine, reference):
    prompts = PROMPTS + FILLER
    assert len(prompts) == 16
    lengths = [len(engine.tokenizer.encode(p)) for p in prompts]
    assert min(lengths) <= 2 and max(lengths) >= 64
    outputs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs[: len(PROMPTS)]] == reference
    assert max(s.num_seqs for s in engine.stats.recent_steps()[-NEW_TOKENS:]) == 16


def test_tiny_token_budget_with_chunked_prefill_equals_alone(smollm2_dir, reference):
    engine = make_engine(smollm2_dir, max_num_seqs=4, max_num_batched_tokens=8, enable_chunked_prefill=True)
    outputs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == reference
    assert max(s.num_tokens for s in engine.stats.recent_steps()) <= 8


def test_tiny_kv_pool_with_preemption_equals_alone(smollm2_dir, reference):
    # 8 blocks of 16 tokens = 128 slots: each request fits alone (<= 56 tokens), all four together do not.
    engine = make_engine(smollm2_dir, num_kv_blocks=8, max_num_seqs=4, max_model_len=128)
    outputs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == reference
    assert engine.stats.num_preemptions > 0
    assert any(o.num_preemptions for o in outputs)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_prefix_cache_hit_equals_alone(smollm2_dir, reference):
    engine = make_engine(smollm2_dir, enable_prefix_caching=True)
    prompt = PROMPTS[2]  # 20+ tokens: at least one full block of 16 to share
    first = engine.add_request("first", prompt, GREEDY)
    while engine.has_unfinished():
        engine.step()
    second = engine.add_request("second", prompt, GREEDY)
    while engine.has_unfinished():
        engine.step()
    assert first.num_cached_tokens == 0 and second.num_cached_tokens > 0
    assert first.output_token_ids == second.output_token_ids == reference[2]


def test_run_to_completion_equals_continuous(smollm2_dir, reference):
    engine = make_engine(smollm2_dir, batching="run_to_completion", max_num_seqs=2)
    # Different lengths so the static batch waits for its longest member before the next one starts.
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (NEW_TOKENS, 8, NEW_TOKENS, 4)]
    outputs = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in outputs] == [ref[: p.max_tokens] for ref, p in zip(reference, params)]
    assert [o.finish_reason for o in outputs] == ["length"] * 4


def test_stop_string_cuts_text_and_finishes_with_stop(engine, reference):
    tokenizer = engine.tokenizer.hf
    full = tokenizer.decode(reference[2], skip_special_tokens=True, clean_up_tokenization_spaces=False)
    # A stop string from the middle of the reference text, straddling token boundaries.
    middle = len(full) // 2
    stop = full[middle - 3 : middle + 4]
    assert stop.strip() and len(stop) == 7
    (out,) = engine.generate(
        [PROMPTS[2]], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, stop=[stop])
    )
    assert out.finish_reason == "stop"
    assert out.text == full[: full.index(stop)]
    assert stop not in out.text and "".join(out.delta_texts) == out.text
    assert out.token_ids == reference[2][: len(out.token_ids)]
    assert len(out.token_ids) < NEW_TOKENS


def test_min_tokens_holds_back_a_stop_token(engine, reference):
    ref = reference[2]
    i = next(i for i in range(2, NEW_TOKENS) if ref[i] not in ref[:i])  # a token that first appears at position i
    params = dict(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, stop_token_ids=[ref[i]])
    (early,) = engine.generate([PROMPTS[2]], SamplingParams(**params))
    assert early.finish_reason == "stop" and early.token_ids == ref[: i + 1]
    (held,) = engine.generate([PROMPTS[2]], SamplingParams(**params, min_tokens=i + 4))
    assert held.token_ids[:i] == ref[:i] and len(held.token_ids) >= i + 4
    assert ref[i] not in held.token_ids[: i + 4]  # not sampled while fewer than min_tokens were generated
    (exact,) = engine.generate([PROMPTS[2]], SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0))
    assert exact.finish_reason == "length" and len(exact.token_ids) == 12  # EOS cannot come before 12 either


def test_max_tokens_finishes_with_length_and_deltas_join_to_decode(engine):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for out in engine.generate(PROMPTS + ["안녕하세요, 제 이름은", "Emoji story: 🎉"], params):
        assert out.finish_reason == "length" and len(out.token_ids) == 12
        decoded = engine.tokenizer.hf.decode(out.token_ids, skip_special_tokens=True,
                                             clean_up_tokenization_spaces=False)
        # A length stop inside a multi-byte character drops its bytes instead of sending U+FFFD.
        assert "".join(out.delta_texts) == out.text == decoded.rstrip("\ufffd")
        assert "\ufffd" not in out.text


def test_failing_step_fails_only_its_requests(engine):
    pool = engine.block_manager
    calls = []

    def fail_once(requests):
        calls.append([r.request_id for r in requests])
        if len(calls) == 1:
            raise RuntimeError("injected fault")

    engine.fault_hook = fail_once
    try:
        engine.add_request("doomed-1", PROMPTS[0], GREEDY)
        engine.add_request("doomed-2", PROMPTS[1], GREEDY)
        outputs = engine.step()
        assert sorted(o.request_id for o in outputs) == ["doomed-1", "doomed-2"]
        for o in outputs:
            assert o.finished and o.finish_reason == "error"
            assert kind_of(o.error) is ErrorKind.ENGINE_FAULT and "injected fault" in o.error
        assert pool.num_free_blocks == pool.num_blocks and not engine.has_unfinished()

        later = engine.add_request("later", PROMPTS[3], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        finished = []
        while engine.has_unfinished():
            finished += [o for o in engine.step() if o.finished]
        assert [o.request_id for o in finished] == ["later"] and finished[0].error is None
        assert finished[0].finish_reason == "length" and later.num_output_tokens == 4
        assert pool.num_free_blocks == pool.num_blocks
    finally:
        engine.fault_hook = None


class FatalFault(BaseException):
    """Not an ``Exception``: no step's handler contains it, as with a broken engine."""


def test_run_to_completion_gives_every_member_one_final_output_whatever_happens(engine):
    from backend.engine.batching import SHUTTING_DOWN, run_to_completion

    def run(ids, cancel=(), expire_after=None, fault=None):
        finals, steps = {}, []
        for request_id in ids:
            engine.add_request(request_id, PROMPTS[0], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        engine.fault_hook = fault

        def sink(output):
            if output.finished:
                assert output.request_id not in finals, "a second final output"
                finals[output.request_id] = output

        try:
            error = run_to_completion(
                engine, ids, sink, cancelled=lambda open_ids: [i for i in cancel if i in open_ids and steps],
                expired=lambda: expire_after is not None and len(steps) >= expire_after,
                after_step=lambda: steps.append(1),
            )
        finally:
            engine.fault_hook = None
        assert sorted(finals) == sorted(ids) and not engine.has_unfinished()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        return error, finals

    error, finals = run(["done", "cancelled"], cancel=["cancelled"])
    assert error is None and finals["done"].finish_reason == "length" and finals["done"].num_output_tokens == 6
    assert finals["cancelled"].finish_reason == "abort" and finals["cancelled"].error is None
    error, finals = run(["late-1", "late-2"], expire_after=2)
    assert error is None and all(o.error == SHUTTING_DOWN and o.finish_reason == "abort" for o in finals.values())

    def fatal(requests):
        raise FatalFault("broken")

    error, finals = run(["broken-1", "broken-2"], fault=fatal)
    assert isinstance(error, FatalFault)
    assert all(o.finish_reason == "error" and kind_of(o.error) is ErrorKind.ENGINE_FAILED for o in finals.values())


def test_iteration_driver_steps_whom_triton_hands_back_and_ends_the_rest_once(smollm2_dir, reference):
    from backend.engine.batching import SHUTTING_DOWN, IterationDriver

    engine = make_engine(smollm2_dir, batching="iterative", max_num_seqs=4, num_kv_blocks=64)
    finals, tokens, gone = {}, {}, {}

    def sink(output):
        tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        if output.finished:
            assert output.request_id not in finals and output.request_id not in gone, "a second final output"
            finals[output.request_id] = output

    driver = IterationDriver(engine, sink, gone=lambda output: gone.setdefault(output.request_id, output),
                             reap_after=3600)
    for name, prompt in zip("ab", PROMPTS):
        assert driver.add(name, prompt, GREEDY, None)
    assert not driver.add("too-long", "word " * 600, GREEDY, None) and finals["too-long"].finish_reason == "refused"
    assert kind_of(finals["too-long"].error) is ErrorKind.CONTEXT_LENGTH_EXCEEDED
    # a in every iteration, b in every other: b is not stepped when absent, and both still equal the reference.
    for n in range(200):
        handed = ["a", "b"] if n % 2 else ["a"]
        unfinished = driver.iterate([rid for rid in handed if driver.is_open(rid)])
        assert unfinished <= set(handed)
        if not engine.has_unfinished():
            break
    assert tokens["a"] == reference[0] and tokens["b"] == reference[1]
    batch_sizes = {s.num_seqs for s in engine.stats.recent_steps()}
    assert batch_sizes == {1, 2}

    # A cancelled one ends at once; one never handed back is reaped (its final output goes to `gone`, not the
    # sink); the deadline ends each request when it is next handed in.
    for name in ("cancelled", "gone", "late", "later"):
        driver.add(name, PROMPTS[0], GREEDY, None)
    driver.iterate(["cancelled", "gone", "late", "later"], cancelled=lambda ids: [i for i in ids if i == "cancelled"])
    assert finals["cancelled"].finish_reason == "abort"
    driver.reap_after = 0.0
    driver.iterate(["late", "later"])  # "gone" was not handed back: reaped, its blocks freed
    assert "gone" not in finals and gone["gone"].finish_reason == "abort" and kind_of(gone["gone"].error) is \
        ErrorKind.CANCELLED
    driver.reap_after = 3600
    # A cancelled one is reaped after cancelled_after, well before Triton's idle time; one whose client did not
    # cancel it may still come back until then.
    driver._cancelled_after = 0.0
    driver.add("cancelled-early", PROMPTS[0], GREEDY, None)
    driver.add("held", PROMPTS[0], GREEDY, None)
    driver._client_cancelled = lambda ids: [i for i in ids if i == "cancelled-early"]
    driver.iterate(["cancelled-early", "held", "late", "later"])
    driver.iterate(["late", "later"])
    assert gone["cancelled-early"].finish_reason == "abort" and driver.is_open("held")
    driver.iterate(["held", "late", "later"])
    assert driver.is_open("held")
    driver.iterate(["held"], cancelled=lambda ids: ids)
    assert finals["held"].finish_reason == "abort"
    driver._cancelled_after = None
    # One not handed back whose client did not cancel it was dropped by Triton: its client still gets a final error.
    driver._client_cancelled = lambda ids: []
    driver.add("dropped", PROMPTS[0], GREEDY, None)
    driver.iterate(["dropped", "late", "later"])
    driver.reap_after = 0.0
    driver.iterate(["late", "later"])
    driver.reap_after = 3600
    assert "dropped" not in gone and finals["dropped"].finish_reason == "error"
    assert kind_of(finals["dropped"].error) is ErrorKind.DROPPED and not driver.is_open("dropped")
    assert driver.iterate(["late"], expired=lambda: True) == set() and finals["late"].error == SHUTTING_DOWN
    assert "later" not in finals and driver.is_open("later")
    driver.iterate(["later"], expired=lambda: True)
    assert finals["later"].error == SHUTTING_DOWN
    assert not engine.has_unfinished() and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks

    def fatal(requests):
        raise FatalFault("broken")

    driver.add("broken", PROMPTS[0], GREEDY, None)
    driver.add("bystander", PROMPTS[0], GREEDY, None)
    engine.fault_hook = fatal
    assert driver.iterate(["broken"]) == set() and isinstance(driver.fatal_error, FatalFault)
    engine.fault_hook = None
    assert finals["broken"].finish_reason == "error" and kind_of(finals["broken"].error) is ErrorKind.ENGINE_FAILED
    assert driver.iterate(["bystander"]) == set() and kind_of(finals["bystander"].error) is ErrorKind.ENGINE_FAILED


# ---- KV-pool sizing on a GPU (memory figures injected: the arithmetic and the profiling step run on the CPU) --------

GIB, MIB = 1 << 30, 1 << 20


def test_gpu_kv_blocks_are_what_utilization_leaves_after_weights_activations_and_other_memory():
    from backend.engine.model_runner import num_gpu_kv_blocks

    # 0.9 of 80 GiB = 72 GiB; minus 16 (weights), 4 (activation peak), 1 (CUDA context) = 51 GiB of 2 MiB blocks.
    assert num_gpu_kv_blocks(80 * GIB, 0.9, 16 * GIB, 4 * GIB, 1 * GIB, 2 * MIB) == 51 * 512
    # Every byte of activation peak is a byte less for the pool; a partial block does not count.
    assert num_gpu_kv_blocks(80 * GIB, 0.9, 16 * GIB, 4 * GIB + 3 * MIB, 1 * GIB, 2 * MIB) == 51 * 512 - 2
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.2 .* Raise gpu_memory_utilization"):
        num_gpu_kv_blocks(80 * GIB, 0.2, 15 * GIB, 1 * GIB, 0, 2 * MIB)


@pytest.mark.parametrize(
    "max_num_seqs, max_num_batched_tokens, max_model_len, lengths",
    [(4, 50, 128, [13, 13, 12, 12]), (2, 64, 16, [16, 16]), (8, 8, 128, [1] * 8)],
    ids=["spread", "capped-by-max-model-len", "one-token-each"],
)
def test_gpu_kv_sizing_profiles_the_largest_step(
    tiny_llama_dir, monkeypatch, max_num_seqs, max_num_batched_tokens, max_model_len, lengths
):
    """The pool is sized after one forward at the largest step (every sequence sampled), on a scratch pool whose bytes
    are not counted as activations; torch.cuda's memory figures are stood in for."""
    from backend.engine.model_runner import ModelRunner, num_gpu_kv_blocks

    runner = ModelRunner(EngineConfig(
        model=str(tiny_llama_dir), dtype="float32", num_threads=2, num_kv_blocks=4, gpu_memory_utilization=0.5,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
    ).resolve())
    steps, scratch = [], []
    forward, profile_run = runner.model.forward, runner.profile_run

    def spy_forward(input_ids, positions, kv_caches, meta, logits_indices):
        steps.append(([c.num_query_tokens for c in meta.prefills], meta.num_decode_tokens, len(logits_indices)))
        return forward(input_ids, positions, kv_caches, meta, logits_indices)

    def spy_profile_run():
        scratch.append(profile_run())
        return scratch[-1]

    monkeypatch.setattr(runner.model, "forward", spy_forward)
    monkeypatch.setattr(runner, "profile_run", spy_profile_run)
    weights, activations, reserved, total, free = 3 * GIB, 5 * MIB, 4 * GIB, 16 * GIB, 11 * GIB
    for name, fake in {
        "empty_cache": lambda: None,
        "reset_peak_memory_stats": lambda device=None: None,
        "synchronize": lambda device=None: None,
        "memory_allocated": lambda device=None: weights,
        "max_memory_allocated": lambda device=None: weights + scratch[-1] + activations,
        "memory_reserved": lambda device=None: reserved,
        "mem_get_info": lambda device=None: (free, total),
    }.items():
        monkeypatch.setattr(torch.cuda, name, fake)

    block_bytes = runner.config.block_bytes
    num_blocks = runner._profile_gpu_kv_blocks(block_bytes)
    assert num_blocks == num_gpu_kv_blocks(total, 0.5, weights, activations, total - free - reserved, block_bytes)
    (prefill_lens, num_decodes, num_sampled), = steps
    assert sorted(prefill_lens + [1] * num_decodes, reverse=True) == lengths and num_sampled == len(lengths)
    assert scratch == [sum(-(-n // runner.block_size) for n in lengths) * block_bytes]


def test_device_auto_takes_cuda_when_torch_sees_one_else_the_cpu(monkeypatch):
    from backend.engine.model_runner import resolve_device

    assert EngineConfig().device == "cpu" and EngineConfig().dtype == "bfloat16"
    for bad in ("gpu", "cuda:", "cuda:x"):
        with pytest.raises(ValueError, match="device must be"):
            EngineConfig(device=bad)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ValueError, match="only 2 CUDA device"):
        resolve_device("cuda:2")


def test_iteration_driver_asks_about_cancels_after_its_step_and_frees_the_seat_at_once(smollm2_dir):
    """Clients cancel in answer to what was sent as the iteration began, so mostly during its step: a request found
    cancelled after the step ends in that same iteration, is not returned for rescheduling, and its seat is free for
    the next batch (asked only before the next step, it held a seat while Triton answered it and never handed it
    back)."""
    from backend.engine.batching import IterationDriver

    engine = make_engine(smollm2_dir, batching="iterative", max_num_seqs=1, num_kv_blocks=64)
    finals = {}
    driver = IterationDriver(engine, lambda o: finals.setdefault(o.request_id, o) if o.finished else None,
                             gone=lambda o: None, reap_after=3600)
    driver.add("cancelled", PROMPTS[0], GREEDY, None)
    steps_when_asked = []

    def cancelled(request_ids):
        steps_when_asked.append(engine.stats.num_steps)
        return [rid for rid in request_ids if rid == "cancelled"]

    before = engine.stats.num_steps
    assert driver.iterate(["cancelled"], cancelled=cancelled) == set()
    assert steps_when_asked == [before + 1]  # asked once, after the step
    assert finals["cancelled"].finish_reason == "abort" and not driver.is_open("cancelled")
    # Its one seat is free: the next request is stepped in the very next iteration.
    driver.add("next", PROMPTS[1], GREEDY, None)
    assert driver.iterate(["next"]) == {"next"} and engine.stats.num_steps == before + 2
