"""The cancel storm (loadtest/storm.py), bounded for the test suite: 40 streams on the tiny random Llama over each
protocol, each left by its client after 0-8 chunks, across llm_continuous, llm_iterative and llm_dynamic. Every
request sent must be accounted for exactly once and none lost, the models must hold nothing afterwards, and the run's
record must carry the counts the docs' storm table is written from. `make storm` runs 20,000 on SmolLM2.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from backend.contract.names import CONTINUOUS, DYNAMIC, ITERATIVE
from records.record import Record
from tests.server_harness import REPO_ROOT, make_repository

pytestmark = [pytest.mark.server]
MODELS = (CONTINUOUS, ITERATIVE, DYNAMIC)
REQUESTS = 40
OUTCOMES = ("disconnected", "completed", "errors", "server_fell", "lost")


def storm(tiny_llama_dir, repo: Path, out: Path, protocol: str) -> tuple[int, dict, Record]:
    done = subprocess.run([sys.executable, "-m", "loadtest.storm", "--protocol", protocol, "--requests", str(REQUESTS),
                           "--model", str(tiny_llama_dir), "--model-repository", str(repo), "--out", str(out),
                           "--request-timeout", "30", "--exit-timeout", "10", "--no-keep"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    print(done.stdout[-6000:], done.stderr[-3000:])
    return done.returncode, json.loads((out / "storm.json").read_text()), Record.read(out / "record.json")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("protocol", ["grpc", "openai"])
def test_a_small_storm_accounts_for_every_request(tiny_llama_dir, tmp_path, protocol):
    repo = make_repository(tmp_path / "model_repository", models=MODELS)
    code, report, record = storm(tiny_llama_dir, repo, tmp_path / "storm", protocol)
    incidents = report["incidents"]
    if incidents:  # NOTE: Triton 2.51's known gRPC-frontend race (docs/server.md) may hit any run that cancels
        assert all(i["kind"] == "crash" and i["known_frontend_crash"] for i in incidents), incidents
        warnings.warn(f"the storm met Triton 2.51's known crash: {incidents}", stacklevel=1)
    totals = report["outcomes"]
    assert report["requests"] == REQUESTS and sum(totals.values()) == REQUESTS, totals
    assert report["clients_still_running"] == 0
    assert totals["lost"] == 0, report["lost_reasons"]
    assert totals["disconnected"] >= REQUESTS // 2, totals  # 64-token streams left after at most 8 chunks
    assert sorted(report["by_model"]) == sorted(MODELS)  # the models by turns
    assert {m: sum(c.values()) for m, c in report["by_model"].items()} == {
        m: len(range(i, REQUESTS, len(MODELS))) for i, m in enumerate(MODELS)}
    assert report["checks"]["nothing_pending_and_no_kv_block_after"], report["after"]
    # NOTE: the exit status is kept, not asserted here: test_soak.py holds SIGTERM's exit 0 under load.
    assert isinstance(report["stop"]["exit_status"], int)

    [row] = record.tables["storm"].rows
    assert row["protocol"] == protocol and row["requests"] == REQUESTS
    assert {k: row[k] for k in OUTCOMES} == totals and row["pending_after"] == 0 and row["kv_after"] == 0
    assert row["crashes"] == len(incidents) and row["req_per_s"] > 0
    assert sum(r["requests"] for r in record.tables["models"].rows) == REQUESTS
    assert code == (0 if report["ok"] else 1)
    if not incidents:
        assert row["crash_rate"] == f"none in {totals['disconnected']}"
