"""A request's lengths against the model's ``max_model_len``, in the OpenAI client's terms, before Triton sees it.

The models check the same, in their own terms: ``text_input``'s bytes (a cheap bound that spares the tokenizer a
10 MB prompt) and ``max_tokens``. An OpenAI client sent messages or a prompt, and perhaps ``max_completion_tokens``
or ``max_output_tokens``, and thinks in tokens: so the frontend counts the prompt's tokens itself, with the same
tokenizer, and names the parameters as the client sent them, in vLLM's words ("This model's maximum context length
is ... tokens").
"""

from __future__ import annotations

import asyncio

from frontend.openai.protocol import bad_request

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
# A byte-level BPE token spans at least one byte of text, so a prompt with fewer bytes than max_model_len less this
# margin (tokens the tokenizer adds itself, such as a BOS) fits without being counted: most prompts cost nothing.
ADDED_TOKENS_MARGIN = 8
# Beyond this many bytes only the beginning is counted ("at least N tokens"): the tokenizer's time is bounded.
MAX_COUNTED_BYTES = 1 << 20


def check_max_tokens(max_tokens: int | None, param: str, max_model_len: int) -> None:
    """A 400 for an output limit the model's context cannot hold even after an empty prompt."""
    if max_tokens is not None and max_tokens >= max_model_len:
        raise bad_request(
            f"'{param}' is too large: {max_tokens}. This model's maximum context length is {max_model_len} tokens, "
            f"which the input and the output share: at most {max_model_len - 1} tokens can be generated",
            param=param, code=CONTEXT_LENGTH_EXCEEDED,
        )


async def check_prompt(tokenizer, prompt: str, param: str, max_model_len: int) -> None:
    """A 400 for a prompt of ``max_model_len`` tokens or more (no room for one generated token), counted as the
    models count it (the prompt rendered from ``messages`` for chat: ``param`` names what the client sent)."""
    size = len(prompt.encode("utf-8"))
    if size + ADDED_TOKENS_MARGIN < max_model_len:
        return
    counted = prompt
    if size > MAX_COUNTED_BYTES:
        counted = prompt.encode("utf-8")[:MAX_COUNTED_BYTES].decode("utf-8", "ignore")
    # NOTE: on a worker thread: a long prompt takes the tokenizer milliseconds that other requests' streams need.
    num_tokens = len(await asyncio.to_thread(tokenizer.encode, counted))
    if num_tokens >= max_model_len:
        at_least = "" if counted is prompt else "at least "
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has {at_least}"
            f"{num_tokens} input tokens, which leaves no room for output. Please reduce the length of the {param}.",
            param=param, code=CONTEXT_LENGTH_EXCEEDED,
        )
