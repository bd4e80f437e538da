"""Incremental detokenization with stop strings.

Streamed deltas concatenate exactly to the final text, never split a multi-byte character, and never contain a
stop string: while a request runs, the last ``len(longest stop) - 1`` characters are held back in case they are
the start of a stop string that the next token completes.
"""

from __future__ import annotations

# Tokens decoded again at each step before the new ones, so tokenizers whose pieces depend on their left
# neighbour (leading spaces, byte fallback) produce the same characters as a full decode.
_CONTEXT_TOKENS = 5
_DECODE_KW = {"skip_special_tokens": True, "clean_up_tokenization_spaces": False}


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str]) -> None:
        self._tokenizer = tokenizer
        self._token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # everything decoded so far (stop string and what follows removed once found)
        self._num_emitted = 0  # characters of self.text already returned as deltas

    def add_token(self, token_id: int) -> tuple[str, bool]:
        """Add one generated token; return (delta to stream now, whether a stop string was hit)."""
        self._token_ids.append(token_id)
        ids = self._token_ids
        prefix = self._tokenizer.decode(ids[self._prefix_offset : self._read_offset], **_DECODE_KW)
        full = self._tokenizer.decode(ids[self._prefix_offset :], **_DECODE_KW)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return "", False  # an incomplete multi-byte character: wait for the next token
        new_text = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        start = max(len(self.text) - self._hold, 0)
        self.text += new_text
        if self._stop:
            hit = _find_stop(self.text, self._stop, start)
            if hit is not None:
                self.text = self.text[:hit]
                self._prefix_offset = self._read_offset = len(ids)
                return self._emit(len(self.text)), True
        return self._emit(len(self.text) - self._hold), False

    def flush(self) -> str:
        """The rest of the text, including held-back characters and an unfinished character (call when finishing)."""
        if self._read_offset < len(self._token_ids):
            ids = self._token_ids
            prefix = self._tokenizer.decode(ids[self._prefix_offset : self._read_offset], **_DECODE_KW)
            full = self._tokenizer.decode(ids[self._prefix_offset :], **_DECODE_KW)
            self.text += full[len(prefix) :]
            self._prefix_offset = self._read_offset = len(ids)
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        if upto <= self._num_emitted:
            return ""
        delta = self.text[self._num_emitted : upto]
        self._num_emitted = upto
        return delta


def _find_stop(text: str, stops: list[str], start: int) -> int | None:
    """Earliest index at which any stop string begins, searching only where a new match can start."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None
