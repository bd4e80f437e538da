"""vLLM itself as the Triton models' peer: its CPU build in its own environment (``make vllm-venv``: ``install.sh``,
``requirements.txt``), its OpenAI server started and stopped here (``server.py``), and its ``vllm`` command for that
build (``vllm_cli.py``, run by the environment's own Python), which ``make peer-sweep`` (``bench/peer_sweep.py``)
drives as vLLM's own client."""
