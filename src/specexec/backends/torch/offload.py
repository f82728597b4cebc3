"""Weight offloading: run a target whose decoder layers do not fit on the GPU.

Streaming (`offload_model`). Every decoder layer that is not kept resident lives in host memory as one
contiguous byte buffer (pinned when the device is a CUDA GPU), so it moves to the device in a single copy.
The device holds a ring of `ring_size` layer-sized buffers. Each streamed layer is replaced in the
model's own `nn.ModuleList` by a thin `OffloadedLayer` wrapper (indexing and slicing keep working), whose
forward

1. waits until its weights are in a ring slot (loading them now if the prefetch missed),
2. points the layer's parameters at views of that slot and runs the layer,
3. points them back at their host views and refills the freed slot with the layer `ring_size` positions
   ahead (cyclically, so the last layers prefetch the first ones of the next forward).

On CUDA the copies run on a side stream, ordered against compute by one "loaded" and one "freed" event
per slot (no global synchronisation), so loading layer i + ring_size overlaps computing layers
i + 1 .. i + ring_size - 1. Every forward moves each streamed layer exactly once, whatever its number of
tokens. The embeddings, final norm, LM head, rotary tables and the resident layers move to the device,
and the KV cache follows the embeddings there. On a CPU `device` the same code runs with plain
synchronous copies (host and ring both in CPU memory): that is how the tests check it, and it is no
faster than not offloading.

With `gpu_memory`, the first layers stay resident on the device as far as the budget allows and only the
rest stream. With a `codec` (`NF4Codec`: bitsandbytes NF4), streamed layers travel 4-bit and are
decoded on the device into one shared full-precision scratch layer just before they run.

When several GPUs together can hold the target, streaming is the wrong tool: load it with accelerate's
``device_map="auto"`` instead (`choose_placement` says which case applies).

Simulation, for machines without a GPU, lives in `simulated` (`simulate_offload`); `offload_label` here
describes both. The codecs are in `codec`, a model's anatomy (`decoder_layers`, `weight_bytes`) in `layers`,
moving tensors and allocating buffers in `devices`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from specexec.backends.torch.codec import WeightCodec, make_codec
from specexec.backends.torch.devices import (
    MetaInit,
    device_buffer,
    host_buffer,
    materialise,
    move_tensors,
    require_init,
)
from specexec.backends.torch.layers import (
    OffloadError,
    decoder_layers,
    itemsize,
    module_bytes,
    unique_tensors,
)
from specexec.sizes import SizeError, format_bytes, parse_size

ALIGN = 256  # bytes: every tensor in a packed buffer starts at a multiple (vectorised kernels need 16)


@dataclass
class OffloadStats:
    """What the ring did; counters only grow."""

    loads: int = 0  # layer copies host -> device
    bytes_loaded: int = 0
    misses: int = 0  # layers whose prefetch had not been issued when their turn came (loaded on demand)
    peak_live_layers: int = 0  # most streamed layers whose parameters pointed into the ring at once


# ---------------------------------------------------------------------------------------------------
# Packing: one layer's tensors as slices of one byte buffer.


@dataclass
class _Slice:
    """Bytes [offset, offset + nbytes) of a packed buffer, viewed as `dtype` of `shape`."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)


class _Layout:
    """Appends aligned slices; `size` is the buffer length so far."""

    def __init__(self) -> None:
        self.size = 0

    def add(self, shape: Sequence[int], dtype: torch.dtype) -> _Slice:
        piece = _Slice(self.size, tuple(shape), dtype)
        self.size = _align(self.size + piece.nbytes)
        return piece


@dataclass
class _Entry:
    """One parameter or buffer of a streamed layer."""

    name: str  # qualified name in the model, for messages and meta_init
    owners: list[tuple[nn.Module, str]]  # every (module, attribute) holding it: ties inside a layer
    is_param: bool
    tensor: torch.Tensor  # the original (possibly meta) tensor, until packed
    stored: list[_Slice]  # one slice: the tensor itself; several: the codec's parts
    dense: _Slice | None  # encoded entries: where they decode to in the scratch layer
    host_value: torch.Tensor | None = None  # what the owners hold between passes (host view, or meta)
    device_values: list[torch.Tensor] | None = None  # per ring slot: what they hold while computing
    part_views: list[list[torch.Tensor]] | None = None  # encoded, per slot: the parts in the slot

    @property
    def encoded(self) -> bool:
        return self.dense is not None

    def assign(self, value: torch.Tensor) -> None:
        for module, attr in self.owners:
            (module._parameters if self.is_param else module._buffers)[attr] = value


class _PackedLayer:
    """A streamed layer: its host buffer, the layout of its tensors and the views the ring swaps in."""

    def __init__(self, index: int, module: nn.Module, prefix: str, codec: WeightCodec | None) -> None:
        self.index = index
        self.module = module
        self.entries: list[_Entry] = []
        layout, dense = _Layout(), _Layout()
        for name, tensor, owners, is_param in unique_tensors(module):
            if codec is not None and is_param and codec.encodes(name, tensor):
                specs = codec.part_specs(tensor.shape, tensor.dtype)
                stored = [layout.add(shape, dtype) for shape, dtype in specs]
                target = dense.add(tensor.shape, tensor.dtype)
            else:
                stored, target = [layout.add(tensor.shape, tensor.dtype)], None
            self.entries.append(_Entry(prefix + name, owners, is_param, tensor, stored, target))
        self.nbytes = layout.size  # moved per pass
        self.dense_nbytes = dense.size  # scratch needed to decode it
        self.host = torch.empty(0, dtype=torch.uint8)

    @property
    def encoded(self) -> bool:
        return self.dense_nbytes > 0

    def pack(
        self, device: torch.device, pin: bool, codec: WeightCodec | None, meta_init: MetaInit | None
    ) -> None:
        """Copy (or encode) every tensor into one new host buffer; the owners then hold host views."""
        self.host = host_buffer(self.nbytes, pin)
        for entry in self.entries:
            if entry.encoded:
                assert codec is not None
                # Encode where it is fast (the GPU), then keep only the parts, in host memory.
                parts = codec.encode(materialise(entry.name, entry.tensor, device, meta_init))
                for piece, part in zip(entry.stored, parts, strict=True):
                    if tuple(part.shape) != piece.shape or part.dtype != piece.dtype:
                        raise OffloadError(f"codec {codec.name} returned an unexpected part for {entry.name}")
                    piece.view(self.host).copy_(part)
                host = torch.empty(entry.tensor.shape, dtype=entry.tensor.dtype, device="meta")
            else:
                host = entry.stored[0].view(self.host)
                if entry.tensor.is_meta:
                    require_init(entry.name, meta_init)(entry.name, host)
                else:
                    host.copy_(entry.tensor)
            entry.tensor = host  # drop the original storage
            entry.host_value = nn.Parameter(host, requires_grad=False) if entry.is_param else host
            entry.assign(entry.host_value)
        self.module.__dict__.pop("_specexec_host_buffer", None)  # a buffer from an earlier offload

    def bind(self, slots: list[torch.Tensor], scratch: torch.Tensor | None) -> None:
        """Precompute, for each ring slot, the tensors the owners hold while this layer runs from it."""
        self.device_values, self.part_views = [], []
        for entry in self.entries:
            values, parts = [], []
            for slot in slots:
                view = entry.dense.view(scratch) if entry.encoded else entry.stored[0].view(slot)
                values.append(nn.Parameter(view, requires_grad=False) if entry.is_param else view)
                parts.append([piece.view(slot) for piece in entry.stored])
            entry.device_values, entry.part_views = values, parts

    def point(self, slot: int | None, codec: WeightCodec | None = None) -> None:
        """Owners hold the slot's views (decoding encoded tensors first), or their host views (None)."""
        for entry in self.entries:
            if slot is None:
                entry.assign(entry.host_value)
                continue
            if entry.encoded:
                codec.decode(entry.part_views[slot], entry.device_values[slot].data)
            entry.assign(entry.device_values[slot])

    def unpack(self, codec: WeightCodec | None) -> None:
        """Leave the owners holding plain host tensors (encoded ones decoded, lossy) and forget the ring."""
        for entry in self.entries:
            if entry.encoded:
                dense = torch.empty(entry.tensor.shape, dtype=entry.tensor.dtype)
                codec.decode([piece.view(self.host) for piece in entry.stored], dense)
                entry.assign(nn.Parameter(dense, requires_grad=False) if entry.is_param else dense)
            else:
                entry.assign(entry.host_value)
            entry.device_values = entry.part_views = None
        # The plain layer's tensors are views of the host buffer: keep it (and its pinning) with the layer.
        self.module.__dict__["_specexec_host_buffer"] = self.host


# ---------------------------------------------------------------------------------------------------
# The ring and the layer wrapper.


class OffloadedLayer(nn.Module):
    """Stands in for a streamed decoder layer in the model's layer list; `inner` is the original layer."""

    def __init__(self, inner: nn.Module, offloader: Offloader, position: int) -> None:
        super().__init__()
        self.inner = inner
        self.position = position  # index among the streamed layers
        self._offloader = offloader  # a plain attribute (not a module): the wrapper does not own it

    def forward(self, *args, **kwargs):
        self._offloader._enter(self.position)
        try:
            return self.inner(*args, **kwargs)
        finally:
            self._offloader._exit(self.position)

    def __getattr__(self, name: str):
        # Attributes the model reads off its layers (attention_type, ...) come from the wrapped layer.
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("inner")
            if inner is None:
                raise
            return getattr(inner, name)


class Offloader:
    """The state of one offloaded model: which layers stream, the ring, its streams and events, stats.

    Made by `offload_model`; `remove()` undoes it (streamed layers back as plain host-memory modules).
    """

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        ring_size: int,
        resident: list[int],
        packed: list[_PackedLayer],
        codec: WeightCodec | None,
        weights_bytes: int,
    ) -> None:
        self.model = model
        self.device = device
        self.codec = codec
        self.resident = resident  # layer indices kept on the device
        self.streamed = [p.index for p in packed]  # layer indices streamed, in order
        self.weights_bytes = weights_bytes  # on the device: always-resident parts + resident layers
        self.stats = OffloadStats()
        self._packed = packed
        self._cuda = device.type == "cuda"
        self.ring_size = min(ring_size, len(packed))
        self.slot_bytes = max((p.nbytes for p in packed), default=0)
        self.scratch_bytes = max((p.dense_nbytes for p in packed), default=0)
        # Shape: ring_size x (slot_bytes,) uint8 on the device, plus one dense scratch layer if encoded.
        self._slots = [device_buffer(self.slot_bytes, device) for _ in range(self.ring_size)]
        self._scratch = device_buffer(self.scratch_bytes, device) if self.scratch_bytes else None
        self._content: list[int | None] = [None] * self.ring_size  # slot -> streamed position
        self._where: list[int | None] = [None] * len(packed)  # streamed position -> slot
        self._live = 0
        if self._cuda:
            self._copy_stream = torch.cuda.Stream(device)
            self._loaded = [torch.cuda.Event() for _ in range(self.ring_size)]
            self._freed = [torch.cuda.Event() for _ in range(self.ring_size)]
        for layer in packed:
            layer.bind(self._slots, self._scratch)
        for position in range(self.ring_size):  # the first forward starts prefetched too
            self._load(position, cursor=0)

    @property
    def streamed_bytes(self) -> int:
        """Bytes moved from host memory per forward."""
        return sum(p.nbytes for p in self._packed)

    @property
    def ring_bytes(self) -> int:
        return self.ring_size * self.slot_bytes + self.scratch_bytes

    @property
    def pinned(self) -> bool:
        return bool(self._packed) and all(p.host.is_pinned() for p in self._packed)

    def describe(self) -> str:
        """One line for logs and benchmark headers."""
        total = len(self.resident) + len(self.streamed)
        quant = f", {self.codec.name}" if self.codec is not None else ""
        memory = "pinned host memory" if self.pinned else "host memory"
        return (
            f"offload: {len(self.streamed)} of {total} decoder layers streamed from {memory}{quant} "
            f"({format_bytes(self.streamed_bytes)} per forward) through a ring of {self.ring_size} x "
            f"{format_bytes(self.slot_bytes)} on {self.device}; {len(self.resident)} resident; "
            f"{format_bytes(self.weights_bytes + self.ring_bytes)} of weights on the device"
        )

    def remove(self) -> None:
        """Put the original layers back: streamed ones as plain modules in host memory (decoded if 4-bit),
        the rest where offloading placed them. The ring is freed."""
        if self._cuda:
            torch.cuda.synchronize(self.device)
        layers = decoder_layers(self.model)
        for position, packed in enumerate(self._packed):
            packed.unpack(self.codec)
            wrapper = layers[packed.index]
            if isinstance(wrapper, OffloadedLayer) and wrapper.position == position:
                layers[packed.index] = wrapper.inner
        self._slots, self._scratch, self._packed = [], None, []
        self.model.__dict__.pop("_specexec_offloader", None)

    def slot_ranges(self) -> list[tuple[int, int]]:
        """[start, end) device addresses of the ring slots (and the scratch layer), for instrumentation."""
        buffers = [*self._slots, *([self._scratch] if self._scratch is not None else [])]
        return [(b.data_ptr(), b.data_ptr() + b.numel()) for b in buffers]

    # The ring. A layer's slot is not fixed: a load goes to the slot whose layer is needed last.

    def _enter(self, position: int) -> None:
        slot = self._where[position]
        if slot is None:
            self.stats.misses += 1
            slot = self._load(position, cursor=position)
        if self._cuda:
            torch.cuda.current_stream(self.device).wait_event(self._loaded[slot])
        self._packed[position].point(slot, self.codec)
        self._live += 1
        self.stats.peak_live_layers = max(self.stats.peak_live_layers, self._live)

    def _exit(self, position: int) -> None:
        self._packed[position].point(None)
        self._live -= 1
        slot = self._where[position]
        if self._cuda:
            self._freed[slot].record(torch.cuda.current_stream(self.device))
        count = len(self._packed)
        ahead = (position + self.ring_size) % count
        if self._where[ahead] is None:
            self._load(ahead, cursor=(position + 1) % count)

    def _load(self, position: int, cursor: int) -> int:
        """Start copying streamed layer `position` into the slot needed last from `cursor` on."""
        count = len(self._packed)

        def needed_in(slot: int) -> int:  # layers until the slot's content is used again
            content = self._content[slot]
            return count + 1 if content is None else (content - cursor) % count

        slot = max(range(self.ring_size), key=needed_in)
        evicted = self._content[slot]
        if evicted is not None:
            self._where[evicted] = None
        layer = self._packed[position]
        target = self._slots[slot][: layer.nbytes]
        if self._cuda:
            self._copy_stream.wait_event(self._freed[slot])  # compute is done with the old content
            with torch.cuda.stream(self._copy_stream):
                target.copy_(layer.host, non_blocking=True)
            self._loaded[slot].record(self._copy_stream)
        else:
            target.copy_(layer.host)
        self._content[slot], self._where[position] = position, slot
        self.stats.loads += 1
        self.stats.bytes_loaded += layer.nbytes
        return slot


def offload_model(
    model: nn.Module,
    *,
    device: str | torch.device | None = None,
    ring_size: int = 2,
    gpu_memory: int | str | None = None,
    codec: WeightCodec | str | None = None,
    meta_init: MetaInit | None = None,
) -> Offloader:
    """Stream `model`'s decoder layers from host memory through a ring of `ring_size` device buffers.

    device: the compute device; None means the current CUDA GPU and refuses (OffloadError) when there is
    none. An explicit CPU device runs the same streaming code with host and ring both in CPU memory.
    gpu_memory: bytes (or a size such as "20GiB") the target's weights may take on the device: the
    embeddings, norm and LM head, the resident layers, the ring and, with a codec, one dense scratch
    layer. The first layers that fit stay resident; the rest stream. None streams every layer. The KV
    cache and activations come on top.
    codec: a `WeightCodec` or "nf4" to store streamed layers 4-bit (fewer bytes per forward).
    meta_init: fills tensors still on the meta device (a model built without weights), see `MetaInit`.
    The model is changed in place; the returned `Offloader` reports and can `remove()` it.
    """
    if ring_size < 1:
        raise OffloadError(f"ring size must be >= 1, got {ring_size}")
    device = _offload_device(device)
    if isinstance(codec, str):
        codec = make_codec(codec)
    if getattr(model, "_specexec_offloader", None) is not None:
        raise OffloadError("this model is already offloaded; call remove() on its offloader first")
    layers = decoder_layers(model)
    layers_name = next(name for name, module in model.named_modules() if module is layers)
    try:
        budget = parse_size(gpu_memory) if isinstance(gpu_memory, str) else gpu_memory
    except SizeError as err:  # the command line reports offloading's refusals
        raise OffloadError(str(err)) from None

    plans = [_PackedLayer(i, layer, f"{layers_name}.{i}.", codec) for i, layer in enumerate(layers)]
    fixed = module_bytes(model, skip=layers_name)
    dense = [module_bytes(layer) for layer in layers]
    kept = plan_resident(
        dense,
        [p.nbytes for p in plans],
        fixed_bytes=fixed,
        ring_size=ring_size,
        gpu_memory=budget,
        scratch_bytes=[p.dense_nbytes for p in plans],
    )

    move_tensors(model, device, meta_init, skip=layers_name)
    for index in range(kept):
        move_tensors(layers[index], device, meta_init, prefix=f"{layers_name}.{index}.")
    packed = plans[kept:]
    pin = device.type == "cuda"
    for layer in packed:
        layer.pack(device, pin, codec, meta_init)
    on_device = fixed + sum(dense[:kept])
    offloader = Offloader(model, device, ring_size, list(range(kept)), packed, codec, on_device)
    for position, layer in enumerate(packed):
        layers[layer.index] = OffloadedLayer(layer.module, offloader, position)
    model.__dict__["_specexec_offloader"] = offloader  # not an attribute nn.Module tracks
    return offloader


def plan_resident(
    dense_bytes: Sequence[int],
    streamed_bytes: Sequence[int],
    *,
    fixed_bytes: int,
    ring_size: int,
    gpu_memory: int | None,
    scratch_bytes: Sequence[int] | None = None,
) -> int:
    """How many leading layers stay resident under `gpu_memory` (the rest stream); see `offload_model`.

    dense_bytes[i]: layer i on the device; streamed_bytes[i]: its packed host buffer (smaller when
    encoded); scratch_bytes[i]: the dense layer it decodes into (0 when not encoded). All layers are
    resident when they fit without a ring. Raises OffloadError when not even the ring fits.
    """
    count = len(dense_bytes)
    if gpu_memory is None:
        return 0
    if fixed_bytes + sum(dense_bytes) <= gpu_memory:
        return count
    scratch = list(scratch_bytes or [0] * count)

    def needed(kept: int) -> int:  # bytes on the device with the first `kept` layers resident
        ring = min(ring_size, count - kept) * max(streamed_bytes[kept:]) + max(scratch[kept:])
        return fixed_bytes + sum(dense_bytes[:kept]) + ring

    for kept in range(count - 1, -1, -1):
        if needed(kept) <= gpu_memory:
            return kept
    raise OffloadError(
        f"GPU memory budget {format_bytes(gpu_memory)} is too small: embeddings, norm and LM head take "
        f"{format_bytes(fixed_bytes)} and a ring of {ring_size} layer buffers "
        f"{format_bytes(needed(0) - fixed_bytes)}; give at least {format_bytes(needed(0))}"
    )


def choose_placement(
    model_bytes: int, free_bytes: Sequence[int] | None = None, headroom: float = 0.85
) -> str:
    """Where a target of `model_bytes` belongs, given each visible GPU's free bytes (default: measured).

    "cpu": no GPU. "gpu": fits on the first GPU within `headroom` of its free memory. "device_map":
    several GPUs together hold it, so load it with ``device_map="auto"`` (accelerate places whole
    layers on each GPU; nothing streams). "offload": stream it with `offload_model`.
    """
    if free_bytes is None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        free_bytes = [torch.cuda.mem_get_info(i)[0] for i in range(count)]
    if not free_bytes:
        return "cpu"
    if model_bytes <= headroom * free_bytes[0]:
        return "gpu"
    if len(free_bytes) > 1 and model_bytes <= headroom * sum(free_bytes):
        return "device_map"
    return "offload"


def offload_label(model: nn.Module) -> str:
    """What offloading, real or simulated, changes this model's forward costs ("" for none)."""
    parts = [
        handle.describe() if hasattr(handle, "describe") else handle.label
        for handle in (model.__dict__.get("_specexec_offloader"), model.__dict__.get("_specexec_simulated"))
        if handle is not None
    ]
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------------------
# Helpers.


def _offload_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        if not torch.cuda.is_available():
            raise OffloadError(
                "offloading streams weights to a CUDA GPU and none is visible; run without offloading, or "
                "model it with a simulated bandwidth (--simulate-offload-gbps)"
            )
        device = "cuda"
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise OffloadError(f"offload device {device} is not available: no CUDA GPU is visible")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise OffloadError(f"offloading supports CUDA and CPU devices, not {device.type}")
    return device


def _align(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN
