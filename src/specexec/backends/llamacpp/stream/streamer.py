"""`Streamer`: a streamed model's plan, its files as llama.cpp maps them, the reader and llama.cpp's eval
callback, tied together; it follows compute pass by pass."""

from __future__ import annotations

import atexit
import time
import weakref
from pathlib import Path

from specexec.backends.gguf_files import split
from specexec.backends.llamacpp.library import LlamaCppError
from specexec.backends.llamacpp.stream.callback import LayerEvents
from specexec.backends.llamacpp.stream.os_calls import PAGE, MappedFiles, inner, read_speed
from specexec.backends.llamacpp.stream.planning import Plan, Unit
from specexec.backends.llamacpp.stream.reader import Reader


class Streamer:
    """Streams a plan's units through llama.cpp's mappings at `bases` (see the package's docstring).

    The runner calls `begin` before and `end` after each `llama_decode`; llama.cpp's eval callback
    (`events`, made before the model was loaded) calls `layer_done` at each layer's output, which lets go
    of the layer at once (a few system calls), unless the reader is reading it right then: a read in
    flight would land after the drop and stay, so the reader lets go of it when its read is over. Where
    reads go past the page cache, `begin` and `layer_done` also wait until the next streamed unit is
    mapped in. Units are counted across passes (unit i of pass p is p * n + i), so the reader runs on into
    the next pass's first units while the draft works."""

    def __init__(self, gguf: Path, bases: tuple[int, ...], plan: Plan, events: LayerEvents) -> None:
        self.plan = plan
        self.gguf = gguf
        self.files = MappedFiles(gguf, bases)  # bases: where llama.cpp maps each file (`mapping_bases`)
        self._identity = self.files.stats()
        self.streamed = [u for u in plan.units if u.name in plan.streamed]
        self._by_layer = {u.layer: i for i, u in enumerate(self.streamed) if u.layer is not None}
        # Which streamed unit follows each layer, and opens the pass, if one does: compute waits for it
        # there when reads go past the page cache.
        index = {u.name: i for i, u in enumerate(self.streamed)}
        following = [index.get(u.name) for u in plan.units[1:]] + [None]
        self._next = {
            u.layer: f
            for u, f in zip(plan.units, following, strict=True)
            if u.layer is not None and f is not None
        }
        self._first = index.get(plan.units[0].name)
        self._last_layer = -1  # the last layer reported in this pass
        self.passes = 0  # passes ended
        # No readahead on page faults: the kernel's window (read_ahead_kb, 8 MiB on some disks) would read
        # into the next unit behind the reader's back, and land after that unit's drop. The reader asks
        # for exactly the units it reads.
        spans = [s for u in plan.units for s in u.spans] + ([plan.embedding] if plan.embedding[1] else [])
        self.files.advise_random(spans)
        self._drop_streamed_pages()
        self.disk_bytes_per_second = self._read_speed()
        self.reader = Reader(self.files, self.streamed)
        events.listener = self
        self.eval_callback = events.callback  # a context's `cb_eval`
        _open.add(self)

    @property
    def reads(self) -> str:
        """How streamed units are read: "direct" (past the page cache) or "cached" (through it)."""
        return self.reader.reads.kind

    def _drop_streamed_pages(self) -> None:
        """Out of RAM: the streamed units and the embedding table, which the load may have read in."""
        # Pages another mapping just let go of, or just written, can take a moment to become evictable.
        for wait in (0.0, 0.05, 0.2, 0.5):
            time.sleep(wait)
            for unit in self.streamed:
                self._drop_unit(unit)
            self.files.drop(*self.plan.embedding)
            pages = [inner(*s) for u in self.streamed for s in u.spans]
            if sum(self.resident(*s) for s in pages if s[1] > s[0]) <= sum(e - s for s, e in pages) // 10:
                return
        self.files.close()
        raise LlamaCppError(
            f"--ram cannot be kept: the pages of {self.gguf} do not leave RAM (is it mapped by another "
            "program, or still being written?)"
        )

    def _read_speed(self, most: int = 256 * 2**20) -> float:
        """The storage's sequential read speed, bytes per second (`os_calls.read_speed`), over up to
        `most` bytes of the streamed units in the first file that streams."""
        start = min(s[0] for u in self.streamed for s in u.spans) // PAGE * PAGE
        k = split(start)[0]
        end = min(start + most, max(e for u in self.streamed for s, e in u.spans if split(s)[0] == k))
        return read_speed(self.files, start, end)

    def populate_resident(self) -> None:
        """Read the resident units into RAM and map them (as at load)."""
        for unit in self.plan.units:
            if unit.name not in self.plan.streamed:
                for span in unit.spans:
                    self.files.populate(*span)

    def begin(self) -> None:
        self.reader.resume()
        if self.files.stats() != self._identity:
            raise LlamaCppError(f"{self.gguf} changed on disk during the run; load it again")
        if self.reader.failed is not None:
            raise LlamaCppError(f"reading {self.gguf} failed: {self.reader.failed}")
        self._last_layer = -1
        if self._first is not None:
            self._wait_ready(self._first)

    def layer_done(self, layer: int) -> None:
        if layer <= self._last_layer:
            # A new graph without `end` and `begin` between: llama.cpp split a batch (llama-cpp-python's
            # `eval` of a prompt longer than its batch). Its first units were computed from the file.
            self._pass_over()
        self._last_layer = layer
        index = self._by_layer.get(layer)
        if index is not None:
            self.reader.advance(self.passes * len(self.streamed) + index + 1)
        following = self._next.get(layer)
        if following is not None:
            self._wait_ready(following)

    def end(self) -> None:
        """After a pass: every unit of it is finished (the head has no layer output of its own), and the
        embedding rows it gathered are dropped."""
        self._pass_over()
        self._last_layer = -1
        self.files.drop(*self.plan.embedding)

    def _pass_over(self) -> None:
        self.passes += 1
        self.reader.advance(self.passes * len(self.streamed))

    def _wait_ready(self, index: int) -> None:
        """Wait until compute may read streamed unit `index` of this pass: read past the page cache, once
        it is mapped in (compute reading it from the file instead would fault it in a page at a time)."""
        self.reader.wait_ready(self.passes * len(self.streamed) + index)

    def release(self) -> None:
        """Between generations: nothing read ahead, every streamed unit out of RAM, until the next pass
        begins (the RAM is the other programs', and another model of the same file can run)."""
        self.reader.release()

    def settle(self) -> None:
        """Wait until the reader has read as far ahead as it may (for measurements)."""
        self.reader.settle()

    def resident(self, start: int, end: int) -> int:
        """Bytes of the file's start..end in the page cache (mincore over the mapping)."""
        return self.files.resident(start, end)

    def residency(self) -> tuple[int, int]:
        """(bytes of the resident units in RAM, bytes of the streamed units in RAM). Read past the page
        cache, the second counts all of the ring's memory in RAM, holding a unit mapped in or not
        (`DirectReads.in_ram`)."""
        kept = sum(
            self.resident(*s) for u in self.plan.units if u.name not in self.plan.streamed for s in u.spans
        )  # resident units are never remapped
        return kept, self.reader.in_ram()

    def close(self) -> None:
        if self.reader.close():
            self.files.close()

    def _drop_unit(self, unit: Unit) -> None:
        for span in unit.spans:
            self.files.drop(*span)


_open: weakref.WeakSet[Streamer] = weakref.WeakSet()


@atexit.register
def _close_open_streamers() -> None:
    """At exit, before the interpreter freezes daemon threads: a reader frozen in the middle of a read
    would never let `release` (a runner's last act) return, and the process would hang."""
    for streamer in list(_open):
        streamer.close()


def restore_resident(gguf: Path) -> None:
    """Read back the resident units of every open streamer of `gguf` (after `os_calls.evict`)."""
    for streamer in list(_open):
        if streamer.gguf.samefile(gguf):
            streamer.populate_resident()
