"""A model's anatomy as offloading sees it: its list of decoder layers (`decoder_layers`), the distinct
tensors under a module with every (module, attribute) that holds each (`unique_tensors`, so tied weights
count once), and their bytes (`module_bytes`, `weight_bytes`: what one forward streams). Also
`OffloadError`, the one-line refusal of offloading, raised here when a model has no decoder layers; the
rest of offloading (codec, devices, offload, simulated) imports it from here and nothing here imports them.
"""

from __future__ import annotations

import torch
from torch import nn

from specexec.backends.base import BackendError


class OffloadError(BackendError):
    """Offloading cannot run as asked; the one-line message says why and what to do instead."""


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of decoder layers (``model.model.layers`` in Hugging Face causal LMs)."""
    owners = [getattr(model, "model", None), model]
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        owners.insert(0, get_decoder())
    for owner in owners:
        layers = getattr(owner, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers):
            return layers
    raise OffloadError(f"{type(model).__name__} has no list of decoder layers (model.model.layers)")


def weight_bytes(model: nn.Module) -> int:
    """Decoder-layer bytes one forward streams from host memory: every layer of a plain model; the
    streamed layers' packed buffers (4-bit when encoded) of an offloaded one."""
    offloader = getattr(model, "_specexec_offloader", None)
    if offloader is not None:
        return offloader.streamed_bytes
    return sum(module_bytes(layer) for layer in decoder_layers(model))


def unique_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor, list, bool]]:
    """(name, tensor, owners, is_param) for each distinct parameter and buffer under `module`."""
    found: dict[int, tuple[str, torch.Tensor, list, bool]] = {}
    for prefix, sub in module.named_modules():
        for store, is_param in ((sub._parameters, True), (sub._buffers, False)):
            for attr, tensor in store.items():
                if tensor is None:
                    continue
                name = f"{prefix}.{attr}" if prefix else attr
                entry = found.setdefault(id(tensor), (name, tensor, [], is_param))
                entry[2].append((sub, attr))
    return list(found.values())


def module_bytes(module: nn.Module, skip: str | None = None) -> int:
    """Bytes of the distinct tensors under `module`, leaving out the submodule named `skip`."""
    total, seen = 0, set()
    for prefix, sub in module.named_modules():
        if skip is not None and (prefix == skip or prefix.startswith(skip + ".")):
            continue
        for tensor in [*sub._parameters.values(), *sub._buffers.values()]:
            if tensor is not None and id(tensor) not in seen:
                seen.add(id(tensor))
                total += tensor.numel() * itemsize(tensor.dtype)
    return total


def itemsize(dtype: torch.dtype) -> int:
    """Bytes of one element of `dtype`."""
    return torch.empty(0, dtype=dtype).element_size()
