"""Parallel sampling (OpenAI's ``n`` > 1): n sequences of one prompt that share the prompt's KV blocks, as in the
PagedAttention paper (section 4.4).

Where the fork happens: a request with ``n`` > 1 runs as one sequence (index 0, the parent) until its prompt is
computed. The step that samples its first token samples n first tokens from that one row of logits, each with the
generator of its own sequence (``seed + index`` when a seed is given), and then creates the n - 1 other sequences,
each holding the parent's blocks by reference (``BlockManager.fork``) and its own first token. Why there: the prompt
is computed once with nothing new in the scheduler (chunked prefill, prefix caching and preemption before the fork
are a single request's); the children appear only once there is something to share, so a queued or half-computed
request holds one seat and one set of blocks; and n sequences that each ran the prompt would have drawn their first
token from these same logits anyway. The last, partial prompt block is copied on write when a sequence first writes
into it (``BlockManager.allocate_slots``, ``ModelRunner.copy_blocks``).

After the fork each sequence is a request of its own to the scheduler: it samples with its own generator, ends on
its own and frees its blocks when done. What makes them a group lives here: the outputs carry the request's id and
the sequence's index, and the request's final output is the last sequence's; an abort of the request's id ends all
its sequences; a group one of whose members was preempted is preempted whole at the end of that step (it goes back to
the front of the queue together, each sequence recomputing its own tokens), and the scheduler refuses a group whose
n sequences could not all fit in the KV cache, so that a group alone can always finish.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable

from backend.engine.request import Request


def sequence_id(request_id: str, index: int) -> str:
    """The scheduler's id of sequence ``index`` of a request (sequence 0 keeps the request's own id)."""
    return request_id if index == 0 else f"{request_id}\x00{index}"  # NOTE: LLMEngine refuses ids with a NUL


@dataclasses.dataclass
class SequenceGroup:
    """The n sequences of one request; ``sequences[i]`` is sequence ``i`` (only the parent before the fork)."""

    request_id: str
    n: int
    sequences: list[Request]
    num_ended: int = 0  # sequences whose last output was made

    @property
    def is_forked(self) -> bool:
        return len(self.sequences) == self.n

    def children(self) -> list[Request]:
        """The n - 1 sequences to fork from the parent (not yet known to the scheduler)."""
        parent = self.sequences[0]
        params = parent.sampling_params
        return [
            Request(sequence_id(self.request_id, i), parent.prompt_token_ids,
                    dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i),
                    parent.eos_token_ids, parent.timings.arrival, parent.priority)
            for i in range(1, self.n)
        ]


@dataclasses.dataclass(frozen=True)
class Fork:
    """A group to fork in this step: its parent's row of the step's logits and its n - 1 new sequences."""

    row: int
    group: SequenceGroup
    children: list[Request]


class SequenceGroups:
    """The engine's groups, by the id of each of their sequences. A request with ``n == 1`` has none."""

    def __init__(self) -> None:
        self._groups: dict[str, SequenceGroup] = {}  # sequence id -> its group

    def add(self, request: Request) -> None:
        """Register a new request; one with ``n`` > 1 becomes the parent of a group."""
        n = request.sampling_params.n
        if n > 1:
            self._groups[request.request_id] = SequenceGroup(request.request_id, n, [request])

    def get(self, request: Request) -> SequenceGroup | None:
        return self._groups.get(request.request_id)

    def to_fork(self, sampled: Iterable[Request]) -> list[Fork]:
        """The groups whose parent samples its first token in this step: the parent's row of the logits, and the
        children to create (not yet known to the scheduler)."""
        forks = []
        for row, request in enumerate(sampled):
            group = self._groups.get(request.request_id)
            if group is not None and not group.is_forked:
                forks.append(Fork(row, group, group.children()))
        return forks

    def fork(self, group: SequenceGroup, children: list[Request]) -> None:
        group.sequences += children
        for child in children:
            self._groups[child.request_id] = group

    def request_id(self, sequence: Request) -> str:
        group = self._groups.get(sequence.request_id)
        return sequence.request_id if group is None else group.request_id

    def index(self, sequence: Request) -> int:
        group = self._groups.get(sequence.request_id)
        return 0 if group is None else group.sequences.index(sequence)

    def end(self, sequence: Request) -> bool:
        """``sequence`` has ended and its last output is being made: whether that output is its request's final one
        (every sequence's last output made; the group is then forgotten)."""
        group = self._groups.get(sequence.request_id)
        if group is None:
            return True
        group.num_ended += 1
        if group.num_ended < len(group.sequences):
            return False
        for member in group.sequences:
            del self._groups[member.request_id]
        return True

    def sequence_ids(self, request_id: str) -> list[str]:
        """The scheduler's ids of a request's sequences (just ``request_id`` for a request without a group)."""
        group = self._groups.get(request_id)
        return [request_id] if group is None else [s.request_id for s in group.sequences]

    def expand(self, request_ids: Collection[str]) -> set[str]:
        """Request ids -> the ids of all their sequences (a step over a request runs all of them)."""
        return {sid for rid in request_ids for sid in self.sequence_ids(rid)}

    def siblings_to_preempt(self, preempted_ids: Iterable[str]) -> list[str]:
        """The other sequences of the groups that lost a member to preemption (a group is preempted whole)."""
        siblings = []
        for preempted in preempted_ids:
            group = self._groups.get(preempted)
            if group is not None:
                siblings += [s.request_id for s in group.sequences
                             if s.request_id != preempted and s.request_id not in siblings]
        return siblings
