"""Which Hugging Face configs the engine runs as HF's own model class does, read from the raw ``config.json``.

The forward (backend/engine/model.py) is one Llama-family decoder: RMSNorm, a rotary embedding of any type HF's
rotary class computes, grouped-query attention over every earlier token, a SiLU-gated MLP, Qwen2's QKV bias, a tied
or separate LM head. A field that would make HF's class for the architecture compute something else is refused when
the config is read (:func:`check_supported`), by its name; a field that class does not read is left alone, whatever
its value, since HF ignores it too.

A sliding window is the one such field taken with a limit: inside the window, sliding and full attention are the
same, so :func:`sliding_window` says how far a sequence may grow and ``EngineConfig.resolve`` caps ``max_model_len``
there (as vLLM does for a backend without sliding-window attention).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

# The rope types HF's rotary class computes (transformers' ROPE_INIT_FUNCTIONS, and "default"): model._rope_tables
# takes each as HF's class does.
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
_SILU = ("silu", "swish")  # one function under two names (transformers' ACT2FN)
_MISTRAL_DEFAULT_WINDOW = 4096  # MistralConfig's, where config.json leaves sliding_window out
_QWEN2_DEFAULT_MAX_WINDOW_LAYERS = 28  # Qwen2Config's


def architecture(cfg: Mapping[str, Any]) -> str:
    """The config's architecture, refused unless the engine has it."""
    arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def check_supported(cfg: Mapping[str, Any]) -> None:
    """Refuse a config the forward would not run as HF's class does, naming every such field and its value."""
    arch = architecture(cfg)
    problems = [*_rope_problems(cfg)]
    if str(cfg.get("hidden_act", "silu")).lower() not in _SILU:
        problems.append(f"hidden_act={cfg['hidden_act']!r} (the MLP's activation is SiLU)")
    if arch == "LlamaForCausalLM":  # the fields LlamaConfig has and the other two do not
        for name, where in (("attention_bias", "o_proj"), ("mlp_bias", "gate_proj, up_proj and down_proj")):
            if cfg.get(name):
                problems.append(f"{name}=true (the forward has no bias on {where})")
    # Features of other architectures, read by no Llama-family class: a config that sets one describes a model that
    # neither the forward nor HF's class for this architecture computes.
    for name, feature in (("attn_logit_softcapping", "attention logit soft-capping (Gemma 2)"),
                          ("final_logit_softcapping", "final logit soft-capping (Gemma 2)"),
                          ("use_qk_norm", "a norm on q and k (Llama 4)"), ("qk_layernorm", "a norm on q and k")):
        if cfg.get(name):
            problems.append(f"{name}={cfg[name]!r} ({feature} is not in the forward)")
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        problems.append(f"quantization_config (quant_method {method!r}: the engine reads plain bf16/fp16/fp32 "
                        "weights; use the unquantized checkpoint, and the engine's own `quantization` setting)")
    if problems:
        raise ValueError(f"this {arch} config asks for what the engine does not compute, so its output would not "
                         f"be the model's: {'; '.join(problems)}")


def sliding_window(cfg: Mapping[str, Any]) -> int | None:
    """How many positions (the token's own included) a sliding-attention layer attends to, as HF's class reads the
    config; None where every layer attends to every earlier token."""
    arch = architecture(cfg)
    if arch == "MistralForCausalLM":  # every layer, whenever sliding_window is set
        return cfg.get("sliding_window", _MISTRAL_DEFAULT_WINDOW)
    if arch == "Qwen2ForCausalLM" and cfg.get("use_sliding_window") and cfg.get("sliding_window") is not None:
        first = cfg.get("max_window_layers", _QWEN2_DEFAULT_MAX_WINDOW_LAYERS)  # layers from here on slide
        layer_types = cfg.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                                 for i in range(cfg["num_hidden_layers"])]
        return cfg["sliding_window"] if "sliding_attention" in layer_types else None
    return None  # Llama: no window, whatever the file says


def _rope_problems(cfg: Mapping[str, Any]) -> list[str]:
    # NOTE: transformers takes rope_scaling over rope_parameters (its name since 5.0) when a config has both
    name = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rope = cfg.get(name) or {}
    problems = []
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        problems.append(f"{name} of type {rope_type!r} (the rotary embedding takes {', '.join(ROPE_TYPES)})")
    for where, fields in (("", cfg), (f"{name}.", rope)):
        factor = fields.get("partial_rotary_factor")
        if factor is not None and factor != 1:
            problems.append(f"{where}partial_rotary_factor={factor} (the rotary embedding turns the whole head)")
    return problems
