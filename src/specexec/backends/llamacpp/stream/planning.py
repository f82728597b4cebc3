"""Which units of a GGUF stay resident within `ram` bytes and which stream, and the read-ahead window they
need: pure, from the file's headers alone."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from specexec.backends.gguf_files import tensor_spans
from specexec.backends.llamacpp.library import LlamaCppError
from specexec.sizes import format_bytes

AHEAD = 2  # the window holds the unit computing and AHEAD more of the largest: reads overlap compute
EMBEDDING = "token_embd.weight"


@dataclass(frozen=True)
class Unit:
    """Tensors used together in a pass: one layer (`blk.N`), or the output head (with every other tensor
    outside the layers); `spans` their byte ranges in the file, adjacent tensors merged."""

    name: str
    spans: tuple[tuple[int, int], ...]
    layer: int | None  # the layer's index; None for the head

    @property
    def nbytes(self) -> int:
        return sum(end - start for start, end in self.spans)


@dataclass(frozen=True)
class Plan:
    """Which units stay resident, which stream, and the RAM they need (bytes)."""

    units: tuple[Unit, ...]  # in the order a pass uses them
    streamed: frozenset[str]
    embedding: tuple[int, int]  # the token embedding table's bytes in the file (gathered)

    @property
    def resident_bytes(self) -> int:
        return sum(u.nbytes for u in self.units if u.name not in self.streamed)

    @property
    def streamed_bytes(self) -> int:
        return sum(u.nbytes for u in self.units if u.name in self.streamed)

    @property
    def window_bytes(self) -> int:
        """The most streamed bytes held at once: the largest AHEAD + 1 units in a row."""
        return window(self.units, self.streamed)

    @property
    def ram_bytes(self) -> int:
        """What the weights may hold in RAM: the resident units and the read-ahead window."""
        return self.resident_bytes + self.window_bytes


def layout(gguf: Path) -> tuple[list[Unit], tuple[int, int]]:
    """The GGUF's units in pass order (layers by index, then the head) and the embedding table's bytes."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    embedding = (0, 0)
    tensors = tensor_spans(gguf)
    for tensor, span in tensors.items():
        if tensor == EMBEDDING:
            embedding = span
            continue
        name = ".".join(tensor.split(".")[:2]) if tensor.startswith("blk.") else "head"
        ranges.setdefault(name, []).append(span)
    if "output.weight" not in tensors:
        # The embedding table is also the output matrix: read whole at the end of every pass.
        ranges.setdefault("head", []).append(embedding)
        embedding = (0, 0)
    units = [
        Unit(name, _merged(spans), int(name.split(".")[1]) if name != "head" else None)
        for name, spans in ranges.items()
    ]
    units.sort(key=lambda u: (u.layer is None, u.layer or 0))
    return units, embedding


def _merged(spans: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1] + 32:  # tensors are 32-byte aligned
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return tuple(merged)


def window(units: tuple[Unit, ...] | list[Unit], streamed: frozenset[str] | set[str]) -> int:
    """The most streamed bytes in RAM at once: the largest AHEAD + 1 units in a row, counted across the
    end of a pass (the reader goes on into the next pass's first units). The reader fills it with as
    many units as fit: after a large unit, several small ones."""
    return window_over([u.nbytes for u in units if u.name in streamed])


def window_over(sizes: list[int]) -> int:
    """The read-ahead window over streamed units of `sizes` bytes, in pass order."""
    return _most_in_a_row(sizes, min(AHEAD + 1, len(sizes)))


def _most_in_a_row(sizes: list[int], count: int) -> int:
    """The largest sum of `count` consecutive `sizes`, the list read as a cycle."""
    cycle = sizes + sizes[: count - 1]
    return max((sum(cycle[i : i + count]) for i in range(len(sizes))), default=0)


def plan(gguf: Path, ram: int) -> Plan:
    """Keep resident what fits in `ram` bytes with the read-ahead window, the rest streamed.

    The units outside the layers (the output head) come first, largest first: the head is the largest
    unit, and a streamed unit also widens the window. Then as many layers as fit, spread evenly over
    the pass (`spread`): compute on a resident layer is time the reader reads ahead, which the leading
    layers, computed right after the window was filled, left idle (the default pair at 512MiB, paired
    in one process against the largest layers first: 6% faster on HumanEval, docs/benchmarks-history.md).
    `ram` 0: everything streams. A `ram` above 0 that cannot hold the read-ahead window is an error
    naming the minimum."""
    if not sys.platform.startswith("linux"):
        raise LlamaCppError("--ram needs Linux (it steers the page cache with madvise and fadvise)")
    units, embedding = layout(gguf)
    streamed = {u.name for u in units}
    minimum = _least(units)
    if 0 < ram < minimum:
        raise LlamaCppError(
            f"--ram {format_bytes(ram)} is below what {gguf.name} needs to run streamed: at least "
            f"{format_bytes(minimum)} (its read-ahead window), or 0 for the least"
        )

    def fits(rest: set[str]) -> bool:
        return sum(u.nbytes for u in units if u.name not in rest) + window(units, rest) <= ram

    for unit in sorted((u for u in units if u.layer is None), key=lambda u: -u.nbytes):
        if fits(streamed - {unit.name}):
            streamed -= {unit.name}
    layers = [u.name for u in units if u.layer is not None]
    for count in range(len(layers), 0, -1):
        if fits(rest := streamed - set(spread(layers, count))):
            streamed = rest
            break
    return Plan(tuple(units), frozenset(streamed), embedding)


def least_ram(gguf: Path) -> int:
    """The least a `ram` above 0 may be for `gguf`: its read-ahead window with everything streamed."""
    return _least(layout(gguf)[0])


def _least(units: list[Unit]) -> int:
    return window(units, {u.name for u in units})


def spread(items: list[str], count: int) -> list[str]:
    """`count` of `items` (count <= len(items)) spread evenly: the middle one of each of `count` equal
    stretches."""
    return [items[(2 * i + 1) * len(items) // (2 * count)] for i in range(count)]
