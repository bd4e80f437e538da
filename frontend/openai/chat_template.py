"""``messages`` rendered with the model folder's own chat template, the generation prompt added.

The template is the one the model folder ships (``tokenizer_config.json`` or ``chat_template.jinja``), applied by
transformers' ``apply_chat_template``, so the prompt is exactly what the model was trained on. The rendered text goes
to Triton as ``text_input``; the models tokenize it (special tokens such as ``<|im_start|>`` included).
"""

from __future__ import annotations

import os
from pathlib import Path

import jinja2

from frontend.openai.protocol import ChatMessage, bad_request

# OpenAI's newer name for the system turn; templates know "system".
ROLE_FOR_TEMPLATE = {"developer": "system"}


class ChatTemplate:
    """The chat template of one model folder (its tokenizer, loaded once)."""

    def __init__(self, model_dir: str | os.PathLike) -> None:
        from transformers import AutoTokenizer  # NOTE: imported here: a second or two, paid once at startup

        self.model_dir = Path(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)

    @property
    def has_template(self) -> bool:
        return bool(self.tokenizer.chat_template)

    def render(self, messages: list[ChatMessage]) -> str:
        """The prompt for ``messages``; a 400 that says why when the template cannot render them."""
        if not self.has_template:
            raise bad_request(
                f"the model folder {self.model_dir.name} has no chat template; send the prompt to /v1/completions",
                param="messages",
            )
        turns = [{"role": ROLE_FOR_TEMPLATE.get(m.role, m.role), "content": m.text()} for m in messages]
        try:
            return self.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
            raise bad_request(
                f"the model's chat template cannot render these messages: {exc}", param="messages"
            ) from None
