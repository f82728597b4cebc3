"""The torch backend's runner: one Hugging Face model over slot-addressed KV buffers.

The KV cache is one buffer per generation, grown on demand (`reserve`, geometrically, so that a long
generation copies it only a few times and a short one never holds its worst case). Slots [0, length)
hold the committed sequence; the slots above are scratch space for the current draft tree. A forward
writes its keys and values at the slots it is given and attends under an explicit mask, so "rolling
back" a rejected branch costs nothing: it is simply never kept, and its slots are overwritten by the
next step. Keeping a prefix (`keep(arange(k))`) truncates the sequence for reuse by a later request.
"""

from __future__ import annotations

import inspect

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

from specexec.backends.base import SlotRunner, grown_capacity
from specexec.backends.torch.graphs import GraphedDecoder
from specexec.backends.torch.native import NativeDecoder, NativeUnsupported, zero_padded
from specexec.timing import clock


class _SlotLayer(CacheLayerMixin):
    """One layer's keys and values in a fixed buffer; writes go to the slots its `SlotCache` names."""

    def __init__(self, cache: SlotCache) -> None:
        super().__init__()
        self.cache = cache

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, k_dim = key_states.shape
        shape = (batch, heads, self.cache.capacity)
        self.keys = key_states.new_zeros((*shape, k_dim))  # (1, H_kv, capacity, D)
        self.values = value_states.new_zeros((*shape, value_states.shape[-1]))
        self.is_initialized = True

    def grow(self, capacity: int) -> None:
        if self.is_initialized:
            self.keys = zero_padded(self.keys, 2, capacity)
            self.values = zero_padded(self.values, 2, capacity)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        slots = self.cache.write_slots
        self.keys.index_copy_(2, slots, key_states)
        self.values.index_copy_(2, slots, value_states)
        width = self.cache.attend_width
        return self.keys[:, :, :width], self.values[:, :, :width]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.attend_width, 0

    def get_seq_length(self) -> int:
        return self.cache.attend_width  # positions are always given, so this is informational

    def get_max_length(self) -> int:
        return self.cache.capacity

    def gather(self, src: torch.Tensor, dst_start: int) -> None:
        if self.is_initialized:
            dst = slice(dst_start, dst_start + src.numel())
            self.keys[:, :, dst] = self.keys[:, :, src]  # advanced indexing copies first: overlap-safe
            self.values[:, :, dst] = self.values[:, :, src]


class SlotCache(Cache):
    """A transformers `Cache` whose writes land at explicit slots of preallocated per-layer buffers."""

    def __init__(self, num_layers: int, capacity: int) -> None:
        self.capacity = capacity
        self.write_slots = torch.zeros(0, dtype=torch.long)
        self.attend_width = 0
        super().__init__(layers=[_SlotLayer(self) for _ in range(num_layers)])


class HFForward:
    """A model's own Hugging Face forward over a `SlotCache`, for every model `NativeDecoder` cannot run."""

    def __init__(self, model: PreTrainedModel, capacity: int, slot_positions: torch.Tensor) -> None:
        self.model = model
        config = model.config.get_text_config()
        self.cache = SlotCache(config.num_hidden_layers, capacity)
        self.slot_positions = slot_positions  # the runner's, for sliding windows
        # Masks are additive, in the model's own dtype: eager attention adds them to the scores.
        self.mask_min = torch.finfo(model.dtype).min
        self.sliding_window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None) or []
        self.mixed_sliding = self.sliding_window is not None and "sliding_attention" in layer_types
        self.all_sliding = self.sliding_window is not None and not layer_types
        params = inspect.signature(model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        allowed: torch.Tensor,
        logits_to_keep: int | torch.Tensor,
    ) -> torch.Tensor:
        width = allowed.shape[1]
        self.cache.write_slots = slots
        self.cache.attend_width = width
        out = self.model(
            input_ids=tokens[None],
            position_ids=positions[None],
            attention_mask=self._masks(allowed, positions, width),
            use_cache=True,
            logits_to_keep=logits_to_keep,
            **{self.cache_kwarg: self.cache},
        )
        return out.logits[0]  # (m, V)

    def gather(self, src: torch.Tensor, dst_start: int) -> None:
        for layer in self.cache.layers:
            layer.gather(src, dst_start)

    def grow(self, capacity: int, slot_positions: torch.Tensor) -> None:
        self.cache.capacity = capacity
        self.slot_positions = slot_positions
        for layer in self.cache.layers:
            layer.grow(capacity)

    @property
    def nbytes(self) -> int:
        return sum(
            layer.keys.nbytes + layer.values.nbytes for layer in self.cache.layers if layer.is_initialized
        )

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s key and value buffers, (H_kv, capacity, D) each."""
        return self.cache.layers[layer].keys[0], self.cache.layers[layer].values[0]

    def _masks(self, allowed: torch.Tensor, positions: torch.Tensor, width: int):
        full = self._additive(allowed)
        if not (self.mixed_sliding or self.all_sliding):
            return full
        # Sliding-window layers see only keys less than `window` positions back, as in the model itself.
        distance = positions[:, None] - self.slot_positions[None, :width]  # (n, width)
        windowed = self._additive(allowed & (distance < self.sliding_window))
        if self.all_sliding:
            return windowed
        return {"full_attention": full, "sliding_attention": windowed}

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(allowed.shape, dtype=self.model.dtype, device=allowed.device)
        return mask.masked_fill_(~allowed, self.mask_min)[None, None]  # (1, 1, n, width)


class ModelRunner(SlotRunner):
    """Drives one causal LM over slot-addressed KV buffers: `reserve`, `extend`, `forward_tree`, `keep`.

    The forward is `NativeDecoder` where it supports the model (and `native` is not False), replayed
    from CUDA graphs on a GPU (`GraphedDecoder`), else the model's own Hugging Face forward (`HFForward`).
    """

    def __init__(self, model: PreTrainedModel, capacity: int, native: bool = True) -> None:
        self.model = model
        self.device = model.device
        self.capacity = capacity
        self.length = 0
        self.slot_positions = torch.zeros(capacity, dtype=torch.long, device=self.device)
        self.backend: NativeDecoder | HFForward = self._forward(native)
        self.forward_seconds = 0.0  # time inside the model's forward, for the stats' time split
        # A draft may have fewer embedding rows than the target's vocabulary; the ids it cannot read
        # only cost it accuracy (the target decides), so they are clamped instead of crashing.
        self.last_token_id = model.get_input_embeddings().num_embeddings - 1

    def _forward(self, native: bool) -> NativeDecoder | HFForward:
        if native:
            try:
                if self.device.type == "cuda":  # launching kernels one by one would leave the GPU idle
                    return GraphedDecoder(self.model, self.capacity)
                return NativeDecoder(self.model, self.capacity)
            except NativeUnsupported:
                pass
        return HFForward(self.model, self.capacity, self.slot_positions)

    @property
    def nbytes(self) -> int:
        """Memory this runner holds for its generation: its KV buffers."""
        return self.backend.nbytes

    def reserve(self, slots: int, most: int | None = None) -> None:
        """Make room for at least `slots` slots, keeping every slot's contents. Grows to twice the current
        capacity where that is more (but not past `most`), so a growing sequence is copied only a few
        times."""
        if slots <= self.capacity:
            return
        capacity = grown_capacity(self.capacity, slots, most)
        self.slot_positions = zero_padded(self.slot_positions, 0, capacity)
        if isinstance(self.backend, HFForward):
            self.backend.grow(capacity, self.slot_positions)
        else:
            self.backend.grow(capacity)
        self.capacity = capacity

    def extend(self, tokens: torch.Tensor, logits_to_keep: int | torch.Tensor = 1) -> torch.Tensor:
        """Append `tokens` (n,) to the committed sequence; returns logits (m, V) of the kept rows."""
        n = tokens.numel()
        start = self.length
        slots = torch.arange(start, start + n, device=self.device)  # (n,)
        width = start + n
        allowed = torch.arange(width, device=self.device)[None, :] <= slots[:, None]  # (n, width) causal
        logits = self.forward_tree(tokens, slots, slots, allowed, logits_to_keep)
        self.length = width
        return logits

    def forward_tree(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        allowed: torch.Tensor,
        logits_to_keep: int | torch.Tensor = 0,
    ) -> torch.Tensor:
        """Forward tokens (n,) at `positions` (n,) into KV `slots` (n,) where row i may attend to the slots
        j < width with allowed[i, j] (n, width). Does not change the committed length.

        Returns logits (m, V) for `logits_to_keep` (0 = all rows, k = last k rows, or a tensor of row
        indices).
        """
        width = allowed.shape[1]
        if width > self.capacity:
            raise RuntimeError(f"KV cache overflow: {width} > {self.capacity} slots")
        self.slot_positions[slots] = positions
        start = clock(self.device)
        tokens = tokens.clamp(max=self.last_token_id)
        logits = self.backend.forward(tokens, positions, slots, allowed, logits_to_keep)
        self.forward_seconds += clock(self.device) - start
        return logits

    def keep(self, slots: torch.Tensor, subtree: torch.Tensor | None = None) -> None:
        """Make the cache hold exactly `slots` (in order) at [0, len(slots)); the new committed length.
        `subtree`'s slots move right after them (`base.Runner.keep`)."""
        self.move(slots if subtree is None else torch.cat([slots, subtree]), 0)
        self.length = slots.numel()

    def move(self, src: torch.Tensor, dst_start: int) -> None:
        """Copy the KV of slots `src` (in order) to [dst_start, dst_start + len(src)); lengths unchanged."""
        dst = torch.arange(dst_start, dst_start + src.numel(), device=src.device)
        moved = (src != dst).nonzero()
        if not moved.numel():
            return
        first = int(moved[0])  # the part already in place is not copied
        src, dst_start = src[first:], dst_start + first
        self.backend.gather(src, dst_start)
        self.slot_positions[dst_start : dst_start + src.numel()] = self.slot_positions[src].clone()
