"""One colour per model, the same in the report's plots (loadtest/plots.py) and the live view (loadtest/live.py).

Hex strings (matplotlib's "tab:" colours, named beside them), so the live view needs no matplotlib: the Locust image
(docker/locust.Dockerfile) has none.
"""

from __future__ import annotations

from backend.contract.names import CONTINUOUS, DYNAMIC, ITERATIVE, STATIC

COLORS = {
    STATIC: "#7f7f7f",  # tab:gray
    DYNAMIC: "#ff7f0e",  # tab:orange
    ITERATIVE: "#2ca02c",  # tab:green
    CONTINUOUS: "#1f77b4",  # tab:blue
    "vllm": "#d62728",  # tab:red: vLLM at its default seats (loadtest/peer_rows.py), apart from every Triton model
}
# tab:brown, tab:red, tab:pink, tab:olive, tab:cyan, tab:purple
OTHER_COLORS = ["#8c564b", "#d62728", "#e377c2", "#bcbd22", "#17becf", "#9467bd"]


def color(model: str) -> str:
    """A fixed colour per shipped model; other models (llm_dynamic's variants) one of the rest, fixed by name."""
    if model in COLORS:
        return COLORS[model]
    return OTHER_COLORS[sum(model.encode()) % len(OTHER_COLORS)]
