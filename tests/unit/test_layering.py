"""Imports point down the layers only: contract <- kernels <- engine <- Triton stub <- launcher <- tools, the frontend
and the load tests (the README's layout). Read from the source with ``ast`` (every import, function-level ones
included), so nothing is imported."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Each layer: the folders (relative to the repository) whose files belong to it, and the module prefixes that name it.
LAYERS = [
    ("contract", ("backend/contract",), ("backend.contract",)),
    ("kernels", ("backend/kernels",), ("backend.kernels",)),
    ("engine", ("backend/engine",), ("backend.engine",)),
    # What runs inside Triton's Python-backend stub (the models and what they import), and what runs tritonserver.
    ("Triton stub", ("backend/triton/stub", "model_repository"), ("backend.triton.stub", "model_repository")),
    ("launcher", ("backend/triton/launcher",), ("backend.triton.launcher",)),
    ("tools, frontends and load tests", ("bench", "tools", "frontend", "loadtest", "client", "records"),
     ("bench", "tools", "frontend", "loadtest", "client", "records")),
]


def layer_of_file(path: Path) -> int | None:
    relative = path.relative_to(ROOT).as_posix()
    return next((i for i, (_, folders, _) in enumerate(LAYERS) if relative.startswith(folders)), None)


def layer_of_module(name: str) -> int | None:
    return next((i for i, (_, _, prefixes) in enumerate(LAYERS)
                 if any(name == p or name.startswith(p + ".") for p in prefixes)), None)


def imported_modules(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, module) for every import in the file, relative imports resolved against its package."""
    package = path.relative_to(root).with_suffix("").parts[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            # `from backend import kernels` names a module too
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def project_files() -> list[Path]:
    files = [p for _, folders, _ in LAYERS for folder in folders for p in (ROOT / folder).rglob("*.py")]
    return sorted(p for p in files if "__pycache__" not in p.parts)


def test_imports_point_down_the_layers_only():
    files = project_files()
    assert len(files) > 40 and all(layer_of_file(p) is not None for p in files)
    upward = []
    for path in files:
        own = layer_of_file(path)
        for line, module in imported_modules(path):
            target = layer_of_module(module)
            if target is not None and target > own:
                upward.append(f"{path.relative_to(ROOT)}:{line} ({LAYERS[own][0]}) imports {module} "
                              f"({LAYERS[target][0]})")
    assert not upward, "imports that point up the layers:\n" + "\n".join(upward)


def test_the_contract_imports_only_the_standard_library():
    """Everything imports the contract, inside Triton's Python stub and in the locust image, which copies that package
    alone of the server's code: it imports nothing of the project's other layers and nothing installed."""
    contract_files = [p for p in project_files() if layer_of_file(p) == 0]
    assert len(contract_files) >= 4
    for path in contract_files:
        for line, module in imported_modules(path):
            top = module.split(".")[0]
            assert top in sys.stdlib_module_names or module.startswith("backend.contract"), \
                f"{path.relative_to(ROOT)}:{line} imports {module}"


def test_the_kernels_import_nothing_of_the_engine():
    """The strictest case, spelled out: a kernel is a tensor operation and knows no engine type."""
    kernel_files = [p for p in project_files() if layer_of_file(p) == 1]
    assert kernel_files
    for path in kernel_files:
        assert not [m for _, m in imported_modules(path) if m.startswith(("backend.engine", "backend.triton"))], path


def test_the_check_sees_an_upward_import(tmp_path):
    """The reader resolves absolute, ``from package import module`` and relative imports."""
    kernel = tmp_path / "backend" / "kernels" / "probe.py"
    kernel.parent.mkdir(parents=True)
    kernel.write_text("from backend import engine\nfrom ..engine import model\nimport backend.triton.launcher.serve\n")
    modules = [m for _, m in imported_modules(kernel, root=tmp_path)]
    assert modules == ["backend.engine", "backend.engine.model", "backend.triton.launcher.serve"]
    assert [layer_of_module(m) for m in modules] == [2, 2, 4]


@pytest.mark.parametrize("folder", ["loadtest", "frontend", "client"])
def test_the_load_tests_the_frontend_and_the_client_import_nothing_of_the_engine(folder):
    """They learn what the server has (KV blocks, seats, max_model_len) from the server, not by importing the engine.
    The frontend and the client not even through the modules they import (their processes load no engine); the load
    tests start servers through the launcher, which does."""
    files = sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)
    assert files
    found = [f"{path.relative_to(ROOT)}:{line} imports {module}" for path in files
             for line, module in imported_modules(path) if module.startswith("backend.engine")]
    if folder != "loadtest":
        found += [f"{folder} imports {module} through other modules" for module in sorted(imported_closure(files))
                  if module.startswith("backend.engine")]
    assert not found, "\n".join(found)


def imported_closure(files: list[Path]) -> set[str]:
    """Every project module that ``files`` import, directly or through each other."""
    seen: set[str] = set()
    todo = list(files)
    while todo:
        for _, module in imported_modules(todo.pop()):
            parts = module.split(".")
            while parts and parts[0] in ("backend", "model_repository"):  # `from m import name`: m is the module
                name = ".".join(parts)
                path = next((p for p in (ROOT / f"{name.replace('.', '/')}.py",
                                         ROOT / name.replace(".", "/") / "__init__.py") if p.is_file()), None)
                if path is not None:
                    if name not in seen:
                        seen.add(name)
                        todo.append(path)
                    break
                parts.pop()
    return seen


def test_the_models_never_load_the_config_text_writer():
    """Triton's Python stub hands a model its config as JSON; ``config_text`` (protobuf text, tritonclient) is for
    the launcher and the tools that write copies, never imported by what runs inside the stub."""
    models = sorted((ROOT / "model_repository").glob("*/1/model.py"))
    closure = imported_closure(models)
    assert "backend.triton.stub.served_model" in closure and "backend.engine.llm_engine" in closure  # the check sees
    assert "backend.triton.launcher.config_text" not in closure


def test_the_stub_never_loads_the_launcher():
    """What runs inside Triton's Python stub (the models' ``model.py`` and ``backend/triton/stub``) imports nothing of
    the launcher, directly or through another module: a fact both need has its owner below them (the stub, or the
    contract)."""
    stub = sorted((ROOT / "model_repository").glob("*/1/model.py"))
    stub += sorted(p for p in (ROOT / "backend" / "triton" / "stub").rglob("*.py") if "__pycache__" not in p.parts)
    closure = imported_closure(stub)
    assert "backend.triton.stub.shutdown_notice" in closure  # the check sees the stub's own modules
    found = sorted(m for m in closure if m == "backend.triton.launcher" or m.startswith("backend.triton.launcher."))
    assert not found, "the stub loads the launcher: " + ", ".join(found)
