"""vLLM's ``/tokenize`` and ``/detokenize``, and each model's ``max_model_len`` (which ``/v1/models`` shows too).

Every model serves the same folder, so one tokenizer (the chat template's) answers for all of them. A prompt is
tokenized as the models tokenize ``text_input``; a chat is rendered with the template first, as
``/v1/chat/completions`` renders it. ``max_model_len`` is the engine's: the model's ``max_model_len`` parameter, or
(unset) what the engine resolves it to against the model folder's ``config.json`` (``EngineConfig.resolve``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from backend.engine.config import EngineConfig, ModelShape
from frontend.openai.chat_template import ChatTemplate
from frontend.openai.protocol import ChatMessage, bad_request

# The model's settings that decide its max_model_len when the parameter is unset.
_MAX_MODEL_LEN_SETTINGS = ("max_model_len", "enable_chunked_prefill", "max_num_batched_tokens", "max_num_seqs")


class CompletionTokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class ChatTokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
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


def max_model_len(model_config: dict, model_shape: ModelShape) -> int:
    """The served model's ``max_model_len``, from its config (config.pbtxt as JSON), resolved as its engine does."""
    parameters = {k: v.get("string_value") for k, v in model_config.get("parameters", {}).items()}
    settings = {k: parameters[k] for k in _MAX_MODEL_LEN_SETTINGS if parameters.get(k)}
    return EngineConfig.from_dict(settings).resolve(model_shape).max_model_len
