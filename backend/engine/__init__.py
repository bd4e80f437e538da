"""The engine: no Triton, no server. A token's path: ``llm_engine.LLMEngine.step`` asks the ``scheduler`` (over the
``block_manager``'s KV blocks) what runs, the ``model_runner`` turns that into tensors and runs ``model`` (attention
over the paged cache in the ``attention`` package, the projections' routing in ``linear``), the ``sampler`` picks
tokens and the ``detokenizer`` turns them into text. ``batching`` holds the ways of driving a batch through it: run to
completion (the batcher models), one step per Triton iteration, and the engine's own loop thread (the continuous
model). ``config`` holds the settings, resolved once against the model's shape, ``sampling_params`` a request's
own; ``shared_cores``, how engines of one server that step at once share the CPU's cores.
"""
