"""Incremental detokenization with the SmolLM2 tokenizer (byte-level BPE: one Korean syllable or emoji spans tokens).

Tokens are fed one by one, as the engine does; the finished stream must equal a full decode of the same ids.
"""

from __future__ import annotations

import pytest

from backend.engine.detokenizer import IncrementalDetokenizer

DECODE_KW = {"skip_special_tokens": True, "clean_up_tokenization_spaces": False}
MULTIBYTE_TEXTS = [
    "안녕하세요, 세계! 반갑습니다.",
    "Party 🎉👍🏽🧑‍🚀 time 🇰🇷!",
    "Café naïve façade — crème brûlée, Ærøskøbing, Dvořák",
    "日本語のテキストと English mixed 한국어",
]
FOX = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def stream(tokenizer, token_ids, stop=(), prompt="Say something:"):
    """Feed ``token_ids`` one at a time the way the engine does; returns (deltas, hit_stop, tokens fed)."""
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), list(stop))
    deltas = []
    for n, token_id in enumerate(token_ids, 1):
        delta, hit = detok.add_token(token_id)
        deltas.append(delta)
        if hit:
            deltas.append(detok.flush())
            return deltas, True, n
    deltas.append(detok.flush())
    return deltas, False, len(token_ids)


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_multibyte_deltas_join_to_full_decode_without_replacement_chars(tokenizer, text):
    token_ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([t]) for t in token_ids), "the text should split characters"
    deltas, hit, _ = stream(tokenizer, token_ids)
    assert not hit
    assert "".join(deltas) == tokenizer.decode(token_ids, **DECODE_KW) == text
    assert not any("\ufffd" in d for d in deltas)


def test_truncated_multibyte_character_is_dropped_not_sent_as_replacement(tokenizer):
    """A generation cut inside a character (a length stop) ends with the characters it completed, no U+FFFD."""
    token_ids = tokenizer.encode("새 세계")[:-1]
    full = tokenizer.decode(token_ids, **DECODE_KW)
    assert full.endswith("\ufffd") and full.rstrip("\ufffd") == "새 세"
    deltas, _, _ = stream(tokenizer, token_ids)
    assert "".join(deltas) == "새 세"
    assert not any("\ufffd" in d for d in deltas)


def test_stop_strings_wait_for_min_tokens(tokenizer):
    """Before min_tokens tokens a stop string does not end the request, and text made then is never searched."""
    token_ids = tokenizer.encode(FOX)  # The| quick| brown| fox| jumps| over| the| lazy| dog|.
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"), ["quick", "lazy"], min_tokens=3)
    deltas, hits = [], []
    for token_id in token_ids:
        delta, hit = detok.add_token(token_id)
        deltas.append(delta)
        hits.append(hit)
        if hit:
            break
    assert hits.index(True) == 7  # " lazy", not " quick" (token 2, within the first three)
    assert "".join(deltas) + detok.flush() == "The quick brown fox jumps over the "


def test_stop_string_straddling_tokens_is_found_and_cut(tokenizer):
    token_ids = tokenizer.encode(FOX)
    stop = "n fox ju"  # spans " brown", " fox" and " jumps"
    deltas, hit, fed = stream(tokenizer, token_ids, [stop])
    assert hit
    assert "".join(deltas) == "The quick brow"
    assert fed == 5  # found on the token that completes it, not later
    assert not any(stop in d for d in deltas)


def test_stop_string_across_multibyte_tokens(tokenizer):
    text = "안녕하세요, 세계! 반갑습니다."
    deltas, hit, _ = stream(tokenizer, tokenizer.encode(text), ["세계"])
    assert hit and "".join(deltas) == "안녕하세요, "


def test_earliest_stop_string_wins(tokenizer):
    # " fox" completes both stop strings at once; "brown fox" starts earlier, so it wins although listed last.
    deltas, hit, _ = stream(tokenizer, tokenizer.encode(FOX), ["fox", "brown fox"])
    assert hit and "".join(deltas) == "The quick "
    deltas, hit, _ = stream(tokenizer, tokenizer.encode(FOX), ["lazy", "over", "jumps"])
    assert hit and "".join(deltas) == "The quick brown fox "


def test_held_back_text_is_flushed_at_the_end(tokenizer):
    token_ids = tokenizer.encode(FOX)
    stop = "dog!!"  # never completes, but "dog" and "." could be its start: they are held back
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"), [stop])
    streamed = "".join(detok.add_token(t)[0] for t in token_ids)
    assert FOX.startswith(streamed) and len(FOX) - len(streamed) == len(stop) - 1
    assert streamed + detok.flush() == FOX


def test_no_stop_strings_streams_everything_at_once(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], [])
    streamed = [detok.add_token(t)[0] for t in tokenizer.encode(FOX)]
    assert "".join(streamed) == FOX and detok.flush() == ""


def test_include_stop_keeps_the_stop_string_and_special_tokens_can_be_kept(tokenizer):
    ids = tokenizer.encode(FOX)
    kept = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"), ["fox", "fox jumps"], include_stop=True)
    text = ""
    for token_id in ids:
        delta, hit = kept.add_token(token_id)
        text += delta
        if hit:
            break
    assert hit and text + kept.flush() == "The quick brown fox"
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for skip, expected in ((True, "Hi"), (False, "Hi<|im_end|>")):
        detok = IncrementalDetokenizer(tokenizer, [1], [], skip_special_tokens=skip)
        text = "".join(detok.add_token(t)[0] for t in [*tokenizer.encode("Hi"), eos]) + detok.flush()
        assert text == expected
