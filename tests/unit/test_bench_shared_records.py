"""The shared-cores benchmarks' records: every figure their summaries give lands in a column of the record, which
reads back as written (the benches themselves need several engines or servers: ``make bench-shared``)."""

from __future__ import annotations

from bench import shared_cores, shared_served
from records.record import Record


def _round_trip(tmp_path, name: str, columns, rows) -> Record:
    record = Record("test", {}, {})
    record.add_table(name, columns, rows)  # raises on a row key without a column
    return Record.read(record.write(tmp_path / "record.json"))


def test_shared_cores_record_holds_every_figure(tmp_path):
    samples = {(arm, n): [(10.0 * n, 400.0 / n), (12.0 * n, 380.0 / n)] for arm in ("divide", "off") for n in (1, 2)}
    result = shared_cores.summarize(samples, [1, 2], ["divide", "off"], batch=4, seconds=1.0, rounds=2)
    table = _round_trip(tmp_path, "shared_cores", shared_cores.COLUMNS, result["rows"]).tables["shared_cores"]
    divide_two = next(r for r in table.rows if r["arm"] == "divide" and r["engines"] == 2)
    assert divide_two["step_ms"] == 22.0 and divide_two["ratio"] == 2.0 and divide_two["tok_s_vs_alone"] == 0.5
    assert "| divide | 2 | 22.0 | 2.00x | 2.00x | 195 | 0.50x |" in table.markdown()


def test_shared_served_record_holds_every_figure(tmp_path):
    sample = {"itl_ms": 20.0, "tpot_ms": 21.0, "tok_s": 100.0}
    samples = {("divide", kind, model): [sample] for kind in ("alone", "pair") for model in shared_served.PAIR}
    samples[("divide", "pair", shared_served.PAIR[0])] = [{"itl_ms": 30.0, "tpot_ms": 31.5, "tok_s": 60.0}]
    result = shared_served.summarize(samples, ["divide"], four=False)
    table = _round_trip(tmp_path, "shared_served", shared_served.COLUMNS, result["rows"]).tables["shared_served"]
    first = next(r for r in table.rows if r["model"] == shared_served.PAIR[0])
    assert first["ratio"] == 1.5 and first["models_tok_s"] == 160.0
    assert " 1.50x " in table.markdown()


def test_quantized_record_sets_each_format_beside_bf16(tmp_path):
    from backend.kernels.weight_format import WeightFormat
    from bench import quantized

    bf16, q4_1 = WeightFormat.BF16, WeightFormat.Q4_1
    result = {"decode_step_ms": {bf16: {1: 10.0, 8: 16.0}, q4_1: {1: 5.0, 8: 16.0}},
              "memory": {bf16: {"weight_mib": 256.6, "kv_blocks_gained": 0},
                         q4_1: {"weight_mib": 92.0, "kv_blocks_gained": 468}},
              "greedy_agreement": {bf16: {"prefix_share": 1.0}, q4_1: {"prefix_share": 0.57}}}
    record = quantized.record_table(Record("test", {}, {}), result)
    table = Record.read(record.write(tmp_path / "q.json")).tables["formats"]
    q_row = next(r for r in table.rows if r["format"] == str(q4_1))
    assert q_row["ratio_b1"] == 0.5 and q_row["ratio_b8"] == 1.0 and q_row["kv_blocks_gained"] == 468
    assert "| q4_1 | 5.00 | 0.50x | 16.00 | 1.00x | 92.0 | 468 | 57% |" in table.markdown()
