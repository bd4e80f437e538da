"""Triton Inference Server glue (not OpenAI Triton, the ``triton`` package of the GPU kernels).

What the models' ``model.py`` files share: ``served_model`` (their base: everything but the driver that decides the
batch), with one small module each for ``model_config`` (engine settings from config.pbtxt, and its checks),
``parsing`` (requests), ``responses``, ``metrics``, ``shutdown_notice`` (draining on SIGTERM) and ``faults``
(test-only fault injection). What the server and its readers share (the names of models and metrics, the errors'
codes) is ``backend.contract``, below every layer. Beside them, how the server runs: the launcher's command line
(``serve``) over ``server`` (one tritonserver process), ``server_home`` (where the binary comes from) and
``launch_options`` (paths, ports, admin flags), with ``config_text`` (config.pbtxt read and written as Triton's
ModelConfig, for copies with other settings); the graceful stop (``shutdown``), the container probes (``probe``)
and ``processes`` (/proc)."""
