"""The scheduler: budget, seats, chunked prefill, preemption, abort, both ways of batching, and random runs."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.engine.block_manager import BlockManager
from backend.engine.config import EngineConfig
from backend.engine.request import FinishReason, Request, RequestStatus
from backend.engine.sampling_params import SamplingParams
from backend.engine.scheduler import Scheduler, SchedulerOutput

EOS = 0


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = False,
    batching: str = "continuous",
    max_model_len: int = 64,
    scheduling_policy: str = "fcfs",
) -> Scheduler:
    config = EngineConfig(
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=enable_chunked_prefill,
        enable_prefix_caching=enable_prefix_caching,
        batching=batching,
        max_model_len=max_model_len,
        scheduling_policy=scheduling_policy,
    )
    return Scheduler(config, BlockManager(num_blocks, block_size, enable_prefix_caching))


def make_request(request_id: str, num_prompt_tokens: int, max_tokens: int | None = 4, first_token: int = 1,
                 priority: int = 0) -> Request:
    prompt = [first_token + i for i in range(num_prompt_tokens)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), eos_token_ids=(EOS,), priority=priority)


def step(scheduler: Scheduler, token: int = 7) -> SchedulerOutput:
    output = scheduler.schedule()
    scheduler.update(output, {s.request.request_id: token for s in output.scheduled if s.samples})
    return output


def plan(output: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.request.request_id, s.num_new_tokens) for s in output.scheduled]


def test_running_requests_are_scheduled_before_new_prompts():
    scheduler = make_scheduler()
    scheduler.add_request(a := make_request("a", 5))
    assert plan(step(scheduler)) == [("a", 5)]
    scheduler.add_request(make_request("b", 3))
    output = scheduler.schedule()
    assert plan(output) == [("a", 1), ("b", 3)]
    assert [s.samples for s in output.scheduled] == [True, True]
    assert output.num_batched_tokens == 4
    assert a.timings.first_scheduled is not None and a.timings.first_token is not None


def test_token_budget_and_max_num_seqs_hold():
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=8)
    for name in "abc":
        scheduler.add_request(make_request(name, 3))
    output = step(scheduler)
    assert plan(output) == [("a", 3), ("b", 3)]  # c has no seat
    assert (output.num_running, output.num_waiting) == (2, 1)

    scheduler = make_scheduler(max_num_seqs=4, max_num_batched_tokens=6)
    for name in "abc":
        scheduler.add_request(make_request(name, 4))
    output = step(scheduler)
    assert plan(output) == [("a", 4), ("b", 2)]  # b is chunked to the budget left; c waits
    assert output.num_batched_tokens == 6


def test_chunked_prefill_splits_a_long_prompt_and_mixes_with_decodes():
    scheduler = make_scheduler(max_num_batched_tokens=8, max_model_len=64)
    scheduler.add_request(make_request("a", 3, max_tokens=10))
    step(scheduler)
    scheduler.add_request(b := make_request("b", 20))
    plans = []
    for _ in range(3):
        output = step(scheduler)
        plans.append((plan(output), [s.samples for s in output.scheduled]))
    assert plans == [
        ([("a", 1), ("b", 7)], [True, False]),
        ([("a", 1), ("b", 7)], [True, False]),
        ([("a", 1), ("b", 6)], [True, True]),
    ]
    assert (b.num_computed_tokens, b.num_output_tokens) == (20, 1)


def test_without_chunked_prefill_a_too_long_head_blocks_the_queue():
    scheduler = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False, max_model_len=16)
    scheduler.add_request(make_request("a", 4, max_tokens=3))
    scheduler.add_request(make_request("a2", 4, max_tokens=3))
    step(scheduler)
    scheduler.add_request(make_request("big", 15, max_tokens=1, first_token=100))  # 15 > 16 - 2 decodes
    scheduler.add_request(make_request("small", 2, max_tokens=1))
    for _ in range(2):  # small would fit beside the decodes, but it must not jump the queue
        assert plan(step(scheduler)) == [("a", 1), ("a2", 1)]
        assert [r.request_id for r in scheduler.waiting] == ["big", "small"]
    assert not scheduler.running  # both decoders reached max_tokens
    assert plan(step(scheduler)) == [("big", 15)]  # whole, never chunked; small needs 2 > 1 left
    assert plan(step(scheduler)) == [("small", 2)]


def test_preemption_takes_the_newest_puts_it_first_and_it_resumes():
    # 6 blocks of 2 tokens; three 3-token prompts take 2 blocks each and fill the pool.
    scheduler = make_scheduler(num_blocks=6, block_size=2, max_model_len=12)
    a, b, c = (make_request(name, 3, max_tokens=5, first_token=10 * i + 1) for i, name in enumerate("abc"))
    for request in (a, b, c):
        scheduler.add_request(request)
    scheduler.add_request(d := make_request("d", 1, max_tokens=1))
    step(scheduler)
    step(scheduler)  # token 4 of each fits in its second block
    assert scheduler.block_manager.num_free_blocks == 0
    output = step(scheduler)  # a and b each need a third block: c (the newest) makes room
    assert output.preempted_ids == ["c"]
    assert plan(output) == [("a", 1), ("b", 1)]
    assert [r.request_id for r in scheduler.waiting] == ["c", "d"]
    assert (c.status, c.num_computed_tokens, c.block_ids, c.num_preemptions) == (RequestStatus.WAITING, 0, [], 1)
    assert scheduler.num_preemptions == 1
    c_tokens = list(c.token_ids)

    for _ in range(50):
        if not scheduler.has_unfinished():
            break
        step(scheduler)
    assert not scheduler.has_unfinished()
    assert c.token_ids[: len(c_tokens)] == c_tokens  # recomputed, not restarted
    assert all(r.finish_reason is FinishReason.LENGTH and r.num_output_tokens == 5 for r in (a, b, c))
    assert d.is_finished
    assert scheduler.block_manager.num_free_blocks == 6


def test_a_request_that_is_itself_the_newest_preempts_itself_and_the_step_stops():
    scheduler = make_scheduler(num_blocks=5, block_size=2, max_model_len=10)
    scheduler.add_request(a := make_request("a", 1, max_tokens=8))
    scheduler.add_request(b := make_request("b", 8, max_tokens=1))
    scheduler.add_request(make_request("c", 1))
    b.sampling_params.max_tokens = 2  # checked at add_request against the pool; now let it grow
    step(scheduler)  # a: 1 block, b: 4 blocks -> pool full; c has no block
    output = step(scheduler)  # a fits in its block; b needs a fifth
    assert plan(output) == [("a", 1)]
    assert output.preempted_ids == ["b"]
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    assert a.status is RequestStatus.RUNNING


def test_abort_frees_blocks_at_once_whether_running_or_waiting():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(a := make_request("a", 9))
    scheduler.add_request(b := make_request("b", 9))
    step(scheduler)
    assert scheduler.block_manager.num_used_blocks == 3
    assert scheduler.finish("a", FinishReason.ABORT) is a
    assert (a.status, a.finish_reason, a.block_ids) == (RequestStatus.FINISHED, FinishReason.ABORT, [])
    assert a.timings.finished is not None
    assert scheduler.block_manager.num_used_blocks == 0
    assert scheduler.finish("b", FinishReason.ABORT) is b and not scheduler.has_unfinished()
    assert scheduler.finish("b", FinishReason.ABORT) is None
    assert scheduler.finish("nobody", FinishReason.ABORT) is None


def test_update_skips_a_request_aborted_after_schedule():
    scheduler = make_scheduler()
    scheduler.add_request(a := make_request("a", 5))
    scheduler.add_request(b := make_request("b", 5))
    output = scheduler.schedule()
    scheduler.finish("a", FinishReason.ABORT)
    assert scheduler.update(output, {"a": 7, "b": 7}) == [b]
    assert a.num_output_tokens == 0 and a.num_computed_tokens == 0
    scheduler.block_manager.check_invariants([a, b])


def test_finish_with_a_stop_string_frees_the_request():
    scheduler = make_scheduler()
    scheduler.add_request(a := make_request("a", 5, max_tokens=None))
    step(scheduler)
    assert scheduler.finish("a", FinishReason.STOP) is a
    assert a.finish_reason is FinishReason.STOP and not scheduler.running
    assert scheduler.block_manager.num_used_blocks == 0


def test_eos_finishes_and_is_returned_once():
    scheduler = make_scheduler()
    scheduler.add_request(a := make_request("a", 5, max_tokens=None))
    output = scheduler.schedule()
    assert scheduler.update(output, {"a": EOS}) == [a]
    assert a.finish_reason is FinishReason.STOP and not scheduler.has_unfinished()
    assert scheduler.schedule().is_empty


def run_two_then_one(batching: str) -> dict[str, int]:
    """a (1 token) and b (6 tokens) run together; c arrives at once. Returns the step that first scheduled c."""
    scheduler = make_scheduler(max_num_seqs=2, batching=batching)
    scheduler.add_request(make_request("a", 2, max_tokens=1))
    scheduler.add_request(make_request("b", 2, max_tokens=6))
    scheduler.add_request(make_request("c", 2, max_tokens=1))
    first_step = {}
    for n in range(20):
        for s in step(scheduler).scheduled:
            first_step.setdefault(s.request.request_id, n)
    assert not scheduler.has_unfinished()
    return first_step


def test_run_to_completion_admits_nobody_until_the_batch_is_done_while_continuous_refills_at_once():
    assert run_two_then_one("continuous") == {"a": 0, "b": 0, "c": 1}
    assert run_two_then_one("run_to_completion") == {"a": 0, "b": 0, "c": 6}


def test_run_to_completion_readmits_a_preempted_member_but_no_newcomer():
    scheduler = make_scheduler(
        num_blocks=6, block_size=2, max_num_seqs=3, batching="run_to_completion", max_model_len=12
    )
    for i, name in enumerate("abc"):
        scheduler.add_request(make_request(name, 3, max_tokens=5, first_token=10 * i + 1))
    scheduler.add_request(make_request("new", 1, max_tokens=1))
    step(scheduler)
    step(scheduler)
    assert step(scheduler).preempted_ids == ["c"]
    admitted = []
    for _ in range(30):  # until the whole batch is done
        if not any(name in scheduler.requests for name in "abc"):
            break
        admitted += [s.request.request_id for s in step(scheduler).scheduled]
    assert "c" in admitted and "new" not in admitted
    assert scheduler.requests["new"].status is RequestStatus.WAITING
    assert plan(step(scheduler)) == [("new", 1)]


def test_iterative_steps_only_the_named_requests_and_the_others_keep_their_blocks():
    scheduler = make_scheduler(batching="iterative")
    for name in "abc":
        scheduler.add_request(make_request(name, 3, max_tokens=4))
    # c is admitted though a and b, ahead of it in the queue, are not named this iteration.
    output = scheduler.schedule(only={"c"})
    assert plan(output) == [("c", 3)]
    scheduler.update(output, {"c": 7})
    assert [r.request_id for r in scheduler.waiting] == ["a", "b"]
    held = list(scheduler.requests["c"].block_ids)
    output = scheduler.schedule(only={"a"})
    assert plan(output) == [("a", 3)]  # c is not stepped and keeps its blocks
    scheduler.update(output, {"a": 7})
    assert scheduler.requests["c"].block_ids == held and scheduler.requests["c"].num_computed_tokens == 3
    assert plan(scheduler.schedule(only={"a", "b", "c"})) == [("c", 1), ("a", 1), ("b", 3)]


def test_iterative_preemption_still_takes_the_newest_running_request_named_or_not():
    scheduler = make_scheduler(num_blocks=4, block_size=2, batching="iterative", max_model_len=12)
    scheduler.add_request(make_request("old", 3, max_tokens=5))
    scheduler.add_request(make_request("new", 3, max_tokens=5, first_token=20))
    step(scheduler)  # both admitted: 2 blocks each, the pool is full
    output = scheduler.schedule(only={"old"})  # old needs no new block yet (4 tokens in 2 blocks)
    scheduler.update(output, {"old": 7})
    output = scheduler.schedule(only={"old"})  # its 5th token needs a third block: new, not named, is preempted
    assert plan(output) == [("old", 1)] and output.preempted_ids == ["new"]
    assert scheduler.requests["new"].status is RequestStatus.WAITING and not scheduler.requests["new"].block_ids


def test_prefix_cache_hit_at_admission_skips_the_shared_blocks():
    scheduler = make_scheduler(block_size=4, enable_prefix_caching=True)
    scheduler.add_request(make_request("a", 10, max_tokens=1))
    step(scheduler)
    scheduler.add_request(b := make_request("b", 11, max_tokens=1))
    assert plan(scheduler.schedule()) == [("b", 3)]  # 8 of 11 tokens come from a's two full blocks
    assert b.num_cached_tokens == 8


def test_a_blocked_head_gives_back_its_prefix_cache_hit():
    scheduler = make_scheduler(
        max_num_seqs=16,
        max_num_batched_tokens=16,
        enable_chunked_prefill=False,
        enable_prefix_caching=True,
        max_model_len=16,
    )
    scheduler.add_request(make_request("a", 9, max_tokens=1))
    step(scheduler)  # a finishes; its two full blocks stay cached in the free queue
    for i in range(10):
        scheduler.add_request(make_request(f"d{i}", 1, max_tokens=5, first_token=50 + i))
    step(scheduler)
    num_free = scheduler.block_manager.num_free_blocks
    scheduler.add_request(b := Request("b", list(range(1, 9)) + list(range(20, 27)), eos_token_ids=(EOS,)))
    # 10 decodes leave 6 tokens of budget; b needs 15 - 8 cached = 7, so it waits without holding the hit.
    assert [n for _, n in plan(scheduler.schedule())] == [1] * 10
    assert (b.block_ids, b.num_computed_tokens, b.status) == ([], 0, RequestStatus.WAITING)
    assert scheduler.block_manager.num_free_blocks == num_free
    scheduler.block_manager.check_invariants(scheduler.running + [b])


def test_a_request_that_can_never_fit_is_refused():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler.add_request(make_request("long", 32))
    with pytest.raises(ValueError, match="prompt has 17 tokens, more than the whole KV cache"):
        scheduler.add_request(make_request("big", 17))
    with pytest.raises(ValueError, match="max_tokens"):
        scheduler.add_request(make_request("grows", 10, max_tokens=8))
    with pytest.raises(ValueError, match="max_tokens"):
        scheduler.add_request(make_request("unbounded", 10, max_tokens=None))
    scheduler.add_request(make_request("ok", 10, max_tokens=7))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("ok", 1))
    assert scheduler.num_waiting == 1


def test_without_chunked_prefill_the_budget_must_cover_max_model_len():
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False, max_model_len=32)


def test_counts_and_kv_bounded_concurrency():
    scheduler = make_scheduler(num_blocks=100, block_size=16, max_num_seqs=64, max_model_len=2048)
    scheduler.add_request(make_request("a", 20))
    scheduler.add_request(make_request("b", 20))
    step(scheduler)
    pool = scheduler.block_manager  # what the engine's snapshot reads
    assert (scheduler.num_running, scheduler.num_waiting, pool.num_used_blocks, pool.num_blocks) == (2, 0, 4, 100)
    assert pool.usage == pytest.approx(0.04)
    # 1,000 tokens per sequence need 63 blocks: the pool holds one such sequence, whatever max_num_seqs says.
    assert scheduler.max_concurrency_by_kv(1000) == 1
    assert scheduler.max_concurrency_by_kv(16) == 100
    with pytest.raises(ValueError):
        scheduler.max_concurrency_by_kv(0)


# ---- random runs ---------------------------------------------------------------------------------------------


@st.composite
def engine_setups(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(2, 40))
    chunked = draw(st.booleans())
    max_num_seqs = draw(st.integers(1, 5))
    min_budget = max_num_seqs if chunked else max(max_num_seqs, max_model_len)
    # NOTE: liveness needs the pool to hold one max-length request; tiny pools above that force preemption.
    min_blocks = -(-max_model_len // block_size)
    return dict(
        block_size=block_size,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(min_budget, min_budget + 16)),
        num_blocks=draw(st.integers(min_blocks, min_blocks + 3)),
        enable_prefix_caching=draw(st.booleans()),
        batching=draw(st.sampled_from(["continuous", "run_to_completion"])),
        scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
    )


# Each arrival: (prompt length, max_tokens, which shared prefix, steps run after it, abort one request or not).
arrivals = st.lists(
    st.tuples(
        st.integers(1, 40),
        st.one_of(st.none(), st.integers(1, 16)),
        st.integers(0, 2),
        st.integers(0, 3),
        st.one_of(st.none(), st.none(), st.none(), st.integers(0, 15)),
    ),
    min_size=1,
    max_size=12,
)


def check_step(scheduler: Scheduler, output: SchedulerOutput, requests: list[Request]) -> None:
    config = scheduler.config
    assert output.num_batched_tokens == sum(s.num_new_tokens for s in output.scheduled)
    assert output.num_batched_tokens <= config.max_num_batched_tokens
    assert len(scheduler.running) <= config.max_num_seqs
    scheduled_ids = [s.request.request_id for s in output.scheduled]
    assert len(set(scheduled_ids)) == len(scheduled_ids)
    assert not set(scheduled_ids) & set(output.preempted_ids)
    if config.scheduling_policy == "fcfs":
        # Running requests first, then admitted ones: together, a subsequence of the running order.
        positions = {r.request_id: i for i, r in enumerate(scheduler.running)}
        assert [positions[i] for i in scheduled_ids] == sorted(positions[i] for i in scheduled_ids)
    else:
        # Both queues in (priority, arrival) order; no class is preempted while a lower one runs this step.
        for queue in (list(scheduler.waiting), scheduler.running):
            keys = [(r.priority, r.timings.arrival) for r in queue]
            assert keys == sorted(keys)
        preempted = [scheduler_request(requests, i).priority for i in output.preempted_ids]
        assert all(p >= s.request.priority for p in preempted for s in output.scheduled)
    for s in output.scheduled:
        request = s.request
        assert s.num_new_tokens >= 1
        assert request.num_computed_tokens + s.num_new_tokens <= request.num_tokens
        num_slots = len(request.block_ids) * scheduler.block_manager.block_size
        assert num_slots >= request.num_computed_tokens + s.num_new_tokens
        assert s.samples == (request.num_computed_tokens + s.num_new_tokens == request.num_tokens)
        if not config.enable_chunked_prefill:
            assert s.samples
    for request in scheduler.waiting:
        assert request.status is RequestStatus.WAITING and request.num_computed_tokens == 0 and not request.block_ids
    if config.batching == "run_to_completion":
        assert {r.request_id for r in scheduler.running} <= scheduler.current_batch_ids
    scheduler.block_manager.check_invariants(requests)


def scheduler_request(requests: list[Request], request_id: str) -> Request:
    return next(r for r in requests if r.request_id == request_id)


def check_after_update(scheduler: Scheduler, requests: list[Request]) -> None:
    for request in requests:
        assert request.num_computed_tokens <= request.num_tokens <= scheduler.max_model_len
        if request.is_finished:
            assert request.finish_reason is not None and not request.block_ids
            assert request.request_id not in scheduler.requests
    scheduler.block_manager.check_invariants(requests)


def fake_sample(rng: random.Random) -> int:
    return EOS if rng.random() < 0.03 else rng.randint(1, 9)


def random_step(scheduler: Scheduler, requests: list[Request], rng: random.Random) -> None:
    output = scheduler.schedule()
    check_step(scheduler, output, requests)
    sampled = {s.request.request_id: fake_sample(rng) for s in output.scheduled if s.samples}
    returned = scheduler.update(output, sampled)
    assert [r.request_id for r in returned] == [i for i in sampled]
    check_after_update(scheduler, requests)


@settings(max_examples=200, deadline=None)
@given(setup=engine_setups(), arrivals=arrivals, seed=st.integers(0, 2**16))
def test_random_runs_never_leak_blocks_break_limits_or_starve(setup, arrivals, seed):
    scheduler = make_scheduler(**setup)
    max_model_len = setup["max_model_len"]
    rng = random.Random(seed)
    # Prompts share prefixes (and come from a tiny vocabulary) so the prefix cache hits and evicts.
    prefixes = [[1, 2, 3, 4, 5, 6, 7, 8] * 5, [2] * 40, [rng.randint(1, 3) for _ in range(40)]]
    requests: list[Request] = []
    for length, max_tokens, prefix, num_steps, abort_index in arrivals:
        length = 1 + (length - 1) % (max_model_len - 1)
        prompt = prefixes[prefix][: max(1, length - 2)] + [rng.randint(1, 9) for _ in range(2)]
        request = Request(f"r{len(requests)}", prompt[:length], SamplingParams(max_tokens=max_tokens), (EOS,),
                          priority=rng.randint(0, 2))
        scheduler.add_request(request)
        requests.append(request)
        for _ in range(num_steps):
            random_step(scheduler, requests, rng)
        if abort_index is not None:
            scheduler.finish(requests[abort_index % len(requests)].request_id, FinishReason.ABORT)
            check_after_update(scheduler, requests)

    # Liveness: each step the oldest running request progresses and is never preempted, so every request
    # finishes within max_model_len steps of becoming the oldest.
    max_steps = max_model_len * sum(not r.is_finished for r in requests) + 1
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            break
        random_step(scheduler, requests, rng)
    assert not scheduler.has_unfinished(), f"still unfinished after {max_steps} steps: {scheduler.requests}"
    assert not scheduler.running and not scheduler.waiting
    assert scheduler.block_manager.num_free_blocks == setup["num_blocks"]
    for request in requests:
        assert request.is_finished
        max_tokens = request.sampling_params.max_tokens
        assert max_tokens is None or request.num_output_tokens <= max_tokens
