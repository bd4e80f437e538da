"""A Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Mistral) written over the paged KV cache.

One forward takes a flat stream of tokens from many sequences (decodes and prefill chunks mixed) and returns logits
only for the positions that will be sampled. Weights come from a local Hugging Face folder (safetensors); the Q, K
and V projections are fused so each layer reads its attention weights in one matmul.

Attention is the backend the model runner chose for the device (``backend.engine.attention``): every layer hands it
the QKV projection's output and the step's metadata. The projections run whichever kernel ``linear.route`` sends
them to and the RMSNorm whichever ``cpu_fast_path`` picks (on CUDA or in float32, the plain torch ops), and a small
decode-only step on the C kernels runs every layer in one C call instead of the loop below
(``cpu_fast_path.run_decode_stack``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from backend.engine import cpu_fast_path, weight_file
from backend.engine.attention import AttentionBackend, AttentionMetadata, TorchAttention
from backend.engine.config import ModelShape, ResolvedConfig
from backend.engine.linear import Layout, Linear, make_linear
from backend.kernels import quantized_linear
from backend.kernels.weight_format import WeightFormat

KVCache = tuple[torch.Tensor, torch.Tensor]  # one layer's (K, V) pools, each [num_blocks, block_size, kvh, hd]


Prepared = weight_file.Prepared  # what the forward reads, by the engine's names (see prepare_weights)
_PROJECTIONS = ("qkv", "o", "gate", "up", "down")


def prepare_weights(w: dict[str, torch.Tensor], shape: ModelShape, dtype: torch.dtype,
                    quantization: WeightFormat | None = None,
                    gguf_blocks: dict[str, tuple[WeightFormat, torch.Tensor]] | None = None) -> Prepared:
    """The checkpoint's tensors as the forward reads them: each projection a :class:`Linear` holding its one copy in
    the layout chosen for this CPU, Q, K and V fused; the norms copied out of ``w`` (a file mapping: nothing the
    engine keeps points into it, so it can be let go). A tied embedding is looked up in the LM head's copy.
    With ``quantization`` the projections are held quantized: q4_1 as the GGUF holds them (``gguf_blocks``: its
    Q4_1 projections and Q8_0 embedding), else quantized here (q4_1's LM head in q8_0, as the shipped GGUF's)."""
    read: set[str] = set()  # the checkpoint's tensors the forward reads: every other one is refused

    def take(name: str) -> torch.Tensor:
        read.add(name)
        return w[name].to(dtype, copy=True)

    def linear(names: list[str], bias: torch.Tensor | None = None,
               quantize_to: WeightFormat | None = quantization) -> Linear:
        read.update(names)
        stored = [(gguf_blocks or {}).get(name) for name in names] if quantization == WeightFormat.Q4_1 else [None]
        if all(s is not None and s[0] == stored[0][0] for s in stored):  # the GGUF's own blocks, rows stacked
            fmt = stored[0][0]
            return Linear(quantized_linear.group_rows(fmt, torch.cat([blocks for _, blocks in stored])), bias,
                          Layout(fmt))
        return make_linear(torch.cat([w[name].to(dtype) for name in names]), bias, quantize_to)

    out: Prepared = {}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        out[f"{i}.input_norm"] = take(p + "input_layernorm.weight")  # (D,)
        out[f"{i}.post_norm"] = take(p + "post_attention_layernorm.weight")  # (D,)
        biases = [p + f"self_attn.{q}_proj.bias" for q in "qkv"]
        qkv_bias = torch.cat([take(b) for b in biases]) if biases[0] in w else None  # Qwen2
        out[f"{i}.qkv"] = linear([p + f"self_attn.{q}_proj.weight" for q in "qkv"], qkv_bias)  # D -> (H+2kvh) hd
        out[f"{i}.o"] = linear([p + "self_attn.o_proj.weight"])  # H hd -> D
        out[f"{i}.gate"] = linear([p + "mlp.gate_proj.weight"])  # D -> I
        out[f"{i}.up"] = linear([p + "mlp.up_proj.weight"])  # D -> I
        out[f"{i}.down"] = linear([p + "mlp.down_proj.weight"])  # I -> D
    read.add("model.embed_tokens.weight")
    embed = w["model.embed_tokens.weight"].to(dtype)  # (V, D)
    head = "model.embed_tokens.weight" if shape.tie_word_embeddings else "lm_head.weight"
    # q4_1's LM head in q8_0: the shipped GGUF holds its token embedding (the tied head) in Q8_0
    lm_head_format = WeightFormat.Q8_0 if quantization == WeightFormat.Q4_1 else quantization
    out["lm_head"] = lm_head = linear([head], quantize_to=lm_head_format)  # D -> V
    if not shape.tie_word_embeddings or lm_head.layout is Layout.ONEDNN:  # its rows cannot be read back
        out["embed"] = embed.clone()
    out["final_norm"] = take("model.norm.weight")  # (D,)
    _refuse_unread(set(w) - read, shape)
    return out


def _refuse_unread(unread: set[str], shape: ModelShape) -> None:
    """A tensor the forward does not read (a QK norm, an o_proj or MLP bias, a layer beyond ``num_hidden_layers``)
    means the output would not be the model's: refused by name. Left alone, as HF's class leaves them: a tied
    model's ``lm_head.weight`` and an old checkpoint's ``rotary_emb.inv_freq`` buffers."""
    harmless = {"lm_head.weight"} if shape.tie_word_embeddings else set()  # HF ties it to the embedding
    unread = sorted(name for name in unread - harmless if not name.endswith("rotary_emb.inv_freq"))
    if unread:
        shown = ", ".join(unread[:8]) + (f" and {len(unread) - 8} more" if len(unread) > 8 else "")
        raise ValueError(f"the checkpoint holds {len(unread)} tensor(s) the engine's forward does not read, so its "
                         f"output would not be the model's: {shown}")


class Layer:
    """Weights of one decoder layer. The MLP's gate and up projections stay separate so that SiLU and the product
    can be fused into their matmuls."""

    def __init__(self, prepared: Prepared, index: int) -> None:
        self.input_norm, self.post_norm = prepared[f"{index}.input_norm"], prepared[f"{index}.post_norm"]  # (D,)
        self.qkv, self.o, self.gate, self.up, self.down = (prepared[f"{index}.{p}"] for p in _PROJECTIONS)


class LlamaModel:
    """Inference-only forward over the paged cache. No autograd, no nn.Module bookkeeping on the hot path."""

    def __init__(
        self, config: ResolvedConfig, dtype: torch.dtype, device: torch.device,
        attention: AttentionBackend | None = None,
    ) -> None:
        self.shape = s = config.model_shape
        self.dtype, self.device = dtype, device
        quantization = config.quantization

        def prepare() -> Prepared:
            weights = {k: v.to(device) for k, v in _load_safetensors(Path(config.model)).items()}
            blocks = weight_file.gguf_blocks(Path(config.model)) if quantization == WeightFormat.Q4_1 else None
            return prepare_weights(weights, s, dtype, quantization, blocks)

        # one copy per machine where the weights can be mapped from a file, else one per engine
        prepared = weight_file.prepared_weights(Path(config.model), dtype, device, prepare, quantization)
        self.lm_head: Linear = prepared["lm_head"]
        self._embed: torch.Tensor | None = prepared.get("embed")  # None: rows of the LM head's copy
        self.final_norm = prepared["final_norm"]  # (D,)
        self.layers = [Layer(prepared, i) for i in range(s.num_layers)]
        cos, sin = _rope_tables(s, config.max_model_len, device)  # (L, hd) each, float32
        half = s.head_dim // 2
        # NOTE: rotate_half(x) * sin == swap_halves(x) * sin_signed with sin_signed = [-sin_lo, sin_hi]; folding the
        # sign into the table makes the rotary embedding three ops for q and k together.
        self.cos = cos.to(dtype)  # (L, hd)
        self.sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1).to(dtype)  # (L, hd)
        self.scale = s.head_dim**-0.5
        self.rms_norm = cpu_fast_path.rms_norm_for(s, dtype, device)  # F.rms_norm's signature
        self.attention = attention or TorchAttention()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # (T, D)
        return self.lm_head.weight_rows(input_ids) if self._embed is None else self._embed.index_select(0, input_ids)

    @property
    def attention(self) -> AttentionBackend:
        """One layer's attention for a whole step; the runner builds the metadata it reads."""
        return self._attention

    @attention.setter
    def attention(self, backend: AttentionBackend) -> None:
        self._attention = backend
        # Every layer of a small decode step in one C call, where the C attention runs (the stack runs its kernel)
        self.decode_stack = cpu_fast_path.build_decode_stack(self.layers, self.shape, self.dtype, backend)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],  # one per layer
        meta: AttentionMetadata,  # from self.attention.build_metadata
        logits_indices: torch.Tensor,  # [S] token indices whose next token is sampled
    ) -> torch.Tensor:  # [S, V] in the model's dtype
        s = self.shape
        h = self.embed(input_ids)  # (T, D)
        if self.decode_stack is None or not cpu_fast_path.run_decode_stack(
                self.decode_stack, h, positions, self.cos, self.sin_signed, kv_caches, meta):
            for layer, kv_cache in zip(self.layers, kv_caches):
                h = self.layer_forward(layer, h, positions, kv_cache, meta)
        # NOTE: only the sampled positions go through the final norm and the LM head (V = 49k makes it costly).
        h = h.index_select(0, logits_indices)  # (S, D)
        h = self.rms_norm(h, (s.hidden_size,), self.final_norm, s.rms_norm_eps)  # (S, D)
        return self.lm_head(h)  # (S, V)

    def layer_forward(
        self, layer: Layer, h: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
    ) -> torch.Tensor:  # (T, D)
        s = self.shape
        num_tokens = h.shape[0]
        x = self.rms_norm(h, (s.hidden_size,), layer.input_norm, s.rms_norm_eps)  # (T, D)
        qkv = layer.qkv(x)  # (T, (H + 2 kvh) hd)
        # rotary embedding on q and k, the step's K/V written to the cache, attention
        attn = self.attention.forward(qkv, positions, self.cos, self.sin_signed, *kv_cache, meta, s.num_heads)
        h = layer.o.add(attn.reshape(num_tokens, s.num_heads * s.head_dim), h)  # (T, D): h + o(attn)
        x = self.rms_norm(h, (s.hidden_size,), layer.post_norm, s.rms_norm_eps)  # (T, D)
        return layer.down.add(layer.up.mul(x, layer.gate.silu(x)), h)  # (T, D): h + down(silu(gate x) * up x)


# rope types whose tables are fixed by the config: HF's rotary class computes them as below; the others ("dynamic",
# "longrope") adapt to the sequence's length in its forward, which runs as HF's own code.
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _rope_tables(shape: ModelShape, max_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for every position, as HF's rotary class computes them, so every ``rope_scaling`` type is honoured.
    Static types take the class's two lines here: importing HF's Llama module (for its class) costs an engine
    190 MiB of resident memory (torch's compiler stack and OpenAI Triton come with it)."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.for_model(**shape.hf_config)  # the config.json the engine read, not read again
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type")
    if rope_type not in _STATIC_ROPE_TYPES:
        return _hf_rope_tables(config, max_len, device)
    if rope_type == "default":
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        base = config.rope_parameters["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        scaling = 1.0
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device)
    freqs = torch.arange(max_len, device=device)[:, None].float() * inv_freq.to(device=device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling  # (L, hd) in float32


def _hf_rope_tables(config, max_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin from HF's rotary class itself."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

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
