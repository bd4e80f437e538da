"""Named workloads: how long prompts are and how many tokens each request must generate.

Every request is fixed by ``max_tokens`` with ``ignore_eos``, so every model given the same workload does exactly the
same work. Request ``i`` of a workload is a pure function of ``(workload, seed, i)``: the same prompt and the same
length on every run, in every process, for every model. Prompts are words drawn from a fixed list (each is about
one token for SmolLM2's tokenizer), so the prompt length is controlled without any data download.

The ``mixed`` workload is two kinds of traffic on one server (:class:`MixedWorkload`): each Locust user belongs to
one class (:func:`deal_user`), interactive or batch, and request ``i`` of a class is a pure function of
``(workload, class, seed, i)``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from backend.contract.priority import BATCH, INTERACTIVE

# Common English words, each a single token (with its leading space) for GPT-2-style BPE vocabularies.
WORDS = tuple(
    dict.fromkeys(
        """
    the of and to in is was for on that with as by at from his her it an were are which this be or has had not
    first one their its new after who they have two also but been other all more time school during city into
    only many most some can year may would over such up there when out where team then about three these world
    than later both state film made between no under music new family part while later used known became being
    game well through series second year league national world since high group life won war played work house
    book four end day each area main around out found even name long early place old local same both small away
    five back last home good life river road light power water north south east west sea land fire wind stone
    tree bird horse king queen story song night morning summer winter garden market village bridge tower ship
    train letter paper picture table window door color green blue red white black gold silver friend mother
    father brother sister child people man woman student teacher doctor farmer writer leader soldier
        """.split()
    )
)


@dataclass(frozen=True)
class Constant:
    value: int

    def sample(self, rng: random.Random) -> int:
        return self.value

    def scaled(self, factor: float) -> "Constant":
        return Constant(_scale(self.value, factor))

    def describe(self) -> str:
        return f"{self.value}"


@dataclass(frozen=True)
class Uniform:
    low: int
    high: int  # inclusive

    def __post_init__(self) -> None:
        if not 0 < self.low <= self.high:
            raise ValueError(f"Uniform needs 0 < low <= high; got {self.low}..{self.high}")

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def scaled(self, factor: float) -> "Uniform":
        return Uniform(_scale(self.low, factor), _scale(self.high, factor))

    def describe(self) -> str:
        return f"{self.low}-{self.high}"


@dataclass(frozen=True)
class Mixture:
    """``parts``: ``(weight, distribution)`` pairs; weights need not sum to one."""

    parts: tuple

    def sample(self, rng: random.Random) -> int:
        weights = [w for w, _ in self.parts]
        _, dist = rng.choices(self.parts, weights=weights)[0]
        return dist.sample(rng)

    def scaled(self, factor: float) -> "Mixture":
        return Mixture(tuple((w, d.scaled(factor)) for w, d in self.parts))

    def describe(self) -> str:
        total = sum(w for w, _ in self.parts)
        return " | ".join(f"{100 * w / total:.0f}%: {d.describe()}" for w, d in self.parts)


def _scale(value: int, factor: float) -> int:
    return max(1, round(value * factor))


@dataclass(frozen=True)
class Workload:
    name: str
    prompt_words: object  # a distribution: number of words in the prompt (about one token each)
    output_tokens: object  # a distribution: max_tokens, generated in full (ignore_eos)
    about: str
    # Shared prefixes: each prompt starts with one of ``prefixes`` fixed texts of ``prefix_words`` words (a system
    # prompt, a document asked about), then its own ``prompt_words``. What a prefix cache, and a router that sends a
    # prefix where it is cached, can save.
    prefixes: int = 0
    prefix_words: int = 0

    def scaled(self, length_scale: float) -> "Workload":
        """Same shape, prompt and output lengths multiplied by ``length_scale`` (shorter runs: --quick, --smoke).

        Both scale together so that the share of the work that is prefill stays what the workload says.
        """
        if length_scale == 1.0:
            return self
        return replace(
            self,
            prompt_words=self.prompt_words.scaled(length_scale),
            output_tokens=self.output_tokens.scaled(length_scale),
            prefix_words=_scale(self.prefix_words, length_scale) if self.prefix_words else 0,
        )

    def describe(self) -> str:
        prefix = f"one of {self.prefixes} shared {self.prefix_words}-word prefixes + " if self.prefixes else ""
        return (
            f"{self.name}: prompt {prefix}{self.prompt_words.describe()} words, "
            f"output {self.output_tokens.describe()} tokens"
        )


WORKLOADS = {
    w.name: w
    for w in (
        Workload("constant", Constant(64), Constant(128), "every request the same: dynamic batching's best case"),
        Workload("uniform", Uniform(16, 128), Uniform(16, 256), "prompt and output lengths uniformly spread"),
        Workload(
            "long_tailed",
            Uniform(16, 128),
            Mixture(((0.9, Uniform(16, 64)), (0.1, Uniform(256, 512)))),
            "most answers short, one in ten very long: a dynamic batch waits on its longest member (docs/batching.md)",
        ),
        Workload(
            "bimodal",
            Uniform(16, 128),
            Mixture(((0.5, Uniform(16, 32)), (0.5, Uniform(192, 256)))),
            "half short answers, half long ones",
        ),
        Workload(
            "shared_prefix",
            Uniform(8, 32),
            Uniform(16, 64),
            "16 long prefixes shared by many requests (system prompts, documents): prefix caching, routing by prefix",
            prefixes=16,
            prefix_words=384,
        ),
    )
}


@dataclass(frozen=True)
class TrafficClass:
    """One kind of traffic of a mixed workload: its request shape, the Triton priority level it is sent at with
    ``--priorities``, and its latency targets (p99; None: no target, e.g. batch jobs)."""

    name: str
    shape: Workload
    priority: int
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def describe(self) -> dict:
        """What results.json keeps of the class, so that a report can be rebuilt from it alone."""
        return {"name": self.name, "shape": self.shape.describe(), "priority": self.priority,
                "ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms}


@dataclass(frozen=True)
class MixedWorkload:
    """Interactive users beside batch users on one model: ``classes[0]`` is the class with latency targets, dealt the
    first ``interactive_users`` users of each model (:func:`deal_user`); the rest are ``classes[1]``."""

    name: str
    classes: tuple[TrafficClass, TrafficClass]
    about: str

    def scaled(self, length_scale: float) -> "MixedWorkload":
        return replace(self, classes=tuple(replace(c, shape=c.shape.scaled(length_scale)) for c in self.classes))

    def traffic_class(self, name: str) -> TrafficClass:
        try:
            return next(c for c in self.classes if c.name == name)
        except StopIteration:
            raise ValueError(f"{self.name} has no class {name!r}") from None

    def describe(self) -> str:
        return f"{self.name}: " + "; ".join(
            f"{c.name} prompt {c.shape.prompt_words.describe()} words, output {c.shape.output_tokens.describe()} "
            "tokens" for c in self.classes)


MIXED = MixedWorkload(
    "mixed",
    (
        TrafficClass("interactive", Workload("interactive", Uniform(16, 64), Uniform(16, 64), "a chat turn"),
                     INTERACTIVE, ttft_ms=500.0, tpot_ms=100.0),
        TrafficClass("batch", Workload("batch", Uniform(256, 512), Uniform(128, 384), "a document job"), BATCH),
    ),
    "short interactive requests with latency targets beside long batch jobs without any",
)
# What --workload accepts in make compare and the Locust users.
WORKLOAD_NAMES = sorted([*WORKLOADS, MIXED.name])


def deal_user(user_number: int, models: list[str], interactive_users: int) -> tuple[str, str]:
    """The model and the class (:data:`MIXED`'s) of the ``user_number``-th user a Locust process starts: users are
    dealt to the models in turn, and the first ``interactive_users`` of each model are interactive."""
    model = models[user_number % len(models)]
    interactive, batch = MIXED.classes
    return model, (interactive if user_number // len(models) < interactive_users else batch).name


@dataclass(frozen=True)
class RequestSpec:
    index: int
    prompt: str
    num_prompt_words: int
    max_tokens: int


def get_workload(name: str, length_scale: float = 1.0) -> Workload | MixedWorkload:
    if name == MIXED.name:
        return MIXED.scaled(length_scale)
    try:
        return WORKLOADS[name].scaled(length_scale)
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOAD_NAMES)}") from None


def make_request(workload: Workload | MixedWorkload, index: int, seed: int = 0, traffic_class: str = "") -> RequestSpec:
    """Request ``index`` of ``workload`` (of its class ``traffic_class`` when it is mixed): the same on every call
    (string seeds hash the same in every process)."""
    if isinstance(workload, MixedWorkload):
        shape = workload.traffic_class(traffic_class).shape
        rng = random.Random(f"{workload.name}:{traffic_class}:{seed}:{index}")
    else:
        shape, rng = workload, random.Random(f"{workload.name}:{seed}:{index}")
    num_words = shape.prompt_words.sample(rng)
    max_tokens = shape.output_tokens.sample(rng)
    prompt = " ".join(rng.choice(WORDS) for _ in range(num_words))
    prefix_words = getattr(shape, "prefix_words", 0)
    if getattr(shape, "prefixes", 0):
        group = rng.randrange(shape.prefixes)
        prefix_rng = random.Random(f"{shape.name}:prefix:{seed}:{group}")  # the group's text, whatever the request
        prompt = " ".join(prefix_rng.choice(WORDS) for _ in range(prefix_words)) + " " + prompt
        num_words += prefix_words
    return RequestSpec(index, prompt, num_words, max_tokens)
