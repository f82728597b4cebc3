"""Weight-only int8 / int4 quantization for CPU inference, on PyTorch's own low-bit matmul kernels.

Every `nn.Linear` of the decoder layers and the LM head becomes a `QuantLinear`. The quantized model is
defined by its dequantized weights: int8 is symmetric per output channel (w = q * s), int4 is asymmetric
per group of `group_size` input channels (w = (q - 8) * s + z, PyTorch's int4pack convention).

Why two paths: PyTorch's CPU kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) read 1/2 or
1/4 of the bytes of a bfloat16 weight, which is what a memory-bound single-token decode needs, but their
cost grows with every input row (at 16 rows they are ~3x slower than a bfloat16 matmul). So inputs of more
than `LOW_BIT_MAX_ROWS` rows, i.e. tree verification and wide draft passes, use a matmul against the same
weights dequantized once into the model's dtype. Both paths compute the same model; they differ only by
floating-point rounding, like any batched versus single-token forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from specexec.draft_vocab import ReducedHead

QUANT_MODES = ("none", "int8", "int4")
INT4_GROUP_SIZE = 64  # 32 is 2-5x slower in the CPU kernel for long rows (K = 8960) and the LM head
# Measured on a 2-core AMX CPU, 1536x8960 weight: the low-bit kernels beat bfloat16 up to 4 rows.
LOW_BIT_MAX_ROWS = 4


class QuantError(ValueError):
    """A quantization that cannot be applied as asked."""


class QuantLinear(nn.Module):
    """A linear layer with int8 (per channel) or int4 (per group) weights; see the module docstring."""

    def __init__(self, linear: nn.Linear, bits: int, group_size: int = INT4_GROUP_SIZE) -> None:
        super().__init__()
        weight = linear.weight.detach()
        dtype = weight.dtype
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bits = bits
        self.group_size = group_size
        if bits == 8:
            qweight, scales, dequantized = _int8(weight.float())
            self.register_buffer("qweight", qweight)  # (N, K) int8
            self.register_buffer("scales", scales.to(dtype))  # (N,)
        elif bits == 4:
            if not int4_fits(linear, group_size):
                raise QuantError(
                    f"int4 needs in_features divisible by {group_size} and out_features by 16, "
                    f"got {self.in_features} x {self.out_features}"
                )
            qweight, scales_zeros, dequantized = _int4(weight.float(), group_size)
            self.register_buffer("qweight", qweight)  # packed by PyTorch
            self.register_buffer("scales_zeros", scales_zeros.to(dtype))  # (K / group, N, 2)
        else:
            raise QuantError(f"bits must be 8 or 4, got {bits}")
        self.register_buffer("dequantized", dequantized.to(dtype))  # (N, K), for many-row inputs
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > LOW_BIT_MAX_ROWS or x.dtype != self.dequantized.dtype:
            return F.linear(x, self.dequantized, self.bias)
        flat = x.reshape(rows, self.in_features)  # (rows, K)
        if self.bits == 8:
            out = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                flat, self.qweight, self.group_size, self.scales_zeros
            )
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}"


def int4_fits(linear: nn.Linear, group_size: int = INT4_GROUP_SIZE) -> bool:
    """Whether PyTorch's int4 CPU kernel takes this shape (else `quantize_model` falls back to int8)."""
    return linear.in_features % group_size == 0 and linear.out_features % 16 == 0


def _int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127  # (N,)
    qweight = (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8)  # (N, K)
    return qweight, scales, qweight.float() * scales[:, None]


def _int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, k = weight.shape
    groups = weight.reshape(n, k // group_size, group_size)  # (N, G, group)
    low, high = groups.amin(-1), groups.amax(-1)  # (N, G)
    scales = ((high - low) / 15).clamp(min=1e-12)
    q = ((groups - low[..., None]) / scales[..., None]).round().clamp(0, 15)  # (N, G, group)
    zeros = low + 8 * scales  # so that (q - 8) * s + z = q * s + low
    dequantized = ((q - 8) * scales[..., None] + zeros[..., None]).reshape(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(n, k).to(torch.int32), 1)
    scales_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).contiguous()  # (G, N, 2)
    return packed, scales_zeros, dequantized


def quantize_model(model: PreTrainedModel, mode: str, group_size: int = INT4_GROUP_SIZE) -> PreTrainedModel:
    """Quantize the decoder layers' and the LM head's linear layers in place; `mode` from QUANT_MODES.

    CPU only. The input embedding stays as it is (a lookup reads one row per token); a tied LM head gets
    its own quantized copy. Under int4, a layer whose shape the int4 kernel cannot take is stored as int8.
    """
    if mode not in QUANT_MODES:
        raise QuantError(f"unknown quantization {mode!r}; choose from {', '.join(QUANT_MODES)}")
    if mode == "none":
        return model
    if model.device.type != "cpu":
        raise QuantError(f"--quant {mode} runs on the CPU kernels; the model is on {model.device}")
    if quant_label(model) != "none":
        raise QuantError(f"the model is already quantized ({quant_label(model)})")
    bits = 8 if mode == "int8" else 4
    with torch.no_grad():
        for layer in _decoder_layers(model):
            for child in list(layer.modules()):
                for attr, sub in list(child.named_children()):
                    if isinstance(sub, nn.Linear):
                        setattr(child, attr, _quantized(sub, bits, group_size))
        head = model.get_output_embeddings()
        if isinstance(head, nn.Linear):
            model.set_output_embeddings(_quantized(head, bits, group_size))
        elif isinstance(head, ReducedHead):
            head.linear = _quantized(head.linear, bits, group_size)
    return model


def _quantized(linear: nn.Linear, bits: int, group_size: int) -> QuantLinear:
    if bits == 4 and not int4_fits(linear, group_size):
        bits = 8
    return QuantLinear(linear, bits, group_size)


def quant_label(model: nn.Module) -> str:
    """ "int8", "int4" or "none": how the model's linear layers are stored."""
    bits = {m.bits for m in model.modules() if isinstance(m, QuantLinear)}
    return f"int{max(bits)}" if bits else "none"


def _decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise QuantError(f"cannot find the decoder layers of {type(model).__name__}")
    return layers
