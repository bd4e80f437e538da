"""The names the server and its readers share: the shipped models, in the order every report shows them, and the
metrics the models publish on Triton's metrics port (``backend/triton/stub/metrics.py`` creates them; the stop, the
health probe and the load tests read them).

NOTE: nothing imported at all (the package's rule, ``backend/contract/__init__.py``).
"""

# The shipped models in the order of docs/batching.md, from Triton's batcher waiting for a full batch to the model's
# own loop. A copy of llm_dynamic served with other batcher settings (llm_dynamic_2x8_2000us) sorts after it.
STATIC = "llm_static"  # static batching, a teaching baseline
DYNAMIC = "llm_dynamic"  # Triton's dynamic batcher; each batch runs to completion
ITERATIVE = "llm_iterative"  # Triton's iterative sequence batcher, one engine step per execute()
CONTINUOUS = "llm_continuous"  # the model's own in-flight batching loop
MODELS = (STATIC, DYNAMIC, ITERATIVE, CONTINUOUS)

# ---- the models' metrics, labelled by model (and by instance where a model has several) -----------------------

METRIC_PREFIX = "llm_"
# Counters
REQUEST_SUCCESS = "llm_request_success_total"  # labelled by finish_reason too
PROMPT_TOKENS = "llm_prompt_tokens_total"
GENERATION_TOKENS = "llm_generation_tokens_total"
PREEMPTIONS = "llm_preemptions_total"
# vLLM's prefix-cache pair, in prompt tokens: hits / queries is the hit rate (a router's prefix affinity shows here)
PREFIX_CACHE_QUERIES = "llm_prefix_cache_queries_total"
PREFIX_CACHE_HITS = "llm_prefix_cache_hits_total"
# Gauges
NUM_REQUESTS_RUNNING = "llm_num_requests_running"
NUM_REQUESTS_WAITING = "llm_num_requests_waiting"
KV_BLOCKS_USED = "llm_kv_blocks_used"
KV_BLOCKS_TOTAL = "llm_kv_blocks_total"
ENGINE_HEALTHY = "llm_engine_healthy"
ENGINES_BUSY = "llm_engines_busy"  # engines stepping at once, this one included, at its last forward
# Histograms (Prometheus adds _bucket, _sum and _count)
TIME_TO_FIRST_TOKEN = "llm_time_to_first_token_seconds"
TIME_PER_OUTPUT_TOKEN = "llm_time_per_output_token_seconds"
E2E_REQUEST_LATENCY = "llm_e2e_request_latency_seconds"
QUEUE_TIME = "llm_queue_time_seconds"
BATCH_SIZE = "llm_batch_size"  # sequences in each forward step
ITERATION_GAP = "llm_iteration_gap_seconds"  # llm_iterative only
# The same, labelled by the request's priority level too (priority="1".."3": backend/contract/priority.py). Families
# of their own: a priority label on the names above would double what a reader that sums a name's series counts.
QUEUE_TIME_BY_PRIORITY = "llm_queue_time_by_priority_seconds"
TIME_TO_FIRST_TOKEN_BY_PRIORITY = "llm_time_to_first_token_by_priority_seconds"
TIME_PER_OUTPUT_TOKEN_BY_PRIORITY = "llm_time_per_output_token_by_priority_seconds"
PREEMPTIONS_BY_PRIORITY = "llm_preemptions_by_priority_total"  # counted when the preempted request ends

# ---- Triton's own metrics, labelled by model -------------------------------------------------------------------

TRITON_METRIC_PREFIX = "nv_inference_"
PENDING_REQUESTS = "nv_inference_pending_request_count"  # the queue in front of execute()
EXEC_COUNT = "nv_inference_exec_count"  # batches the model executed



def model_order(model: str) -> tuple[int, str]:
    """Sort key: the shipped models in the order of :data:`MODELS`, a copy served with other settings
    (``llm_dynamic_2x8_2000us``) right after its model, any other model last."""
    base = max((m for m in MODELS if model == m or model.startswith(m + "_")), key=len, default=None)
    return (MODELS.index(base) if base is not None else len(MODELS), model)


def short_name(model: str) -> str:
    """``continuous`` for ``llm_continuous``: a model's name in a sentence."""
    return model.removeprefix("llm_")
