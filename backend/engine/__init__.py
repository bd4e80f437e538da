"""The engine: no Triton, no server. A token's path: ``llm_engine.LLMEngine.step`` asks the ``scheduler`` (over the
``block_manager``'s KV blocks) what runs, the ``model_runner`` turns that into tensors and runs ``model`` (attention over
the paged cache in ``attention``), the ``sampler`` picks tokens and the ``detokenizer`` turns them into text.
``batching`` holds the ways of driving a batch through it: run to completion (the batcher models) and the engine's
own loop thread (the continuous model)."""
