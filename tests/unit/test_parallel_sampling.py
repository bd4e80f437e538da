"""Parallel sampling (``n`` > 1): forked sequences share the prompt's blocks, copy the partial one on write, sample
with their own seeds, end on their own, and are preempted and aborted as one request."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.contract.errors import InvalidRequest
from backend.engine.block_manager import BlockManager
from backend.engine.config import EngineConfig
from backend.engine.llm_engine import LLMEngine
from backend.engine.request import FinishReason, Request, RequestStatus
from backend.engine.sampling_params import SamplingParams

PROMPT = "Once upon a time, in a small village at the edge of a great forest, there lived"
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


# ---- the ledger: fork and copy on write -------------------------------------------------------------------------


def forked(manager: BlockManager, num_prompt: int) -> tuple[Request, Request]:
    """A parent whose prompt is computed and a child forked from it, each holding its first token."""
    parent = Request("p", list(range(num_prompt)))
    assert manager.allocate_slots(parent, num_prompt) is not None
    child = Request("c", list(range(num_prompt)))
    manager.fork(parent, child)
    for request, token in ((parent, 100), (child, 200)):
        request.num_computed_tokens = num_prompt
        request.append_token(token)
    return parent, child


def test_fork_shares_every_block_and_copies_the_partial_one_on_first_write():
    manager = BlockManager(num_blocks=8, block_size=4)
    parent, child = forked(manager, 6)  # blocks: one full, one holding 2 of 4
    assert child.block_ids == parent.block_ids and manager.num_used_blocks == 2
    assert [manager.ref_counts[b] for b in parent.block_ids] == [2, 2]
    manager.check_invariants([parent, child])

    shared_full, shared_partial = parent.block_ids
    assert manager.allocate_slots(child, 1) == [2]  # the child writes position 6 into its own copy
    assert child.block_ids == [shared_full, 2]
    assert manager.take_blocks_to_copy() == [(shared_partial, 2)]
    assert manager.allocate_slots(parent, 1) == []  # now the parent's alone: written in place
    assert manager.take_blocks_to_copy() == []
    manager.check_invariants([parent, child])

    manager.free(child)
    assert manager.ref_counts[shared_full] == 1
    manager.free(parent)
    assert manager.num_free_blocks == 8
    manager.check_invariants([])


def test_a_prompt_of_whole_blocks_needs_no_copy():
    manager = BlockManager(num_blocks=8, block_size=4)
    parent, child = forked(manager, 8)
    assert manager.allocate_slots(child, 1) == [2] and manager.allocate_slots(parent, 1) == [3]
    assert manager.take_blocks_to_copy() == []
    manager.check_invariants([parent, child])


def test_copy_on_write_is_all_or_nothing_and_a_freed_copy_is_not_made():
    manager = BlockManager(num_blocks=3, block_size=4)
    parent, child = forked(manager, 6)
    assert manager.allocate_slots(child, 3) is None  # a copy and a new block: one free block is not enough
    assert child.block_ids == parent.block_ids and manager.blocks_to_copy == []
    assert manager.allocate_slots(child, 1) is not None
    manager.free(child)  # preempted before the forward: its copy is dropped
    assert manager.blocks_to_copy == []
    manager.check_invariants([parent])


# ---- the engine -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_threads=2, max_model_len=256,
                                  block_size=16, num_kv_blocks=64, max_num_seqs=16))


def texts(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def test_n_is_validated_and_best_of_refused():
    with pytest.raises(InvalidRequest, match="n must be"):
        SamplingParams(n=0)
    with pytest.raises(InvalidRequest, match="best_of"):
        SamplingParams.from_dict({"n": 2, "best_of": 3})
    assert SamplingParams.from_dict({"n": "3"}).n == 3
    with pytest.raises(InvalidRequest, match="seed \\+ n - 1"):  # sequence i samples with seed + i
        SamplingParams(n=2, seed=2**64 - 1)


def test_n_greedy_answers_equal_the_single_greedy_answer(engine):
    (alone,) = engine.generate([PROMPT], GREEDY)
    outputs = engine.generate([PROMPT], SamplingParams(**{**vars(GREEDY), "n": 3}))
    assert [o.index for o in outputs] == [0, 1, 2]
    assert texts(outputs) == [alone.token_ids] * 3
    assert {o.num_prompt_tokens for o in outputs} == {alone.num_prompt_tokens}
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("settings", [dict(enable_prefix_caching=True), dict(max_num_batched_tokens=7, max_num_seqs=4),
                                      dict(batching="run_to_completion", max_num_seqs=2)],
                         ids=["prefix_caching", "chunked_prefill", "run_to_completion"])
def test_n_greedy_answers_equal_the_single_one_with_prefix_caching_chunks_or_a_fixed_batch(
        tiny_llama_dir, engine, settings):
    (alone,) = engine.generate([PROMPT], GREEDY)
    other = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_threads=2, max_model_len=256,
                                   block_size=16, num_kv_blocks=64, **settings))
    for _ in range(2):  # with prefix caching, the second time hits the first one's blocks
        outputs = other.generate([PROMPT, PROMPT], [SamplingParams(**{**vars(GREEDY), "n": 3}), GREEDY])
        assert texts(outputs) == [alone.token_ids] * 4
        other.block_manager.check_invariants([])


def test_each_sequence_samples_with_its_own_seed(engine):
    params = dict(max_tokens=12, temperature=1.0, ignore_eos=True)
    outputs = engine.generate([PROMPT], SamplingParams(**params, n=3, seed=7))
    alone = engine.generate([PROMPT] * 3, [SamplingParams(**params, seed=7 + i) for i in range(3)])
    assert texts(outputs) == texts(alone)
    assert len(set(map(tuple, texts(outputs)))) > 1


def test_shared_prefix_kv_is_unchanged_by_the_copy_on_write(engine):
    num_prompt = len(engine.tokenizer.encode(PROMPT))
    assert num_prompt % engine.config.block_size, "the prompt must end inside a block for a copy on write"
    engine.add_request("kv", PROMPT, SamplingParams(**{**vars(GREEDY), "n": 2}))
    engine.step()  # the prompt, and the fork
    parent, child = (engine.scheduler.requests[i] for i in engine.groups.sequence_ids("kv"))
    assert parent.block_ids == child.block_ids
    shared = parent.block_ids[-1]
    k_cache, v_cache = engine.runner.kv_caches[0]
    before = k_cache[shared].clone(), v_cache[shared].clone()
    engine.step()  # both write position num_prompt: one into a copy
    assert parent.block_ids[:-1] == child.block_ids[:-1] and parent.block_ids[-1] != child.block_ids[-1]
    used = num_prompt % engine.config.block_size
    for block_id in (parent.block_ids[-1], child.block_ids[-1]):
        assert torch.equal(k_cache[block_id][:used], before[0][:used])
        assert torch.equal(v_cache[block_id][:used], before[1][:used])
    engine.abort("kv")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_outputs_carry_the_index_and_only_the_last_sequence_finishes_the_request(engine):
    engine.add_request("ends", PROMPT, SamplingParams(n=2, temperature=0.0, ignore_eos=True, max_tokens=4))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert {o.request_id for o in outputs} == {"ends"}
    assert sorted(o.index for o in outputs if o.finish_reason) == [0, 1]
    assert [o.finished for o in outputs].count(True) == 1 and outputs[-1].finished
    assert sum(len(o.new_token_ids) for o in outputs) == 8


def test_abort_ends_every_sequence_and_frees_their_blocks(engine):
    engine.add_request("gone", PROMPT, SamplingParams(n=4, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    sequence_ids = engine.groups.sequence_ids("gone")
    assert len(sequence_ids) == 4
    engine.block_manager.check_invariants(engine.scheduler.requests.values())
    assert engine.snapshot().running_request_ids == ("gone",)
    final = engine.abort("gone")
    assert final.finished and final.finish_reason == FinishReason.ABORT.value and final.request_id == "gone"
    assert not engine.has_unfinished() and engine.abort("gone") is None
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.block_manager.check_invariants([])


def test_a_group_is_preempted_whole_and_resumes_to_the_same_answers(tiny_llama_dir, engine):
    # 6 blocks of 16: the group of 2 (40 tokens each at most) fits alone; beside another request it runs out.
    small = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_threads=2, max_model_len=64,
                                   block_size=16, num_kv_blocks=6, max_num_seqs=8))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = engine.generate([PROMPT, PROMPT + " a"], params)
    small.add_request("other", PROMPT + " a", params)
    small.add_request("group", PROMPT, SamplingParams(**{**vars(params), "n": 2}))
    finals, group_preemptions = {}, 0
    while small.has_unfinished():
        before = {r.request_id: r.num_preemptions for r in small.scheduler.requests.values()}
        for output in small.step():
            finals.setdefault((output.request_id, output.index), []).extend(output.new_token_ids)
        requests = list(small.scheduler.requests.values())
        small.block_manager.check_invariants(requests)
        group = [r for r in requests if r.request_id.startswith("group")]
        if any(r.num_preemptions > before.get(r.request_id, 0) for r in group):
            group_preemptions += 1
            assert all(r.status is RequestStatus.WAITING and not r.block_ids for r in group)
    assert group_preemptions > 0
    assert small.stats.num_preemptions > 0
    assert finals[("group", 0)] == finals[("group", 1)] == expected[0].token_ids
    assert finals[("other", 0)] == expected[1].token_ids
    assert small.block_manager.num_free_blocks == small.block_manager.num_blocks


def test_a_group_that_cannot_fit_in_the_cache_is_refused(tiny_llama_dir):
    small = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_threads=2, max_model_len=64,
                                   block_size=16, num_kv_blocks=6))
    with pytest.raises(InvalidRequest, match="n=3"):
        small.add_request("big", PROMPT, SamplingParams(n=3, max_tokens=40))


def test_the_bench_shows_one_prompts_blocks_and_tokens_beside_n_requests(tiny_llama_dir):
    from bench import parallel_sampling

    result = parallel_sampling.run(str(tiny_llama_dir), n=4, prompt_len=64, rounds=1, dtype="float32")
    separate, forked = (result[arm] for arm in parallel_sampling.ARMS)
    assert (separate["kv_blocks"], forked["kv_blocks"]) == (4 * 4, 4)
    assert (separate["tokens_computed"], forked["tokens_computed"]) == (4 * 64, 64)
    record = parallel_sampling.record_table(parallel_sampling.Record("test", {}, {}), result, 4, 64)
    assert "| one request, n=4 | 4 | 64 |" in record.tables["arms"].markdown()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["new", "fork", "decode", "free"]), st.integers(0, 50)), max_size=60))
def test_forked_blocks_are_never_leaked_double_owned_or_written_while_shared(ops):
    manager = BlockManager(num_blocks=12, block_size=4)
    live: list[Request] = []
    for i, (op, x) in enumerate(ops):
        if op == "new":
            request = Request(f"r{i}", list(range(1 + x % 9)))
            if manager.allocate_slots(request, request.num_tokens) is not None:
                request.num_computed_tokens = request.num_tokens
                request.append_token(x)
                live.append(request)
        elif op == "fork" and live:
            parent = live[x % len(live)]
            child = Request(f"r{i}", parent.prompt_token_ids)
            manager.fork(parent, child)
            child.token_ids = list(parent.token_ids)
            child.num_computed_tokens = parent.num_computed_tokens
            live.append(child)
        elif op == "decode" and live:
            request = live[x % len(live)]
            if manager.allocate_slots(request, 1) is not None:
                written = request.block_ids[request.num_computed_tokens // manager.block_size]
                assert manager.ref_counts[written] == 1, "a sequence writes only into a block of its own"
                request.num_computed_tokens += 1
                request.append_token(x)
        elif op == "free" and live:
            manager.free(live.pop(x % len(live)))
        manager.check_invariants(live)
    for request in live:
        manager.free(request)
    manager.check_invariants([])
    assert manager.num_free_blocks == manager.num_blocks


@pytest.mark.parametrize("interactive_first", [True, False])
def test_forked_sequences_keep_their_requests_priority_and_never_run_ahead_of_a_higher_level(tiny_llama_dir,
                                                                                              interactive_first):
    """An n=3 batch request (level 3) beside an interactive one (level 1) in a cache too small for both: its forks
    carry level 3, so they are the ones preempted and the interactive request never waits behind them."""
    small = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_threads=2, max_model_len=64,
                                   block_size=16, num_kv_blocks=12, max_num_seqs=8, scheduling_policy="priority"))
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    add = {"interactive": lambda: small.add_request("interactive", PROMPT + " a", params, priority=1),
           "batch": lambda: small.add_request("batch", PROMPT, SamplingParams(**{**vars(params), "n": 3}),
                                              priority=3)}
    for name in (["interactive", "batch"] if interactive_first else ["batch", "interactive"]):
        add[name]()
    interactive_done = False
    while small.has_unfinished():
        for output in small.step():
            interactive_done |= output.request_id == "interactive" and output.finished
        requests = list(small.scheduler.requests.values())
        assert all(r.priority == 3 for r in requests if r.request_id.startswith("batch"))
        interactive = [r for r in requests if r.request_id == "interactive"]
        if interactive and not interactive_done:
            assert interactive[0].num_preemptions == 0, "the interactive request was preempted for a fork"
    assert small.stats.num_preemptions > 0  # the cache was too small for both: someone had to wait
    assert interactive_done and small.block_manager.num_free_blocks == small.block_manager.num_blocks
