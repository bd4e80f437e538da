"""The engine: no Triton, no server. A token's path: ``llm_engine.LLMEngine.step`` asks the ``scheduler`` (over the
``block_manager``'s KV blocks) what runs, the ``model_runner`` turns that into tensors and runs ``model`` (attention over
the paged cache in ``attention``), the ``sampler`` picks tokens and the ``detokenizer`` turns them into text.
``engine_loop`` runs the engine on a thread of its own for the continuous model."""
