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
