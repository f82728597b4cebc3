"""Weight codecs of offloading: how a streamed decoder layer's weights are stored in host memory and
turned back into dense tensors on the device just before the layer runs. `WeightCodec` is the protocol
the packing in `offload` relies on; `NF4Codec` (bitsandbytes NF4, 4.5 bits a weight) is the one
`--quant-offload` offers, listed in `QUANT_CHOICES` and made by `make_codec`.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from specexec.backends.torch.layers import OffloadError

QUANT_CHOICES = ("nf4",)


class WeightCodec(Protocol):
    """How a streamed weight is stored in host memory and turned back into a dense tensor on the device."""

    name: str

    def encodes(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether this parameter (name inside its layer) is encoded; others travel as they are."""
        ...

    def part_specs(self, shape: torch.Size, dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Shapes and dtypes of the parts `encode` returns for a tensor of this shape and dtype."""
        ...

    def encode(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """The stored parts of `tensor` (on any device)."""
        ...

    def decode(self, parts: list[torch.Tensor], out: torch.Tensor) -> None:
        """Write the dense tensor into `out` from its `parts`, both on the same device."""
        ...


class NF4Codec:
    """bitsandbytes NF4: 4-bit codes in blocks of `blocksize` weights, one float32 absmax per block.

    4.5 bits a weight at blocksize 64 (3.6x fewer bytes than bfloat16). Only 2-D weights are encoded;
    norms and biases stay as they are. Decoding on CUDA is one bitsandbytes kernel per matrix, writing
    straight into the scratch layer; on the CPU it goes through a temporary.
    """

    name = "nf4"

    def __init__(self, blocksize: int = 64) -> None:
        try:
            import bitsandbytes.functional as bnb_functional
        except ImportError:
            raise OffloadError(
                "4-bit offloading (nf4) needs bitsandbytes; install it with: pip install bitsandbytes"
            ) from None
        self._f = bnb_functional
        self.blocksize = blocksize
        self._codes: dict[torch.device, torch.Tensor] = {}

    def encodes(self, name: str, tensor: torch.Tensor) -> bool:
        return (
            name.endswith("weight")
            and tensor.dim() == 2
            and tensor.is_floating_point()
            and tensor.numel() % self.blocksize == 0
        )

    def part_specs(self, shape: torch.Size, dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
        numel = math.prod(shape)
        return [((numel // 2, 1), torch.uint8), ((numel // self.blocksize,), torch.float32)]

    def encode(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        packed, state = self._f.quantize_4bit(tensor.contiguous(), blocksize=self.blocksize, quant_type="nf4")
        return [packed, state.absmax.float()]

    def decode(self, parts: list[torch.Tensor], out: torch.Tensor) -> None:
        packed, absmax = parts
        if out.device not in self._codes:
            self._codes[out.device] = self._f.get_4bit_type("nf4", device=out.device)
        state = self._f.QuantState(
            absmax=absmax,
            shape=out.shape,
            code=self._codes[out.device],
            blocksize=self.blocksize,
            quant_type="nf4",
            dtype=out.dtype,
        )
        if out.is_cuda:
            self._f.dequantize_4bit(packed, state, out=out)
        else:  # bitsandbytes has no CPU kernel for the out= form
            out.copy_(self._f.dequantize_4bit(packed, state))


def make_codec(name: str | None) -> WeightCodec | None:
    """The codec for a `--quant-offload` choice (None: full precision)."""
    if name is None:
        return None
    if name == "nf4":
        return NF4Codec()
    raise OffloadError(f"unknown offload quantization {name!r}; choose one of {', '.join(QUANT_CHOICES)}")
