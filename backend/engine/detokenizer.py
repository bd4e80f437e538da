"""Incremental detokenization with stop strings.

Streamed deltas concatenate exactly to the final text, never split a multi-byte character, and never contain a
stop string: while a request runs, the last ``len(longest stop) - 1`` characters are held back in case they are
the start of a stop string that the next token completes. A request that ends in the middle of a multi-byte
character (a length stop) never sends the half character: its bytes are dropped from the text, as vLLM does (the
token ids still go out). Stop strings are looked for only after ``min_tokens`` tokens, in the text made after them.
With ``include_stop``, the stop string that ends the text stays in it (vLLM's ``include_stop_str_in_output``).
"""

from __future__ import annotations

# Tokens decoded again at each step before the new ones, so tokenizers whose pieces depend on their left
# neighbour (leading spaces, byte fallback) produce the same characters as a full decode.
_CONTEXT_TOKENS = 5
class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str], min_tokens: int = 0,
                 include_stop: bool = False, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._decode_kw = {"skip_special_tokens": skip_special_tokens, "clean_up_tokenization_spaces": False}
        self._include_stop = include_stop
        self._min_tokens = min_tokens
        self._num_tokens = 0  # generated tokens added so far
        self._stop_from = 0  # stop strings may start at this index of self.text or later
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
        self._num_tokens += 1
        ids = self._token_ids
        prefix = self._tokenizer.decode(ids[self._prefix_offset : self._read_offset], **self._decode_kw)
        full = self._tokenizer.decode(ids[self._prefix_offset :], **self._decode_kw)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return "", False  # an incomplete multi-byte character: wait for the next token
        new_text = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        start = max(len(self.text) - self._hold, self._stop_from, 0)
        self.text += new_text
        if self._num_tokens <= self._min_tokens:
            self._stop_from = len(self.text)  # text made before min_tokens cannot hold a stop
        elif self._stop:
            hit = _find_stop(self.text, self._stop, start)
            if hit is not None:
                where, length = hit
                self.text = self.text[:where + length if self._include_stop else where]
                self._prefix_offset = self._read_offset = len(ids)
                return self._emit(len(self.text)), True
        return self._emit(len(self.text) - self._hold), False

    def flush(self) -> str:
        """The rest of the text, held-back characters included (call when finishing).

        NOTE: the bytes of a character the request did not finish are dropped, not sent as U+FFFD.
        """
        if self._read_offset < len(self._token_ids):
            ids = self._token_ids
            prefix = self._tokenizer.decode(ids[self._prefix_offset : self._read_offset], **self._decode_kw)
            full = self._tokenizer.decode(ids[self._prefix_offset :], **self._decode_kw)
            self.text += full[len(prefix) :].rstrip("\ufffd")
            self._prefix_offset = self._read_offset = len(ids)
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        if upto <= self._num_emitted:
            return ""
        delta = self.text[self._num_emitted : upto]
        self._num_emitted = upto
        return delta


def _find_stop(text: str, stops: list[str], start: int) -> tuple[int, int] | None:
    """Earliest index at which any stop string begins (searching only where a new match can start), and that stop
    string's length (the longest, of those that begin there)."""
    hits = [(i, -len(s)) for s, i in ((s, text.find(s, start)) for s in stops) if i >= 0]
    if not hits:
        return None
    where, minus_length = min(hits)
    return where, -minus_length
