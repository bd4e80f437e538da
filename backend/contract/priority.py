"""What a request's priority means, the one owner of the numbers every layer reads: the models (their ``priority``
input and Triton's per-request priority), the client, the load tests and the OpenAI frontend.

Triton's meaning: a level from 1 (the highest) to :data:`PRIORITY_LEVELS`; 0, or a level beyond the last, is
:data:`DEFAULT_PRIORITY_LEVEL` (as Triton's dynamic batcher reads it). The shipped models have three: 1 for interactive
requests, 2 for those that say nothing, 3 for batch jobs. The engine takes the level as it is, as vLLM's
``priority`` (a lower value served earlier), so a level and the engine's number agree in direction.

NOTE: standard library only (the package's rule, ``backend/contract/__init__.py``).
"""

from __future__ import annotations

PRIORITY_LEVELS = 3  # dynamic_batching { priority_levels } of llm_dynamic and llm_static (a test reads both)
DEFAULT_PRIORITY_LEVEL = 2  # dynamic_batching { default_priority_level }: what a request that says nothing gets
INTERACTIVE = 1
BATCH = 3


def priority_level(level: int) -> int:
    """A request's Triton priority as its level: 0 and a level beyond the last are the default one."""
    return level if 1 <= level <= PRIORITY_LEVELS else DEFAULT_PRIORITY_LEVEL


def level_of_openai(priority: int) -> int:
    """vLLM's OpenAI ``priority`` (a lower value served earlier, 0 by default) as Triton's level: 0 is the default
    level, each step below or above it one level up or down, clamped to the levels there are (-1 or lower:
    interactive, 1 or higher: batch)."""
    return min(max(DEFAULT_PRIORITY_LEVEL + priority, 1), PRIORITY_LEVELS)


def openai_priority(level: int) -> int:
    """Triton's level as vLLM's OpenAI ``priority``: the inverse of :func:`level_of_openai`."""
    return priority_level(level) - DEFAULT_PRIORITY_LEVEL
