"""A Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Mistral) written over the paged KV cache.

One forward takes a flat stream of tokens from many sequences (decodes and prefill chunks mixed) and returns logits
only for the positions that will be sampled. Weights come from a local Hugging Face folder (safetensors); QKV and
gate/up projections are fused so each layer does four matmuls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from backend.attention import AttentionMetadata, paged_attention, paged_decode_attention

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelShape:
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )


class Layer:
    """Weights of one decoder layer, fused for fewer matmuls."""

    def __init__(self, w: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype) -> None:
        def get(name: str) -> torch.Tensor:
            return w[prefix + name].to(dtype)

        self.input_norm = get("input_layernorm.weight")
        self.post_norm = get("post_attention_layernorm.weight")
        self.qkv = torch.cat([get(f"self_attn.{p}_proj.weight") for p in "qkv"])  # ((H + 2 kvh) hd, D)
        biases = [prefix + f"self_attn.{p}_proj.bias" for p in "qkv"]
        self.qkv_bias = torch.cat([w[b].to(dtype) for b in biases]) if biases[0] in w else None  # Qwen2
        self.o = get("self_attn.o_proj.weight")  # (D, H hd)
        self.gate_up = torch.cat([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")])  # (2 I, D)
        self.down = get("mlp.down_proj.weight")  # (D, I)


class LlamaModel:
    """Inference-only forward over the paged cache. No autograd, no nn.Module bookkeeping on the hot path."""

    def __init__(self, model_dir: str | Path, dtype: torch.dtype, device: torch.device, max_model_len: int) -> None:
        model_dir = Path(model_dir)
        hf_config = json.loads((model_dir / "config.json").read_text())
        self.shape = s = ModelShape.from_hf_config(hf_config)
        self.dtype, self.device = dtype, device
        weights = _load_safetensors(model_dir)
        weights = {k: v.to(device) for k, v in weights.items()}
        self.embed = weights["model.embed_tokens.weight"].to(dtype)  # (V, D)
        self.lm_head = self.embed if s.tie_word_embeddings else weights["lm_head.weight"].to(dtype)
        self.final_norm = weights["model.norm.weight"].to(dtype)
        self.layers = [Layer(weights, f"model.layers.{i}.", dtype) for i in range(s.num_layers)]
        del weights
        self.cos, self.sin = _rope_tables(model_dir, max_model_len, device, dtype)  # (L, hd) each
        self.q_size, self.kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        self.scale = s.head_dim**-0.5
        self.decode_fn = paged_decode_attention

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (K, V) [num_blocks, bs, kvh, hd]
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [S] token indices whose next token is sampled
    ) -> torch.Tensor:  # [S, V] float32
        s = self.shape
        num_tokens = input_ids.shape[0]
        h = self.embed[input_ids]  # (T, D)
        cos, sin = self.cos[positions], self.sin[positions]  # (T, hd)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = F.rms_norm(h, (s.hidden_size,), layer.input_norm, s.rms_norm_eps)
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)  # (T, (H + 2 kvh) hd)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = _rotate(q.view(num_tokens, s.num_heads, s.head_dim), cos, sin)  # (T, H, hd)
            k = _rotate(k.view(num_tokens, s.num_kv_heads, s.head_dim), cos, sin)  # (T, kvh, hd)
            v = v.view(num_tokens, s.num_kv_heads, s.head_dim)
            attn = paged_attention(q, k, v, k_cache, v_cache, meta, self.decode_fn)  # (T, H, hd)
            h = h + F.linear(attn.reshape(num_tokens, self.q_size), layer.o)
            x = F.rms_norm(h, (s.hidden_size,), layer.post_norm, s.rms_norm_eps)
            gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)  # (T, I) each
            h = h + F.linear(F.silu(gate) * up, layer.down)
        # NOTE: only the sampled positions go through the final norm and the LM head (V = 49k makes it costly).
        h = F.rms_norm(h[logits_indices], (s.hidden_size,), self.final_norm, s.rms_norm_eps)  # (S, D)
        return F.linear(h, self.lm_head).float()  # (S, V)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, HF's non-interleaved layout: x * cos + rotate_half(x) * sin."""
    cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, hd)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _rope_tables(model_dir: Path, max_len: int, device: torch.device, dtype: torch.dtype):
    """cos/sin for every position, computed by HF's own rotary class so every ``rope_scaling`` type is honoured."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    rope = LlamaRotaryEmbedding(config, device=device) if _takes_device() else LlamaRotaryEmbedding(config)
    positions = torch.arange(max_len, device=device)[None, :]
    probe = torch.zeros(1, dtype=torch.float32, device=device)
    with torch.no_grad():
        cos, sin = rope(probe, positions)  # (1, L, hd) in float32
    return cos[0].to(dtype), sin[0].to(dtype)


def _takes_device() -> bool:
    import inspect

    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return "device" in inspect.signature(LlamaRotaryEmbedding.__init__).parameters


def _load_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    return weights
