"""The perplexity tool (bench/perplexity.py): llama-perplexity's chunking, and its two ways through the
engine, one prefill per chunk and one decode step per scored token, which must score the same numbers (the tiny
random Llama in float32, where the two paths differ only by the order of float32 sums)."""

from __future__ import annotations

import math

import pytest

from bench import perplexity


def test_chunks_are_cut_as_llama_perplexity_cuts_them():
    assert perplexity.chunks(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the remainder dropped
    with pytest.raises(ValueError, match="2 \\* ctx"):
        perplexity.chunks(list(range(7)), 4)


def test_the_decode_path_scores_what_the_prefill_path_scores(tiny_llama_dir):
    parts = perplexity.chunks(list(range(100, 196)), 48)  # two chunks, 24 scored tokens each
    prefill = perplexity.engine_nll(str(tiny_llama_dir), None, parts, threads=1, path="prefill")
    decode = perplexity.engine_nll(str(tiny_llama_dir), None, parts, threads=1, path="decode")
    assert prefill[1] == decode[1] == 48
    assert math.isfinite(prefill[0]) and prefill[0] > 0
    assert decode[0] == pytest.approx(prefill[0], rel=1e-4)


def test_llamacpp_figure_is_read_from_llama_perplexitys_final_estimate(tmp_path):
    fake = tmp_path / "llama-perplexity"  # prints what the real one prints last, and checks the arguments it gets
    fake.write_text("#!/bin/sh\n"
                    'case "$*" in *"-c 512"*"-t 2"*) ;; *) echo "bad arguments: $*" >&2; exit 3;; esac\n'
                    'echo "[1]22.1,[2]23.0"; echo "Final estimate: PPL = 23.0594 +/- 0.71512" >&2\n')
    fake.chmod(0o755)
    assert perplexity.llamacpp_perplexity(fake, tmp_path / "m.gguf", tmp_path / "t.txt", 512, 2) == 23.0594
    with pytest.raises(RuntimeError, match="without a final estimate"):
        perplexity.llamacpp_perplexity(fake, tmp_path / "m.gguf", tmp_path / "t.txt", 256, 2)


def test_gguf_pairs_are_parsed_and_bad_ones_refused(tmp_path):
    assert perplexity.parse_ggufs("bf16=a.gguf, q4_1=b/c.gguf") == {"bf16": perplexity.Path("a.gguf"),
                                                                    "q4_1": perplexity.Path("b/c.gguf")}
    assert perplexity.parse_ggufs("") == {}
    with pytest.raises(ValueError, match="format=path"):
        perplexity.parse_ggufs("bf16")


def test_the_record_puts_each_format_beside_hf_and_llamacpp_from_the_same_run():
    record = perplexity.Record("python -m bench.perplexity", {}, {})
    ppl = {"hf_fp32": 20.0, "bf16": 21.0, "q4_1": 22.0}
    table = perplexity.record_table(record, ppl, {"q4_1": 20.0}, "decode").tables["perplexity"]
    rows = {row["format"]: row for row in table.rows}
    assert rows["bf16"]["vs_hf"] == pytest.approx(0.05) and "llamacpp" not in rows["bf16"]
    assert rows["q4_1"]["vs_llamacpp"] == pytest.approx(0.10) and rows["q4_1"]["path"] == "decode"
    assert "| q4_1 | decode | 22.000 | +10.00% | 20.000 | +10.00% |" in table.markdown()
