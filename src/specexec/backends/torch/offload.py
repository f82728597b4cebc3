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

Simulation (`simulate_offload`). On a machine without a GPU, a forward hook on the top-level model makes
each forward last at least (streamed weight bytes) / (GB/s), so the engine's and benchmarks' wall-clock
timings show what streaming at that bandwidth would cost. Such timings are simulated and must be
labelled so.
"""

from __future__ import annotations

import math
import re
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from specexec.timing import clock

QUANT_CHOICES = ("nf4",)
ALIGN = 256  # bytes: every tensor in a packed buffer starts at a multiple (vectorised kernels need 16)

# Called to fill a tensor that is still on the meta device (a model built without weights):
# meta_init(qualified_name, out) writes the values into `out`, a host view or a device tensor.
MetaInit = Callable[[str, torch.Tensor], None]


class OffloadError(ValueError):
    """Offloading cannot run as asked; the one-line message says why and what to do instead."""


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
        return math.prod(self.shape) * _itemsize(self.dtype)

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
        for name, tensor, owners, is_param in _unique_tensors(module):
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
                parts = codec.encode(_materialise(entry.name, entry.tensor, device, meta_init))
                for piece, part in zip(entry.stored, parts, strict=True):
                    if tuple(part.shape) != piece.shape or part.dtype != piece.dtype:
                        raise OffloadError(f"codec {codec.name} returned an unexpected part for {entry.name}")
                    piece.view(self.host).copy_(part)
                host = torch.empty(entry.tensor.shape, dtype=entry.tensor.dtype, device="meta")
            else:
                host = entry.stored[0].view(self.host)
                if entry.tensor.is_meta:
                    _require_init(entry.name, meta_init)(entry.name, host)
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
        self._slots = [_device_buffer(self.slot_bytes, device) for _ in range(self.ring_size)]
        self._scratch = _device_buffer(self.scratch_bytes, device) if self.scratch_bytes else None
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
    budget = parse_size(gpu_memory) if isinstance(gpu_memory, str) else gpu_memory

    plans = [_PackedLayer(i, layer, f"{layers_name}.{i}.", codec) for i, layer in enumerate(layers)]
    fixed = _module_bytes(model, skip=layers_name)
    dense = [_module_bytes(layer) for layer in layers]
    kept = plan_resident(
        dense,
        [p.nbytes for p in plans],
        fixed_bytes=fixed,
        ring_size=ring_size,
        gpu_memory=budget,
        scratch_bytes=[p.dense_nbytes for p in plans],
    )

    _move_tensors(model, device, meta_init, skip=layers_name)
    for index in range(kept):
        _move_tensors(layers[index], device, meta_init, prefix=f"{layers_name}.{index}.")
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


# ---------------------------------------------------------------------------------------------------
# Simulation for machines without a GPU.


class SimulatedOffload:
    """Makes each forward of a model take at least `bytes_per_pass / gbps` seconds; see `simulate_offload`."""

    def __init__(self, model: nn.Module, gbps: float, bytes_per_pass: int) -> None:
        self.model = model
        self.gbps = gbps
        self.bytes_per_pass = bytes_per_pass
        self.seconds_per_pass = bytes_per_pass / (gbps * 1e9)
        self.calls = 0
        self.slept_seconds = 0.0  # added on top of the measured compute
        self._starts: list[float] = []  # a stack, in case a forward re-enters the model
        cuda = [p.device for p in model.parameters() if p.device.type == "cuda"]
        self._device = cuda[0] if cuda else torch.device("cpu")
        self._handles = [
            model.register_forward_pre_hook(self._before),
            model.register_forward_hook(self._after),
        ]
        model.__dict__["_specexec_simulated"] = self  # read by `offload_label`, not tracked by nn.Module

    @property
    def label(self) -> str:
        return (
            f"simulated offload: {format_bytes(self.bytes_per_pass)} streamed per target forward at "
            f"{self.gbps:g} GB/s (>= {self.seconds_per_pass * 1e3:.1f} ms per forward)"
        )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.model.__dict__.pop("_specexec_simulated", None)

    def __enter__(self) -> SimulatedOffload:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def _before(self, module, args) -> None:
        self._starts.append(clock(self._device))

    def _after(self, module, args, output) -> None:
        start = self._starts.pop()
        if self._starts:  # an inner call: the outermost one is charged
            return
        rest = self.seconds_per_pass - (clock(self._device) - start)
        self.calls += 1
        if rest > 0:
            time.sleep(rest)
            self.slept_seconds += rest


def simulate_offload(model: nn.Module, gbps: float, bytes_per_pass: int | None = None) -> SimulatedOffload:
    """Charge every forward of `model` max(measured compute, bytes_per_pass / gbps GB/s) of wall-clock time.

    bytes_per_pass defaults to `weight_bytes(model)`. The handle's `remove()` (or leaving it as a
    context manager) restores the model; its `label` says what is simulated. Timings taken with it on
    are simulations, not measurements.
    """
    if not gbps > 0 or not math.isfinite(gbps):
        raise OffloadError(f"simulated offload bandwidth must be a positive number of GB/s, got {gbps}")
    return SimulatedOffload(model, gbps, weight_bytes(model) if bytes_per_pass is None else bytes_per_pass)


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
    return sum(_module_bytes(layer) for layer in decoder_layers(model))


_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "kib": 2**10, "kb": 10**3,
    "m": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gib": 2**30, "gb": 10**9,
    "t": 2**40, "tib": 2**40, "tb": 10**12,
}  # fmt: skip


def parse_size(text: str | int) -> int:
    """Bytes from "20GiB", "20GB" (10^9), "512M" (bare letters are binary) or a plain number."""
    if isinstance(text, int):
        value = text
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
        unit = match.group(2).lower() if match else None
        if unit not in _UNITS:
            raise OffloadError(f"cannot read {text!r} as a memory size; write it like 20GiB, 20GB or 512MiB")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise OffloadError(f"a memory size must be positive, got {text!r}")
    return value


def format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return ""  # unreachable


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


def _unique_tensors(module: nn.Module):
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


def _module_bytes(module: nn.Module, skip: str | None = None) -> int:
    """Bytes of the distinct tensors under `module`, leaving out the submodule named `skip`."""
    total, seen = 0, set()
    for prefix, sub in module.named_modules():
        if skip is not None and (prefix == skip or prefix.startswith(skip + ".")):
            continue
        for tensor in [*sub._parameters.values(), *sub._buffers.values()]:
            if tensor is not None and id(tensor) not in seen:
                seen.add(id(tensor))
                total += tensor.numel() * _itemsize(tensor.dtype)
    return total


def to_device(model: nn.Module, device: str | torch.device, meta_init: MetaInit | None = None) -> nn.Module:
    """Move every parameter and buffer of `model` to `device` in place, keeping tied weights tied and
    filling those still on the meta device with `meta_init`. Returns `model`."""
    _move_tensors(model, torch.device(device), meta_init)
    return model


def _move_tensors(
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
                    value = _materialise(name, tensor, device, meta_init)
                    moved[id(tensor)] = nn.Parameter(value, requires_grad=False) if is_param else value
                store[attr] = moved[id(tensor)]


def _materialise(
    name: str, tensor: torch.Tensor, device: torch.device, meta_init: MetaInit | None
) -> torch.Tensor:
    if not tensor.is_meta:
        return tensor.detach().to(device)
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    _require_init(name, meta_init)(name, out)
    return out


def _require_init(name: str, meta_init: MetaInit | None) -> MetaInit:
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


def _device_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _align(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN
