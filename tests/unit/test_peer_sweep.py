"""The peer sweep (bench/peer_sweep.py): which servers it starts and in what order, the ``vllm bench serve`` command
line it runs, a saved ``vllm bench serve`` result read back (tests/data/vllm_bench_serve_result.json, from a real
smoke run), the rows of its record with the ratios to vLLM, and a server that fails without ending the sweep. No
server and no vLLM: milliseconds."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from bench import peer_sweep
from bench.peer_sweep import SMOKE, Load, Peer, bench_command, figures, peers, run_bench, run_order, summarize
from records.record import Record

ROOT = Path(__file__).resolve().parents[2]
RESULT = ROOT / "tests" / "data" / "vllm_bench_serve_result.json"


def test_make_peer_sweep_runs_the_sweep_with_vllms_environment():
    makefile = (ROOT / "Makefile").read_text()
    assert "\npeer-sweep: model vllm-venv\n" in makefile
    assert '$(PY) -m bench.peer_sweep --model "$(MODEL)" --vllm-venv $(VLLM_VENV) $(ARGS)' in makefile


def test_every_server_at_each_seat_count_and_stream_interval_in_the_order_given():
    sweep = peers(["vllm", "llm_continuous", "llm_dynamic"], [None, 8], ["auto", "1"])
    assert [p.slug for p in sweep] == [
        "vllm-default", "vllm-8", "llm_continuous-interval-auto", "llm_continuous-interval-1",
        "llm_dynamic-interval-auto", "llm_dynamic-interval-1",
    ]  # fmt: skip
    assert sweep[0].label == "vllm (default seats)" and sweep[3].label == "llm_continuous (stream_interval 1)"


def test_the_order_of_the_servers_alternates_across_repeats():
    sweep = peers(list(peer_sweep.SERVERS), [None], ["auto"])
    assert run_order(sweep, 0) == sweep
    assert run_order(sweep, 1) == sweep[::-1]
    assert run_order(sweep, 2) == sweep
    assert run_order(sweep, 0) is not sweep  # a copy: the sweep's own order is left alone


def options(command: list[str]) -> dict[str, str | None]:
    """``--name value`` pairs of a command line; a flag without a value maps to None."""
    found, i = {}, 0
    while i < len(command):
        if command[i].startswith("--"):
            value = command[i + 1] if i + 1 < len(command) and not command[i + 1].startswith("--") else None
            found[command[i]] = value
            i += 2 if value is not None else 1
        else:
            i += 1
    return found


def test_the_vllm_bench_serve_command_is_vllms_own_yardstick(tmp_path):
    python, tokenizer = tmp_path / "venv" / "bin" / "python", tmp_path / "model"
    command = bench_command(python, "http://127.0.0.1:9000", "llm_continuous", tokenizer, 16, Load(), tmp_path,
                            "r0-c16.json")
    assert command[:5] == [str(python), "-P", str(peer_sweep.VLLM_CLI), "bench", "serve"]
    assert options(command) == {
        "--backend": "openai", "--base-url": "http://127.0.0.1:9000", "--endpoint": "/v1/completions",
        "--model": "llm_continuous", "--tokenizer": str(tokenizer),
        "--dataset-name": "random", "--random-input-len": "128", "--random-output-len": "128",
        "--random-range-ratio": "0", "--seed": "16",  # its own prompts: none a prefix cache has seen
        "--num-prompts": "128", "--max-concurrency": "16",  # 8 prompts per stream
        "--ignore-eos": None, "--temperature": "0", "--num-warmups": "16",
        "--percentile-metrics": "ttft,tpot,itl,e2el", "--metric-percentiles": "50,99",
        "--save-result": None, "--result-dir": str(tmp_path), "--result-filename": "r0-c16.json",
        "--disable-tqdm": None,
    }  # fmt: skip


def test_the_smoke_load_is_short_and_the_full_one_as_the_issue_sets_it():
    assert Load().concurrencies == (1, 8, 16, 32, 64) and [Load().prompts_at(c) for c in (1, 64)] == [8, 512]
    assert SMOKE.concurrencies == (1, 2) and SMOKE.output_len == 16
    assert [SMOKE.prompts_at(c) for c in SMOKE.concurrencies] == [4, 4]


def test_the_command_line_parses_lists_and_smoke_keeps_one_server_each(tmp_path):
    args = peer_sweep.parse_args(["--servers", "vllm,llm_continuous", "--vllm-seats", "default,8,64",
                                  "--stream-intervals", "1,auto", "--concurrency", "1,4"])
    assert args.servers == ["vllm", "llm_continuous"] and args.vllm_seats == [None, 8, 64]
    assert args.stream_intervals == ["1", "auto"] and peer_sweep.load_of(args).concurrencies == (1, 4)
    assert args.model.is_absolute()
    smoke = peer_sweep.parse_args(["--smoke"])
    assert smoke.servers == list(peer_sweep.SERVERS) and smoke.vllm_seats == [None]
    assert smoke.stream_intervals == ["auto"] and peer_sweep.load_of(smoke) == SMOKE
    for bad in (["--servers", "llm_static"], ["--vllm-seats", "0"], ["--stream-intervals", "often"],
                ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            peer_sweep.parse_args(bad)


def test_a_saved_vllm_bench_serve_result_is_read_into_the_sweeps_figures():
    result = json.loads(RESULT.read_text())
    found = figures(result)
    assert found["output_tok_s"] == result["output_throughput"] and found["req_s"] == result["request_throughput"]
    assert found["ttft_p50_ms"] == result["p50_ttft_ms"] and found["ttft_p99_ms"] == result["p99_ttft_ms"]
    assert found["tpot_p99_ms"] == result["p99_tpot_ms"] and found["itl_p50_ms"] == result["p50_itl_ms"]
    assert (found["completed"], found["failed"]) == (result["completed"], result["failed"]) == (4, 0)
    assert all(found[key] is not None for key in peer_sweep.RESULT_KEYS)
    # 4 requests of 16 tokens: the server honoured ignore_eos, and the log line says nothing more
    assert found["output_tokens"] == 64 and peer_sweep.outcome(found, 16).endswith("0 failed")
    assert peer_sweep.outcome({**found, "output_tokens": 50}, 16).endswith("; 50 tokens out, not 64")


def test_run_bench_reads_the_saved_result_or_counts_every_prompt_failed(tmp_path):
    saved = tmp_path / "r0-c1.json"
    write = f"import shutil; shutil.copy({str(RESULT)!r}, {str(saved)!r})"
    ran = run_bench([sys.executable, "-c", write], tmp_path / "ok.log", saved, num_prompts=4)
    assert ran["failed"] == 0 and ran["output_tok_s"] > 0
    failed = run_bench([sys.executable, "-c", "print('connection refused'); raise SystemExit(1)"],
                       tmp_path / "bad.log", tmp_path / "none.json", num_prompts=4)
    assert failed["failed"] == 4 and "exited 1" in failed["error"] and "connection refused" in failed["error"]
    hung = run_bench([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "hung.log",
                     tmp_path / "none.json", num_prompts=8, timeout=0.5)
    assert hung["failed"] == 8 and "killed after 0.5 s" in hung["error"]


def run(peer: str, concurrency: int, repeat: int = 0, **figures) -> dict:
    return {"peer": peer, "repeat": repeat, "concurrency": concurrency, "completed": 4, "failed": 0, **figures}


def test_rows_put_each_server_beside_vllm_at_the_same_concurrency():
    sweep = peers(["vllm", "llm_continuous"], [None], ["auto"])
    load = Load(concurrencies=(1, 8))
    runs = [
        run("vllm-default", 1, output_tok_s=50.0, ttft_p50_ms=40.0, ttft_p99_ms=50.0, tpot_p99_ms=20.0),
        run("vllm-default", 8, output_tok_s=400.0, ttft_p50_ms=200.0, ttft_p99_ms=250.0, tpot_p99_ms=25.0),
        run("llm_continuous-interval-auto", 1, output_tok_s=100.0, ttft_p50_ms=40.0, ttft_p99_ms=45.0,
            tpot_p99_ms=10.0),
        # two repeats at 8 streams: the medians; a repeat that failed counts its failures only
        run("llm_continuous-interval-auto", 8, output_tok_s=300.0, ttft_p50_ms=220.0, ttft_p99_ms=300.0,
            tpot_p99_ms=20.0),
        run("llm_continuous-interval-auto", 8, 1, output_tok_s=500.0, ttft_p50_ms=180.0, ttft_p99_ms=200.0,
            tpot_p99_ms=30.0),
        {**run("llm_continuous-interval-auto", 8, 2), "failed": 64, "completed": 0, "error": "it died"},
    ]
    rows = summarize(runs, sweep, load, {"llm_continuous-interval-auto": {"max_num_seqs": "8"}})
    by = {(r["server"], r["concurrency"]): r for r in rows}
    assert [(r["server"], r["concurrency"]) for r in rows] == [("vllm", 1), ("vllm", 8), ("llm_continuous", 1),
                                                               ("llm_continuous", 8)]
    assert by["vllm", 1]["tok_s_vs_vllm"] == 1.0 and by["vllm", 1]["seats"] == "default"
    continuous = by["llm_continuous", 8]
    assert continuous["seats"] == "8" and continuous["stream_interval"] == "auto"
    assert continuous["output_tok_s"] == 400.0 and continuous["failed"] == 64
    assert continuous["tok_s_vs_vllm"] == 1.0 and continuous["ttft_p50_vs_vllm"] == 1.0
    assert continuous["ttft_p99_vs_vllm"] == 1.0 and continuous["tpot_p99_vs_vllm"] == 1.0
    assert by["llm_continuous", 1]["tok_s_vs_vllm"] == 2.0 and by["llm_continuous", 1]["tpot_p99_vs_vllm"] == 0.5
    record = Record("make peer-sweep", {}, {})
    table = record.add_table("peer_sweep", peer_sweep.COLUMNS, rows)  # every key has its column
    assert "| llm_continuous | 8 | auto | 1 | 100.0 |" in table.markdown() and "2.00x" in table.markdown()


def test_without_vllm_in_the_sweep_there_are_no_ratios():
    rows = summarize([run("llm_dynamic-interval-1", 1, output_tok_s=90.0)], peers(["llm_dynamic"], [None], ["1"]),
                     Load(concurrencies=(1,)), {})
    assert rows[0]["output_tok_s"] == 90.0 and "tok_s_vs_vllm" not in rows[0]


def test_a_server_that_does_not_start_fails_its_concurrencies_and_the_sweep_goes_on(monkeypatch, tmp_path):
    @contextlib.contextmanager
    def serving(peer, args, out, repeat):
        raise RuntimeError("vLLM exited with status 1 before it was ready")
        yield

    monkeypatch.setattr(peer_sweep, "serving", serving)
    args = peer_sweep.parse_args(["--vllm-venv", str(tmp_path)])
    lines = []
    runs, settings = peer_sweep.sweep_peer(Peer("vllm"), 0, args, Load(concurrencies=(1, 8)), tmp_path, lines.append)
    assert [(r["concurrency"], r["failed"]) for r in runs] == [(1, 8), (8, 64)] and settings == {}
    assert all("exited with status 1" in r["error"] for r in runs) and "failed" in lines[-1]


def test_the_sweep_refuses_to_start_without_vllms_environment(tmp_path, capsys):
    assert peer_sweep.main(["--vllm-venv", str(tmp_path / "none"), "--out", str(tmp_path / "out")]) == 2
    assert "make vllm-venv" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_sweep_module_starts_without_vllm_installed():
    # Only the vLLM environment imports vLLM: the project's Python runs the sweep and the launcher.
    shown = subprocess.run([sys.executable, "-m", "bench.peer_sweep", "--help"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
    assert shown.returncode == 0 and "vllm bench serve" in shown.stdout


# ---- where a server's CPU goes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name, command_line, role", [
    ("triton_python_b", ["/x/triton_python_backend_stub", "/repo/llm_continuous/1/model.py", "..."], "stub"),
    ("tritonserver", ["/x/bin/tritonserver", "--model-repository", "/r"], "tritonserver"),
    ("python", ["/repo/.venv/bin/python", "-m", "frontend.openai", "--port", "9000"], "frontend"),
    ("VLLM::EngineCor", ["VLLM::EngineCore"], "engine core"),
    ("VLLM::Worker", ["VLLM::Worker"], "worker"),
    ("python", ["/repo/.venv-vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"], "API server"),
    ("resource_tracker", ["python", "-c", "from multiprocessing.resource_tracker import main"], "resource_tracker"),
])
def test_each_process_of_a_server_is_named_by_what_it_does(name, command_line, role):
    assert peer_sweep.process_role(name, command_line) == role


def test_cpu_per_token_is_what_each_role_used_over_the_tokens_counted():
    before = {"stub": 10.0, "tritonserver": 1.0}
    after = {"stub": 14.0, "tritonserver": 1.5, "frontend": 0.5}  # the frontend seen for the first time: all of it
    found = peer_sweep.cpu_per_token(before, after, 1000)
    assert found["cpu_ms_per_token_by_process"] == {"frontend": 0.5, "stub": 4.0, "tritonserver": 0.5}
    assert found["server_cpu_ms_per_token"] == 5.0
    assert peer_sweep.cpu_per_token(before, after, 0) == {} and peer_sweep.cpu_per_token(before, after, None) == {}


def test_the_rows_carry_the_median_cpu_per_token_largest_process_first():
    sweep, load = peers(["llm_continuous"], [None], ["1"]), Load(concurrencies=(8,))
    runs = [run("llm_continuous-interval-1", 8, repeat, server_cpu_ms_per_token=total,
                cpu_ms_per_token_by_process={"stub": stub, "frontend": 0.3, "tritonserver": 0.001})
            for repeat, (total, stub) in enumerate([(4.0, 3.7), (5.0, 4.7)])]
    row = summarize(runs, sweep, load, {})[0]
    assert row["server_cpu_ms_per_token"] == 4.5 and row["server_cpu_by_process"] == "stub 4.20, frontend 0.30"
    old = summarize([run("llm_continuous-interval-1", 8)], sweep, load, {})[0]  # a run without them: none
    assert old["server_cpu_ms_per_token"] is None and old["server_cpu_by_process"] is None


def test_server_cpu_reads_every_process_of_the_tree(tmp_path):
    # A parent that starts a child; the child burns 0.2 s of CPU (time it used, not time that passed), then both wait.
    child = "import time\nwhile time.process_time() < 0.2: pass\nprint('done', flush=True)\ntime.sleep(60)"
    parent = (f"import subprocess, sys, time\np = subprocess.Popen([sys.executable, '-c', {child!r}])\n"
              "time.sleep(60)")
    process = subprocess.Popen([sys.executable, "-c", parent])
    try:
        used = {}
        for _ in range(600):  # up to 60 s on a loaded machine for the child to start and burn its share
            used = peer_sweep.server_cpu([process.pid, None])
            if sum(used.values()) >= 0.2:
                break
            time.sleep(0.1)
        assert sum(used.values()) >= 0.2, used
        assert peer_sweep.server_cpu([2**22 + 12345]) == {}  # a pid that is not there: nothing
    finally:
        for proc in psutil.Process(process.pid).children(recursive=True):
            proc.kill()
        process.kill()
        process.wait()
