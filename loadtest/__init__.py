"""Locust load tests for the Triton LLM models, and the side-by-side comparison report (``make compare``)."""

# Default service-level objectives for goodput: a request counts when both hold (p99 over a load point must meet
# them for loadtest.slo). Chosen for SmolLM2-135M on 2 CPU cores: a first token within 2 s, and at least 10 tokens/s
# after it (a reader's pace). Override with --slo-ttft-ms / --slo-tpot-ms everywhere.
DEFAULT_SLO_TTFT_MS = 2000.0
DEFAULT_SLO_TPOT_MS = 100.0
