"""Where tritonserver comes from: the nvidia-pytriton wheel's binary, laid out once with the Python-backend stub
for this interpreter, or an installed server named by ``$TRITONSERVER_HOME``.

The wheel ships only the binary we use (PyTriton's Python API is not used). Its tree is laid out once in
``.triton/tritonserver-<wheel version>-py<XY>/`` with the stub for the running Python; ``$TRITONSERVER_HOME`` names an
installed server instead (NVIDIA's tritonserver image: ``/opt/tritonserver``, with ``bin/`` and ``backends/``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

from backend.contract.settings import SERVER_HOME_ENV_VAR
from backend.triton.launcher.launch_options import REPO_ROOT, LauncherError
from backend.triton.launcher.processes import STUB_NAME, is_alive

DEFAULT_LAYOUT_ROOT = REPO_ROOT / ".triton"
LAYOUT_MARKER = ".complete"
# NOTE: the temporary copy is named after the process: two threads of one process laying the tree out at once would
# remove each other's copy (seen: the soak's two servers of a pattern, "No such file or directory: '__pycache__'").
_LAYING_OUT = threading.Lock()


def _pytriton_dir() -> Path:
    # NOTE: find_spec on the top-level package locates it without importing PyTriton's Python API.
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise LauncherError("nvidia-pytriton is not installed (it ships the tritonserver binary); run `make venv`")
    return Path(next(iter(spec.submodule_search_locations)))


def server_distribution() -> tuple[Path, Path, str]:
    """``(tritonserver tree, shared-library folder, wheel version)`` of the installed nvidia-pytriton wheel."""
    package_dir = _pytriton_dir()
    tree = package_dir / "tritonserver"
    libs = package_dir.parent / "nvidia_pytriton.libs"
    if not (tree / "bin" / "tritonserver").is_file():
        raise LauncherError(f"no tritonserver binary in {tree}; reinstall nvidia-pytriton")
    return tree, libs, importlib.metadata.version("nvidia-pytriton")


def python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def stub_versions(tree: Path) -> list[str]:
    """Python versions that have a Python-backend stub in the wheel, oldest first."""
    stubs = tree / "python_backend_stubs"
    found = [p.parent.name for p in stubs.glob(f"*/{STUB_NAME}")]
    return sorted(found, key=lambda v: tuple(int(part) for part in v.split(".") if part.isdigit()))


def find_stub(tree: Path, version: str) -> Path:
    stub = tree / "python_backend_stubs" / version / STUB_NAME
    if not stub.is_file():
        raise LauncherError(
            f"the Triton Python backend has no stub for Python {version}; "
            f"stubs exist for Python {', '.join(stub_versions(tree)) or '(none)'}. "
            "Recreate the virtual environment with one of those (`make clean venv PYTHON=python3.X`)."
        )
    return stub


def prepare_server_home(version: str | None = None, layout_root: Path = DEFAULT_LAYOUT_ROOT) -> Path:
    """Lay the wheel's tritonserver tree out once, with the stub for ``version``; return that folder.

    The tree is copied into a temporary sibling and renamed into place with its marker already written, so a
    folder without the marker is a leftover of an interrupted copy and is redone. Site-packages is never written.
    """
    version = version or python_version()
    tree, _, wheel_version = server_distribution()
    stub = find_stub(tree, version)
    home = layout_root / f"tritonserver-{wheel_version}-py{version.replace('.', '')}"
    wanted = {"source": str(tree), "nvidia_pytriton": wheel_version, "python": version}
    if _read_json(home / LAYOUT_MARKER) == wanted:
        return home
    with _LAYING_OUT:
        if _read_json(home / LAYOUT_MARKER) != wanted:  # not laid out by another thread meanwhile
            _lay_out(tree, stub, home, wanted, layout_root)
    return home


def _lay_out(tree: Path, stub: Path, home: Path, wanted: dict, layout_root: Path) -> None:
    t0 = time.perf_counter()
    if home.exists():
        shutil.rmtree(home)
    layout_root.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_copies(layout_root, home.name)
    tmp = layout_root / f".{home.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        shutil.copytree(tree, tmp, ignore=shutil.ignore_patterns("python_backend_stubs", "__pycache__"))
        shutil.copy2(stub, tmp / "backends" / "python" / STUB_NAME)
        (tmp / LAYOUT_MARKER).write_text(json.dumps(wanted, indent=2) + "\n")
        try:
            tmp.rename(home)
        except OSError:
            if _read_json(home / LAYOUT_MARKER) != wanted:  # not just another launcher finishing first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"[serve] laid out tritonserver in {home} ({time.perf_counter() - t0:.2f} s)", flush=True)


def server_home(version: str | None = None, layout_root: Path = DEFAULT_LAYOUT_ROOT) -> Path:
    """The tritonserver install to run: ``$TRITONSERVER_HOME`` as it is, else the wheel's, laid out once."""
    installed = os.environ.get(SERVER_HOME_ENV_VAR)
    if not installed:
        return prepare_server_home(version, layout_root)
    home = Path(installed)
    for part in ("bin/tritonserver", "backends/python"):
        if not (home / part).exists():
            raise LauncherError(f"${SERVER_HOME_ENV_VAR} is {home}, which has no {part}: not a tritonserver install")
    return home


def _remove_abandoned_copies(layout_root: Path, name: str) -> None:
    """Remove half-made copies left by launchers that were killed mid-copy."""
    for leftover in layout_root.glob(f".{name}.tmp-*"):
        pid = leftover.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not is_alive(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
