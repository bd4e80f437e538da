"""Triton Inference Server glue (not OpenAI Triton, the ``triton`` package of the GPU kernels).

What the models' ``model.py`` files share, one small module each: ``model_config`` (engine settings from
config.pbtxt), ``parsing`` (requests), ``responses``, ``metrics``, ``shutdown_notice`` (draining on SIGTERM) and
``faults`` (test-only fault injection). Beside them, how the server runs: the launcher (``serve``), the graceful stop
(``shutdown``) and the container probes (``probe``)."""
