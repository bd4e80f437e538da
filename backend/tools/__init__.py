"""Command-line tools around the engine: ``prepare_model`` (the GGUF to a safetensors folder), ``bench`` (offline
decode steps beside HF ``generate`` and the memory floor) and ``bench_served`` (the same workloads through the
server)."""
