"""``messages`` rendered with the model folder's own chat template, the generation prompt added.

The template is the one the model folder ships (``tokenizer_config.json`` or ``chat_template.jinja``), applied by
transformers' ``apply_chat_template``, so the prompt is exactly what the model was trained on. The rendered text goes
to Triton as ``text_input``; the models tokenize it (special tokens such as ``<|im_start|>`` included).

Tools (tools.py) go to a template that takes them as ``apply_chat_template(tools=...)``; a template that does not
(SmolLM2's) gets them, and the format of the reply, in the system turn.
"""

from __future__ import annotations

import os
from pathlib import Path

import jinja2

from frontend.openai import tools
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

    @property
    def takes_tools(self) -> bool:
        """The template renders a ``tools`` list (transformers passes it in as ``tools``)."""
        template = self.tokenizer.chat_template
        return "tools" in (template if isinstance(template, str) else " ".join(template.values()))

    def render(self, messages: list[ChatMessage], tool_calling: tools.ToolCalling | None = None) -> str:
        """The prompt for ``messages`` (and the tools a request offers); a 400 that says why when the template cannot
        render them."""
        if not self.has_template:
            raise bad_request(
                f"the model folder {self.model_dir.name} has no chat template; send the prompt to /v1/completions",
                param="messages",
            )
        native = self.takes_tools
        turns = [tools.template_turn(m, i, native) if m.role == "tool" or m.tool_calls
                 else {"role": ROLE_FOR_TEMPLATE.get(m.role, m.role), "content": m.text()}
                 for i, m in enumerate(messages)]
        offered = {}
        if tool_calling is not None and native:
            offered["tools"] = [tool.definition() for tool in tool_calling.tools]
        elif tool_calling is not None:
            turns = tools.with_system_text(turns, tool_calling.system_prompt())
        try:
            return self.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True, **offered)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
            what = "tool messages" if any(m.role == "tool" or m.tool_calls for m in messages) else "these messages"
            raise bad_request(
                f"the model's chat template cannot render {what}: {exc}", param="messages"
            ) from None
