"""Tensors and buffers on devices, for offloading: `to_device` moves a model's parameters and buffers in
place (keeping tied weights tied, filling meta tensors through a `MetaInit`), `host_buffer` and
`device_buffer` allocate the raw byte buffers streamed layers live in (the host one page-locked without
PyTorch's power-of-two rounding), and `materialise`/`require_init` give a possibly-meta tensor real values.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn

from specexec.backends.torch.layers import OffloadError

# Called to fill a tensor that is still on the meta device (a model built without weights):
# meta_init(qualified_name, out) writes the values into `out`, a host view or a device tensor.
MetaInit = Callable[[str, torch.Tensor], None]


def to_device(model: nn.Module, device: str | torch.device, meta_init: MetaInit | None = None) -> nn.Module:
    """Move every parameter and buffer of `model` to `device` in place, keeping tied weights tied and
    filling those still on the meta device with `meta_init`. Returns `model`."""
    move_tensors(model, torch.device(device), meta_init)
    return model


def move_tensors(
    root: nn.Module,
    device: torch.device,
    meta_init: MetaInit | None,
    skip: str | None = None,
    prefix: str = "",
) -> None:
    """Move every parameter and buffer under `root` (but not under `skip`) to `device`, keeping ties."""
    moved: dict[int, torch.Tensor] = {}
    for path, sub in root.named_modules():
        if skip is not None and (path == skip or path.startswith(skip + ".")):
            continue
        for store, is_param in ((sub._parameters, True), (sub._buffers, False)):
            for attr, tensor in list(store.items()):
                if tensor is None or (tensor.device == device and not tensor.is_meta):
                    continue
                if id(tensor) not in moved:
                    name = prefix + (f"{path}.{attr}" if path else attr)
                    value = materialise(name, tensor, device, meta_init)
                    moved[id(tensor)] = nn.Parameter(value, requires_grad=False) if is_param else value
                store[attr] = moved[id(tensor)]


def materialise(
    name: str, tensor: torch.Tensor, device: torch.device, meta_init: MetaInit | None
) -> torch.Tensor:
    """`tensor` on `device`: a copy, or (on the meta device) a new tensor filled by `meta_init`."""
    if not tensor.is_meta:
        return tensor.detach().to(device)
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    require_init(name, meta_init)(name, out)
    return out


def require_init(name: str, meta_init: MetaInit | None) -> MetaInit:
    """`meta_init`, refusing when there is none to fill the meta tensor `name`."""
    if meta_init is None:
        raise OffloadError(f"{name} is on the meta device (no data); pass meta_init to fill it")
    return meta_init


def host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """An uninitialised (nbytes,) uint8 host tensor, page-locked when `pin`.

    Pinning registers the tensor's own memory (cudaHostRegister) rather than asking PyTorch's pinned
    allocator, which rounds every block up to a power of two: up to 2x the host memory for big layers.
    The registration ends when the returned tensor object is freed.
    """
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    if not pin or nbytes == 0:
        return buffer
    cudart = torch.cuda.cudart()
    try:
        error = cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0)
        registered = error == cudart.cudaError.success
    except (AttributeError, RuntimeError, TypeError):
        registered = False
    if not registered:
        return buffer.pin_memory()
    weakref.finalize(buffer, cudart.cudaHostUnregister, buffer.data_ptr())
    return buffer


def device_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """An uninitialised (nbytes,) uint8 tensor on `device`."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)
