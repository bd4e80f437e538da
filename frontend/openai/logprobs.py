"""Log-probabilities: the models' ``logprobs`` output (vllm_backend's JSON) read, and written in OpenAI's two shapes,
chat's ``{"content": [{"token", "bytes", "logprob", "top_logprobs"}]}`` and completions' ``{"tokens",
"token_logprobs", "top_logprobs", "text_offset"}``.

The models compute them from the distribution each token was drawn from: after logit bias, penalties, min_p and the
request's temperature (1 for greedy), before top-k and top-p (model_repository/README.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from openai.types.chat import chat_completion, chat_completion_chunk
from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob, TopLogprob
from openai.types.completion_choice import Logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its text and log-probability, and the likeliest tokens the model sent, best first."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...]


def parse_logprobs(text: str) -> tuple[TokenLogprob, ...]:
    """The models' ``logprobs`` output: one ``{token_id: {"logprob", "rank", "decoded_token"}}`` per token, the
    sampled token first. NOTE: the sampled token is among the likeliest only when its rank says so; it loses ties."""
    found = []
    for entry in json.loads(text):
        ranked = list(entry.values())
        sampled = ranked[0]
        best_first = sorted(enumerate(ranked), key=lambda pair: (pair[1]["rank"], pair[0] == 0))
        found.append(TokenLogprob(sampled["decoded_token"], sampled["logprob"],
                                  tuple((e["decoded_token"], e["logprob"]) for _, e in best_first)))
    return tuple(found)


def chat_logprobs(tokens: tuple[TokenLogprob, ...], k: int, chunk: bool = False):
    """Chat's ``logprobs`` of a choice (``chunk``: of a streamed chunk's choice), ``k`` likeliest per token."""
    kind = chat_completion_chunk.ChoiceLogprobs if chunk else chat_completion.ChoiceLogprobs
    return kind(content=[
        ChatCompletionTokenLogprob(token=t.token, bytes=list(t.token.encode()), logprob=t.logprob,
                                   top_logprobs=[TopLogprob(token=tok, bytes=list(tok.encode()), logprob=lp)
                                                 for tok, lp in t.top[:k]])
        for t in tokens
    ])


def completion_logprobs(tokens: tuple[TokenLogprob, ...], k: int, offset: int = 0) -> Logprobs:
    """Completions' ``logprobs`` of a choice; ``offset``: where the first token's text starts in the answer."""
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.token)
    return Logprobs(tokens=[t.token for t in tokens], token_logprobs=[t.logprob for t in tokens],
                    top_logprobs=[dict(t.top[:k]) for t in tokens], text_offset=offsets)
