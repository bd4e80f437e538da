"""A Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Mistral) written over the paged KV cache.

One forward takes a flat stream of tokens from many sequences (decodes and prefill chunks mixed) and returns logits
only for the positions that will be sampled. Weights come from a local Hugging Face folder (safetensors); QKV
projections are fused so each layer reads its attention weights in one matmul.

On CPU every projection runs through oneDNN with its weight laid out once at load time (``Linear``), and the
elementwise work that follows a matmul (SiLU, the gate product, the residual add) is fused into it, so a decode step
is little more than one pass over the weights; a step of at most ``SMALL_BATCH_ROWS`` sequences streams them
through a C kernel instead, which reads them half again as fast, and on a CPU with AMX a step of 2 to
``AMX_MAX_ROWS`` runs its own AMX kernel (both let a decode-only step run every layer in one C call). RMSNorm uses
the C kernel of ``backend.kernels.cpu_kernels`` where it builds.
Attention is whichever ``AttentionBackend`` the model runner chose for the device (the OpenAI Triton kernels on CUDA,
the C kernels or the torch reference on CPU): every layer calls it with the step's metadata. On CPU one C call per
layer takes the QKV projection's output to the attention output (rotary embedding, K/V write, decode attention).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from backend.engine.attention import TORCH_ATTENTION, AttentionBackend, AttentionMetadata, rotate
from backend.kernels import cpu_kernels

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


# At or below this many rows a bf16 decode step on CPU runs its projections in C (``cpu_linear_small``, and every
# layer in one call: ``DecodeStack``). SmolLM2 decode step, C against oneDNN: 8 rows 23.0 against 27.2 ms, 12 rows
# about even, 16 rows 37.0 against 30.4 (oneDNN's AMX matmuls win once the step is compute-bound).
SMALL_BATCH_ROWS = 8
# On a CPU with AMX (Sapphire Rapids on) the rows above this and up to AMX_MAX_ROWS run ``cpu_linear_amx`` instead
# (and ``DecodeStack`` with it). SmolLM2 decode step, 64-token contexts, linear_small against AMX in one process:
# 1 row 12.4 against 12.8 ms, 2 rows 16.4 against 12.9, 8 rows 21.7 against 14.3. Projections of 30 layers with
# their weights read from memory, AMX against oneDNN: 64 rows 12.3 against 17.0 ms, 32 rows 10.0-11.0 against 15.3;
# above 64 oneDNN is faster (weights in cache, 128 rows: 116 against 150 us).
SMALL_BATCH_ROWS_WITH_AMX = 1
AMX_MAX_ROWS = 64


def small_rows_limit(amx: bool) -> int:
    """The most rows ``cpu_linear_small`` takes: fewer where the AMX kernel is there to take the rest."""
    return SMALL_BATCH_ROWS_WITH_AMX if amx else SMALL_BATCH_ROWS


class Linear:
    """``x @ weight.T + bias``, optionally followed by a fused SiLU, product or sum.

    On CPU the weight is reordered once into oneDNN's blocked layout: a plain ``F.linear`` re-lays the weight out on
    every call, which costs as much as the matmul itself at decode batch sizes. The fused variants apply the
    elementwise op to the fp32 accumulator before rounding (one rounding instead of two in bf16). A bf16 decode step
    of at most ``SMALL_BATCH_ROWS`` rows streams a copy of the weight through ``cpu_linear_small`` instead (22 GB/s
    where oneDNN read 14-15 on the Xeon measured); on a CPU with AMX, a step of 2 to ``AMX_MAX_ROWS`` rows runs a
    copy in the AMX tiles' layout through ``cpu_linear_amx`` (``small_rows_limit``). Elsewhere (CUDA, or a CPU
    without oneDNN support for the dtype) it is the plain op sequence.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:  # weight (out, in)
        self.bias = bias
        self.out_features = weight.shape[0]
        self.packed = _onednn_pack(weight)
        self.weight = weight if self.packed is None else None  # the packed copy replaces it
        # bf16 on CPU: the few rows of a decode step read a copy of their own (cpu_linear_small's layout), or None
        self.small_rows_weight = cpu_kernels.prepare_linear_weight(weight)
        self.amx_weight = cpu_kernels.prepare_linear_weight_amx(weight)  # None without AMX

    def _small(self, x: torch.Tensor) -> bool:
        return self.small_rows_weight is not None and x.shape[0] <= small_rows_limit(self.amx_weight is not None) \
            and x.dtype == torch.bfloat16 and x.stride(-1) == 1

    def _amx(self, x: torch.Tensor) -> bool:
        return self.amx_weight is not None and small_rows_limit(True) < x.shape[0] <= AMX_MAX_ROWS \
            and x.dtype == torch.bfloat16 and x.stride(-1) == 1

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (T, in) -> (T, out)
        if self._small(x):
            return cpu_kernels.cpu_linear_small(x, self.small_rows_weight, self.bias)
        if self._amx(x):
            return cpu_kernels.cpu_linear_amx(x, self.amx_weight, self.bias)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def silu(self, x: torch.Tensor) -> torch.Tensor:  # silu(x W^T)
        if self._small(x):
            return cpu_kernels.cpu_linear_small(x, self.small_rows_weight, self.bias, "silu")
        if self._amx(x):
            return cpu_kernels.cpu_linear_amx(x, self.amx_weight, self.bias, "silu")
        if self.packed is None:
            return F.silu(F.linear(x, self.weight, self.bias))
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "swish", [], "")

    def mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:  # (x W^T) * other
        if self._small(x) and other.stride(-1) == 1:
            return cpu_kernels.cpu_linear_small(x, self.small_rows_weight, self.bias, "mul", other)
        if self._amx(x) and other.stride(-1) == 1:
            return cpu_kernels.cpu_linear_amx(x, self.amx_weight, self.bias, "mul", other)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias) * other
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.packed, self.bias, "mul")

    def add(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:  # (x W^T) + other
        if self._small(x) and other.stride(-1) == 1:
            return cpu_kernels.cpu_linear_small(x, self.small_rows_weight, self.bias, "add", other)
        if self._amx(x) and other.stride(-1) == 1:
            return cpu_kernels.cpu_linear_amx(x, self.amx_weight, self.bias, "add", other)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias) + other
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.packed, self.bias, "add")


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)
    except RuntimeError:  # e.g. no bf16 support on this CPU: the plain path still works
        return None


class Layer:
    """Weights of one decoder layer. The MLP's gate and up projections stay separate so that SiLU and the product
    can be fused into their matmuls."""

    def __init__(self, w: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype) -> None:
        def get(name: str) -> torch.Tensor:
            return w[prefix + name].to(dtype)

        self.input_norm = get("input_layernorm.weight")
        self.post_norm = get("post_attention_layernorm.weight")
        biases = [prefix + f"self_attn.{p}_proj.bias" for p in "qkv"]
        qkv_bias = torch.cat([w[b].to(dtype) for b in biases]) if biases[0] in w else None  # Qwen2
        self.qkv = Linear(torch.cat([get(f"self_attn.{p}_proj.weight") for p in "qkv"]), qkv_bias)  # D -> (H+2kvh) hd
        self.o = Linear(get("self_attn.o_proj.weight"))  # H hd -> D
        self.gate = Linear(get("mlp.gate_proj.weight"))  # D -> I
        self.up = Linear(get("mlp.up_proj.weight"))  # D -> I
        self.down = Linear(get("mlp.down_proj.weight"))  # I -> D


class LlamaModel:
    """Inference-only forward over the paged cache. No autograd, no nn.Module bookkeeping on the hot path."""

    def __init__(
        self,
        model_dir: str | Path,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        attention: AttentionBackend = TORCH_ATTENTION,
    ) -> None:
        model_dir = Path(model_dir)
        hf_config = json.loads((model_dir / "config.json").read_text())
        self.shape = s = ModelShape.from_hf_config(hf_config)
        self.dtype, self.device = dtype, device
        weights = _load_safetensors(model_dir)
        weights = {k: v.to(device) for k, v in weights.items()}
        self.embed = weights["model.embed_tokens.weight"].to(dtype)  # (V, D)
        self.lm_head = Linear(self.embed if s.tie_word_embeddings else weights["lm_head.weight"].to(dtype))  # D -> V
        self.final_norm = weights["model.norm.weight"].to(dtype)
        self.layers = [Layer(weights, f"model.layers.{i}.", dtype) for i in range(s.num_layers)]
        del weights
        cos, sin = _rope_tables(model_dir, max_model_len, device)  # (L, hd) each, float32
        half = s.head_dim // 2
        # NOTE: rotate_half(x) * sin == swap_halves(x) * sin_signed with sin_signed = [-sin_lo, sin_hi]; folding the
        # sign into the table makes the rotary embedding three ops for q and k together.
        self.cos = cos.to(dtype)
        self.sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1).to(dtype)
        self.q_size, self.kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        self.scale = s.head_dim**-0.5
        self.attention = attention  # one layer's attention for a whole step; the runner builds the metadata it reads
        # NOTE: the C RMSNorm equals HF's bit for bit in bf16; in float32 (the correctness reference) F.rms_norm does.
        use_c = device.type == "cpu" and dtype == torch.bfloat16 and cpu_kernels.load() is not None
        self.rms_norm = cpu_kernels.cpu_rms_norm if use_c else F.rms_norm
        # A decode-only step of at most SMALL_BATCH_ROWS sequences (AMX_MAX_ROWS with AMX) runs every layer in one C
        # call (the same kernels).
        self.decode_stack = cpu_kernels.DecodeStack.for_layers(self.layers, s, dtype) if use_c else None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (K, V) [num_blocks, bs, kvh, hd]
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [S] token indices whose next token is sampled
    ) -> torch.Tensor:  # [S, V] in the model's dtype
        s = self.shape
        h = self.embed.index_select(0, input_ids)  # (T, D)
        if not self._decode_stack(h, positions, kv_caches, meta):
            h = self._layers(h, positions, kv_caches, meta)
        # NOTE: only the sampled positions go through the final norm and the LM head (V = 49k makes it costly).
        h = h.index_select(0, logits_indices)  # (S, D)
        h = self.rms_norm(h, (s.hidden_size,), self.final_norm, s.rms_norm_eps)
        return self.lm_head(h)  # (S, V)

    def _layers(
        self, h: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # (T, D)
        s = self.shape
        num_tokens = h.shape[0]
        num_qk_heads = s.num_heads + s.num_kv_heads
        rope_forward = self.attention.rope_forward
        if rope_forward is None:
            cos = self.cos.index_select(0, positions)[:, None, :]  # (T, 1, hd), shared by every layer
            sin = self.sin_signed.index_select(0, positions)[:, None, :]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = self.rms_norm(h, (s.hidden_size,), layer.input_norm, s.rms_norm_eps)
            qkv = layer.qkv(x)  # (T, (H + 2 kvh) hd)
            if rope_forward is not None:  # rotary embedding, K/V write and attention in one call
                attn = rope_forward(qkv, positions, self.cos, self.sin_signed, k_cache, v_cache, meta, s.num_heads)
            else:
                qk = rotate(qkv[:, : self.q_size + self.kv_size].view(num_tokens, num_qk_heads, s.head_dim), cos, sin)
                q, k = qk[:, : s.num_heads], qk[:, s.num_heads :]  # (T, H, hd), (T, kvh, hd)
                v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, s.num_kv_heads, s.head_dim)  # (T, kvh, hd)
                attn = self.attention.forward(q, k, v, k_cache, v_cache, meta)  # (T, H, hd), K/V written to the cache
            h = layer.o.add(attn.reshape(num_tokens, self.q_size), h)  # h + o(attn)
            x = self.rms_norm(h, (s.hidden_size,), layer.post_norm, s.rms_norm_eps)
            h = layer.down.add(layer.up.mul(x, layer.gate.silu(x)), h)  # h + down(silu(gate x) * up x)
        return h

    def _decode_stack(
        self, h: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> bool:
        """Every layer in one C call (``DecodeStack``), where the step is a few decodes on the C kernels; updates
        ``h`` in place. False where it does not apply: the layers then run one by one."""
        return (self.decode_stack is not None
                and h.shape[0] <= (AMX_MAX_ROWS if self.decode_stack.takes_amx else SMALL_BATCH_ROWS)
                and meta.num_decode_tokens == h.shape[0] and not meta.prefills
                and self.attention.rope_forward is cpu_kernels.cpu_rope_paged_attention
                and self.decode_stack(h, positions, self.cos, self.sin_signed, kv_caches, meta,
                                      small_rows_limit(self.decode_stack.takes_amx)))


def _rope_tables(model_dir: Path, max_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for every position, computed by HF's own rotary class so every ``rope_scaling`` type is honoured."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    rope = LlamaRotaryEmbedding(config, device=device) if _takes_device() else LlamaRotaryEmbedding(config)
    positions = torch.arange(max_len, device=device)[None, :]
    probe = torch.zeros(1, dtype=torch.float32, device=device)
    with torch.no_grad():
        cos, sin = rope(probe, positions)  # (1, L, hd) in float32
    return cos[0], sin[0]


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
