"""What runs inside Triton's Python-backend stub process: what the models' ``model.py`` files share.

``served_model`` (their base: everything but the driver that decides the batch), with one small module each for
``model_config`` (engine settings from config.pbtxt, and its checks), ``parsing`` (requests), ``responses``,
``metrics``, ``shutdown_notice`` (draining on SIGTERM), ``stream_interval`` (how often a stream's tokens are sent),
``sequence_relay`` (``llm_iterative``'s requests that carry a client's sequence) and ``faults`` (test-only fault
injection).

NOTE: nothing here imports the launcher (``backend.triton.launcher``, above it; ``tests/unit/test_layering.py``): the
stub's environment need not have what the launcher uses (tritonclient, protobuf).
"""
