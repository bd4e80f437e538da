"""Engines that share the cores (``backend/engine/shared_cores.py``): each takes its share of the threads while others
are busy, one forward at a time under the step lock, and a process that died inside a forward holds nobody back.

Engines run in processes of their own, as Triton's model instances do: what is shared is a file and ``flock`` locks,
which only other processes exercise."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backend.contract.settings import SHARED_CORES_ENV_VAR
from backend.engine.config import EngineConfig
from backend.engine.shared_cores import BUSY_WINDOW_S, MAX_ENGINES, MAX_FORWARD_S, CoreRegistry, SharedCores, share_of
from tests.fakes import FakeClock

ROOT = str(Path(__file__).resolve().parents[2])


def test_share_of_divides_threads_among_busy_engines():
    assert [share_of(2, busy) for busy in (0, 1, 2, 3, 4)] == [2, 2, 1, 1, 1]
    assert [share_of(8, busy) for busy in (1, 2, 3, 4)] == [8, 4, 2, 2]


def test_an_engine_alone_keeps_every_thread_and_shares_them_while_another_is_busy(tmp_path):
    clock = FakeClock()
    registry = CoreRegistry(tmp_path / "cores")
    a = SharedCores(2, "divide", registry, clock)
    b = SharedCores(2, "divide", CoreRegistry(tmp_path / "cores"), clock)  # another process's own mapping
    with a.forward() as threads:
        assert threads == 2  # b has not stepped
        with b.forward() as threads_b:
            assert threads_b == 1
    with a.forward() as threads:
        assert threads == 1  # b stepped within the busy window
    clock.now += BUSY_WINDOW_S + 0.01
    with a.forward() as threads:
        assert threads == 2  # b went idle
    b.close()
    clock.now += 0.01
    with a.forward() as threads:
        assert threads == 2


def test_off_and_no_registry_take_every_thread(tmp_path, monkeypatch):
    clock = FakeClock()
    busy = SharedCores(2, "divide", CoreRegistry(tmp_path / "cores"), clock)
    off = SharedCores(2, "off", CoreRegistry(tmp_path / "cores"), clock)
    with busy.forward(), off.forward() as threads:
        assert threads == 2 and off.registry is None
    monkeypatch.delenv(SHARED_CORES_ENV_VAR, raising=False)
    assert SharedCores.for_engine(2, "divide").registry is None  # offline: an engine alone, as before


def test_core_sharing_is_validated():
    with pytest.raises(ValueError, match="core_sharing must be one of divide, step_lock, off"):
        EngineConfig(core_sharing="spin")
    assert EngineConfig.from_dict({"core_sharing": "step_lock"}).core_sharing == "step_lock"


def test_slots_are_reused_once_released_and_refused_beyond_the_file(tmp_path):
    registry = CoreRegistry(tmp_path / "cores")
    slots = [registry.register() for _ in range(MAX_ENGINES)]
    assert sorted(slots) == list(range(MAX_ENGINES))
    with pytest.raises(ValueError, match="more than 64 engines"):
        registry.register()
    registry.release(5)
    assert registry.register() == 5


# ---- other processes ---------------------------------------------------------------------------------------------

FORWARDS = r"""
import json, sys, time
from backend.engine.shared_cores import CoreRegistry, SharedCores

path, sharing, count, hold = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
cores = SharedCores(2, sharing, CoreRegistry(path))
print("ready", flush=True)
sys.stdin.readline()  # both start at once
intervals = []
for _ in range(count):
    with cores.forward() as threads:
        start = time.monotonic()
        while time.monotonic() - start < hold:  # a forward: the CPU is busy
            pass
        intervals.append((start, time.monotonic(), threads))
    time.sleep(0.001)  # what a step does besides the forward
print(json.dumps(intervals), flush=True)
"""


def _start(code: str, *args, env: dict | None = None) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": ROOT, **(env or {})})
    assert process.stdout.readline().strip() == "ready"
    return process


def _go(*processes: subprocess.Popen) -> None:
    for process in processes:
        process.stdin.write("go\n")
        process.stdin.flush()


def _intervals(process: subprocess.Popen) -> list:
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 0
    return json.loads(out.strip().splitlines()[-1])


def test_under_the_step_lock_two_processes_never_run_a_forward_at_once_and_both_finish(tmp_path):
    path = tmp_path / "cores"
    a, b = (_start(FORWARDS, path, "step_lock", 60, 0.004) for _ in range(2))
    _go(a, b)
    first, second = _intervals(a), _intervals(b)
    assert len(first) == len(second) == 60  # neither starved
    spans = sorted((start, end) for start, end, _ in first + second)
    overlaps = [(x, y) for x, y in zip(spans, spans[1:]) if y[0] < x[1]]
    assert overlaps == []
    assert {threads for *_, threads in first + second} == {2}  # each forward on every thread


def _certainly_busy(intervals: list) -> list[tuple[float, float]]:
    """When the registry surely counted a process busy, from its forwards' ``(start, end, threads)``: from a
    forward's start (marked before it) to its end plus :data:`BUSY_WINDOW_S` (marked after), but no later than
    :data:`MAX_FORWARD_S` after the forward before it ended (the mark's deadline while it runs); touching spans
    merged. The first forward is left out: when it was marked is not known."""
    spans: list[tuple[float, float]] = []
    for (_, before_end, _), (start, end, _) in zip(intervals, intervals[1:]):
        until = min(end + BUSY_WINDOW_S, before_end + MAX_FORWARD_S)
        if spans and start <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], until))
        else:
            spans.append((start, until))
    return spans


def test_divided_two_busy_processes_each_step_on_half_the_threads(tmp_path):
    path = tmp_path / "cores"
    a, b = (_start(FORWARDS, path, "divide", 100, 0.004) for _ in range(2))
    _go(a, b)
    first, second = _intervals(a), _intervals(b)
    assert len(first) == len(second) == 100
    # A forward whose engine counted the busy engines (between its previous forward's end and its start) while the
    # other was surely busy ran on half the threads. NOTE: which forwards those are is read from the times, not
    # assumed: on a loaded machine one process may start, or pause, long after the other.
    for mine, other in ((first, second), (second, first)):
        busy = _certainly_busy(other)
        beside = [threads for (_, counted_from, _), (counted_by, _, threads) in zip(mine, mine[1:])
                  if any(start <= counted_from and counted_by < until for start, until in busy)]
        assert len(beside) >= 20, f"only {len(beside)} of 100 forwards ran while the other process surely stepped"
        assert beside == [1] * len(beside)


HOLDER = r"""
import sys, time
from backend.engine.shared_cores import CoreRegistry, SharedCores

cores = SharedCores(2, sys.argv[2], CoreRegistry(sys.argv[1]))
with cores.forward():
    print("ready", flush=True)
    time.sleep(600)  # killed inside its forward, holding the step lock
"""


@pytest.mark.timeout(60)  # a forward that waited for the dead holder would wait for ever
@pytest.mark.parametrize("sharing", ["step_lock", "divide"])
def test_an_engine_that_died_inside_a_forward_does_not_hold_the_others(tmp_path, sharing):
    path = tmp_path / "cores"
    holder = _start(HOLDER, path, sharing)
    registry = CoreRegistry(path)
    assert registry.num_busy(time.monotonic()) == 1
    if sharing == "step_lock":  # held: a forward would wait
        fd = registry.step_lock_fd()
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)
    holder.send_signal(signal.SIGKILL)
    holder.wait(10)
    if sharing == "step_lock":  # the kernel dropped the dead holder's flock
        fd = registry.step_lock_fd()
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)
    clock = FakeClock()
    clock.now = time.monotonic() + MAX_FORWARD_S  # the dead holder's deadline has passed
    cores = SharedCores(2, sharing, registry, clock)
    assert cores._slot == 0  # the dead process's slot, taken again
    with cores.forward() as threads:
        assert threads == 2 and cores.last_busy == 1


ENGINE = r"""
import json, sys, threading, time
from backend.engine.openmp import set_wait_policy

set_wait_policy()
from backend.engine.config import EngineConfig
from backend.engine.sampling_params import SamplingParams
from backend.engine.llm_engine import LLMEngine

engine = LLMEngine(EngineConfig(model=sys.argv[1], dtype="float32", max_num_seqs=4, num_kv_blocks=64,
                                max_model_len=256))
print("ready", flush=True)
sys.stdin.readline()  # both start stepping at once
told_to_stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), told_to_stop.set()), daemon=True).start()
params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
threads = []
for i in range(4):
    engine.add_request(f"r{i}", "The history of the printing press begins", params)
finished = set()
# NOTE: on a loaded machine one process may begin after the other has finished: each steps on (a short request at a
# time) until the test has seen both step beside each other, for 60 s at most.
deadline, more = time.monotonic() + 60, 0
while engine.has_unfinished() or (not told_to_stop.is_set() and time.monotonic() < deadline):
    if not engine.has_unfinished():
        engine.add_request(f"more{more}", "And then", SamplingParams(max_tokens=4, ignore_eos=True))
        more += 1
    outputs = engine.step()
    threads.append(engine.cores.last_busy)
    if threads[-1] == 2 and threads.count(2) == 1:  # the first step beside the other
        print("saw the other", flush=True)
    finished |= {o.request_id for o in outputs if o.finished and o.error is None and o.request_id[0] == "r"}
print(json.dumps({"finished": sorted(finished), "busy": threads, "num_steps": engine.stats.num_steps}), flush=True)
"""


def test_two_engines_in_two_processes_stepping_at_once_both_finish(tmp_path, tiny_llama_dir):
    env = {SHARED_CORES_ENV_VAR: str(tmp_path / "cores")}
    engines = [_start(ENGINE, tiny_llama_dir, env=env) for _ in range(2)]
    _go(*engines)
    for engine in engines:  # a process that never sees the other prints its result after 60 s instead
        assert engine.stdout.readline() == "saw the other\n"
    _go(*engines)  # stop
    results = []
    for engine in engines:
        out, _ = engine.communicate(timeout=120)
        assert engine.returncode == 0
        results.append(json.loads(out.strip().splitlines()[-1]))
    for result in results:
        assert result["finished"] == ["r0", "r1", "r2", "r3"]
        assert result["num_steps"] >= 48
        assert 2 in result["busy"]  # they did step at the same time, and saw each other
