"""``make bench``'s burst workload, continuous beside static batching: what one run of each measured
(:class:`PolicyRun`), and the two side by side (:class:`WorkloadComparison`), as ``bench.engine`` writes them into
its JSON (key ``workload``) and the table and the record read them back."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

POLICIES = ("continuous", "static")


@dataclass(frozen=True)
class PolicyRun:
    """One batching policy's run of the whole workload."""

    tok_s: float  # output tokens / wall time in steps
    mean_batch: float  # mean sequences per forward step (StepRecord.num_seqs)
    num_steps: int
    # KV internal fragmentation: 1 - sum(tokens in cache) / sum(blocks held * block_size) over running requests,
    # summed over every step
    fragmentation: float
    num_output_tokens: int
    # Where the time went: wall time in steps that carried prompt tokens, and in decode-only steps; how many steps
    # carried prompt tokens, and the decode rows they carried beside their chunks. None: a result from before they
    # were measured.
    prefill_s: float | None = None
    decode_s: float | None = None
    prefill_steps: int | None = None
    prefill_step_decodes: int | None = None


@dataclass(frozen=True)
class WorkloadComparison:
    """The same requests (all at t=0, ``ignore_eos``) under both policies at the same ``max_num_seqs``."""

    num_requests: int
    max_num_seqs: int
    num_prompt_tokens: int
    continuous: PolicyRun
    static: PolicyRun

    @property
    def speedup(self) -> float:
        """Continuous's output tokens/s over static's."""
        return self.continuous.tok_s / self.static.tok_s

    @property
    def num_output_tokens(self) -> int:
        return self.continuous.num_output_tokens

    def runs(self) -> list[tuple[str, PolicyRun]]:
        """(policy, its run), continuous first."""
        return [("continuous", self.continuous), ("static", self.static)]

    def to_json(self) -> dict:
        """The JSON ``bench.engine`` writes: the counts, ``num_output_tokens`` and ``speedup``, and one object per
        policy."""
        counts = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in POLICIES}
        return {**counts, "num_output_tokens": self.num_output_tokens, "speedup": self.speedup,
                **{policy: dataclasses.asdict(run) for policy, run in self.runs()}}

    @classmethod
    def from_json(cls, data: dict) -> WorkloadComparison:
        """What :meth:`to_json` wrote, or a result written before the policies had an object each: flat keys
        ``continuous_tok_s``, ``static_tok_s``, ... (``fragmentation`` for continuous's) and one
        ``num_output_tokens`` (both policies generate the same tokens)."""
        counts = {"num_requests": data["num_requests"], "max_num_seqs": data["max_num_seqs"],
                  "num_prompt_tokens": data["num_prompt_tokens"]}
        if all(policy in data for policy in POLICIES):
            return cls(**counts, **{policy: PolicyRun(**data[policy]) for policy in POLICIES})
        return cls(**counts, **{policy: _flat_policy_run(data, policy) for policy in POLICIES})


def _flat_policy_run(data: dict, policy: str) -> PolicyRun:
    """One policy's run from a result of the older, flat shape."""
    return PolicyRun(
        tok_s=data[f"{policy}_tok_s"],
        mean_batch=data[f"{policy}_mean_batch"],
        num_steps=data[f"{policy}_steps"],
        fragmentation=data["fragmentation" if policy == "continuous" else f"{policy}_fragmentation"],
        num_output_tokens=data["num_output_tokens"],
        prefill_s=data.get(f"{policy}_prefill_s"),
        decode_s=data.get(f"{policy}_decode_s"),
        prefill_steps=data.get(f"{policy}_prefill_steps"),
        prefill_step_decodes=data.get(f"{policy}_prefill_step_decodes"),
    )
