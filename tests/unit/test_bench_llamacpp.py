"""The llama.cpp column of ``make bench`` without llama.cpp: the ITL from token arrival times, the stream reader, the
command line and requests it builds, the whole column against a fake ``llama-server``, and the target it judges."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from bench import engine_table, engine_targets
from bench.llamacpp import (
    LlamaCppWorkload,
    completion_body,
    default_gguf,
    itl_summary,
    llamacpp_column,
    read_stream,
    server_command,
)


def test_itl_is_the_median_gap_after_the_first_two_tokens():
    # Stream 0: gaps 100 (skipped), 50 (skipped), then 10, 10, 30; stream 1: 100, 100, then 20, 20, 40.
    token_times = [[0.0, 0.1, 0.15, 0.16, 0.17, 0.2], [0.0, 0.1, 0.2, 0.22, 0.24, 0.28]]
    summary = itl_summary(token_times, started=-0.1, new_tokens=6)
    assert summary["itl_ms"] == pytest.approx(20.0)  # median of 10, 10, 20, 20, 30, 40
    assert summary["itl_p90_ms"] == pytest.approx(30.0)  # index int(0.9 * 5) = 4 of the sorted gaps
    assert summary["tok_s"] == pytest.approx(12 / 0.38)  # 12 tokens from the release to the last token


def test_itl_refuses_a_stream_with_the_wrong_number_of_tokens():
    with pytest.raises(RuntimeError, match="exactly 6 tokens"):
        itl_summary([[0.0, 0.1, 0.2, 0.3, 0.4, 0.5], [0.0, 0.1, 0.2]], started=0.0, new_tokens=6)


def sse(**event) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n"


def test_stream_reader_times_each_token_and_a_held_back_one_with_the_next_event():
    lines = [
        sse(content="a", tokens_predicted=1, stop=False), b"\n",
        sse(content="bc", tokens_predicted=3, stop=False), b"\n",  # token 2 was an incomplete UTF-8 character
        sse(content="", tokens_predicted=3, stop=True, timings={"predicted_per_token_ms": 7.5}), b"\n",
    ]
    clock = iter([1.0, 2.0, 3.0]).__next__
    times, timings = read_stream(iter(lines), clock=clock)
    assert times == [1.0, 2.0, 2.0]
    assert timings == {"predicted_per_token_ms": 7.5}


def test_stream_reader_raises_on_an_error_event_and_on_a_cut_stream():
    with pytest.raises(RuntimeError, match="context size"):
        read_stream(iter([sse(error={"message": "context size exceeded"})]))
    with pytest.raises(RuntimeError, match="final event"):
        read_stream(iter([sse(content="a", tokens_predicted=1, stop=False)]))


def test_server_command_listens_on_loopback_with_a_slot_per_stream():
    command = server_command("/x/bin/llama-server", "/x/m.gguf", 4321, threads=2, num_slots=8, slot_context=256)
    assert command[0] == "/x/bin/llama-server"
    options = dict(zip(command[1::2], command[2::2]))
    assert options["--host"] == "127.0.0.1" and options["--port"] == "4321" and options["--model"] == "/x/m.gguf"
    assert options["--threads"] == options["--threads-batch"] == "2"
    assert options["--parallel"] == "8" and options["--ctx-size"] == str(8 * 256)
    assert "--cont-batching" in command and "--cache-ram" in command


def test_completion_body_asks_for_exactly_the_new_tokens():
    greedy = completion_body([5, 6, 7], LlamaCppWorkload(batch=1, temperature=0.0, new_tokens=32), seed=3)
    assert greedy["prompt"] == [5, 6, 7] and greedy["n_predict"] == 32 and greedy["ignore_eos"] is True
    assert greedy["stream"] is True and greedy["temperature"] == 0 and greedy["top_k"] == 1
    assert greedy["cache_prompt"] is False and greedy["seed"] == 3
    sampled = completion_body([5], LlamaCppWorkload(batch=1, temperature=1.0, new_tokens=32), seed=3)
    assert sampled["temperature"] == 1.0 and sampled["top_k"] == 0 and sampled["top_p"] == 1.0
    assert sampled["min_p"] == 0.0


def test_default_gguf_is_beside_the_bin_folder():
    assert default_gguf("/a/.llamacpp/bin/llama-server", "models/smollm2-135m-instruct") == (
        default_gguf("/a/.llamacpp/bin/llama-server", "x").parent / "smollm2-135m-instruct-bf16.gguf")
    assert str(default_gguf("/a/.llamacpp/bin/llama-server", "m")) == "/a/.llamacpp/m-bf16.gguf"


FAKE_SERVER = '''\
"""A stand-in for llama-server: /health, and /completion streaming one event per token every 50 ms."""
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

args = sys.argv[1:]
if args == ["--version"]:
    print("version: 1 (fake)")
    sys.exit(0)
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps({"argv": args}) + "\\n")

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(os.environ["FAKE_LOG"], "a") as log:
            log.write(json.dumps({"body": body}) + "\\n")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(1, body["n_predict"] + 1):
            time.sleep(0.05)
            event = {"content": "x", "tokens_predicted": i, "stop": False}
            self.wfile.write(b"data: " + json.dumps(event).encode() + b"\\n\\n")
            self.wfile.flush()
        final = {"content": "", "tokens_predicted": body["n_predict"], "stop": True,
                 "timings": {"predicted_per_token_ms": 50.0}}
        self.wfile.write(b"data: " + json.dumps(final).encode() + b"\\n\\n")

ThreadingHTTPServer((args[args.index("--host") + 1], int(args[args.index("--port") + 1])), Handler).serve_forever()
'''


def test_column_against_a_fake_llama_server(tmp_path, monkeypatch):
    server = tmp_path / "bin" / "llama-server"
    server.parent.mkdir()
    server.write_text(f"#!{sys.executable}\n" + textwrap.dedent(FAKE_SERVER))
    server.chmod(0o755)
    (tmp_path / "tiny-bf16.gguf").write_bytes(b"GGUF")
    fake_log = tmp_path / "fake.jsonl"
    monkeypatch.setenv("FAKE_LOG", str(fake_log))
    prompts = [[100 + i] * 5 for i in range(3)]

    column = llamacpp_column(server, "models/tiny", threads=2, batches=(1, 3), prompts=prompts, new_tokens=6,
                             repeats=1, seed=10, log=lambda msg: None)

    assert column["version"] == "1 (fake)" and column["gguf"] == str(tmp_path / "tiny-bf16.gguf")
    assert column["num_slots"] == 3 and column["prompt_len"] == 5 and column["new_tokens"] == 6
    assert [(r["batch"], r["temperature"]) for r in column["runs"]] == [(1, 0.0), (1, 1.0), (3, 0.0), (3, 1.0)]
    for run in column["runs"]:
        # NOTE: 50 ms sleeps, not 2: a client held back reads the events that waited meanwhile back to back, and
        # with 2 ms between events a few ms' delay empties two of a stream's three gaps, and so the median.
        assert run["itl_ms"] >= 10 and run["itl_p90_ms"] >= run["itl_ms"] and run["tok_s"] > 0
        assert run["server_ms_per_token"] == 50.0 and run["server_cpu"] >= 0
    records = [json.loads(line) for line in fake_log.read_text().splitlines()]
    argv = records[0]["argv"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--parallel") + 1] == "3"
    bodies = [r["body"] for r in records[1:]]
    assert len(bodies) == 2 + 1 * 2 + 3 * 2  # warm-up of 2 streams, then batch 1 and 3, greedy and T=1
    assert {b["n_predict"] for b in bodies[2:]} == {6} and all(b["ignore_eos"] for b in bodies)
    assert sorted(b["seed"] for b in bodies[-3:]) == [10, 11, 12]  # one seed per stream
    assert sorted(tuple(b["prompt"]) for b in bodies[-3:]) == sorted(map(tuple, prompts))


def test_column_says_how_to_make_a_missing_gguf(tmp_path):
    with pytest.raises(FileNotFoundError, match="make llamacpp"):
        llamacpp_column(tmp_path / "bin" / "llama-server", "models/tiny", 2, (1,), [[1, 2]], 4, 1, 0)


# ---- the target (bench/engine_targets.py) and the table (bench/engine_table.py) --------------------------------------


def fake_result(served_itl: dict[int, float] | None, llamacpp_itl: dict[int, float] | None) -> dict:
    """A bench result with only what ``judge_targets`` and ``format_table`` read."""
    fixed = [{"batch": b, "engine_tok_s": 50.0 * b, "hf_tok_s": None, "ratio": None, "engine_decode_step_ms": 20.0,
              "decode_tok_s": 50.0 * b, "sampled_decode_step_ms": 21.0, "top_p_decode_step_ms": 21.0,
              "sample_ms": {"greedy": 0.1, "t1": 0.2, "t1_top_p": 0.3}, "floor_ms": 9.0, "step_over_floor": 2.2}
             for b in (1, 8)]
    result = {
        "config": {"model": "m", "dtype": "bfloat16", "threads": 2, "quick": True, "prompt_len": 64,
                   "new_tokens": 32},
        "fixed_batches": fixed,
        "memory_floor": {"weight_bytes": 2.7e8, "mean_context": 80.0, "bandwidth_gbs": 30.0},
        "served": None,
        "workload": {"num_requests": 4, "num_prompt_tokens": 100, "num_output_tokens": 50, "max_num_seqs": 8,
                     "continuous_tok_s": 100.0, "continuous_mean_batch": 4.0, "continuous_steps": 20,
                     "fragmentation": 0.02, "continuous_prefill_s": 0.1, "continuous_decode_s": 0.4,
                     "static_tok_s": 50.0, "static_mean_batch": 2.0, "static_steps": 40,
                     "static_fragmentation": 0.03, "static_prefill_s": 0.1, "static_decode_s": 0.9, "speedup": 2.0,
                     "continuous_prefill_steps": 4, "static_prefill_steps": 2, "continuous_prefill_step_decodes": 6,
                     "static_prefill_step_decodes": 0},
        "mixed_steps": [],
        "scheduler": {"num_seqs": 256, "us_per_step": 200.0, "share_of_step": 0.002, "step_ms": 100.0,
                      "step_source": "fake"},
    }
    if served_itl is not None:
        result["served"] = {"prompt_len": 64, "new_tokens": 32, "runs": [
            {"model": model, "batch": b, "temperature": t, "itl_ms": ms * (3 if model == "llm_dynamic" else 1),
             "itl_p90_ms": ms, "offline_step_ms": ms, "ratio": 1.0, "client_cpu": 0.1, "server_cpu": 1.0}
            for model in ("llm_continuous", "llm_dynamic") for b, ms in served_itl.items() for t in (0.0, 1.0)]}
    if llamacpp_itl is not None:
        runs = [{"batch": b, "temperature": t, "itl_ms": ms, "itl_p90_ms": ms, "tok_s": b * 1e3 / ms,
                 "server_ms_per_token": None if t else ms - 1, "server_cpu": 2.0}
                for b, ms in llamacpp_itl.items() for t in (0.0, 1.0)]
        result["llamacpp"] = {"version": "1 (x)", "gguf": "/a/m-bf16.gguf", "threads": 2, "num_slots": 8,
                              "prompt_len": 64, "new_tokens": 32, "runs": runs}
    result["targets"] = engine_targets.judge_targets(result)
    return result


def llamacpp_target(result: dict) -> dict:
    (target,) = [t for t in result["targets"] if t["name"] == "served vs llama.cpp's llama-server"]
    return target


def test_target_met_when_batch_1_is_close_and_batch_8_is_much_faster():
    target = llamacpp_target(fake_result(served_itl={1: 20.0, 8: 26.0}, llamacpp_itl={1: 17.5, 8: 55.0}))
    assert target["met"] is True
    assert target["value"] == pytest.approx(20.0 / 17.5)
    assert "1.14x" in target["detail"] and f"{55 / 26:.2f}x faster" in target["detail"]  # both ratios shown
    assert "moonshot" not in target["detail"]


def test_target_missed_at_batch_1_or_at_batch_8():
    assert llamacpp_target(fake_result({1: 30.0, 8: 26.0}, {1: 17.5, 8: 55.0}))["met"] is False  # 1.71x slower
    assert llamacpp_target(fake_result({1: 17.0, 8: 40.0}, {1: 17.5, 8: 55.0}))["met"] is False  # 1.38x faster
    moonshot = llamacpp_target(fake_result({1: 17.0, 8: 26.0}, {1: 17.5, 8: 55.0}))
    assert moonshot["met"] is True and "moonshot met" in moonshot["detail"]


def test_target_not_judged_without_both_columns():
    no_llamacpp = llamacpp_target(fake_result({1: 20.0, 8: 26.0}, None))
    assert no_llamacpp["met"] is None and no_llamacpp["value"] is None and "--llamacpp" in no_llamacpp["detail"]
    no_served = llamacpp_target(fake_result(None, {1: 17.5, 8: 55.0}))
    assert no_served["met"] is None and "17.5 ms at batch 1" in no_served["detail"]


def test_table_sets_llama_cpp_beside_the_served_itl():
    table = engine_table.format_table(fake_result({1: 20.0, 8: 26.0}, {1: 17.5, 8: 55.0}))
    assert "2b. llama.cpp's llama-server (1 (x)) on m-bf16.gguf: 64-token prompts" in table
    row = next(line.split() for line in table.splitlines() if line.split()[:2] == ["8", "greedy"]
               and "55.0" in line)
    assert row[2] == "55.0" and row[-2] == "26.0" and row[-1] == f"{55 / 26:.2f}x"
    table = engine_table.format_table(fake_result(None, {1: 17.5, 8: 55.0}))  # no served column: dashes, no crash
    row = next(line.split() for line in table.splitlines() if line.split()[:2] == ["1", "greedy"])
    assert row[-2:] == ["-", "-"]
