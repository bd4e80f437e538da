"""The scheduler's ``priority`` policy: queue order, which request is preempted, and that fcfs ignores priorities."""

import pytest

from backend.engine.config import EngineConfig
from backend.engine.request import Request
from tests.unit.test_scheduler import make_request, make_scheduler, plan, step


def queued(scheduler, *requests: Request) -> None:
    for request in requests:
        scheduler.add_request(request)


def test_the_queue_is_ordered_by_priority_then_arrival():
    scheduler = make_scheduler(scheduling_policy="priority", max_num_seqs=2)
    queued(scheduler, make_request("batch1", 3, priority=3), make_request("default", 3, priority=2),
           make_request("batch2", 3, priority=3), make_request("interactive", 3, priority=1))
    assert [r.request_id for r in scheduler.waiting] == ["interactive", "default", "batch1", "batch2"]
    assert plan(step(scheduler)) == [("interactive", 3), ("default", 3)]


def test_fcfs_ignores_priorities():
    scheduler = make_scheduler(max_num_seqs=2)
    queued(scheduler, make_request("low", 3, priority=3), make_request("high", 3, priority=1))
    assert plan(step(scheduler)) == [("low", 3), ("high", 3)]


def test_the_same_class_keeps_arrival_order():
    scheduler = make_scheduler(scheduling_policy="priority", max_num_seqs=1)
    queued(scheduler, *(make_request(name, 2, max_tokens=1, priority=2) for name in "abcd"))
    assert [plan(step(scheduler))[0][0] for _ in range(4)] == ["a", "b", "c", "d"]


def test_a_higher_class_takes_the_seat_of_the_lowest_latest_running_request():
    scheduler = make_scheduler(scheduling_policy="priority", max_num_seqs=3)
    queued(scheduler, make_request("low_old", 2, max_tokens=8, priority=3),
           make_request("mid", 2, max_tokens=8, priority=2),
           make_request("low_new", 2, max_tokens=8, priority=3))
    step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["mid", "low_old", "low_new"]
    scheduler.add_request(make_request("high", 2, max_tokens=8, priority=1))
    output = step(scheduler)
    assert output.preempted_ids == ["low_new"]
    assert [r.request_id for r in scheduler.running] == ["high", "mid", "low_old"]
    assert ("high", 2) in plan(output) and "low_new" not in dict(plan(output))
    assert [r.request_id for r in scheduler.waiting] == ["low_new"]


def test_no_class_is_preempted_for_its_own_or_a_lower_one():
    scheduler = make_scheduler(scheduling_policy="priority", max_num_seqs=2)
    queued(scheduler, make_request("high", 2, max_tokens=8, priority=1),
           make_request("mid", 2, max_tokens=8, priority=2))
    step(scheduler)
    queued(scheduler, make_request("mid_later", 2, priority=2), make_request("low", 2, priority=3))
    output = step(scheduler)
    assert output.preempted_ids == []
    assert plan(output) == [("high", 1), ("mid", 1)]


def test_when_blocks_run_out_the_lowest_class_is_preempted_even_if_it_arrived_first():
    # 4 blocks of 4 tokens: three 4-token prompts take 3 blocks; their first decodes need a block each.
    scheduler = make_scheduler(scheduling_policy="priority", num_blocks=4, max_model_len=16)
    queued(scheduler, make_request("low", 4, max_tokens=8, priority=3),
           make_request("high", 4, max_tokens=8, priority=1),
           make_request("mid", 4, max_tokens=8, priority=2))
    step(scheduler)
    output = step(scheduler)
    assert output.preempted_ids == ["low"]
    assert plan(output) == [("high", 1), ("mid", 1)]
    # The higher classes run on; the preempted one waits for their blocks.
    assert "low" not in dict(plan(step(scheduler)))


def test_a_waiting_higher_class_takes_blocks_from_a_lower_running_one():
    scheduler = make_scheduler(scheduling_policy="priority", num_blocks=4, max_model_len=16)
    scheduler.add_request(make_request("low", 12, max_tokens=2, priority=3))
    step(scheduler)  # low holds 3 of the 4 blocks
    scheduler.add_request(make_request("high", 8, max_tokens=2, priority=1))
    output = step(scheduler)
    assert output.preempted_ids == ["low"] and plan(output) == [("high", 8)]


def test_the_policy_is_checked_and_priority_must_be_an_integer():
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        EngineConfig(scheduling_policy="lifo")
    assert EngineConfig.from_dict({"scheduling_policy": "priority"}).scheduling_policy == "priority"
    with pytest.raises(ValueError, match="priority must be an integer"):
        make_request("a", 2, priority="1")
