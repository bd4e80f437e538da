"""The soak's plan, its expected duration from a kept record, and the record it keeps (loadtest/soak_plan.py,
loadtest/soak_report.py): no server."""

from __future__ import annotations

import pytest

from backend.contract.names import CONTINUOUS, DYNAMIC, ITERATIVE, MODELS, STATIC
from loadtest import soak, soak_plan, soak_report
from loadtest.soak_patterns import PATTERNS
from records import tables
from records.record import Record

IDLE = {"nv_inference_pending_request_count": 0.0, "llm_num_requests_running": 0.0, "llm_num_requests_waiting": 0.0,
        "llm_kv_blocks_used": 0.0}


def test_the_default_soak_sends_what_the_issue_asks_for_on_each_cell():
    args = soak.parse_args([])
    groups = soak_plan.plan(args.patterns, args.clients, args.models, args.requests, args.light_requests)
    assert len(groups) == len(PATTERNS) * 2 and soak.is_full_soak(args)
    for group in groups:
        for model, requests in group.requests.items():
            total = args.rounds * requests
            if group.clients > 1 and model in (CONTINUOUS, ITERATIVE, DYNAMIC):
                assert total >= 2000, (group.name, model)
            else:  # one client, or llm_static
                assert total >= 200, (group.name, model)
    assert not soak.is_full_soak(soak.parse_args(["--requests", "25"]))


def cell(pattern: str, clients: int, model: str, round_index: int = 0, requests: int = 10, seconds: float = 5.0,
         **changes) -> dict:
    return {"round": round_index, "pattern": pattern, "clients": clients, "model": model, "requests": requests,
            "completed": requests, "cancelled": 0, "errors": 0, "lost": 0, "seconds": seconds, "after_s": 1.0,
            "after": dict(IDLE), "full_batch_after": [8, 8], "error_reasons": {}, "lost_reasons": [],
            "client_failures": [], "out_of_time": False, "settled_after_s": 0.0, **changes}


def two_round_report() -> dict:
    stop = {"exit_status": 0, "exited_after_s": 2.5, "grace_s": 10.0, "forced": "forced: ...",
            "forced_models": [DYNAMIC], "frontend_exit": "not started"}
    servers = [{"pattern": "fresh_stream_cancel_after_final", "clients": clients, "start_s": 20.0, "stop_s": 3.0,
                "stop": stop if clients == 8 else {**stop, "forced": None, "forced_models": []},
                "rss": {"growth": 0.01}} for clients in (1, 8)]
    cells = [cell("fresh_stream_cancel_after_final", clients, model, r, requests=10 if clients == 1 else 40,
                  seconds=4.0 if clients == 1 else 8.0)
             for clients in (1, 8) for r in range(2) for model in (STATIC, DYNAMIC)]
    return {"patterns": ["fresh_stream_cancel_after_final"], "models": [STATIC, DYNAMIC], "servers": servers,
            "cells": cells, "requests": sum(c["requests"] for c in cells), "duration_s": 100.0,
            "checks": {"no_request_lost": True}, "load_average": {"cpus": 2, "load_mean": 1.5, "load_max": 3.0}}


def test_a_cells_rounds_add_up_in_its_row_with_the_forced_unloads_of_its_server():
    report = two_round_report()
    rows = {(r["clients"], r["model"]): r for r in soak_report.cell_rows(report)}
    assert rows[(8, DYNAMIC)]["requests"] == 80 and rows[(8, DYNAMIC)]["completed"] == 80
    assert rows[(8, DYNAMIC)]["forced"] == "1/1" and rows[(8, STATIC)]["forced"] == "0/1"
    assert rows[(1, DYNAMIC)]["forced"] == "0/1" and rows[(8, DYNAMIC)]["req_per_s"] == 5.0
    assert rows[(8, DYNAMIC)]["load_s"] == 16.0 and rows[(8, DYNAMIC)]["after_s"] == 2.0
    [pattern] = soak_report.pattern_rows(report, list(rows.values()))
    assert pattern["forced"] == f"{DYNAMIC} x8" and pattern["cells_idle_after"] == "8 of 8"
    assert pattern["requests"] == report["requests"] and pattern["exit_status"] == "0"


def test_the_expected_duration_comes_from_the_kept_records_rates(tmp_path):
    report = two_round_report()
    record = soak_report.make_record(Record("make soak", {"rounds": 2}, {"commit": "c" * 40, "cpu": {
        "model": "AMD EPYC"}, "date": "2026-12-06T00:00:00+00:00"}), report)
    runs = tmp_path / "runs"
    record.write(runs / "soak-amd-epyc.json")
    rates = soak_plan.find_rates("intel-xeon", runs)  # no record of this CPU: any kept one
    assert rates is not None and "soak-amd-epyc.json" in rates.source and "ccccccc" in rates.source
    assert "a mean load average of 1.5 on 2 CPUs" in rates.source  # how busy the machine was besides the soak
    groups = soak_plan.plan(["fresh_stream_cancel_after_final"], [1, 8], [STATIC, DYNAMIC], 400, 100)
    estimated = soak_plan.estimate(groups, 2, rates)
    # 8 s per 40 requests with 8 clients, 4 s per 10 with one; 1 s after each cell; 23 s per server.
    assert estimated.by_cell[("fresh_stream_cancel_after_final", 8, DYNAMIC)] == pytest.approx(400 * 0.2 + 1)
    assert estimated.by_cell[("fresh_stream_cancel_after_final", 1, STATIC)] == pytest.approx(100 * 0.4 + 1)
    # The two servers run side by side: the longer one counts, 8 clients' (llm_static: 100 requests).
    assert estimated.seconds == pytest.approx(max(23 + 2 * (81 + 21), 23 + 2 * (41 + 41)))
    assert soak_plan.side_by_side(groups) == [[0, 1]]
    # A cell the record lacks goes by its model's cells of that many clients; none of that many clients: unknown.
    other = soak_plan.estimate(soak_plan.plan(["http_generate"], [8, 2], [DYNAMIC], 40, 10), 1, rates)
    assert other.by_cell[("http_generate", 8, DYNAMIC)] == pytest.approx(9) and other.unknown == [
        ("http_generate", 2, DYNAMIC)]
    assert soak_plan.find_rates("amd-epyc", tmp_path / "nothing") is None
    assert soak_plan.duration(6500) == "1 h 48 min" and soak_plan.duration(720) == "12 min"


def test_the_docs_soak_tables_render_from_the_record(tmp_path):
    record = soak_report.make_record(Record("make soak", {"rounds": 2}, {"commit": "c" * 40, "cpu": {
        "model": "AMD EPYC"}, "date": "2026-12-06T00:00:00+00:00"}), two_round_report())
    record.write(tmp_path / "records" / "runs" / "soak-amd-epyc.json")
    doc = tmp_path / "docs" / "server.md"
    doc.parent.mkdir()
    doc.write_text("<!-- record-table: records/runs/soak-amd-epyc.json#patterns -->\n<!-- /record -->\n")
    text = tables.regenerate(doc.read_text(), doc, tmp_path)
    assert "| fresh_stream_cancel_after_final | 200 | 200 | 0 | 0 | 0 | 8 of 8 | llm_dynamic x8 | 0 |" in text


def test_every_model_is_a_cell_of_every_group():
    groups = soak_plan.plan(list(PATTERNS), [1, 8], list(MODELS), 1000, 100)
    assert {g.name for g in groups} == {f"{p}-x{c}" for p in PATTERNS for c in (1, 8)}
    assert all(g.models == list(MODELS) for g in groups)
    assert soak_plan.total_requests(groups, 2) == 2 * len(PATTERNS) * (3 * 1000 + 100 + 4 * 100)
