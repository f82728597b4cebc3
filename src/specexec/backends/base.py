"""What the engine, drafters, policies, benchmark and server ask of a model runtime: the `Model` and
`Runner` protocols. Nothing above `specexec.backends` knows which runtime it drives.

A runner is one generation's view of one model: its KV cache addressed by slot. Slots [0, length) hold
the committed sequence; the slots above are scratch space for the current draft tree. A forward writes
its keys and values at the slots it is given and attends under an explicit mask, so "rolling back" a
rejected branch costs nothing: it is never kept, and its slots are overwritten by the next step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from specexec.backends.options import Given, LoadOptions


@runtime_checkable
class Runner(Protocol):
    """One model over one generation's slot-addressed KV cache."""

    device: torch.device
    length: int  # committed tokens held in slots [0, length)
    capacity: int  # slots it holds now (`reserve` grows it)
    forward_seconds: float  # time inside the model's forwards, for the statistics' time split
    skipped: int

    @property
    def nbytes(self) -> int:
        """Memory this runner holds for its generation (KV cache and working buffers)."""

    @property
    def read(self) -> int:
        """Committed tokens accounted for: in slots, or skipped."""

    def slot(self, index: int) -> int:
        """The slot of committed token `index`."""

    def skip(self, tokens: int) -> None:
        """Count the next `tokens` committed tokens as read without storing them."""

    def reserve(self, slots: int, most: int | None = None) -> None:
        """Make room for at least `slots` slots, keeping every slot's contents (at most `most`)."""

    def extend(self, tokens: torch.Tensor, logits_to_keep: int | torch.Tensor = 1) -> torch.Tensor:
        """Append `tokens` (n,) to the committed sequence; logits (m, V) of the kept rows."""

    def forward_tree(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        allowed: torch.Tensor,
        logits_to_keep: int | torch.Tensor = 0,
    ) -> torch.Tensor:
        """Forward tokens (n,) at `positions` into KV `slots` where row i attends to slot j < width with
        allowed[i, j] (n, width); logits (m, V) for `logits_to_keep` (0 all, k last k, or row indices)."""

    def keep(self, slots: torch.Tensor, subtree: torch.Tensor | None = None) -> None:
        """Make the cache hold exactly `slots` (in order) at [0, len(slots)): the new committed length.
        `subtree`: tree slots below the last kept one (ascending, ancestor-closed) whose KV moves to the
        slots right after it, where the next step's tree, rooted at that last slot, finds them."""

    def keep_prefix(self, tokens: int) -> None:
        """Keep the cache of the first `tokens` committed tokens only."""

    def move(self, src: torch.Tensor, dst_start: int) -> None:
        """Copy the KV of slots `src` (in order) to [dst_start, dst_start + len(src))."""

    def share_cpu(self, shared: bool) -> None:
        """While `shared`, forwards run beside another model's pass (fewer threads where that helps)."""

    def idle(self) -> None:
        """Its generation was released: let go of what only forwards need (a streamed model's read-ahead
        window) until the next forward; the cache stays."""


@runtime_checkable
class Runtime(Protocol):
    """What a runtime subpackage of `specexec.backends` exposes (`backends.backend(name)`)."""

    LABEL: str  # its name in messages
    WEIGHTS: str  # "gguf" (loads a GGUF file) or "folder" (a Hugging Face folder)
    # The keys of the load options it takes (`LoadOptions`' metadata: "dtype", "offload", "quant", "ram",
    # "gguf_quant" for a `quant` of GGUF_QUANTS, ...); the options without a key every runtime takes
    OPTIONS: tuple[str, ...]
    MAX_TREE_LEAVES: int | None  # the most leaves one forward verifies (None: any tree)

    def unavailable(self) -> str | None:
        """Why it cannot run here (its library is not installed), if it cannot."""

    def refusal(self, given: list[Given]) -> str | None:
        """Why it cannot load with the options `given` (`LoadOptions.given`), if it cannot."""

    def load(self, path: Path, options: LoadOptions) -> Model:
        """The model at `path` (a GGUF file or a folder, as WEIGHTS says), loaded as `options` ask."""

    def default_draft_vocab(self, vocab_size: int) -> int:
        """The ids `--draft-vocab auto` keeps (0: the whole head)."""

    def default_draft_quant(self, streamed_target: bool) -> str:
        """A draft's quantization where none is asked for, beside a target streamed from disk or not."""


@runtime_checkable
class StreamingRuntime(Runtime, Protocol):
    """A runtime with "ram" in OPTIONS: it streams a model's weights from disk."""

    def least_ram(self, path: Path) -> int:
        """The least RAM above 0 the model at `path` streams in."""


@runtime_checkable
class Model(Protocol):
    """A loaded model as the engine sees it, whatever runtime holds its weights."""

    device: torch.device
    runtime: str  # its runtime's name, for messages ("llama.cpp")

    @property
    def vocab_size(self) -> int:
        """Token ids it reads and scores: [0, vocab_size)."""

    @property
    def context_window(self) -> int | None:
        """The longest sequence it was trained for, None where it states none."""

    @property
    def max_tree_leaves(self) -> int | None:
        """The most leaves one forward can verify (None: no limit of its own)."""

    def eos_token_ids(self) -> list[int]:
        """The end-of-sequence ids its own metadata lists."""

    @property
    def weights(self) -> str:
        """What its weights are, for reports ("bfloat16", "qwen2 1.5B Q4_K - Medium")."""

    @property
    def quantization(self) -> str:
        """The low-bit form its weights were converted to at load (one of QUANT_MODES or GGUF_QUANTS; "none"
        where it runs them as stored)."""

    @property
    def cost_label(self) -> str:
        """What changes its forward costs beyond its weights, for people ("" for nothing)."""

    def cost_key(self) -> str:
        """What its forward costs depend on (weights, kernels, threads, device, offloading): calibrations
        are kept per pair of keys."""

    def memory(self) -> WeightsMemory | None:
        """Where its weights are when part of them is read from storage on every pass (`--ram`); None
        when they are all in memory."""

    def placement(self) -> str:
        """Where its layers run beyond this process, for the stats line and the server log ("" where all
        run here)."""

    def make_runner(self, capacity: int, trees: bool = True) -> Runner:
        """A runner of `capacity` slots to start with. `trees=False` says the generation expects plain
        one-token steps (a runtime may then start smaller and grow at its first tree)."""


@dataclass(frozen=True)
class WeightsMemory:
    """A model whose weights do not all stay in RAM: what stays, what is read from storage every pass,
    measured where it says so."""

    resident: int  # bytes of weights kept in RAM
    streamed: int  # bytes read from storage on every pass
    window: int  # the most streamed bytes held at once (read ahead of compute)
    in_ram: int  # bytes of the weights in RAM now (measured)
    disk_bytes_per_second: float  # sequential read speed of the weights' storage (measured at load)

    def describe(self) -> str:
        """One line for the stats line and the server log."""
        return (
            f"weights {self.resident / 2**20:.0f} MiB resident, {self.streamed / 2**20:.0f} MiB streamed "
            f"per pass (read-ahead window {self.window / 2**20:.0f} MiB, disk "
            f"{self.disk_bytes_per_second / 1e9:.2f} GB/s)"
        )


class SlotRunner:
    """What every runner shares: the committed sequence in slots [0, `length`), each at its slot's
    position, less any committed tokens it was told to `skip`.

    A draft catching up after many plain steps reads only the latest tokens: the others are left out of
    its cache for good, and it reads the text as if they had never been there (positions stay
    consecutive, as llama.cpp requires). The target never skips.
    """

    length: int
    device: torch.device
    skipped = 0  # committed tokens left out of the cache
    cut = 0  # the slot where the first of them were left out

    @property
    def read(self) -> int:
        """Committed tokens accounted for: in slots, or skipped."""
        return self.length + self.skipped

    def slot(self, index: int) -> int:
        """The slot of committed token `index`, one read after the last skip (a tree root, say)."""
        return index - self.skipped

    def skip(self, tokens: int) -> None:
        """Count the next `tokens` committed tokens as read without storing them."""
        if tokens > 0 and not self.skipped:
            self.cut = self.length
        self.skipped += tokens

    def keep_prefix(self, tokens: int) -> None:
        """Keep the cache of the first `tokens` committed tokens only (fewer where it holds fewer, or
        skipped some of them), for a new sequence that shares them."""
        kept = min(tokens, self.cut if self.skipped else self.length)
        self.keep(torch.arange(kept, device=self.device))
        self.skipped = 0

    def keep(self, slots: torch.Tensor, subtree: torch.Tensor | None = None) -> None:
        raise NotImplementedError

    def share_cpu(self, shared: bool) -> None:
        """Torch sizes its thread pool per process, not per model: nothing to change."""

    def idle(self) -> None:
        """Nothing held for forwards beyond the cache."""


def grown_capacity(capacity: int, slots: int, most: int | None) -> int:
    """The capacity a runner grows to for `slots`: at least twice `capacity` (never past `most`), so a
    growing sequence is copied only a few times."""
    doubled = 2 * capacity if most is None else min(2 * capacity, most)
    return max(slots, doubled)


PREFILL_CHUNK = 512  # tokens per forward when catching up on many: bounds the mask, allows cancelling


def prefill(runner: Runner, tokens: torch.Tensor, cancelled: Callable[[], bool] | None = None) -> bool:
    """Append `tokens` (n,) to `runner`'s committed sequence, PREFILL_CHUNK at a time. Returns False if
    `cancelled()` turned true between two chunks (what was prefilled stays)."""
    for first in range(0, tokens.numel(), PREFILL_CHUNK):
        runner.extend(tokens[first : first + PREFILL_CHUNK])
        if cancelled is not None and cancelled():
            return False
    return True


class BackendError(ValueError):
    """A runtime cannot do what was asked (an option it lacks, a model it cannot run, missing hardware);
    the message says why in one line."""
