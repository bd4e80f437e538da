"""The tokenizer of a local Hugging Face model folder, and the ids that end a generation."""

from __future__ import annotations

import json
from pathlib import Path


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        self.eos_token_ids = _eos_token_ids(Path(model_dir), self.hf.eos_token_id)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text)


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    return Tokenizer(model_dir)


def _eos_token_ids(model_dir: Path, tokenizer_eos: int | None) -> tuple[int, ...]:
    """EOS ids from generation_config.json (may be a list, as in Llama 3) plus the tokenizer's own."""
    ids: list[int] = []
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        value = json.loads(gen.read_text()).get("eos_token_id")
        ids += value if isinstance(value, list) else [value] if value is not None else []
    if tokenizer_eos is not None:
        ids.append(tokenizer_eos)
    return tuple(dict.fromkeys(ids))
