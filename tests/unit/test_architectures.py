"""Every architecture the README names, built tiny and random here, generates HF ``generate``'s greedy tokens (fp32).

Llama 2, Llama 3 (``rope_scaling`` of type llama3, ``head_dim`` apart from hidden / heads), Qwen2 (QKV bias, tied
embeddings) and Mistral, with and without a sliding window. The engine attends to every earlier token, so where a
model has a sliding window it keeps every sequence inside it (``max_model_len`` capped to the window), and refuses a
``max_model_len`` beyond it; a config the engine cannot run as HF does is refused at load, by the field's name.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend.engine.config import EngineConfig, ModelShape
from backend.engine.llm_engine import LLMEngine
from backend.engine.sampling_params import SamplingParams

VOCAB = 512  # ids below it decode with the SmolLM2 tokenizer the models borrow
MAX_POSITIONS = 128
WINDOW = 24
NEW_TOKENS = 24
PROMPT_LENGTHS = (5, 19)  # with NEW_TOKENS, both pass the window: 29 and 43 tokens
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-5,
             initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=2)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}

DROP = object()  # a key left out of config.json

# name: (the transformers config class, its settings beyond SMALL, config.json's keys as the model's own file has them)
ARCHITECTURES = {
    "llama2": ("LlamaConfig", dict(tie_word_embeddings=False), {}),
    "llama3": ("LlamaConfig", dict(head_dim=32, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE), {}),
    # as Meta writes it: rope_scaling and rope_theta, not transformers 5's rope_parameters
    "llama3-meta-json": ("LlamaConfig", dict(head_dim=32, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE),
                         dict(rope_scaling=LLAMA3_ROPE, rope_theta=500000.0, rope_parameters=DROP)),
    # as Qwen2.5 writes it: a window, not used
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True),
              dict(sliding_window=WINDOW, use_sliding_window=False, layer_types=DROP)),
    "mistral-no-window": ("MistralConfig", dict(sliding_window=None), {}),  # Mistral v0.2 and later
    "mistral-window-at-max": ("MistralConfig", dict(sliding_window=MAX_POSITIONS), {}),
}
WINDOWED = {
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW), {}),  # as Mistral 7B v0.1 (4096 of 32768)
    "qwen2-sliding": ("Qwen2Config", dict(sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1),
                      dict(layer_types=DROP)),  # layer 1 slides (max_window_layers), layer 0 does not
}


@pytest.fixture(scope="module")
def tokenizer_dir(tiny_llama_dir) -> Path:
    """The tiny Llama's folder: its tokenizer files (SmolLM2's, tests/conftest.py) serve every model here."""
    return tiny_llama_dir


def build(out_dir: Path, tokenizer_dir: Path, config_class: str, settings: dict, as_written: dict | None = None,
          seed: int = 0) -> Path:
    """A random tiny model of ``config_class`` (a transformers config class) saved as an fp32 HF folder, with the
    tiny Llama's tokenizer; ``as_written``: config.json's keys then set (or left out: DROP)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = getattr(transformers, config_class)(**{**SMALL, **settings}, dtype="float32")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():  # HF starts biases at 0 and norms at 1: moved, so that reading them wrong shows
        for vector in (p for p in model.parameters() if p.dim() == 1):
            vector.add_(0.1 * torch.randn_like(vector))
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out_dir)
    written = json.loads((out_dir / "config.json").read_text())
    for key, value in (as_written or {}).items():
        if value is DROP:
            del written[key]
        else:
            written[key] = value
    (out_dir / "config.json").write_text(json.dumps(written, indent=2))
    return out_dir


def prompts() -> list[list[int]]:
    gen = random.Random(1)
    return [[gen.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENGTHS]


def hf_greedy(model_dir: Path, prompt: list[int], num_tokens: int) -> list[int]:
    """HF ``generate``'s greedy tokens in fp32, exactly ``num_tokens`` of them (EOS cannot end it sooner)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    input_ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=num_tokens, min_new_tokens=num_tokens, pad_token_id=2)
    return out[0, len(prompt):].tolist()


def make_engine(model_dir: Path, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_threads=2, block_size=8,
                                  num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=256, **overrides))


# EOS (id 2) is not sampled before min_tokens, here as in HF (min_new_tokens): the count is fixed
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_greedy_tokens_equal_hf_generate(tmp_path, tokenizer_dir, name):
    """Both prompts in one batch; each sequence reaches past position WINDOW, where a window would matter."""
    model_dir = build(tmp_path, tokenizer_dir, *ARCHITECTURES[name])
    engine = make_engine(model_dir)
    assert engine.max_model_len == MAX_POSITIONS, "no window in effect: the model's own length"
    outputs = engine.generate(prompts(), GREEDY)
    for prompt, out in zip(prompts(), outputs):
        assert len(prompt) + NEW_TOKENS > WINDOW
        assert out.token_ids == hf_greedy(model_dir, prompt, NEW_TOKENS), (name, len(prompt))


@pytest.mark.parametrize("name", WINDOWED)
def test_sliding_window_keeps_every_sequence_inside_it(tmp_path, tokenizer_dir, name):
    """HF's tokens are generated past the window; the engine's, up to the window, must be the same, and its sequences
    end there (``max_model_len`` capped to the window): full attention past it would give other tokens."""
    model_dir = build(tmp_path, tokenizer_dir, *WINDOWED[name])
    engine = make_engine(model_dir)
    outputs = engine.generate(prompts(), GREEDY)
    for prompt, out in zip(prompts(), outputs):
        theirs = hf_greedy(model_dir, prompt, NEW_TOKENS)
        assert out.token_ids == theirs[: len(out.token_ids)], (name, len(prompt))
    assert engine.max_model_len == WINDOW
    for prompt, out in zip(prompts(), outputs):
        assert len(prompt) + len(out.token_ids) == WINDOW and out.finish_reason == "length"


def test_sliding_window_refuses_a_longer_max_model_len(tmp_path, tokenizer_dir):
    model_dir = build(tmp_path, tokenizer_dir, *WINDOWED["mistral"])
    with pytest.raises(ValueError, match=rf"max_model_len \(64\).*sliding_window \({WINDOW}\).*max_model_len <= "):
        make_engine(model_dir, max_model_len=64)
    assert make_engine(model_dir, max_model_len=16).max_model_len == 16  # within the window: as asked


# ---- what the engine would not run as HF does is refused by name -----------------------------------------------


def llama_config(**fields) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            **fields}


@pytest.mark.parametrize("fields, named", [
    ({"rope_scaling": {"type": "mrope", "mrope_section": [4, 2, 2]}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "su", "rope_theta": 10000.0}}, "rope_parameters"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"use_qk_norm": True}, "use_qk_norm"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_config_fields_the_engine_cannot_honour_are_refused_by_name(fields, named):
    with pytest.raises(ValueError, match=named):
        ModelShape.from_hf_config(llama_config(**fields))


@pytest.mark.parametrize("fields", [
    {"rope_scaling": None}, {"rope_scaling": LLAMA3_ROPE}, {"rope_theta": 500000.0},
    {"rope_scaling": {"type": "linear", "factor": 2.0}}, {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
    {"hidden_act": "silu"}, {"attention_bias": False}, {"mlp_bias": False}, {"pretraining_tp": 2},
    {"attention_dropout": 0.1}, {"final_logit_softcapping": None}, {"partial_rotary_factor": 1.0},
    {"sliding_window": 16},  # HF's Llama takes no window: the field is not read
], ids=lambda v: ",".join(v))
def test_harmless_fields_are_not_refused(fields):
    assert ModelShape.from_hf_config(llama_config(**fields)).sliding_window is None


@pytest.mark.parametrize("arch, fields", [
    ("MistralForCausalLM", dict(sliding_window=4096)),
    ("MistralForCausalLM", {}),  # MistralConfig's default window
    ("MistralForCausalLM", dict(sliding_window=None)),
    ("Qwen2ForCausalLM", dict(use_sliding_window=False, sliding_window=16)),
    ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)),
    ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=16, max_window_layers=2)),
    ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=16)),  # max_window_layers 28 by default
    ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=16,
                              layer_types=["full_attention", "sliding_attention"])),
    ("Qwen2ForCausalLM", dict(use_sliding_window=False, sliding_window=16,
                              layer_types=["full_attention", "sliding_attention"])),
    ("LlamaForCausalLM", dict(sliding_window=16)),
])
def test_sliding_window_is_read_as_hf_reads_it(arch, fields):
    """The window of HF's config class, where its model class reads one (Llama's takes none)."""
    from transformers import AutoConfig

    model_type = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}[arch]
    cfg = llama_config(architectures=[arch], model_type=model_type, **fields)
    hf = AutoConfig.for_model(**cfg)
    sliding_layers = "sliding_attention" in (getattr(hf, "layer_types", None) or ["sliding_attention"])
    hf_window = hf.sliding_window if arch != "LlamaForCausalLM" and sliding_layers else None
    assert ModelShape.from_hf_config(cfg).sliding_window == hf_window


def test_mistral_v01_caps_max_model_len_to_its_window(caplog):
    """Mistral 7B v0.1: sliding_window 4096, max_position_embeddings 32768."""
    shape = ModelShape.from_hf_config(llama_config(architectures=["MistralForCausalLM"], model_type="mistral",
                                                   sliding_window=4096, max_position_embeddings=32768))
    with caplog.at_level("WARNING"):
        assert EngineConfig().resolve(shape).max_model_len == 4096
    assert "sliding_window" in caplog.text and "4096" in caplog.text
    assert EngineConfig(max_model_len=2048).resolve(shape).max_model_len == 2048
    with pytest.raises(ValueError, match="sliding_window"):
        EngineConfig(max_model_len=8192).resolve(shape)


def test_weights_the_forward_would_not_read_are_refused_by_name(tmp_path, tokenizer_dir):
    """E.g. a QK norm (Qwen3, OLMo 2) or an o_proj bias: the output would silently differ from the model's."""
    model_dir = build(tmp_path, tokenizer_dir, *ARCHITECTURES["llama2"])
    weights = load_file(str(model_dir / "model.safetensors"))
    weights["model.layers.1.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.q_norm\.weight"):
        make_engine(model_dir)
