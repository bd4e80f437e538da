"""vLLM's /tokenize and /detokenize answers, and a served model's max_model_len as the model publishes it, without a
server (tests/unit/test_io_schema.py: what the model publishes)."""

from __future__ import annotations

import pytest

from frontend.openai import tokenize as vllm
from frontend.openai.chat_template import ChatTemplate
from frontend.openai.protocol import APIError


@pytest.fixture(scope="module")
def template(smollm2_dir):
    return ChatTemplate(smollm2_dir)


def test_a_prompt_and_a_chat_are_tokenized_as_the_models_see_them(template):
    answer = vllm.tokenize(template, vllm.CompletionTokenizeRequest(prompt="Hello world", return_token_strs=True), 512)
    assert answer["tokens"] == template.tokenizer.encode("Hello world") and answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] == 512 and "".join(answer["token_strs"]).replace("Ġ", " ") == "Hello world"
    chat = vllm.ChatTokenizeRequest(messages=[{"role": "user", "content": "Hi"}])
    rendered = template.render(chat.messages)
    assert vllm.tokenize(template, chat, 512)["tokens"] == template.tokenizer.encode(rendered, add_special_tokens=False)
    assert vllm.tokenize(template, vllm.CompletionTokenizeRequest(prompt="x"), 512)["token_strs"] is None
    with pytest.raises(APIError):
        vllm.tokenize(template, vllm.ChatTokenizeRequest(messages=chat.messages, continue_final_message=True), 512)


def test_detokenize_is_the_inverse_and_refuses_unknown_ids(template):
    ids = template.tokenizer.encode("Bonjour, le monde")
    assert vllm.detokenize(template, vllm.DetokenizeRequest(tokens=ids)) == {"prompt": "Bonjour, le monde"}
    with pytest.raises(APIError) as error:
        vllm.detokenize(template, vllm.DetokenizeRequest(tokens=[10**9]))
    assert error.value.param == "tokens"


def test_max_model_len_is_what_the_model_published_in_its_config():
    config = {"name": "llm_x", "parameters": {"max_model_len": {"string_value": "2048"}, "model": {"string_value": "x"},
                                              "stream_interval": {"string_value": "4"}}}
    assert vllm.max_model_len(config) == 2048
    with pytest.raises(APIError) as error:  # a model of someone else's, which publishes none
        vllm.max_model_len({"name": "other", "parameters": {}})
    assert error.value.status == 500 and "'other' publishes no max_model_len" in str(error.value)
