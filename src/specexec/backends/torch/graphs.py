"""CUDA graphs for the native forward: the GPU computes a small model's pass in a few milliseconds, but
launching its few hundred kernels one by one from Python costs the CPU about 25 ms (measured on an H200,
docs/benchmarks.md), so without graphs the GPU mostly waits. `GraphedDecoder` captures `NativeDecoder`'s
layers once per block size and replays them.

A graph's shapes are fixed, so a block of n tokens runs as the next size in BLOCK_SIZES, attending over
every slot of the KV buffer. The padding rows write their keys and values into one scratch slot past the
usable ones and attend to it alone, so they change nothing a real row reads; their output is dropped.
Blocks larger than the largest size (prompt prefills) run eagerly. The final norm and LM head run
outside the graph, on the kept rows only.

`capture=False` runs the same padded forward without graphs, on any device: that is how the CPU tests
check the padding. If a capture fails, the decoder warns once and runs eagerly from then on.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from specexec.backends.torch.native import NativeDecoder

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass
class _Block:
    """One padded block size's static inputs and output, and its graph (None: run eagerly)."""

    tokens: torch.Tensor  # (b,)
    positions: torch.Tensor  # (b,)
    slots: torch.Tensor  # (b,)
    allowed: torch.Tensor  # (b, slots in the buffer)
    hidden: torch.Tensor | None = None  # (b, C), the graph's output
    graph: torch.cuda.CUDAGraph | None = None


class GraphedDecoder(NativeDecoder):
    """`NativeDecoder` with its blocks of up to BLOCK_SIZES[-1] tokens replayed from CUDA graphs."""

    def __init__(self, model: PreTrainedModel, capacity: int, capture: bool | None = None) -> None:
        super().__init__(model, capacity + 1)  # the last slot: the padding rows' scratch
        self.capture = model.device.type == "cuda" if capture is None else capture
        self.blocks: dict[int, _Block] = {}
        self.pool = None  # one memory pool for every graph of this decoder
        self.replays = 0

    @property
    def scratch(self) -> int:
        return self.keys.shape[2] - 1

    @torch.inference_mode()  # the static buffers are written in place, whatever mode the caller is in
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        allowed: torch.Tensor,
        logits_to_keep: int | torch.Tensor,
    ) -> torch.Tensor:
        """Logits (m, V) of the kept rows; tokens, positions and slots (n,), allowed (n, width)."""
        n, width = allowed.shape
        size = next((b for b in BLOCK_SIZES if b >= n), None)
        if size is None:
            return super().forward(tokens, positions, slots, allowed, logits_to_keep)
        block = self.blocks.get(size) or self._block(size)
        block.tokens[:n] = tokens
        block.positions[:n] = positions
        block.slots[:n] = slots
        block.allowed[:n, :width] = allowed
        block.allowed[:n, width:] = False
        self._pad(block, n)
        if block.graph is not None:
            block.graph.replay()
            self.replays += 1
            hidden = block.hidden
        else:
            hidden = self.hidden(block.tokens, block.positions, block.slots, block.allowed)
        return self.logits(hidden[:n], logits_to_keep)

    def _pad(self, block: _Block, n: int) -> None:
        """Rows n.. of `block` become padding: token 0 at position 0, into and over the scratch slot."""
        block.tokens[n:] = 0
        block.positions[n:] = 0
        block.slots[n:] = self.scratch
        block.allowed[n:] = False
        block.allowed[n:, self.scratch] = True

    def _block(self, size: int) -> _Block:
        device = self.keys.device
        index = torch.zeros(size, dtype=torch.long, device=device)
        allowed = torch.zeros(size, self.scratch + 1, dtype=torch.bool, device=device)
        block = _Block(index, index.clone(), index.clone(), allowed)
        self._pad(block, 0)
        if self.capture:
            try:
                self._capture(block)
            except RuntimeError as err:
                warnings.warn(f"CUDA graph capture failed, running eagerly: {err}", stacklevel=2)
                self.capture = False
                block.graph = block.hidden = None
        self.blocks[size] = block
        return block

    def _capture(self, block: _Block) -> None:
        """Warm up on a side stream (the documented way), then capture; every row is padding meanwhile,
        so both only write the scratch slot."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.hidden(block.tokens, block.positions, block.slots, block.allowed)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            block.hidden = self.hidden(block.tokens, block.positions, block.slots, block.allowed)
        self.pool = graph.pool()
        block.graph = graph

    def grow(self, capacity: int) -> None:
        """Room for `capacity` usable slots; graphs captured over the old buffers are dropped."""
        super().grow(capacity + 1)
        self.blocks.clear()
        self.pool = None  # a pool outlives no graph of its own: the next captures start a fresh one
