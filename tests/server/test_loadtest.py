"""The load tests against a real server: headless Locust and `make compare --smoke` (tests/unit/test_loadtest.py: the
parts without one).

The Locust runs are subprocesses (as ``loadtest.compare`` runs them), so gevent never patches the test process.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest import slo
from loadtest.runner import LOCUSTFILE, REPO_ROOT
from tests.server_harness import make_repository

# ---- headless Locust against the real server ----------------------------------------------------------------


@pytest.fixture(scope="module")
def server(triton_server_factory, smollm2_dir):
    return triton_server_factory.start(REPO_ROOT / "model_repository", model=smollm2_dir)


def run_locust(
    server, tmp_path: Path, user: str, model: str, *extra: str, run_time: str = "60s"
) -> tuple[subprocess.CompletedProcess, Path]:
    """Headless Locust, 2 users, ending when its 6-request budget is spent (``run_time`` is only a bound)."""
    prefix = tmp_path / f"{user}_{model}"
    command = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary",
        "-u", "2", "-r", "2", "--run-time", run_time, "--stop-timeout", "30", "--csv", str(prefix),
        "--host", server.http_url, "--grpc-url", server.grpc_url, "--model", model,
        "--workload", "constant", "--length-scale", "0.1", "--max-requests", "6",
        "--records-file", f"{prefix}_requests.jsonl", *extra, user,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=150)
    return done, prefix


def read_stats(prefix: Path) -> dict[str, dict]:
    with open(f"{prefix}_stats.csv") as f:
        return {row["Name"]: row for row in csv.DictReader(f) if row["Type"]}


def read_latency(prefix: Path) -> dict[str, dict]:
    """The latency table Locust's one event per request cannot hold (``<prefix>_llm_latency.csv``), per model."""
    with open(f"{prefix}_llm_latency.csv") as f:
        return {row["Model"]: row for row in csv.DictReader(f)}


def read_requests(prefix: Path) -> list[dict]:
    lines = Path(f"{prefix}_requests.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "index" in r]


@pytest.mark.server
@pytest.mark.smollm2
@pytest.mark.timeout(240)
@pytest.mark.parametrize("model", ["llm_dynamic", "llm_continuous"])
@pytest.mark.parametrize("user,protocol", [("GrpcStreamUser", "grpc"), ("HttpStreamUser", "http")])
def test_headless_locust_reports_streaming_metrics_without_failures(server, tmp_path, user, protocol, model):
    done, prefix = run_locust(server, tmp_path, user, model)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr

    # One Locust event per request, timed end to end; the latencies in their own CSV.
    (row,) = read_stats(prefix).values()
    assert (row["Type"], row["Name"]) == (protocol, f"{model} (e2e)")
    assert int(row["Request Count"]) == len(read_requests(prefix)) and int(row["Failure Count"]) == 0
    latency = read_latency(prefix)[model]
    assert latency["Requests"] == row["Request Count"] and latency["Failures"] == "0"
    for column in ("TTFT p50 (ms)", "TTFT p99 (ms)", "TPOT p50 (ms)", "TPOT p99 (ms)", "ITL max p99 (ms)"):
        assert float(latency[column]) > 0, column
    with open(f"{prefix}_failures.csv") as f:
        assert len(f.read().strip().splitlines()) == 1  # the header only

    requests = read_requests(prefix)
    assert requests and all(r["ok"] and r["num_output_tokens"] == r["max_tokens"] == 13 for r in requests)
    assert all(r["finish_reason"] == "length" and 0 < r["ttft_ms"] <= r["e2e_ms"] for r in requests)
    assert all(r["num_input_tokens"] >= 6 for r in requests)  # 64 words x 0.1


@pytest.mark.server
@pytest.mark.smollm2
@pytest.mark.timeout(240)
@pytest.mark.parametrize("user", ["GrpcStreamUser", "HttpStreamUser"])
def test_refused_requests_are_locust_failures_not_exceptions(server, tmp_path, user):
    # A negative temperature is refused by the model with an error response, request by request.
    done, prefix = run_locust(server, tmp_path, user, "llm_continuous", "--temperature", "-1")
    assert done.returncode == 1, done.stderr[-3000:]  # Locust's own "there were failures" exit code
    e2e = read_stats(prefix)["llm_continuous (e2e)"]
    assert int(e2e["Request Count"]) == int(e2e["Failure Count"]) == 6
    with open(f"{prefix}_failures.csv") as f:
        failures = list(csv.DictReader(f))
    assert failures and all(row["Name"] == "llm_continuous (e2e)" and "temperature" in row["Error"] for row in failures)
    with open(f"{prefix}_exceptions.csv") as f:
        assert len(f.read().strip().splitlines()) == 1  # nothing raised inside the users
    assert all(not r["ok"] and "temperature" in r["error"] for r in read_requests(prefix))


@pytest.mark.server
@pytest.mark.smollm2
@pytest.mark.timeout(240)
def test_streams_cut_off_by_the_drain_limit_are_recorded_not_failed(server, tmp_path):
    # 1,024-token answers cannot finish in a 2 s run with a 1 s drain (at 128 a fast idle machine nearly did: the
    # engine's batch-2 step is about 20 ms).
    extra = ("--length-scale", "8", "--stop-timeout", "1")
    done, prefix = run_locust(server, tmp_path, "GrpcStreamUser", "llm_continuous", *extra, run_time="2s")
    assert done.returncode == 0, done.stderr[-3000:]
    requests = read_requests(prefix)
    seen = [{k: r.get(k) for k in ("cut", "ok", "error", "num_output_tokens")} for r in requests]
    assert len(requests) == 2 and all(r["cut"] and not r["ok"] and r["error"] is None for r in requests), seen
    assert all(r["num_output_tokens"] < 1024 for r in requests)
    assert read_stats(prefix) == {}  # nothing reported to Locust as done or failed


@pytest.mark.server
@pytest.mark.smollm2
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compare_smoke_end_to_end(tmp_path, smollm2_dir):
    """``python -m loadtest.compare --smoke``: its own server, the default models (the four, and llm_dynamic at its
    best, two instances), the report (about 3-4 minutes)."""
    command = [sys.executable, "-m", "loadtest.compare", "--smoke", "--model", str(smollm2_dir), "--out", str(tmp_path),
               "--dynamic-variants", "2x4@2000"]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=580)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "continuous vs dynamic at 4 users:" in done.stdout

    (out_dir,) = tmp_path.iterdir()
    results = json.loads((out_dir / "results.json").read_text())
    models = ["llm_static", "llm_dynamic", "llm_dynamic_2x4_2000us", "llm_iterative", "llm_continuous"]
    assert [(r["model"], r["users"]) for r in results["runs"]] == [(model, 4) for model in models]
    kv_total = {}
    for run in results["runs"]:
        assert any(r["ok"] for r in run["requests"]), run["model"]
        assert not [r["error"] for r in run["requests"] if r["error"]], run["model"]
        assert any("llm_batch_size_count" in s["values"] for s in run["metrics"])
        assert any("loadgen" in s["cpu"] for s in run["metrics"])
        kv_total[run["model"]] = run["metrics"][-1]["values"]["llm_kv_blocks_total"]
    # Two instances, two engines and KV pools of the same size: the metrics port shows each, the sample their sum.
    assert kv_total["llm_dynamic_2x4_2000us"] == 2 * kv_total["llm_dynamic"]
    assert results["meta"]["configs"]["llm_dynamic_2x4_2000us"]["instance_count"] == 2
    md = (out_dir / "report.md").read_text()
    for other in ("static", "dynamic", "dynamic_2x4_2000us", "iterative"):
        assert f"## Continuous beside {other}, per load point" in md
    assert "What each way of deciding the batch costs, measured:" in md and "**iterative** pays" in md
    assert (out_dir / "report.html").stat().st_size > 50_000
    assert (out_dir / "locust" / "llm_dynamic_u4_stats.csv").exists()


@pytest.mark.server
@pytest.mark.smollm2
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compare_smoke_of_the_mixed_workload_without_and_with_priorities(tmp_path, smollm2_dir):
    """``python -m loadtest.compare --smoke --workload mixed --priorities both`` on two models: each load point run
    without priorities and with them, each request recorded with its class (and its level with priorities), and the
    report's table of each class per model (about 3 minutes)."""
    command = [sys.executable, "-m", "loadtest.compare", "--smoke", "--model", str(smollm2_dir), "--out", str(tmp_path),
               "--workload", "mixed", "--priorities", "both", "--models", "llm_dynamic,llm_continuous",
               "--dynamic-variants", ""]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=580)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    (out_dir,) = tmp_path.iterdir()
    results = json.loads((out_dir / "results.json").read_text())
    assert sorted((r["model"], r["priorities"]) for r in results["runs"]) == [
        ("llm_continuous", False), ("llm_continuous", True), ("llm_dynamic", False), ("llm_dynamic", True)]
    for run in results["runs"]:
        assert not [r["error"] for r in run["requests"] if r["error"]], run["model"]
        levels = {(r["class"], r["priority"]) for r in run["requests"]}
        assert levels == ({("interactive", 1), ("batch", 3)} if run["priorities"] else
                          {("interactive", None), ("batch", None)}), (run["model"], levels)
    # The served copies order the engine's queue by priority.
    assert {c["scheduling_policy"] for c in results["meta"]["configs"].values()} == {"priority"}
    md = (out_dir / "report.md").read_text()
    section = md.split("## Interactive beside batch: each class, per model")[1].split("\n## ")[0]
    for model in ("llm_dynamic", "llm_continuous"):
        rows = section.split(f"### {model}")[1].split("\n\n")[1].splitlines()[2:]
        assert [row.split(" | ")[:3] for row in rows] == [
            ["| 4 users", "off", "interactive"], ["| 4 users", "off", "batch"],
            ["| 4 users", "on (level 1)", "interactive"], ["| 4 users", "on (level 3)", "batch"]], model
    assert "classes" in json.loads((out_dir / "record.json").read_text())["tables"]


# ---- make slo --capacity: the KV pool as a server reports it --------------------------------------------------------


@pytest.mark.server
@pytest.mark.timeout(300)
def test_capacity_is_sized_from_the_pool_a_server_of_a_written_copy_reports(tmp_path, tiny_llama_dir):
    """``make slo --capacity``'s first server: a copy of llm_continuous written through ``config_text`` (the tiny
    Llama's 256 KV blocks, and blocks of 8 tokens rather than the shipped 16), which Triton loads; the seats come
    from the blocks on its metrics port and the block size of the config it serves."""
    source = make_repository(tmp_path / "source", {"block_size": "8"}, models=("llm_continuous",))
    args = slo.parse_args(["--capacity", "--model-repository", str(source), "--model", str(tiny_llama_dir)])
    said = []
    capacity = slo.size_capacity(args, tmp_path / "out", say=said.append)
    assert capacity == slo.capacity_seats(256, 8, args.workload)
    assert (capacity["kv_blocks"], capacity["block_size"]) == (256, 8)
    assert said and "llm_continuous alone" in said[0]
    assert (tmp_path / "out" / "sizing" / "tritonserver.log").is_file()


# ---- make slo --workload mixed: a short ladder against a real server ------------------------------------------------


@pytest.mark.server
@pytest.mark.timeout(300)
def test_slo_of_the_mixed_workload_end_to_end(tmp_path, tiny_llama_dir):
    """``make slo --workload mixed --priorities on`` on the tiny Llama's llm_continuous: its own server (the served
    copy ordering its queue by priority), a ladder of 0 and 1 batch users beside 2 interactive users, 8 s a point
    (about a minute). The tiny model answers well within the interactive targets, so the whole ladder holds."""
    source = make_repository(tmp_path / "source", models=("llm_continuous",))
    argv = ["--workload", "mixed", "--priorities", "on", "--models", "llm_continuous", "--users", "0,1",
            "--duration", "8", "--length-scale", "0.25", "--model-repository", str(source), "--model",
            str(tiny_llama_dir), "--out", str(tmp_path / "out")]  # fmt: skip
    assert slo.main(argv) == 0

    (out_dir,) = (tmp_path / "out").iterdir()
    summary = json.loads((out_dir / "slo.json").read_text())
    (result,) = summary["results"]
    assert (result["model"], result["priorities"], result["config"]["scheduling_policy"]) == (
        "llm_continuous", True, "priority")
    assert [row["load"] for row in result["rows"]] == ["0 users", "1 users"]
    assert result["first_violation"] is None and result["best"]["load"] == "1 users", result["rows"]
    best = result["best"]
    assert best["num_requests"] >= 20 and best["within_targets"] == 1.0 and best["batch_tok_per_s"] > 0
    assert result["rows"][0]["batch_tok_per_s"] == 0.0  # no batch user: the interactive class alone
    # Each request was sent at its class's level.
    records = (out_dir / "locust" / "llm_continuous_u1_priorities_requests.jsonl").read_text().splitlines()
    levels = {(r["class"], r["priority"]) for r in map(json.loads, records) if "index" in r}
    assert levels == {("interactive", 1), ("batch", 3)}
    table = json.loads((out_dir / "record.json").read_text())["tables"]["mixed"]
    assert [(r["model"], r["priorities"], r["batch_load"]) for r in table["rows"]] == [("llm_continuous", "on",
                                                                                        "1 users")]
