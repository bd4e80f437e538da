"""The GPU image (NVIDIA's tritonserver 24.10: Python 3.10) serves the OpenAI frontend as the CPU image does: its
pins (docker/requirements-gpu.txt) carry every package the frontend imports, at versions released for Python 3.10,
and the Dockerfile turns it on for both flavors."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
GPU_PINS = ROOT / "docker" / "requirements-gpu.txt"
FRONTEND_SOURCES = ("frontend/openai", "client", "backend/contract")  # what `python -m frontend.openai` imports


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        spec = line.partition("#")[0].strip()
        if spec:
            requirement = Requirement(spec)
            pins[normalize(requirement.name)] = str(requirement.specifier).removeprefix("==")
    return pins


def third_party_imports() -> set[str]:
    """Top-level modules the frontend's files import that are neither the standard library nor the project's."""
    found = set()
    for folder in FRONTEND_SOURCES:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    found |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m not in ("backend", "client", "frontend")}


def test_the_gpu_image_pins_every_package_the_frontend_imports():
    pins = pinned(GPU_PINS)
    owners = metadata.packages_distributions()
    modules = third_party_imports()
    assert {"fastapi", "uvicorn", "openai", "tritonclient"} <= modules
    missing = {m: owners.get(m) for m in modules if not any(normalize(d) in pins for d in owners.get(m, []))}
    assert not missing, f"docker/requirements-gpu.txt pins no distribution of {missing}"
    # uvicorn's event loop and HTTP parser, which it picks up only when they are installed
    assert {"uvloop", "httptools"} <= pins.keys()


def test_both_flavors_start_the_frontend():
    text = (ROOT / "docker" / "Dockerfile").read_text()
    assert not re.search(r"OPENAI_PORT=0\b", text), "a flavor turns the OpenAI frontend off"
    final_stage = text[text.index("FROM ${FLAVOR}"):]
    assert re.search(r"OPENAI_PORT=9000\b", final_stage), "the stage both flavors share sets OPENAI_PORT=9000"


@pytest.mark.timeout(600)
def test_the_gpu_image_pins_resolve_for_python310(tmp_path):
    """pip finds every pin (torch's CUDA build and its libraries aside, which tests/unit/test_deploy.py checks) as a
    wheel for CPython 3.10 on manylinux x86-64 (metadata only: a dry run); skipped when the package index cannot be
    reached."""
    cuda = re.compile(r"^(torch|triton|nvidia-|cuda-)")
    wanted = tmp_path / "requirements.txt"
    wanted.write_text("".join(f"{n}=={v}\n" for n, v in pinned(GPU_PINS).items() if not cuda.match(n)))
    # NOTE: the image's Ubuntu 22.04 has glibc 2.35, so a wheel for manylinux_2_35 or older installs there.
    tags = ("manylinux_2_35_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
            "manylinux2014_x86_64")
    platforms = [arg for tag in tags for arg in ("--platform", tag)]
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--disable-pip-version-check",
               "--ignore-installed", "--no-deps", "--only-binary=:all:", "--python-version", "3.10",
               "--implementation", "cp", *platforms, "--target", str(tmp_path / "target"), "-r", str(wanted)]
    env = {k: v for k, v in os.environ.items() if k != "PIP_FIND_LINKS"}  # the index, not a local wheel folder
    done = subprocess.run(command, capture_output=True, text=True, timeout=540, env=env)
    if done.returncode and re.search(r"NewConnectionError|Max retries exceeded|Temporary failure", done.stderr):
        pytest.skip(f"the package index cannot be reached: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr[-3000:]
