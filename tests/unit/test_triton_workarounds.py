"""backend/contract/triton_workarounds.py names every Triton 2.51 workaround: each entry's modules name it where the
workaround sits, and no module speaks of 2.51 without naming an entry."""

from __future__ import annotations

import re
from pathlib import Path

from backend.contract import triton_workarounds as tw

ROOT = Path(__file__).resolve().parents[2]
CODE = ("backend", "frontend", "client", "loadtest", "model_repository", "bench")


def code_files() -> list[Path]:
    return sorted(p for folder in CODE for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def test_every_entry_is_complete_and_named_as_its_constant():
    assert len(tw.ALL) == len({w.name for w in tw.ALL}) >= 10
    for workaround in tw.ALL:
        assert getattr(tw, workaround.name) is workaround
        assert workaround.problem and workaround.remedy and workaround.upstream and workaround.remove_when
        assert workaround.modules and all((ROOT / module).is_file() for module in workaround.modules), workaround.name


def test_every_module_an_entry_lists_names_it():
    missing = [f"{module} does not name triton_workarounds.{w.name}" for w in tw.ALL for module in w.modules
               if f"triton_workarounds.{w.name}" not in (ROOT / module).read_text()]
    assert not missing, "\n".join(missing)


def test_a_module_that_names_an_entry_is_listed_by_it():
    named = {(w.name, path.relative_to(ROOT).as_posix()) for path in code_files()
             if path.name != "triton_workarounds.py"
             for w in tw.ALL if f"triton_workarounds.{w.name}" in path.read_text()}
    unlisted = [f"{path} names {name} but is not in its modules" for name, path in sorted(named)
                if path not in getattr(tw, name).modules]
    assert not unlisted, "\n".join(unlisted)


def test_no_module_speaks_of_2_51_without_naming_an_entry():
    version = re.compile(r"(?<![\d.])2\.51(?![\d])")
    silent = [path.relative_to(ROOT).as_posix() for path in code_files() if path.name != "triton_workarounds.py"
              and version.search(path.read_text()) and "triton_workarounds." not in path.read_text()]
    assert not silent, "these speak of Triton 2.51 without naming its workaround:\n" + "\n".join(silent)


def test_the_list_prints(capsys):
    tw.main()
    assert capsys.readouterr().out.count("\n  goes: ") == len(tw.ALL)
