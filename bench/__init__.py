"""The benchmarks, one layer above the engine, the Triton glue and the client they drive: ``make bench``
(``engine``, with its ``served``, ``llamacpp`` and ``mixed_steps`` parts), ``make bench-shared`` (``shared_cores``,
``shared_served``), the weight formats (``quantized``, ``perplexity``), the OpenAI frontend's cost
(``frontend_overhead``) and ``make gpu-check`` (``gpu_check``). Each prints its figures beside a baseline from the same
run."""
