"""The client-behaviour soak (loadtest/soak.py), bounded for the test suite: every pattern on all four models, with 1
and with 8 clients at once, 8 short requests per cell, on the tiny random Llama (the text does not matter here, the
accounting does). Every request must end as completed, cancelled or an error that says why, none lost; after each
cell nothing may be pending in Triton or the engine, no KV block in use, and a full batch must be answered; and
SIGTERM must stop each pattern's server (one per number of clients) with status 0 within its exit timeout, the
models it had to end by force counted per cell in the run's record. `make soak` runs the same with 1,000 requests
per cell of 8 clients (100 with one client or on llm_static), twice over, on SmolLM2.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from backend.contract.names import ITERATIVE, MODELS
from backend.triton.launcher import crash
from loadtest.soak_patterns import PATTERNS
from records.record import Record
from tests.server_harness import REPO_ROOT, make_repository

pytestmark = [pytest.mark.server, pytest.mark.slow]
REQUESTS = 8  # per cell: one for each of the 8 clients at once
# Greedy answers of up to 8 tokens; cancelled ones ask for 150, which a prompt of 40 words leaves room for in the tiny
# model's 256-token context.
# NOTE: exit timeout 30 s (Triton's default): a pattern's two servers run side by side, so one unloads its models while
# the other serves; at a load of 18 on 2 cores an unload took 11 s, past the 10 s this test used to give.
SOAK_ARGS = ["--requests", str(REQUESTS), "--light-requests", str(REQUESTS), "--clients", "1,8", "--rounds", "1",
             "--max-tokens", "8",
             "--long-tokens", "150", "--sequence-length", "4", "--request-timeout", "30", "--duration-limit", "60",
             "--settle-timeout", "30", "--exit-timeout", "30", "--no-keep"]
# What each pattern's requests must mostly come to, so that a soak that does not do what it says fails too.
COMPLETE = ("fresh_stream_cancel_after_final", "long_lived_stream", "http_generate")
CANCEL = ("cancel_mid_stream", "http_generate_stream_drop")


def soak(tiny_llama_dir, out: Path) -> tuple[int, dict, Record]:
    # NOTE: in its own process, as `make soak` runs it: the gRPC channels and threads this test process has
    # collected from earlier tests are not part of what is measured.
    repo = make_repository(out.parent / f"{out.name}-model_repository", models=MODELS)
    done = subprocess.run([sys.executable, "-m", "loadtest.soak", "--model", str(tiny_llama_dir),
                           "--model-repository", str(repo), "--out", str(out), *SOAK_ARGS],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=1200)
    print(done.stdout[-12000:], done.stderr[-3000:])
    return done.returncode, json.loads((out / "soak.json").read_text()), Record.read(out / "record.json")


@pytest.mark.timeout(3700)  # up to three soaks of 16 servers each
def test_every_request_of_every_client_behaviour_ends_and_the_server_lets_go(tiny_llama_dir, tmp_path):
    # NOTE: Triton 2.51's gRPC frontend can crash on a stream whose state it freed while a cancellation notice for it
    # was still queued (docs/server.md, "A known crash in Triton 2.51"). Such a run says nothing about this project's
    # code: soak again, at most twice. Any other crash, or a third one, fails the test.
    for attempt in range(3):
        code, report, record = soak(tiny_llama_dir, tmp_path / f"soak-{attempt}")
        sites = [s.get("crash_site") for s in report["servers"] if s.get("died") is not None]
        if report["checks"]["server_stayed_up"] or not sites or not all(map(crash.is_known_frontend_crash, sites)):
            break
        warnings.warn(f"tritonserver crashed in its gRPC frontend ({sites}); soaking again", stacklevel=1)
    assert report["checks"]["server_stayed_up"], [(s["pattern"], s["clients"], s.get("start_error"), s.get("log_tail"))
                                                  for s in report["servers"] if s.get("died") is not None
                                                  or s.get("start_error")]
    assert len(report["servers"]) == 2 * len(PATTERNS)  # one per pattern and number of clients
    assert report["checks"]["every_cell_ran"], [(c["pattern"], c["clients"], c["model"]) for c in report["cells"]]
    cells = report["cells"]
    where = "{round}/{pattern}/x{clients}/{model}".format
    lost = {where(**c): c["lost_reasons"] + c["client_failures"] for c in cells
            if c["lost"] or c["client_failures"] or c["clients_still_running"]}
    assert not lost, f"requests lost: {lost}"
    for gauge, check in [("nv_inference_pending_request_count", "nothing_pending_in_triton_after_each_cell"),
                         ("llm_kv_blocks_used", "kv_blocks_back_to_zero_after_each_cell")]:
        assert report["checks"][check], {where(**c): c["after"][gauge] for c in cells if c["after"][gauge] != 0}
    assert report["checks"]["engine_idle_after_each_cell"], {where(**c): c["after"] for c in cells}
    # A seat kept for a request that is gone (a sequence slot, a batch place) shows as a full batch left waiting.
    assert report["checks"]["full_batch_answered_after_each_cell"], {
        where(**c): c["full_batch_after"] for c in cells if c["full_batch_after"][0] != c["full_batch_after"][1]}

    for cell in cells:
        assert cell["requests"] == REQUESTS, where(**cell)
        if cell["pattern"] in COMPLETE:
            assert cell["completed"] == REQUESTS, (where(**cell), cell["error_reasons"])
        elif cell["pattern"] in CANCEL:
            assert cell["cancelled"] == REQUESTS, (where(**cell), cell["error_reasons"])
        elif cell["pattern"] == "openai_stream_disconnect":
            # Every third request (by its number) is read to the end. One client numbers them 0-7: 2 and 5. Eight
            # clients number theirs from their own index on, and one may send two while another sends none.
            assert cell["completed"] + cell["cancelled"] == REQUESTS, (where(**cell), cell["error_reasons"])
            if cell["clients"] == 1:
                assert cell["completed"] == 2, where(**cell)
        elif cell["pattern"] == "bad_requests":
            assert cell["errors"] == REQUESTS and all(r.startswith("bad request:") for r in cell["error_reasons"])
        elif cell["pattern"] == "perf_analyzer_sequences":
            # llm_iterative answers one request per sequence; a multi-request sequence's later requests get an error
            # that says so. The other models have no sequence batcher and answer every request.
            if cell["model"] == ITERATIVE:
                assert cell["completed"] >= 1 and cell["errors"] >= 1, (where(**cell), cell["error_reasons"])
            else:
                assert cell["completed"] == REQUESTS, (where(**cell), cell["error_reasons"])

    assert report["checks"]["sigterm_exit_0_within_grace"], [s["stop"] for s in report["servers"]]
    assert report["checks"]["frontend_exit_0"], [s["stop"]["frontend_exit"] for s in report["servers"]]
    assert report["ok"] and code == 0, report["checks"]

    # The record the docs' tables are written from: a row per cell, each with its forced unloads out of its server's
    # one stop (the models that stop named), and one per pattern.
    rows = record.tables["cells"].rows
    assert len(rows) == 2 * len(PATTERNS) * len(MODELS) and sum(r["requests"] for r in rows) == report["requests"]
    for server in report["servers"]:
        for row in (r for r in rows if (r["pattern"], r["clients"]) == (server["pattern"], server["clients"])):
            assert row["forced"] == f"{int(row['model'] in server['stop']['forced_models'])}/1", (row, server)
    assert [r["pattern"] for r in record.tables["patterns"].rows] == list(PATTERNS)
