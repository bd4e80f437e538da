"""Log-probabilities: the models' ``logprobs`` and ``prompt_logprobs`` outputs (vllm_backend's JSON) read, and written
in OpenAI's two shapes, chat's ``{"content": [{"token", "bytes", "logprob", "top_logprobs"}]}`` and completions'
``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` (with ``echo``, the prompt's tokens first, the first
of them with ``null`` for its log-probability and its likeliest tokens, as OpenAI's legacy completions and vLLM answer).

The models compute a generated token's from the distribution it was drawn from: after logit bias, penalties, min_p
and the request's temperature (1 for greedy), before top-k and top-p; a prompt token's from the model's own
distribution at its position (model_repository/README.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from openai.types.chat import chat_completion, chat_completion_chunk
from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob, TopLogprob
from openai.types.completion_choice import Logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """One token: its text and log-probability, and the likeliest tokens the model sent, best first (a prompt's first
    token has neither: None)."""

    token: str
    logprob: float | None
    top: tuple[tuple[str, float], ...] | None


def parse_logprobs(text: str) -> tuple[TokenLogprob, ...]:
    """The models' ``logprobs`` output: one ``{token_id: {"logprob", "rank", "decoded_token"}}`` per token, the
    sampled token first."""
    return tuple(token_logprob(entry) for entry in json.loads(text))


def token_logprob(entry: dict) -> TokenLogprob:
    """One entry of the models' JSON, its token first. NOTE: that token is among the likeliest only when its rank says
    so; it loses ties."""
    ranked = list(entry.values())
    token = ranked[0]
    best_first = sorted(enumerate(ranked), key=lambda pair: (pair[1]["rank"], pair[0] == 0))
    return TokenLogprob(token["decoded_token"], token["logprob"],
                        tuple((e["decoded_token"], e["logprob"]) for _, e in best_first))


def echo_logprobs(prompt: str, entries: list[dict | None]) -> tuple[TokenLogprob, ...]:
    """The prompt's tokens from the models' ``prompt_logprobs`` (vLLM's: one entry per prompt token, the first
    ``null``). NOTE: the models send no text for the first token; it is the prompt's text before the other tokens'
    (a byte-level BPE token's text is its piece of the prompt), or empty where those do not end the prompt."""
    rest = tuple(token_logprob(entry) for entry in entries[1:])
    joined = "".join(t.token for t in rest)
    first = prompt[: len(prompt) - len(joined)] if prompt.endswith(joined) else ""
    return (TokenLogprob(first, None, None), *rest) if entries else ()


def chat_logprobs(tokens: tuple[TokenLogprob, ...], k: int, chunk: bool = False):
    """Chat's ``logprobs`` of a choice (``chunk``: of a streamed chunk's choice), ``k`` likeliest per token."""
    kind = chat_completion_chunk.ChoiceLogprobs if chunk else chat_completion.ChoiceLogprobs
    return kind(content=[
        ChatCompletionTokenLogprob(token=t.token, bytes=list(t.token.encode()), logprob=t.logprob,
                                   top_logprobs=[TopLogprob(token=tok, bytes=list(tok.encode()), logprob=lp)
                                                 for tok, lp in t.top[:k]])
        for t in tokens
    ])


class CompletionLogprobs(Logprobs):
    """OpenAI's type, with the ``null`` entries of an echoed prompt's first token."""

    token_logprobs: list[float | None] | None = None
    top_logprobs: list[dict[str, float] | None] | None = None


def completion_logprobs(tokens: tuple[TokenLogprob, ...], k: int, offset: int = 0,
                        prompt: tuple[TokenLogprob, ...] = ()) -> CompletionLogprobs:
    """Completions' ``logprobs`` of a choice; ``offset``: where the first token's text starts in the answer.
    ``prompt``: an echoed prompt's tokens, first, from offset 0 (then ``offset`` is the prompt's length)."""
    offsets = []
    for start, some in ((0, prompt), (offset, tokens)):
        for t in some:
            offsets.append(start)
            start += len(t.token)
    every = (*prompt, *tokens)
    return CompletionLogprobs(tokens=[t.token for t in every], token_logprobs=[t.logprob for t in every],
                              top_logprobs=[None if t.top is None else dict(t.top[:k]) for t in every],
                              text_offset=offsets)
