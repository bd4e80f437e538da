"""The code is linted as pyproject.toml's [tool.ruff] says: pyflakes, pycodestyle, import order and bugbear, at 120
columns, over every Python file of the project (the ruff pinned in requirements.txt); and the README stays short."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_ruff_finds_nothing():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


def test_the_readme_stays_within_250_lines():
    """The README holds what a newcomer needs first; the rest belongs in docs/."""
    lines = (REPO_ROOT / "README.md").read_text().count("\n")
    assert lines <= 250, f"README.md has {lines} lines; move detail into docs/"
