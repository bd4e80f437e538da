"""``make bench``'s speed targets for this machine, as data (:data:`TARGETS`: what each one measures, its limit and
its moonshot), and :func:`judge_targets`, which judges them on one run's figures. The table
(``bench.engine_table``) prints the judged entries; the JSON file holds them under ``targets``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from backend.contract.names import CONTINUOUS
from bench.engine_workload import WorkloadComparison


@dataclass(frozen=True)
class Target:
    """One target: ``value <= limit`` or ``value >= limit`` (``better``) on a run's figure of what ``meaning`` says.

    ``unit`` says how the limit and the value read: ``x`` a ratio (``<= 1.1x``), ``%`` a share (``<= 3%``), ``""``
    a rate (``>= 1500``). ``scope`` (what the judged figure covers) follows the name in parentheses once judged.
    """

    name: str
    meaning: str
    limit: float
    better: Literal["<=", ">="]
    unit: Literal["x", "%", ""] = "x"
    moonshot: float | None = None  # the limit we would like, same direction
    scope: str = ""

    @property
    def title(self) -> str:
        return f"{self.name} ({self.scope})" if self.scope else self.name

    @property
    def bound(self) -> str:
        """The limit as the goal says it: ``<= 1.1x``, ``<= 3%``, ``>= 1500``."""
        amount = {"x": f"{self.limit}x", "%": f"{self.limit:.0%}", "": f"{self.limit:.0f}"}[self.unit]
        return f"{self.better} {amount}"

    @property
    def goal(self) -> str:
        return self.bound + (f" (moonshot {self.moonshot:g}x)" if self.moonshot is not None else "")

    def met(self, value: float) -> bool:
        return value <= self.limit if self.better == "<=" else value >= self.limit

    def moonshot_met(self, value: float) -> bool:
        return self.moonshot is not None and (value <= self.moonshot if self.better == "<=" else value >= self.moonshot)

    def format_value(self, value: float | None) -> str:
        return "-" if value is None else f"{value:.1%}" if self.unit == "%" else f"{value:.2f}"


TARGETS: dict[str, Target] = {
    "served_itl": Target(
        "served ITL / offline step", "served inter-token gap / the offline decode step at the same batch and sampling",
        1.10, "<=", scope="batch 1, 8, 32; greedy and T=1"),
    "memory_floor": Target(
        "offline decode step at batch 1 / memory floor",
        "greedy decode step / the time to read the weights and the K/V once at the measured bandwidth",
        1.5, "<=", moonshot=1.2),
    "sampling_share": Target(
        "sampling share of the step at batch 32", "time in the sampler / the decode step", 0.03, "<=", unit="%",
        scope="T=1, top_p=0.9"),
    "batch64_tok_s": Target(
        "decode output tok/s at batch 64", "64 / the greedy decode step", 1500.0, ">=", unit="", scope="offline"),
    "mixed_step": Target(
        "mixed step / (its chunk alone + its decodes alone)",
        "a step with a prefill chunk and N decodes / (a step of the chunk alone + a decode step of the N rows)",
        1.10, "<="),
    "workload_speedup": Target(
        "workload: continuous / static output tok/s", "the burst workload's output tok/s, continuous / static",
        2.0, ">="),
    "llamacpp_itl": Target(
        "served vs llama.cpp's llama-server", "llm_continuous served ITL / llama.cpp's ITL at batch 1, greedy",
        1.5, "<=", moonshot=1.0),
    "llamacpp_speedup": Target(
        "served vs llama.cpp's llama-server", "llama.cpp's ITL / llm_continuous served ITL at batch 8, greedy",
        1.5, ">="),
}


def judge_targets(result: dict) -> list[dict]:
    """One entry per target: ``key`` (in :data:`TARGETS`), ``name``, ``value`` (``None`` when this run did not
    measure it), ``goal``, ``met`` (``None``: not judged) and ``detail``."""
    judged = [
        _served_itl(result), _memory_floor(result), _sampling_share(result), _batch64_tok_s(result),
        _mixed_step(result), _workload_speedup(result), _versus_llamacpp(result),
    ]
    return [entry for entry in judged if entry is not None]


def _entry(key: str, value: float | None, detail: str = "", name: str | None = None, goal: str | None = None,
           met: bool | None = None) -> dict:
    """A judged entry of ``TARGETS[key]``; ``met`` from its limit unless given, ``None`` without a value."""
    target = TARGETS[key]
    if value is not None and met is None:
        met = target.met(value)
    return {"key": key, "name": target.title if name is None else name, "value": value,
            "goal": target.goal if goal is None else goal, "met": met, "detail": detail}


def _fixed_row(result: dict, batch: int) -> dict | None:
    return next((row for row in result["fixed_batches"] if row["batch"] == batch), None)


def _served_itl(result: dict) -> dict:
    served = [r for r in (result["served"] or {}).get("runs", []) if r["batch"] in (1, 8, 32)]
    if not served:
        return _entry("served_itl", None, "no served column in this run", name=TARGETS["served_itl"].name)
    worst = max(served, key=lambda r: r["ratio"])
    return _entry("served_itl", worst["ratio"],
                  f"worst: {worst['model']} batch {worst['batch']} T={worst['temperature']:g}")


def _memory_floor(result: dict) -> dict | None:
    row = _fixed_row(result, 1)
    if row is None:
        return None
    ratio = row["step_over_floor"]
    return _entry("memory_floor", ratio, "moonshot met" if TARGETS["memory_floor"].moonshot_met(ratio) else "")


def _sampling_share(result: dict) -> dict | None:
    row = _fixed_row(result, 32)
    if row is None:
        return None
    sample_ms, step_ms = row["sample_ms"]["t1_top_p"], row["top_p_decode_step_ms"]
    return _entry("sampling_share", sample_ms / step_ms, f"{sample_ms:.2f} ms of {step_ms:.1f}")


def _batch64_tok_s(result: dict) -> dict | None:
    row = _fixed_row(result, 64)
    return None if row is None else _entry("batch64_tok_s", row["decode_tok_s"])


def _mixed_step(result: dict) -> dict | None:
    mixed = result.get("mixed_steps") or []
    if not mixed:
        return None
    worst = max(mixed, key=lambda r: r["ratio"])
    detail = f"worst: {worst['num_decodes']} decodes + a {worst['chunk']}-token chunk"
    return _entry("mixed_step", worst["ratio"], detail)


def _workload_speedup(result: dict) -> dict:
    return _entry("workload_speedup", WorkloadComparison.from_json(result["workload"]).speedup)


def _versus_llamacpp(result: dict) -> dict:
    """Two targets judged as one entry: ``llm_continuous`` served and llama.cpp at batches 1 and 8, greedy, both in
    this run; ``value`` is batch 1's (served ITL / llama.cpp's)."""
    itl, speedup = TARGETS["llamacpp_itl"], TARGETS["llamacpp_speedup"]
    goal = f"batch 1 {itl.bound} its ITL (moonshot {itl.moonshot:g}x); batch 8 {speedup.bound} faster"
    served = {r["batch"]: r["itl_ms"] for r in (result["served"] or {}).get("runs", [])
              if r["model"] == CONTINUOUS and r["temperature"] == 0}
    llamacpp = {r["batch"]: r["itl_ms"] for r in (result.get("llamacpp") or {}).get("runs", [])
                if r["temperature"] == 0}
    if not llamacpp:
        return _entry("llamacpp_itl", None, "llama.cpp not run (--llamacpp PATH; `make llamacpp` builds it)",
                      goal=goal)
    if not {1, 8} <= served.keys():
        return _entry("llamacpp_itl", None, "no llm_continuous served at batches 1 and 8 in this run; llama.cpp ITL "
                      + ", ".join(f"{v:.1f} ms at batch {b}" for b, v in sorted(llamacpp.items())), goal=goal)
    if not {1, 8} <= llamacpp.keys():
        return _entry("llamacpp_itl", None, "llama.cpp was not run at batches 1 and 8", goal=goal)
    slower, faster = served[1] / llamacpp[1], llamacpp[8] / served[8]
    detail = (f"batch 1: served {served[1]:.1f} ms / llama.cpp {llamacpp[1]:.1f} ms = {slower:.2f}x"
              f"{' (moonshot met)' if itl.moonshot_met(slower) else ''}; batch 8: llama.cpp {llamacpp[8]:.1f} "
              f"ms / served {served[8]:.1f} ms = {faster:.2f}x faster")
    return _entry("llamacpp_itl", slower, detail, goal=goal, met=itl.met(slower) and speedup.met(faster))
