"""vLLM's ``/tokenize`` and ``/detokenize``, and each model's ``max_model_len`` (which ``/v1/models`` shows too).

Every model serves the same folder, so one tokenizer (the chat template's) answers for all of them. A prompt is
tokenized as the models tokenize ``text_input``; a chat is rendered with the template first, as
``/v1/chat/completions`` renders it. ``max_model_len`` is the engine's: each model publishes the value its engine
resolved in its config's parameters when it loads (backend/contract/io_schema.py), and it is read from Triton.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from backend.contract.io_schema import MAX_MODEL_LEN_PARAMETER, served_max_model_len
from frontend.openai.chat_template import ChatTemplate
from frontend.openai.protocol import APIError, ChatMessage, RequestModel, bad_request


class CompletionTokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class ChatTokenizeRequest(RequestModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


def tokenize(template: ChatTemplate, request: CompletionTokenizeRequest | ChatTokenizeRequest,
             max_model_len: int) -> dict[str, Any]:
    """vLLM's answer: ``count``, ``max_model_len``, ``tokens``, ``token_strs`` (when asked)."""
    if isinstance(request, ChatTokenizeRequest):
        if not request.add_generation_prompt or request.continue_final_message:
            raise bad_request("only add_generation_prompt: true (without continue_final_message) is supported: the "
                              "chat is tokenized as /v1/chat/completions renders it", param="add_generation_prompt")
        text = template.render(request.messages)
    else:
        text = request.prompt
    tokens = template.tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
    strs = template.tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs else None
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens, "token_strs": strs}


def detokenize(template: ChatTemplate, request: DetokenizeRequest) -> dict[str, Any]:
    vocab = len(template.tokenizer)
    beyond = [t for t in request.tokens if not 0 <= t < vocab]
    if beyond:
        raise bad_request(f"token id {beyond[0]} is not in the model's vocabulary (0 to {vocab - 1})", param="tokens")
    return {"prompt": template.tokenizer.decode(request.tokens)}


def max_model_len(model_config: dict) -> int:
    """The served model's ``max_model_len``, from its config as Triton serves it (JSON), where the model put the value
    its engine resolved. A 500 for a model that publishes none: not one of this project's models."""
    limit = served_max_model_len(model_config)
    if limit is None:
        raise APIError(500, f"model {model_config.get('name', '?')!r} publishes no {MAX_MODEL_LEN_PARAMETER} in its "
                       "config: only this project's models (model_repository/) can be served here", "server_error",
                       None, "internal_error")
    return limit
