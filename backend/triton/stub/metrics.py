"""The models' custom metrics on Triton's metrics port (``llm_*``, labelled by model; the ``*_by_priority`` ones by the
request's priority level too)."""

from __future__ import annotations

from typing import Any

from backend.contract import names
from backend.contract.priority import DEFAULT_PRIORITY_LEVEL
from backend.engine.llm_engine import RequestOutput
from backend.engine.request import FinishReason

_LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
_GAP_BUCKETS = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0]
_BATCH_BUCKETS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256]


def instance_label(args: dict, model_config: dict) -> str | None:
    """The ``instance`` label of a model served by more than one instance (its ``model_instance_name``), else None.

    Each instance runs its own engine and KV pool in its own stub, and Triton gives two stubs that create a metric
    with the same labels one shared metric: their gauges would overwrite each other. With the instance in the
    labels each has its own; whoever reads the port sums them per model (``loadtest.metrics.select``)."""
    count = sum(int(group.get("count", 1)) for group in model_config.get("instance_group", []) or [{}])
    return args.get("model_instance_name") if count > 1 else None


class TritonMetrics:
    """Custom metrics on Triton's metrics port, labelled by model (and by instance where a model has several:
    :func:`instance_label`). Updated from the one thread that runs the engine.

    NOTE: each MetricFamily must stay referenced while its metrics are used (Triton deletes it otherwise).
    """

    def __init__(self, pb, model_name: str, instance: str | None = None) -> None:
        F = pb.MetricFamily
        labels = {"model": model_name, **({"instance": instance} if instance else {})}
        self._labels = labels

        def family(name: str, doc: str, kind) -> Any:
            fam = F(name=name, description=doc, kind=kind)
            self._families.append(fam)
            return fam

        self._families: list = []
        self._finished = family(names.REQUEST_SUCCESS, "Requests finished, by finish_reason", F.COUNTER)
        self._finished_by_reason: dict[str, Any] = {}
        self.prompt_tokens = family(names.PROMPT_TOKENS, "Prompt tokens processed", F.COUNTER).Metric(labels)
        self.generation_tokens = family(names.GENERATION_TOKENS, "Tokens generated", F.COUNTER).Metric(labels)
        self.prefix_queries = family(names.PREFIX_CACHE_QUERIES, "Prompt tokens looked up in the prefix cache",
                                     F.COUNTER).Metric(labels)
        self.prefix_hits = family(names.PREFIX_CACHE_HITS, "Prompt tokens the prefix cache served (not computed)",
                                  F.COUNTER).Metric(labels)
        self.preemptions = family(names.PREEMPTIONS, "Sequences preempted (recompute)", F.COUNTER).Metric(labels)
        self.running = family(names.NUM_REQUESTS_RUNNING, "Sequences in the running batch", F.GAUGE).Metric(labels)
        self.waiting = family(names.NUM_REQUESTS_WAITING, "Requests waiting to be scheduled", F.GAUGE).Metric(labels)
        self.kv_used = family(names.KV_BLOCKS_USED, "KV-cache blocks in use", F.GAUGE).Metric(labels)
        self.kv_total = family(names.KV_BLOCKS_TOTAL, "KV-cache blocks in the pool", F.GAUGE).Metric(labels)
        self.engines_busy = family(
            names.ENGINES_BUSY, "Engines of this server stepping at once at this engine's last forward, this one "
            "included; above 1 they share the cores (backend/engine/shared_cores.py)", F.GAUGE).Metric(labels)
        self._engine_healthy = family(
            names.ENGINE_HEALTHY, "1 while the engine serves; 0 once it failed and refuses every request "
            "(Triton 2.51 lets a Python model report this nowhere else)", F.GAUGE).Metric(labels)
        # triton_workarounds.READY_AFTER_ENGINE_FAILURE: the launcher's probe reads this gauge
        self._engine_healthy.set(1)
        self._healthy = True
        self._gauge_values: dict[str, int] = {}  # each gauge's value as last set: an unchanged one costs no IPC

        def histogram(name: str, doc: str, buckets: list) -> Any:
            return family(name, doc, F.HISTOGRAM).Metric(labels, buckets=buckets)

        self.ttft = histogram(names.TIME_TO_FIRST_TOKEN, "Time to first token (server side)", _LATENCY_BUCKETS)
        self.tpot = histogram(names.TIME_PER_OUTPUT_TOKEN, "Mean time per output token after the first",
                              _LATENCY_BUCKETS)
        self.e2e = histogram(names.E2E_REQUEST_LATENCY, "Request latency (server side)", _LATENCY_BUCKETS)
        self.queue = histogram(names.QUEUE_TIME, "Time from arrival to first scheduling", _LATENCY_BUCKETS)
        self.batch_size = histogram(names.BATCH_SIZE, "Sequences in each forward step", _BATCH_BUCKETS)
        self._num_steps_seen = 0
        self._histogram = histogram
        self._by_priority = {
            "queue": family(names.QUEUE_TIME_BY_PRIORITY, "Time from arrival to first scheduling, by priority level",
                            F.HISTOGRAM),
            "ttft": family(names.TIME_TO_FIRST_TOKEN_BY_PRIORITY, "Time to first token (server side), by priority "
                           "level", F.HISTOGRAM),
            "tpot": family(names.TIME_PER_OUTPUT_TOKEN_BY_PRIORITY, "Mean time per output token after the first, by "
                           "priority level", F.HISTOGRAM),
            "preemptions": family(names.PREEMPTIONS_BY_PRIORITY, "Preemptions of the requests that ended, by their "
                                  "priority level (counted as each ends)", F.COUNTER),
        }
        self._of_level: dict[int, dict[str, Any]] = {}  # a level's metrics, made when its first request ends

    def iteration_gap(self) -> Any:
        """llm_iterative only: what handing the batch back to Triton costs per iteration."""
        return self._histogram(
            names.ITERATION_GAP, "Time from one execute()'s end to the next execute()'s start while "
            "requests wait to be rescheduled (Triton's iterative sequence batcher)", _GAP_BUCKETS)

    def _level(self, level: int) -> dict[str, Any]:
        metrics = self._of_level.get(level)
        if metrics is None:
            labels = {**self._labels, "priority": str(level)}
            metrics = {kind: fam.Metric(labels) if kind == "preemptions" else
                       fam.Metric(labels, buckets=_LATENCY_BUCKETS) for kind, fam in self._by_priority.items()}
            self._of_level[level] = metrics
        return metrics

    def on_finished(self, output: RequestOutput, arrival: float, priority: int = DEFAULT_PRIORITY_LEVEL) -> None:
        """Count a request that ended; ``priority``: its level, the ``*_by_priority`` series' label."""
        reason = output.finish_reason or FinishReason.ERROR.value
        counter = self._finished_by_reason.get(reason)
        if counter is None:
            counter = self._finished.Metric({**self._labels, "finish_reason": reason})
            self._finished_by_reason[reason] = counter
        counter.increment(1)
        self.prompt_tokens.increment(output.num_prompt_tokens)
        self.prefix_queries.increment(output.num_prompt_tokens)
        if output.num_cached_tokens:
            self.prefix_hits.increment(output.num_cached_tokens)
        self.generation_tokens.increment(output.num_output_tokens)
        level = self._level(priority)
        if output.num_preemptions:
            level["preemptions"].increment(output.num_preemptions)
        t = output.timings
        if t is None or t.finished is None:
            return
        self.e2e.observe(t.finished - arrival)
        if t.first_scheduled is not None:
            for histogram in (self.queue, level["queue"]):
                histogram.observe(max(t.first_scheduled - arrival, 0.0))
        if t.first_token is not None:
            for histogram in (self.ttft, level["ttft"]):
                histogram.observe(t.first_token - arrival)
            if output.num_output_tokens > 1:
                for histogram in (self.tpot, level["tpot"]):
                    histogram.observe((t.finished - t.first_token) / (output.num_output_tokens - 1))

    def on_sequence_finished(self, output: RequestOutput) -> None:
        """A sequence of a request with ``n`` > 1 ended before the request's last one: its tokens count too."""
        self.generation_tokens.increment(output.num_output_tokens)

    def on_steps(self, engine) -> None:
        """Observe the engine steps recorded since the last call, and refresh the gauges. Call it on the thread
        that steps the engine."""
        snapshot = engine.snapshot()
        new = snapshot.num_steps - self._num_steps_seen
        if new > 0:
            for record in engine.stats.recent_steps()[-new:]:
                self.batch_size.observe(record.num_seqs)
                if record.num_preempted:
                    self.preemptions.increment(record.num_preempted)
            self._num_steps_seen = snapshot.num_steps
        self._set("running", snapshot.num_running)
        self._set("waiting", snapshot.num_waiting)
        self._set("kv_used", snapshot.num_kv_blocks_used)
        self._set("kv_total", snapshot.num_kv_blocks_total)
        self._set("engines_busy", snapshot.num_engines_busy)

    def set_healthy(self, healthy: bool) -> None:
        """``llm_engine_healthy``: 0 once the engine failed (``ServedModel.fail``); the only way to set it."""
        if healthy != self._healthy:
            self._engine_healthy.set(1 if healthy else 0)
            self._healthy = healthy

    def _set(self, gauge: str, value: int) -> None:
        # NOTE: every metric update is an IPC round trip to the server; the engine's thread pays it after each step.
        if self._gauge_values.get(gauge) != value:
            getattr(self, gauge).set(value)
            self._gauge_values[gauge] = value
