"""What the Triton models share and how the server runs: request parsing, responses and metrics for the models'
``model.py`` files (``triton_adapter``), the launcher (``serve``), the graceful stop (``shutdown``) and the container
probes (``probe``). Not to be confused with OpenAI Triton (the ``triton`` package of the GPU kernels)."""
