"""Records of runs and the tables written from them (records/)."""

from __future__ import annotations

import json

import pytest

from records import provenance, tables
from records.record import Column, Record

INTEL = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni amx_bf16 amx_tile amx_int8

processor\t: 1
vendor_id\t: GenuineIntel
"""

AMD = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni
"""

ZEN2 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 23
model\t\t: 49
model name\t: AMD EPYC
flags\t\t: fpu fma avx2
"""


def test_the_cpu_is_named_with_the_instruction_sets_that_choose_a_kernel():
    intel, amd = provenance.cpu(INTEL), provenance.cpu(AMD)
    assert intel["isa"]["amx_tile"] and not amd["isa"]["amx_tile"]
    assert amd["core"] == "Zen 4" and intel["core"] is None
    assert provenance.cpu_label(intel).startswith("Intel(R) Xeon(R) Platinum 8480+ (AVX-512 BF16, VNNI, AMX)")
    assert provenance.cpu_label(amd).startswith("AMD EPYC (Zen 4; AVX-512 BF16, VNNI, no AMX)")
    assert provenance.cpu_label(provenance.cpu(ZEN2)).startswith("AMD EPYC (Zen 2; AVX2, no AMX)")


def test_provenance_names_the_commit_and_the_software():
    found = provenance.provenance(measure_bandwidth=False)
    assert found["commit"] and len(found["commit"]) == 40 and isinstance(found["dirty"], bool)
    assert found["versions"]["torch"] and found["cpu"]["cpus"] >= 1


def test_bandwidth_is_measured_in_gb_per_s():
    assert 0.1 < provenance.read_bandwidth_gbs(1, num_bytes=16 << 20, repeats=2) < 10_000


def make_record(cpu_text: str, tok_s: float, commit: str = "a" * 40) -> Record:
    record = Record("make bench", {"formats": ("bf16",)}, {
        "commit": commit, "dirty": False, "date": "2026-12-03T10:00:00+00:00", "cpu": provenance.cpu(cpu_text)})
    record.add_table("decode", [Column("format"), Column("ms", "step ms", "{:.1f}"), Column("base", "llama.cpp ms",
                                                                                           "{:.1f}")],
                     [{"format": "bf16", "ms": tok_s, "base": 9.84}, {"format": "q4_1", "ms": None, "base": 8.1}])
    return record


def test_a_record_reads_back_what_was_written(tmp_path):
    path = make_record(AMD, 10.94).write(tmp_path / "r.json")
    again = Record.read(path)
    assert again.tables["decode"].rows[0] == {"format": "bf16", "ms": 10.94, "base": 9.84}
    assert again.settings == {"formats": ["bf16"]}
    with pytest.raises(ValueError, match="no column"):
        again.add_table("x", [Column("a")], [{"a": 1, "b": 2}])
    data = json.loads(path.read_text())
    data["schema"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="schema"):
        Record.read(path)


def doc_tree(tmp_path, marker: str):
    (tmp_path / "docs").mkdir()
    make_record(AMD, 10.94).write(tmp_path / "records/runs/amd.json")
    make_record(INTEL, 7.25, commit="b" * 40).write(tmp_path / "records/runs/intel.json")
    doc = tmp_path / "docs" / "perf.md"
    doc.write_text(f"# Perf\n\nbefore\n\n{marker}\nold text\n{tables.END}\n\nafter\n")
    (tmp_path / "README.md").write_text("no tables\n")
    return doc


def test_a_marked_table_is_written_from_its_record_and_stamped(tmp_path):
    doc = doc_tree(tmp_path, "<!-- record-table: records/runs/amd.json#decode columns=format,ms -->")
    assert set(tables.stale(tmp_path)) == {doc}
    doc.write_text(tables.regenerate(doc.read_text(), doc, tmp_path))
    text = doc.read_text()
    assert "| format | step ms |\n|---|---|\n| bf16 | 10.9 |\n| q4_1 | – |\n" in text
    assert "`make bench` at commit aaaaaaa, 2026-12-03, AMD EPYC (Zen 4; AVX-512 BF16, VNNI, no AMX)" in text
    assert "[records/runs/amd.json](../records/runs/amd.json)" in text
    assert text.startswith("# Perf\n\nbefore\n\n") and text.endswith(f"{tables.END}\n\nafter\n")
    assert tables.stale(tmp_path) == {}
    doc.write_text(text.replace("10.9", "9.9"))  # a hand-edited figure
    assert "-| bf16 | 9.9 |" in tables.stale(tmp_path)[doc]


def test_where_keeps_the_rows_that_print_a_value(tmp_path):
    doc = doc_tree(tmp_path, "<!-- record-table: records/runs/amd.json#decode where=format=q4_1 columns=format,base"
                             " -->")
    text = tables.regenerate(doc.read_text(), doc, tmp_path)
    assert "| format | llama.cpp ms |\n|---|---|\n| q4_1 | 8.1 |\n\n" in text


def test_a_picture_of_a_run_is_stamped_like_a_table(tmp_path):
    doc = doc_tree(tmp_path, "<!-- record-figure: records/runs/amd.json#batch_size image=records/runs/amd.png -->")
    with pytest.raises(ValueError, match="no image"):
        tables.regenerate(doc.read_text(), doc, tmp_path)
    (tmp_path / "records/runs/amd.png").write_bytes(b"\x89PNG")
    text = tables.regenerate(doc.read_text(), doc, tmp_path)
    assert "![batch_size](../records/runs/amd.png)\n\n<sub>`make bench` at commit aaaaaaa, 2026-12-03, AMD EPYC" in text


def test_two_records_stand_side_by_side_under_a_cpu_column(tmp_path):
    doc = doc_tree(tmp_path, "<!-- record-table: records/runs/amd.json#decode records/runs/intel.json#decode -->")
    text = tables.regenerate(doc.read_text(), doc, tmp_path)
    assert "| CPU | format | step ms | llama.cpp ms |" in text
    assert "| AMD EPYC (Zen 4, no AMX) | bf16 | 10.9 | 9.8 |" in text
    assert "| Intel(R) Xeon(R) Platinum 8480+ (AMX) | bf16 | 7.2 | 9.8 |" in text
    assert "commit aaaaaaa" in text and "commit bbbbbbb" in text


@pytest.mark.parametrize("marker, message", [
    ("<!-- record-table: records/runs/amd.json#nope -->", "no table 'nope'"),
    ("<!-- record-table: records/runs/amd.json#decode columns=tok_s -->", "no column"),
    ("<!-- record-table: columns=ms -->", "names no record"),
])
def test_a_marker_that_names_what_is_not_there_is_an_error(tmp_path, marker, message):
    doc = doc_tree(tmp_path, marker)
    with pytest.raises(ValueError, match=message):
        tables.regenerate(doc.read_text(), doc, tmp_path)


def test_every_table_in_the_readme_and_docs_is_what_its_record_gives():
    differences = tables.stale()
    assert not differences, "tables differ from their records (run `python -m records.tables`):\n" + "\n".join(
        differences.values())


SETTINGS = """| variable | default | meaning |
|---|---|---|
| `STALL_TIMEOUT` | 30 | seconds a model may hold requests before a restart |
| `--dynamic-variants 2x8@2000` | `llm_dynamic_2x8_2000us` | `--slo-ttft-ms 2000`; `max_num_seqs` 8, ports 8000, 8001 |
"""
MEASUREMENTS = """| batch | engine tok/s | decode step |
|---|---|---|
| 1 | 92.6 | 10.4 ms |
"""
BARE = """| tool | TTFT p50 | ITL p50 |
|---|---|---|
| genai-perf | 116 / 118 | 53 / 56 |
"""


@pytest.mark.parametrize("table, rows", [
    (SETTINGS, []),
    (MEASUREMENTS, [3]),  # a number with its unit
    (BARE, [3]),  # bare numbers under a header that names a latency
    ("| | before | after |\n|---|---|---|\n| mixed / parts | 1.13x | 0.97x |\n", [3]),
    ("| model | sustained |\n|---|---|\n| llm_continuous | 5.64 req/s |\n", [3]),
    (f"```\n{MEASUREMENTS}```\n", []),  # a code block is not a table
])
def test_a_table_outside_the_markers_may_hold_settings_but_no_measured_figure(tmp_path, table, rows):
    doc = doc_tree(tmp_path, "<!-- record-table: records/runs/amd.json#decode -->")
    text = tables.regenerate(doc.read_text(), doc, tmp_path) + "\n"
    doc.write_text(text + table)
    assert tables.stale(tmp_path) == {}  # the record's own table, inside the markers, is not a finding
    lines_before = text.count("\n")
    assert tables.unrecorded_figures(tmp_path) == [
        f"docs/perf.md:{lines_before + r}: {table.splitlines()[r - 1]}" for r in rows]
    assert tables.main(["--check"], root=tmp_path) == (1 if rows else 0)


def test_no_table_in_the_readme_and_docs_prints_a_figure_without_its_record():
    found = tables.unrecorded_figures()
    assert not found, "measured figures with no record (write them from a record, or remove them):\n" + "\n".join(
        found)


def test_a_kept_record_is_named_after_its_command_and_cpu(tmp_path):
    assert provenance.cpu_slug(provenance.cpu(AMD)) == "amd-epyc"
    assert provenance.cpu_slug(provenance.cpu(ZEN2)) == "amd-epyc-avx2"  # the same name, other kernels
    assert provenance.cpu_slug(provenance.cpu(INTEL)) == "intel-xeon"
    assert provenance.cpu_slug({"model": "13th Gen Intel(R) Core(TM) i9-13900K"}) == "intel-core"
    assert provenance.cpu_slug({}) == "unknown-cpu"
    assert make_record(AMD, 1.0).kept_path("storm-grpc", tmp_path) == tmp_path / "storm-grpc-amd-epyc.json"
