"""Triton Inference Server glue (not OpenAI Triton, the ``triton`` package of the GPU kernels), in two layers:
``stub`` (what runs inside Triton's Python-backend stub process, imported by the models' ``model.py``) below
``launcher`` (what starts, watches and stops tritonserver from outside it). The launcher may import the stub, never
the other way (``tests/unit/test_layering.py``). What the server and its readers share (the names of models and
metrics, the errors' codes, tritonserver's command line) is ``backend.contract``, below every layer."""
