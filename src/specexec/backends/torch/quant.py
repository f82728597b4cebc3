"""int8 / int4 quantization for CPU inference: PyTorch's own low-bit kernels, and a small C kernel.

Every `nn.Linear` of the decoder layers and the LM head becomes a `QuantLinear`, in one of three modes:
- "int8", weight-only, symmetric per output channel (w = q * s): the model is its dequantized weights;
- "int4", weight-only, asymmetric per group of `group_size` input channels (w = (q - 8) * s + z,
  PyTorch's int4pack convention): the model is its dequantized weights;
- "w4a8": the same 4-bit weights (w = q * s + low, groups of 64) times activations rounded to int8 per
  row and group of 64 on the fly, as llama.cpp's Q4 x Q8 dot products do. One C kernel (w4a8.c,
  compiled on first use, AVX-512 VNNI, AMX tiles past 8 rows) does it with exact integer dot products
  per group; every row is computed the same way whatever the number of rows, so the linear layers give
  a tree's rows bit for bit as one-token decoding would, and a block of rows costs far less than that
  many single rows: the weights are read once per block and serve every row from registers and the
  cache.

PyTorch's int8/int4 CPU kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) read 1/2 or 1/4 of
the bytes of a bfloat16 weight, which is what a memory-bound single-token decode needs, but their cost
grows with every input row (at 16 rows they are ~3x slower than a bfloat16 matmul). So in "int8" and
"int4", inputs of more than `LOW_BIT_MAX_ROWS` rows (tree verification, wide draft passes) use a matmul
against the same weights dequantized once into the model's dtype; both paths compute the same model and
differ only by floating-point rounding, like any batched versus single-token forward.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from specexec.backends.base import BackendError
from specexec.backends.options import QUANT_MODES
from specexec.backends.torch.draft_vocab import ReducedHead
from specexec.paths import cache_root

INT4_GROUP_SIZE = 64  # 32 is 2-5x slower in the CPU kernel for long rows (K = 8960) and the LM head
W4A8_GROUP_SIZE = 64  # fixed by w4a8.c
# Measured on a 2-core AMX CPU, 1536x8960 weight: the low-bit kernels beat bfloat16 up to 4 rows.
LOW_BIT_MAX_ROWS = 4


class QuantError(BackendError):
    """A quantization that cannot be applied as asked."""


class QuantLinear(nn.Module):
    """A linear layer stored as `mode` ("int8", "int4" or "w4a8"); see the module docstring."""

    def __init__(self, linear: nn.Linear, mode: str, group_size: int = INT4_GROUP_SIZE) -> None:
        super().__init__()
        weight = linear.weight.detach()
        dtype = weight.dtype
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.mode = mode
        self.group_size = _group_size(mode, group_size)
        self.bias = linear.bias
        self.shared: SharedInput | None = None  # set by `share_inputs`
        if mode in ("int4", "w4a8") and not int4_fits(linear, self.group_size):
            raise QuantError(
                f"{mode} needs in_features divisible by {self.group_size} and out_features by 16, "
                f"got {self.in_features} x {self.out_features}"
            )
        if mode == "w4a8":
            w4a8_kernel()  # compiled now, so a missing compiler fails at load time
            packed, scales, lows = _w4a8(weight.float())
            self.register_buffer("qweight", packed)  # (N / 16, K / 8, 64) uint8
            self.register_buffer("scales", scales)  # (N / 16, K / 64, 16) float16
            self.register_buffer("lows", lows)
            return
        if mode == "int8":
            qweight, scales, dequantized = _int8(weight.float())
            self.register_buffer("qweight", qweight)  # (N, K) int8
            self.register_buffer("scales", scales.to(dtype))  # (N,)
        elif mode == "int4":
            qweight, scales_zeros, dequantized = _int4(weight.float(), group_size)
            self.register_buffer("qweight", qweight)  # packed by PyTorch
            self.register_buffer("scales_zeros", scales_zeros.to(dtype))  # (K / group, N, 2)
        else:
            raise QuantError(f"unknown QuantLinear mode {mode!r}")
        self.register_buffer("dequantized", dequantized.to(dtype))  # (N, K), for many-row inputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        flat = x.reshape(rows, self.in_features)  # (rows, K)
        if self.mode == "w4a8" and self.shared is not None:
            out = self.shared.output(self, x, flat)
        elif self.mode == "w4a8":
            out = _w4a8_matmul(flat, self.qweight, self.scales, self.lows)
        elif rows > LOW_BIT_MAX_ROWS or x.dtype != self.dequantized.dtype:
            return F.linear(x, self.dequantized, self.bias)
        elif self.mode == "int8":
            out = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                flat, self.qweight, self.group_size, self.scales_zeros
            )
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}"


def _w4a8_matmul(
    flat: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, lows: torch.Tensor
) -> torch.Tensor:
    """flat (rows, K) times packed w4a8 weights of N = 16 * len(qweight) outputs: (rows, N), flat's dtype."""
    x = flat.float().contiguous()  # (rows, K)
    out = torch.empty(x.shape[0], 16 * qweight.shape[0], dtype=torch.float32)  # (rows, N)
    failed = w4a8_kernel().w4a8_linear(
        x.data_ptr(), x.shape[0], x.shape[1], out.shape[1], qweight.data_ptr(), scales.data_ptr(),
        lows.data_ptr(), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("w4a8 kernel: out of memory for its activation buffers")
    return out.to(flat.dtype)


class SharedInput:
    """w4a8 layers that read the same input tensor (a decoder layer's q/k/v projections, its MLP's
    gate/up), run as one kernel call over their concatenated weights: one conversion and rounding of the
    activations and one thread launch instead of two or three. The first member called with an input
    computes every member's output; the others take theirs when called with that same tensor object, and
    compute afresh otherwise. Bit for bit what separate calls give: the
    kernel computes each block of 16 outputs on its own. The members' weights become views of the
    concatenated ones (no second copy).
    """

    def __init__(self, members: list[QuantLinear]) -> None:
        self.qweight = torch.cat([m.qweight for m in members])  # (sum N / 16, K / 8, 64)
        self.scales = torch.cat([m.scales for m in members])  # (sum N / 16, K / 64, 16)
        self.lows = torch.cat([m.lows for m in members])
        self.columns: dict[int, slice] = {}
        start = 0
        for member in members:
            blocks = slice(start // 16, (start + member.out_features) // 16)
            member.qweight = self.qweight[blocks]
            member.scales = self.scales[blocks]
            member.lows = self.lows[blocks]
            member.shared = self
            self.columns[id(member)] = slice(start, start + member.out_features)
            start += member.out_features
        self.input: torch.Tensor | None = None
        self.out: torch.Tensor | None = None
        self.taken: set[int] = set()

    def output(self, member: QuantLinear, x: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """`member`'s output (rows, N_member) for input x (..., K), flattened as `flat` (rows, K)."""
        if x is not self.input or id(member) in self.taken:
            self.input, self.taken = x, set()
            self.out = _w4a8_matmul(flat, self.qweight, self.scales, self.lows)  # (rows, sum N)
        out = self.out[:, self.columns[id(member)]]
        self.taken.add(id(member))
        if len(self.taken) == len(self.columns):
            self.input = self.out = None  # all served: hold no tensors between forwards
        return out


# Sibling projections that read one input in the Llama-style decoder layers (attention, MLP).
SHARED_INPUT_NAMES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def share_inputs(model: nn.Module) -> None:
    """Group every set of w4a8 sibling layers named in SHARED_INPUT_NAMES into a `SharedInput`."""
    for module in model.modules():
        for names in SHARED_INPUT_NAMES:
            members = [getattr(module, name, None) for name in names]
            free = all(isinstance(m, QuantLinear) and m.mode == "w4a8" and m.shared is None for m in members)
            if free and len({m.in_features for m in members}) == 1:
                SharedInput(members)


def int4_fits(linear: nn.Linear, group_size: int = INT4_GROUP_SIZE) -> bool:
    """Whether PyTorch's int4 CPU kernel takes this shape (else `quantize_model` falls back to int8)."""
    return linear.in_features % group_size == 0 and linear.out_features % 16 == 0


def _int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127  # (N,)
    qweight = (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8)  # (N, K)
    return qweight, scales, qweight.float() * scales[:, None]


def _groupwise_4bit(
    weight: torch.Tensor, group_size: int, stored: torch.dtype, min_scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes q in 0..15 (N, G, group), scale and low (N, G) per output and group of inputs, w ≈ q·s + low.
    Scale and low are rounded to `stored`, the dtype the kernel reads, before the codes are chosen."""
    n, k = weight.shape
    groups = weight.reshape(n, k // group_size, group_size)  # (N, G, group)
    low, high = torch.aminmax(groups, dim=-1)  # (N, G)
    low = low.to(stored).float()
    scales = ((high - low) / 15).clamp(min=min_scale).to(stored).float()
    # In place: one (N, G, group) temporary instead of four (loading a 1.5B model took 40 s here).
    q = (groups - low[..., None]).div_(scales[..., None]).round_().clamp_(0, 15)  # (N, G, group)
    return q, scales, low


def _int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, k = weight.shape
    q, scales, low = _groupwise_4bit(weight, group_size, torch.float32, min_scale=1e-12)
    zeros = low + 8 * scales  # so that (q - 8) * s + z = q * s + low
    dequantized = (q - 8).mul_(scales[..., None]).add_(zeros[..., None]).reshape(n, k)  # (N, K)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(n, k).to(torch.int32), 1)
    scales_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).contiguous()  # (G, N, 2)
    return packed, scales_zeros, dequantized


def _w4a8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack (N, K) float weights as w4a8.c reads them: q (0..15), scale and low per output and group."""
    n, k = weight.shape
    q, scales, low = _groupwise_4bit(weight, W4A8_GROUP_SIZE, torch.float16, min_scale=1e-6)
    q = q.to(torch.uint8).reshape(n // 16, 16, k // 8, 2, 4)  # (N / 16, lane, K / 8, nibble, 4)
    packed = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).permute(0, 2, 1, 3)  # (N / 16, K / 8, lane, 4)

    def per_block(t: torch.Tensor) -> torch.Tensor:  # (N, G) -> (N / 16, G, 16) float16
        return t.reshape(n // 16, 16, -1).transpose(1, 2).contiguous().half()

    return packed.reshape(n // 16, k // 8, 64).contiguous(), per_block(scales), per_block(low)


def w4a8_reference(x: torch.Tensor, layer: QuantLinear) -> torch.Tensor:
    """What the w4a8 kernel computes, in float64 with PyTorch ops (for tests): x (rows, K) -> (rows, N)."""
    groups = x.double().reshape(x.shape[0], -1, W4A8_GROUP_SIZE)  # (rows, G, 64)
    amax = groups.abs().amax(-1, keepdim=True).float()
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    xi = (groups.float() * inverse).round().clamp(-127, 127)  # as the kernel rounds, in float32
    activations = (xi.double() * (amax / 127).double()).reshape(x.shape)
    n, k = layer.out_features, layer.in_features
    packed = layer.qweight.reshape(n // 16, k // 8, 16, 4)  # (N / 16, K / 8, lane, 4)
    q = torch.stack([packed & 0x0F, packed >> 4], dim=3)  # (N / 16, K / 8, lane, nibble, 4)
    q = q.permute(0, 2, 1, 3, 4).reshape(n, k).double()  # (N, K)

    def per_output(t: torch.Tensor) -> torch.Tensor:  # (N / 16, G, 16) -> (N, K)
        return t.transpose(1, 2).reshape(n, -1).double().repeat_interleave(W4A8_GROUP_SIZE, dim=1)

    weight = q * per_output(layer.scales) + per_output(layer.lows)
    return activations @ weight.t()


def kernel_tag(model: nn.Module) -> str:
    """What the model's speed depends on besides its quantization mode: under w4a8, the kernel build
    (source, compiler, flags, CPU), so a calibration of another build is not reused."""
    if quant_label(model) != "w4a8":
        return ""
    return _kernel_build("native")[2].stem


def _kernel_build(march: str) -> tuple[str, list[str], Path]:
    """The compiler, flags and cached library path of w4a8.c for `march`; the path names a hash of the
    source, the compiler and flags, and the CPU."""
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None:
        raise QuantError("--quant w4a8 compiles a small C kernel on first use: install gcc (or set CC)")
    flags = ["-O3", f"-march={march}", "-fopenmp", "-fPIC", "-shared"]
    source = Path(__file__).with_name("w4a8.c").read_bytes()
    key = hashlib.sha256(
        b"\0".join([source, " ".join([compiler, *flags]).encode(), _cpu_description().encode()])
    ).hexdigest()[:16]
    return compiler, flags, cache_root() / "kernels" / f"w4a8-{key}.so"


@functools.cache
def w4a8_kernel(march: str = "native") -> ctypes.CDLL:
    """The compiled w4a8.c, built with the machine's C compiler on first use and cached per source,
    flags and CPU (``SPECEXEC_CACHE``/kernels). Without AVX-512 VNNI in `march`, the portable C path;
    with AMX in `march` and granted by the OS, tile instructions for blocks of more than 8 rows."""
    compiler, flags, path = _kernel_build(march)
    source = Path(__file__).with_name("w4a8.c")
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        built = subprocess.run(
            [compiler, *flags, str(source), "-o", str(partial), "-lm"], capture_output=True, text=True
        )
        if built.returncode:
            message = (built.stderr.strip().splitlines() or ["no message"])[0]
            raise QuantError(f"compiling the w4a8 kernel failed: {message}")
        os.replace(partial, path)
    library = ctypes.CDLL(str(path))
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    library.w4a8_linear.argtypes = [pointer, size, size, size, *[pointer] * 4, ctypes.c_int]
    library.w4a8_linear.restype = ctypes.c_int
    library.w4a8_has_vnni.restype = ctypes.c_int
    library.w4a8_enable_amx.restype = ctypes.c_int
    library.w4a8_enable_amx()
    return library


def _cpu_description() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        flags = next(line for line in lines if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return f"{platform.machine()} {flags}"


def quantize_model(model: PreTrainedModel, mode: str, group_size: int = INT4_GROUP_SIZE) -> PreTrainedModel:
    """Quantize the decoder layers' and the LM head's linear layers in place; `mode` from QUANT_MODES.

    CPU only. The input embedding stays as it is (a lookup reads one row per token); a tied LM head gets
    its own quantized copy. Under int4 and w4a8, a layer whose shape the 4-bit kernel cannot take is
    stored as int8 (weight-only). Under w4a8, projections that read the same input share one kernel
    call (`share_inputs`).
    """
    if mode not in QUANT_MODES:
        raise QuantError(f"unknown quantization {mode!r}; choose from {', '.join(QUANT_MODES)}")
    if mode == "none":
        return model
    if model.device.type != "cpu":
        raise QuantError(f"--quant {mode} runs on the CPU kernels; the model is on {model.device}")
    if quant_label(model) != "none":
        raise QuantError(f"the model is already quantized ({quant_label(model)})")
    from specexec.backends.torch.layers import OffloadError, decoder_layers

    try:
        layers = decoder_layers(model)
    except OffloadError:
        raise QuantError(f"cannot find the decoder layers of {type(model).__name__}") from None
    with torch.no_grad():
        for layer in layers:
            for child in list(layer.modules()):
                for attr, sub in list(child.named_children()):
                    if isinstance(sub, nn.Linear):
                        setattr(child, attr, _quantized(sub, mode, group_size))
        head = model.get_output_embeddings()
        if isinstance(head, nn.Linear):
            model.set_output_embeddings(_quantized(head, mode, group_size))
        elif isinstance(head, ReducedHead):
            head.linear = _quantized(head.linear, mode, group_size)
    if mode == "w4a8":
        share_inputs(model)
    return model


def _quantized(linear: nn.Linear, mode: str, group_size: int) -> QuantLinear:
    if mode in ("int4", "w4a8") and not int4_fits(linear, _group_size(mode, group_size)):
        mode = "int8"
    return QuantLinear(linear, mode, group_size)


def _group_size(mode: str, group_size: int) -> int:
    """The group along K a mode quantizes by: w4a8's is fixed by its kernel."""
    return W4A8_GROUP_SIZE if mode == "w4a8" else group_size


def quant_label(model: nn.Module) -> str:
    """One of QUANT_MODES: how the model's linear layers are stored (with int8 fallbacks, the 4-bit mode)."""
    modes = {m.mode for m in model.modules() if isinstance(m, QuantLinear)}
    return next((mode for mode in ("w4a8", "int4", "int8") if mode in modes), "none")
