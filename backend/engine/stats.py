"""Engine statistics: per-step timings and batch sizes, KV usage, and per-request counters.

Recorded by the engine thread only; readers (metrics, benchmarks) take snapshots.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepTimes:
    schedule: float
    prepare: float
    forward: float
    sample: float
    update: float

    @property
    def total(self) -> float:
        return self.schedule + self.prepare + self.forward + self.sample + self.update


@dataclass(frozen=True)
class StepRecord:
    num_seqs: int  # sequences in this forward (the batch size that static, dynamic and continuous batching differ in)
    num_tokens: int  # tokens scheduled this step (prefill chunks + decodes)
    num_decodes: int  # sequences that ran one token (the rest ran prompt chunks)
    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_preempted: int
    times: StepTimes


@dataclass
class EngineStats:
    history: int = 4096
    steps: collections.deque = field(default_factory=collections.deque)
    num_steps: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.steps = collections.deque(maxlen=self.history)

    def record_step(self, sched, times: StepTimes, block_manager) -> None:
        record = StepRecord(
            num_seqs=len(sched.scheduled),
            num_tokens=sched.num_batched_tokens,
            num_decodes=sum(1 for s in sched.scheduled if s.num_new_tokens == 1),
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            num_kv_blocks_used=block_manager.num_used_blocks,
            num_preempted=len(sched.preempted_ids),
            times=times,
        )
        with self._lock:
            self.steps.append(record)
            self.num_steps += 1
            self.num_preemptions += record.num_preempted

    def record_finish(self, request) -> None:
        with self._lock:
            self.num_prompt_tokens += request.num_prompt_tokens
            self.num_generation_tokens += request.num_output_tokens

    def recent_steps(self) -> list[StepRecord]:
        with self._lock:
            return list(self.steps)
