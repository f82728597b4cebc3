"""The Llama-family decoder forward in a few plain PyTorch ops, over preallocated KV buffers.

Hugging Face's forward spends about 0.6 ms per decoder layer on a CPU outside the matrix products: mask
and cache bookkeeping, dtype round trips, module and keyword plumbing. For a 4-bit draft that decodes
one token in ~35 ms that is 40% of the pass. For the models whose layer is exactly "RMSNorm, attention
with RoPE, RMSNorm, SiLU-gated MLP" (llama, qwen2, mistral without a sliding window) in their default
RoPE, `NativeDecoder` computes the same function with the model's own modules for every linear layer
(so quantized layers work unchanged) and its own norms, rotary embedding and attention, writing keys and
values at explicit slots of one buffer per generation. Other models, and models whose layers are
wrapped (offloading) or whose forward is hooked, keep Hugging Face's forward (`runner.HFForward`).

Activations are in the model's dtype, with the norms computed in float32 as in Hugging Face, except under
w4a8, whose kernel reads and writes float32: there the whole residual stream stays in float32 rather
than being rounded to bfloat16 around every kernel call, and the attention runs in float64. The w4a8
linear layers give every row the same bits whatever the block (w4a8.c), and so do the norms, the rotary
embedding and the MLP's elementwise ops; the attention is the one operation whose float32 result
depends on the block: which keys are masked and where they sit change its summation order, and rounding
the activations to int8 in the next layer turns a last-bit difference into a whole quantization step. In
float64, rounded to float32, the result no longer depends on that order (except with a probability of
about 1e-9 per value), so a verified tree's rows are what one-token decoding computes: speculative
greedy output under w4a8 is the plain w4a8 model's greedy output, token for token. A prompt's prefill,
which every method computes alike, keeps the float32 attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from specexec.backends.torch.quant import quant_label

NATIVE_MODEL_TYPES = ("llama", "qwen2", "mistral")


class NativeUnsupported(ValueError):
    """`NativeDecoder` cannot run this model (the message says why)."""


def native_unsupported(model: PreTrainedModel) -> str:
    """Why `NativeDecoder` cannot run `model` ("" when it can)."""
    config = model.config
    if config.model_type not in NATIVE_MODEL_TYPES:
        return f"model type {config.model_type!r}"
    if getattr(config, "sliding_window", None) is not None and (
        config.model_type == "mistral" or "sliding_attention" in (getattr(config, "layer_types", None) or [])
    ):
        return "a sliding attention window"
    if config.hidden_act != "silu":
        return f"activation {config.hidden_act!r}"
    base = model.get_decoder()
    rotary = getattr(base, "rotary_emb", None)
    if rotary is None or getattr(rotary, "rope_type", None) != "default":
        return "a non-default rotary embedding"
    layer_classes = {type(layer).__name__ for layer in base.layers}
    if len(layer_classes) != 1 or not layer_classes.pop().endswith("DecoderLayer"):
        return "wrapped decoder layers (offloading)"
    if model._forward_hooks or model._forward_pre_hooks or base._forward_hooks or base._forward_pre_hooks:
        return "hooks on the model's forward (simulated offloading)"
    # accelerate keeps its hook in the module's __dict__; `hasattr` would also search submodules and
    # parameters through nn.Module.__getattr__, and a runner is made for every generation.
    if any("_hf_hook" in vars(module) for module in model.modules()) or any(
        p.is_meta for p in model.parameters()
    ):
        return "weights loaded by hooks (accelerate's offloading)"
    return ""


def forward_label(model: PreTrainedModel) -> str:
    """Which forward a runner gives `model` (for calibration cache keys)."""
    if native_unsupported(model):
        return "hf"
    attention = _attention_dtype(model, quant_label(model))
    return f"native, {str(attention).removeprefix('torch.')} attention"


def _attention_dtype(model: PreTrainedModel, quant: str) -> torch.dtype:
    # Under w4a8 the attention runs in float64 (why: the module docstring), else in the model's dtype.
    return torch.float64 if quant == "w4a8" else model.dtype


class NativeDecoder:
    """`model`'s forward for blocks of tokens at explicit positions, KV written at explicit slots."""

    def __init__(
        self, model: PreTrainedModel, capacity: int, attention_dtype: torch.dtype | None = None
    ) -> None:
        """attention_dtype: None for float64 under w4a8, else the model's dtype. Raises NativeUnsupported
        for a model it cannot run (`native_unsupported`)."""
        reason = native_unsupported(model)
        if reason:
            raise NativeUnsupported(f"the native forward does not support {reason}")
        base = model.get_decoder()
        self.model = model
        self.layers = list(base.layers)
        config = model.config
        self.eps = config.rms_norm_eps
        quant = quant_label(model)
        self.dtype = torch.float32 if quant == "w4a8" else model.dtype
        # Keys and values are kept in the attention's dtype.
        self.attention_dtype = attention_dtype or _attention_dtype(model, quant)
        attention = self.layers[0].self_attn
        self.head_dim = attention.head_dim
        self.q_heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.scale = attention.scaling
        self.inv_freq = base.rotary_emb.inv_freq.float()  # (D / 2,)
        self.rope_scale = base.rotary_emb.attention_scaling
        self.embed = model.get_input_embeddings()
        self.norm_weights = [  # (before attention, before the MLP) per layer
            (self._cast(layer.input_layernorm), self._cast(layer.post_attention_layernorm))
            for layer in self.layers
        ]
        self.final_norm = self._cast(base.norm)
        shape = (len(self.layers), self.kv_heads, capacity, self.head_dim)
        device = model.device
        self.keys = torch.zeros(shape, dtype=self.attention_dtype, device=device)  # (L, H_kv, capacity, D)
        self.values = torch.zeros(shape, dtype=self.attention_dtype, device=device)

    @torch.inference_mode()  # the buffers are written in place, whatever mode the caller is in
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        allowed: torch.Tensor,
        logits_to_keep: int | torch.Tensor,
    ) -> torch.Tensor:
        """Logits (m, V) of the kept rows; tokens, positions and slots (n,), allowed (n, width)."""
        return self.logits(self.hidden(tokens, positions, slots, allowed), logits_to_keep)

    @torch.inference_mode()
    def hidden(
        self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, allowed: torch.Tensor
    ) -> torch.Tensor:
        """The last decoder layer's output (n, C), its keys and values written at `slots`."""
        n, width = allowed.shape
        x = self.embed(tokens).to(self.dtype)  # (n, C)
        cos, sin = self._rotary(positions)  # (n, 1, D / 2) each
        for i, (layer, (norm_in, norm_post)) in enumerate(zip(self.layers, self.norm_weights, strict=True)):
            keys, values = self.keys[i], self.values[i]  # (H_kv, capacity, D)
            attention, mlp = layer.self_attn, layer.mlp
            h = self._rms_norm(x, norm_in)
            q = _rotate(attention.q_proj(h).view(n, self.q_heads, self.head_dim), cos, sin)  # (n, H, D)
            k = _rotate(attention.k_proj(h).view(n, self.kv_heads, self.head_dim), cos, sin)  # (n, H_kv, D)
            v = attention.v_proj(h).view(n, self.kv_heads, self.head_dim)
            keys.index_copy_(1, slots, k.transpose(0, 1).to(keys.dtype))
            values.index_copy_(1, slots, v.transpose(0, 1).to(values.dtype))
            out = self._attend(q, keys[:, :width], values[:, :width], allowed)  # (n, H * D)
            x = x + attention.o_proj(out)
            h = self._rms_norm(x, norm_post)
            x = x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))  # (n, C)
        return x

    @torch.inference_mode()
    def logits(self, x: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        """Logits (m, V) of the kept rows of the last layer's output x (n, C)."""
        x = x[-logits_to_keep:] if isinstance(logits_to_keep, int) else x[logits_to_keep]  # (m, C)
        return self.model.get_output_embeddings()(self._rms_norm(x, self.final_norm))  # (m, V)

    @torch.inference_mode()
    def gather(self, src: torch.Tensor, dst_start: int) -> None:
        """Copy the KV of slots `src` to [dst_start, dst_start + len(src)) in every layer."""
        dst = slice(dst_start, dst_start + src.numel())
        self.keys[:, :, dst] = self.keys[:, :, src]  # advanced indexing copies first: overlap-safe
        self.values[:, :, dst] = self.values[:, :, src]

    def grow(self, capacity: int) -> None:
        """Room for `capacity` slots, the existing ones kept."""
        self.keys = zero_padded(self.keys, 2, capacity)
        self.values = zero_padded(self.values, 2, capacity)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s key and value buffers, (H_kv, capacity, D) each."""
        return self.keys[layer], self.values[layer]

    def _cast(self, norm: torch.nn.Module) -> torch.Tensor:
        return norm.weight.to(self.dtype)

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions[:, None].float() * self.inv_freq  # (n, D / 2)
        cos = (angles.cos() * self.rope_scale).to(self.dtype)[:, None]
        sin = (angles.sin() * self.rope_scale).to(self.dtype)[:, None]
        return cos, sin

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor):
        """Attention of q (n, H, D) over keys and values (H_kv, width, D) where allowed (n, width)."""
        n, width = allowed.shape
        # A block that is the whole sequence (a prompt's prefill) is computed alike by every method, so it
        # needs no float64: float64 over a long prompt would cost seconds.
        if self.attention_dtype == self.dtype or n == width:
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], keys.to(self.dtype)[None], values.to(self.dtype)[None],
                attn_mask=allowed[None, None], scale=self.scale, enable_gqa=True,
            )  # (1, H, n, D)  # fmt: skip
            return out[0].transpose(0, 1).reshape(n, -1)
        group = self.q_heads // self.kv_heads
        q = q.to(self.attention_dtype).view(n, self.kv_heads, group, -1).transpose(0, 1)  # (H_kv, n, g, D)
        scores = torch.bmm(q.reshape(self.kv_heads, n * group, -1), keys.transpose(1, 2)) * self.scale
        scores = scores.view(self.kv_heads, n, group, -1).masked_fill(~allowed[None, :, None], float("-inf"))
        out = torch.bmm(scores.softmax(-1).view(self.kv_heads, n * group, -1), values)  # (H_kv, n g, D)
        return out.view(self.kv_heads, n, -1).transpose(0, 1).reshape(n, -1).to(self.dtype)  # (n, H D)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # float32 inside, rounded to the activations' dtype before the weight, as Hugging Face does
        normed = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)
        return weight * normed.to(self.dtype)


def zero_padded(buffer: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """`buffer` with dimension `dim` zero-padded to `size` (zeros: masked slots must not hold NaNs)."""
    shape = list(buffer.shape)
    shape[dim] = size - buffer.shape[dim]
    return torch.cat([buffer, buffer.new_zeros(shape)], dim=dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the half-split layout: (a, b) -> (a cos - b sin, b cos + a sin); x (n, H, D)."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
