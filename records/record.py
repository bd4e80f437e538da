"""A run's record: what ran (the command, every setting), where it ran (:mod:`records.provenance`) and what it
measured, as named tables whose rows put each figure beside its baseline from the same run.

Every benchmark command writes one (``record.json`` beside its other output); the records that back a table in the
README or ``docs/`` are kept in ``records/runs/`` and the tables are written from them (:mod:`records.tables`)."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from records.provenance import REPO_ROOT, cpu_slug, provenance

SCHEMA = 1
RUNS = REPO_ROOT / "records" / "runs"


def format_value(value, spec: str = "{}") -> str:
    """A figure as a table prints it: ``spec`` is a ``str.format`` spec, or ``"ms"`` for a duration in
    milliseconds (printed in seconds from one second up); a missing figure is a dash."""
    if value is None:
        return "–"
    if isinstance(value, str):
        return value
    if spec == "ms":
        return f"{value / 1000:.2f} s" if value >= 1000 else f"{value:.0f} ms"
    return spec.format(value)


@dataclass(frozen=True)
class Column:
    """One column: ``key`` in each row, the header ``label``, and how a figure is printed (``format_value``'s
    spec; a unit other than ms goes in the label)."""

    key: str
    label: str | None = None
    format: str = "{}"

    def cell(self, row: dict) -> str:
        return format_value(row.get(self.key), self.format)

    @property
    def header(self) -> str:
        return self.label or self.key


@dataclass
class Table:
    columns: list[Column]
    rows: list[dict] = field(default_factory=list)
    title: str | None = None

    def __post_init__(self) -> None:
        keys = [c.key for c in self.columns]
        if len(set(keys)) != len(keys):
            raise ValueError(f"a table's column keys must be unique: {keys}")

    def markdown(self) -> str:
        """The table as a Markdown table, as a command prints it at the end of its run."""
        lines = ["| " + " | ".join(c.header for c in self.columns) + " |", "|" + "---|" * len(self.columns)]
        return "\n".join(lines + ["| " + " | ".join(c.cell(row) for c in self.columns) + " |" for row in self.rows])

    @classmethod
    def from_json(cls, data: dict) -> "Table":
        return cls([Column(**c) for c in data["columns"]], list(data.get("rows", [])), data.get("title"))


@dataclass
class Record:
    command: str
    settings: dict
    provenance: dict
    tables: dict[str, Table] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    argv: list[str] = field(default_factory=lambda: list(sys.argv))

    @classmethod
    def start(cls, command: str, settings: dict, measure_bandwidth: bool = True) -> "Record":
        """A record whose provenance is taken now, before the run measures anything."""
        return cls(command, _plain(settings), provenance(measure_bandwidth))

    def add_table(self, name: str, columns: list[Column], rows: list[dict], title: str | None = None) -> Table:
        unknown = sorted({k for row in rows for k in row} - {c.key for c in columns})
        if unknown:
            raise ValueError(f"table {name!r}: rows hold keys with no column: {unknown}")
        self.tables[name] = Table(columns, [_plain(r) for r in rows], title)
        return self.tables[name]

    def to_json(self) -> dict:
        return {
            "schema": SCHEMA,
            "command": self.command,
            "argv": self.argv,
            "settings": self.settings,
            "provenance": self.provenance,
            "tables": {name: {"title": t.title, "columns": [asdict(c) for c in t.columns], "rows": t.rows}
                       for name, t in self.tables.items()},
            "notes": self.notes,
        }

    def write_beside(self, out: Path, result) -> Path:
        """A benchmark's ending: its whole result as JSON at ``out``, this record beside it (``<out>.record.json``),
        and where both went, printed. Returns the record's path."""
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        kept = self.write(out.with_suffix(".record.json"))
        print(f"\nwritten to {out}; the run's record to {kept}")
        return kept

    def kept_path(self, name: str, runs: Path = RUNS) -> Path:
        """Where this run's record is kept for the docs' tables: ``records/runs/<name>-<cpu>.json`` (the CPU as
        :func:`records.provenance.cpu_slug` names it), one record per command and machine."""
        return Path(runs) / f"{name}-{cpu_slug(self.provenance.get('cpu', {}))}.json"

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path

    @classmethod
    def read(cls, path: Path) -> "Record":
        data = json.loads(Path(path).read_text())
        if data.get("schema") != SCHEMA:
            raise ValueError(f"{path}: record schema {data.get('schema')!r}, this code reads {SCHEMA}")
        tables = {name: Table.from_json(t) for name, t in data["tables"].items()}
        return cls(data["command"], data["settings"], data["provenance"], tables, data.get("notes", []),
                   data.get("argv", []))


def _plain(value):
    """JSON-safe copies of settings and rows (paths as text, tuples as lists)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
