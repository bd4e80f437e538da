"""The result tables of the README and ``docs/``, written from records.

A table in a Markdown file stands between two markers that name its record(s) and the table inside each::

    <!-- record-table: records/runs/compare-default-zen4.json#summary columns=model,output_tok_s -->
    (generated: do not edit)
    <!-- /record -->

A picture of a run stands the same way, stamped like a table::

    <!-- record-figure: records/runs/compare-default-zen4.json image=records/runs/compare-default-zen4.png -->
    <!-- /record -->

``columns=`` picks and orders columns by key (default: all); ``where=KEY=VALUE`` keeps the rows whose KEY prints as
VALUE (``+`` for a space: ``where=load=8+users``). With more than one source the rows of each are put one
after the other under a first column that names the CPU, so figures of two machines stand side by side. Under every
table, one line per record says where its figures came from: command, commit, date and CPU.

A figure with no record is not printed: a Markdown table outside the markers (and outside code blocks) whose cells
hold a measured figure fails ``--check`` with its file and line. A measured figure is a number with a unit of time
(``ns``, ``µs``, ``us``, ``ms``, ``s``) or of rate (``tok/s``, ``req/s``, ``GB/s``, ...), a ratio written ``1.54x``,
or any number in a column whose header names a latency or a rate (``TTFT p50``, ``step ms``, ``tok/s``). A table of
settings passes: its limits and defaults are bare numbers under headers such as ``default``.

    python -m records.tables           # rewrite every marked table in README.md, docs/*.md and docker/README.md
    python -m records.tables --check   # exit 1 if a table is not what its record gives, or a table outside the
                                       # markers holds a measured figure
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from records.provenance import REPO_ROOT, cpu_label
from records.record import Column, Record

BEGIN = re.compile(r"^<!-- record-(?P<kind>table|figure): (?P<spec>.+?) -->\n", re.M)
END = "<!-- /record -->"
# A measured figure in a table cell: a number (1,341.1) with a unit of time or rate after it, or a ratio (1.54x);
# not part of a name (llm_dynamic_2x8_2000us), an option (--slo-ttft-ms) or a shape (2x8).
MEASURED = re.compile(r"(?<![\w.,/-])\d+(?:,\d{3})*(?:\.\d+)?(?:"
                      r"\s?(?:ns|µs|us|ms|s|(?:tok|tokens|req|requests|seq|G?FLOP|TFLOP|[KMG]i?B)/s)(?![\w/])"
                      r"|x(?!\w))")
MEASURED_HEADER = re.compile(r"\b(?:ns|µs|us|ms|TTFT|TPOT|ITL|E2E|latency|throughput|p\d\d)\b|/s\b", re.I)


@dataclass(frozen=True)
class Source:
    path: str  # relative to the repository
    table: str


@dataclass(frozen=True)
class Spec:
    sources: tuple[Source, ...]
    columns: tuple[str, ...] | None
    where: tuple[str, str] | None = None
    image: str | None = None

    @classmethod
    def parse(cls, text: str) -> "Spec":
        sources, columns, where, image = [], None, None, None
        for word in text.split():
            if word.startswith("columns="):
                columns = tuple(k for k in word.removeprefix("columns=").split(",") if k)
            elif word.startswith("where="):
                key, sep, value = word.removeprefix("where=").partition("=")
                if not sep:
                    raise ValueError(f"record-table marker: {word!r} is not where=KEY=VALUE")
                where = (key, value.replace("+", " "))
            elif word.startswith("image="):
                image = word.removeprefix("image=")
            elif "#" in word:
                path, _, table = word.partition("#")
                sources.append(Source(path, table))
            else:
                raise ValueError(f"record marker: {word!r} is neither PATH#NAME nor columns=, where=, image=")
        if not sources:
            raise ValueError(f"record-table marker names no record: {text!r}")
        return cls(tuple(sources), columns, where, image)


def short_cpu(cpu_fields: dict) -> str:
    core = cpu_fields.get("core")
    amx = "AMX" if cpu_fields.get("isa", {}).get("amx_tile") else "no AMX"
    return f"{cpu_fields.get('model', '?')} ({core + ', ' if core else ''}{amx})"


def stamp(record: Record, source: Source, doc: Path, root: Path) -> str:
    p = record.provenance
    commit = (p.get("commit") or "unknown")[:7] + (" with uncommitted changes" if p.get("dirty") else "")
    link = Path(*([".."] * len(doc.relative_to(root).parts[:-1])), source.path).as_posix()
    return (f"<sub>`{record.command}` at commit {commit}, {p.get('date', '?')[:10]}, {cpu_label(p.get('cpu', {}))}: "
            f"[{source.path}]({link})</sub>")


def render(spec: Spec, doc: Path, root: Path = REPO_ROOT) -> str:
    records = [(source, Record.read(root / source.path)) for source in spec.sources]
    first = _table(records[0][1], records[0][0])
    keys = spec.columns or tuple(c.key for c in first.columns)
    columns = _columns(first.columns, keys, records[0][0])
    several = len(records) > 1
    header = (["CPU"] if several else []) + [c.header for c in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for source, record in records:
        table = _table(record, source)
        cells_of = _columns(table.columns, keys, source)
        cpu = [short_cpu(record.provenance.get("cpu", {}))] if several else []
        lines += ["| " + " | ".join(cpu + [c.cell(row) for c in cells_of]) + " |" for row in _kept(table, spec)]
    lines.append("")
    lines += [stamp(record, source, doc, root) + ("<br>" if i < len(records) - 1 else "")
              for i, (source, record) in enumerate(records)]
    return "\n".join(lines) + "\n"


def render_figure(spec: Spec, doc: Path, root: Path = REPO_ROOT) -> str:
    if spec.image is None or len(spec.sources) != 1:
        raise ValueError("record-figure marker: one record and image=PATH")
    (source,) = spec.sources
    if not (root / spec.image).is_file():
        raise ValueError(f"record-figure marker: no image {spec.image}")
    record = Record.read(root / source.path)
    link = Path(*([".."] * len(doc.relative_to(root).parts[:-1])), spec.image).as_posix()
    return f"![{source.table or Path(spec.image).stem}]({link})\n\n{stamp(record, source, doc, root)}\n"


def _kept(table, spec: Spec) -> list[dict]:
    if spec.where is None:
        return table.rows
    key, value = spec.where
    column = next((c for c in table.columns if c.key == key), None)
    if column is None:
        raise ValueError(f"where={key}=...: the table has no column {key!r}")
    return [row for row in table.rows if column.cell(row) == value]


def _table(record: Record, source: Source):
    if source.table not in record.tables:
        raise ValueError(f"{source.path} has no table {source.table!r} (it has {sorted(record.tables)})")
    return record.tables[source.table]


def _columns(columns: list[Column], keys: tuple[str, ...], source: Source) -> list[Column]:
    by_key = {c.key: c for c in columns}
    missing = [k for k in keys if k not in by_key]
    if missing:
        raise ValueError(f"{source.path}#{source.table} has no column {missing} (it has {list(by_key)})")
    return [by_key[k] for k in keys]


def regenerate(text: str, doc: Path, root: Path = REPO_ROOT) -> str:
    """``text`` with every marked table written anew from its records."""
    out, at = [], 0
    for match in BEGIN.finditer(text):
        if match.start() < at:
            continue
        end = text.find(END, match.end())
        if end < 0:
            raise ValueError(f"{doc}: a record-table marker has no {END}")
        draw = render if match["kind"] == "table" else render_figure
        out += [text[at:match.end()], draw(Spec.parse(match["spec"]), doc, root)]
        at = end
    out.append(text[at:])
    return "".join(out)


def documents(root: Path = REPO_ROOT) -> list[Path]:
    docs = [root / "README.md", *sorted((root / "docs").glob("*.md")), root / "docker" / "README.md"]
    return [doc for doc in docs if doc.exists()]


def stale(root: Path = REPO_ROOT) -> dict[Path, str]:
    """Each document whose tables differ from what their records give, with the difference."""
    found = {}
    for doc in documents(root):
        text = doc.read_text()
        new = regenerate(text, doc, root)
        if new != text:
            rel = doc.relative_to(root).as_posix()
            found[doc] = "".join(difflib.unified_diff(text.splitlines(True), new.splitlines(True), rel,
                                                      rel + " (from records)"))
    return found


def unrecorded_figures(root: Path = REPO_ROOT) -> list[str]:
    """``FILE:LINE: ROW`` for each row of a Markdown table outside the record markers that holds a measured figure."""
    found = []
    for doc in documents(root):
        rel = doc.relative_to(root).as_posix()
        for table in _free_tables(doc.read_text()):
            found += [f"{rel}:{number}: {row}" for number, row in _measured(table)]
    return found


def _free_tables(text: str) -> list[list[tuple[int, str]]]:
    """The Markdown tables outside record markers and code blocks, each as its (line number, row) pairs."""
    tables, rows, in_record, in_code = [], [], False, False
    for number, line in enumerate(text.splitlines() + [""], 1):
        stripped = line.strip()
        if stripped.startswith("|") and not (in_record or in_code):
            rows.append((number, stripped))
            continue
        if rows:
            tables.append(rows)
            rows = []
        if stripped.startswith("```"):
            in_code = not in_code
        elif BEGIN.match(stripped + "\n"):
            in_record = True
        elif stripped == END:
            in_record = False
    return tables


def _measured(table: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The rows that hold a measured figure: a number with its unit, or a number under a header that names a
    measured quantity (``TTFT p50``, ``step ms``, ``tok/s``)."""
    header = _cells(table[0][1])
    measured_columns = {i for i, cell in enumerate(header) if MEASURED_HEADER.search(cell)}
    return [(number, row) for k, (number, row) in enumerate(table) if MEASURED.search(row) or k > 1 and any(
        i in measured_columns and re.search(r"\d", cell) for i, cell in enumerate(_cells(row)))]


def _cells(row: str) -> list[str]:
    return [cell.strip() for cell in row.strip().strip("|").split("|")]


def main(argv=None, root: Path = REPO_ROOT) -> int:
    p = argparse.ArgumentParser(prog="python -m records.tables", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table differs from its record, "
                   "or a table outside the markers holds a measured figure")
    args = p.parse_args(argv)
    differences = stale(root)
    if args.check:
        for diff in differences.values():
            sys.stdout.write(diff)
        if differences:
            print(f"{len(differences)} document(s) hold tables that differ from their records: "
                  "run `python -m records.tables`")
        unrecorded = unrecorded_figures(root)
        for row in unrecorded:
            print(row)
        if unrecorded:
            print(f"{len(unrecorded)} table row(s) outside the record markers hold measured figures: write the table "
                  "from a record (<!-- record-table: ... -->) or remove the figures")
        return 1 if differences or unrecorded else 0
    for doc in differences:
        doc.write_text(regenerate(doc.read_text(), doc, root))
        print(f"wrote {doc.relative_to(root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
