"""The reader: a thread of ours that reads streamed units ahead of compute, as many as fit in the read-ahead
window with the one computing, and lets go of each as soon as compute is done with it (`Streamer` says how
far compute got). Units are counted across passes (unit i of pass p is p * n + i), so the reader runs on
into the next pass's first units while the draft works.

It reads one of two ways (`open_reads`), behind one interface (`Reads`):

- `DirectReads`, where the file system takes O_DIRECT: a unit is read past the page cache into a `Ring`
  of our own, mapped over the unit's pages in llama.cpp's mapping once read whole (compute waits for it
  at the layer before), and the file is mapped back there when compute is done;
- `PageCacheReads` elsewhere: `posix_fadvise(WILLNEED)` to queue large reads, `madvise(MADV_POPULATE_READ)`
  to wait for them and map them, and `madvise(MADV_DONTNEED)` then `posix_fadvise(DONTNEED)` to drop them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

from specexec.backends.llamacpp.stream.os_calls import (
    MappedFiles,
    Ring,
    edges,
    inner,
    map_read,
    request_reads,
)
from specexec.backends.llamacpp.stream.planning import Unit, window_over

Pieces = list[tuple[int, int, int]]  # (global offset, ring offset, bytes) of a unit mapped in
Pages = list[tuple[int, int]]  # (start, end) of a unit's whole pages, global offsets


class Reads(Protocol):
    """One way of reading units in and letting them go. Methods marked "locked" run holding the reader's
    condition, which the reads share."""

    kind: str  # "direct" or "cached": what a calibration's cost key records
    failed: OSError | None  # a read or a mapping failed: the next pass stops with it

    def blocked(self, g: int) -> bool:
        """Locked: whether unit g cannot be read yet, though it fits in the window."""

    def claim(self, g: int, last: int) -> object:
        """Locked: what reading unit g needs reserved; `last` is the last unit that may be read now (g, or
        the next one where it fits too)."""

    def read(self, g: int, claim: object) -> object:
        """Read unit g into RAM, mapped where compute reads it; the outcome for `record`."""

    def record(self, g: int, outcome: object, late: bool) -> None:
        """Locked: the read of unit g is over; `late` if compute finished it meanwhile."""

    def ready(self, g: int) -> bool:
        """Locked: whether compute may read unit g without waiting for the reader."""

    def let_go(self, g: int) -> bool:
        """Compute is done with unit g: whether its pages may be dropped now."""

    def held(self) -> list[int]:
        """The units mapped in, compute not done with them."""

    def restart(self, done: int) -> None:
        """Locked: nothing read ahead; the next read is unit `done`."""

    def wait_queued(self) -> None:
        """The reader is paused: wait for reads queued and not yet mapped in to land, so that dropping
        their units drops them."""

    def empty(self) -> None:
        """Nothing read ahead: give back what holds no unit."""

    def in_ram(self, in_page_cache: Callable[[], int]) -> int:
        """Bytes of the streamed units in RAM, `in_page_cache()` counting their pages in llama.cpp's
        mapping."""

    def close(self) -> None: ...


class PageCacheReads:
    """Units read through the page cache: compute reads a unit's pages from the file as it goes, mapped in
    by then or faulted in."""

    kind = "cached"
    failed = None

    def __init__(self, files: MappedFiles, streamed: list[Unit]) -> None:
        self.files = files
        self.streamed = streamed
        self._requested = -1  # the last unit whose reads are queued
        self._queued: set[int] = set()  # units whose reads are queued, not yet mapped in

    def blocked(self, g: int) -> bool:
        return False

    def claim(self, g: int, last: int) -> tuple[int, int]:
        # Queue the next unit's reads too, so the disk has work while this one is mapped in.
        first, self._requested = max(self._requested + 1, g), max(self._requested, last)
        return first, last

    def read(self, g: int, claim: tuple[int, int]) -> None:
        n = len(self.streamed)
        first, last = claim
        for queued in range(first, last + 1):
            for span in self.streamed[queued % n].spans:
                _, fd, start, end = self.files.local(*span)
                request_reads(fd, start, end)
            self._queued.add(queued)
        self._map_in(g)

    def _map_in(self, g: int) -> None:
        for span in self.streamed[g % len(self.streamed)].spans:
            base, _, start, end = self.files.local(*span)
            map_read(base, start, end)
        self._queued.discard(g)

    def record(self, g: int, outcome: None, late: bool) -> None:
        pass

    def ready(self, g: int) -> bool:
        return True

    def let_go(self, g: int) -> bool:
        return True

    def held(self) -> list[int]:
        return []

    def restart(self, done: int) -> None:
        self._requested = done - 1

    def wait_queued(self) -> None:
        # The page cache keeps a page still being read when told to drop it: the kernel reads the queued
        # pages whatever we do, so wait for them (no more disk reads) and let the drop that follows work.
        for g in sorted(self._queued):
            self._map_in(g)

    def empty(self) -> None:
        pass

    def in_ram(self, in_page_cache: Callable[[], int]) -> int:
        return in_page_cache()

    def close(self) -> None:
        pass


class DirectReads:
    """Units read past the page cache into `ring` and mapped over their whole pages; their edge pages
    (shared with a neighbour) through the page cache."""

    kind = "direct"

    def __init__(
        self,
        ring: Ring,
        files: MappedFiles,
        streamed: list[Unit],
        pages: list[Pages],
        cond: threading.Condition,
    ) -> None:
        self.ring = ring
        self.files = files
        self.streamed = streamed
        self._pages = pages  # each streamed unit's whole pages
        self._page_bytes = [_nbytes(unit) for unit in pages]
        self._cond = cond
        self.failed: OSError | None = None
        self._mapped = 0  # every unit before this one was mapped in (or skipped)
        self._pieces: dict[int, Pieces] = {}  # each unit mapped in
        self._remapping = 0  # mappings in or out under way
        self._remaps = 0  # mappings in or out done

    def blocked(self, g: int) -> bool:
        return self.failed is not None or self.ring.free_bytes() < self._page_bytes[g % len(self.streamed)]

    def claim(self, g: int, last: int) -> int:
        """Room in the ring for unit g (a unit at a time: room for the next is taken when it is read)."""
        return self.ring.take(g, self._page_bytes[g % len(self.streamed)])

    def read(self, g: int, start: int) -> tuple[Pieces, OSError | None, bool]:
        """Read unit g's whole pages into the ring from `start` on and map them in, its edge pages through
        the page cache: (pieces, the error if one failed, whether a mapping in began)."""
        unit = self.streamed[g % len(self.streamed)]
        mapping = False
        try:
            pieces = self.ring.read(start, self._pages[g % len(self.streamed)])
            for span in unit.spans:
                for edge in edges(*span):
                    self.files.populate(*edge)
            with self._cond:
                self._remapping += 1
            mapping = True
            self.ring.map_in(self.files.bases, pieces)
        except OSError as error:
            return [], error, mapping
        return pieces, None, mapping

    def record(self, g: int, outcome: tuple[Pieces, OSError | None, bool], late: bool) -> None:
        pieces, failed, mapping = outcome
        self.failed = self.failed or failed
        self._pieces[g] = pieces
        if not late and failed is None:
            self._mapped = max(self._mapped, g + 1)
        if mapping:
            self._remapped()

    def ready(self, g: int) -> bool:
        # Compute reading it from the file instead would fault it in a page at a time.
        return self._mapped > g or self.failed is not None

    def let_go(self, g: int) -> bool:
        """The file mapped back over unit g first; on failure its ring bytes stay mapped, so they are never
        read into again, and its pages stay."""
        with self._cond:
            pieces = self._pieces.pop(g, None)
            self._remapping += 1
        try:
            self.ring.map_out(self.files.bases, self.files.fds, pieces or [])
        except OSError as error:
            with self._cond:
                self.failed = error
                self._remapped()
            return False
        with self._cond:
            self.ring.give_back(g)
            self._remapped()
        return True

    def held(self) -> list[int]:
        with self._cond:
            return list(self._pieces)

    def restart(self, done: int) -> None:
        self._mapped = done

    def wait_queued(self) -> None:
        pass  # the reader reads a unit whole before it maps it in: nothing is left in flight

    def empty(self) -> None:
        if not self._pieces:
            self.ring.empty()

    def in_ram(self, in_page_cache: Callable[[], int]) -> int:
        """All of the ring's memory in RAM, holding a unit mapped in or not, and the pages of units mapped
        in once only: counted between two mappings in or out, retried otherwise (a unit being mapped in or
        out is in both places at once)."""
        while True:
            with self._cond:
                settled, remaps = self._remapping == 0, self._remaps
                mapped_in = sum(n for pieces in self._pieces.values() for _, _, n in pieces)
            if settled:
                streamed = in_page_cache() + self.ring.in_ram() - mapped_in
                with self._cond:
                    if self._remapping == 0 and self._remaps == remaps:
                        return streamed
            time.sleep(0.0005)

    def close(self) -> None:
        self.ring.close()

    def _remapped(self) -> None:
        """A mapping in or out is over and recorded (called holding the condition)."""
        self._remapping -= 1
        self._remaps += 1
        self._cond.notify_all()


def open_reads(
    files: MappedFiles, streamed: list[Unit], pages: list[Pages], window: int, cond: threading.Condition
) -> Reads:
    """`DirectReads` into a ring of `window` bytes, for the units in RAM at once, or `PageCacheReads` where
    the file system refuses O_DIRECT."""
    try:
        if window:
            return DirectReads(Ring(files.paths, window), files, streamed, pages, cond)
    except (OSError, AttributeError):  # AttributeError: no os.memfd_create (a C library before 2.27)
        pass
    return PageCacheReads(files, streamed)


def _nbytes(pages: Pages) -> int:
    return sum(end - start for start, end in pages)


class Reader:
    """The thread reading `streamed` units (in pass order) of `files` ahead of compute."""

    def __init__(self, files: MappedFiles, streamed: list[Unit]) -> None:
        self.files = files
        self.streamed = streamed
        # Each streamed unit's whole pages: what a ring holds, and what the window is counted over.
        pages = [[p for p in (inner(*s) for s in u.spans) if p[1] > p[0]] for u in streamed]
        self._page_bytes = [_nbytes(unit) for unit in pages]
        self._window = window_over(self._page_bytes)  # over the units' whole pages (a ring's size)
        self._cond = threading.Condition()
        self.reads = open_reads(files, streamed, pages, self._window, self._cond)
        self._done = 0  # units finished by compute, counted across passes
        self._read = 0  # units read ahead
        self._reading: int | None = None  # the unit the reader is reading
        self._drop_after_read = False  # compute finished it meanwhile: the reader drops it
        self._closed = False
        self._paused = True  # read nothing ahead until the first pass begins, or after `release`
        self._thread = threading.Thread(target=self._work, name="specexec-stream", daemon=True)
        self._thread.start()

    @property
    def failed(self) -> OSError | None:
        return self.reads.failed

    def resume(self) -> None:
        """A pass begins: read ahead again after `release`."""
        with self._cond:
            if self._paused:
                self._paused = False
                self._cond.notify_all()

    def wait_ready(self, g: int) -> None:
        """Wait until compute may read unit g (see `Reads.ready`)."""
        with self._cond:
            self._cond.wait_for(lambda: self.reads.ready(g) or self._done > g or self._closed or self._paused)

    def advance(self, done: int) -> None:
        """Compute finished every unit before `done`: drop those it had not, but the one being read."""
        with self._cond:
            first, self._done = self._done, max(self._done, done)
            finished = range(first, self._done)
            if self._reading in finished:
                self._drop_after_read = True
            finished = [g for g in finished if g != self._reading]
            self._cond.notify_all()
        for g in finished:
            self.finish(g)

    def finish(self, g: int) -> None:
        """Compute is done with unit g: out of RAM."""
        if self.reads.let_go(g):
            self._drop_unit(self.streamed[g % len(self.streamed)])

    def release(self) -> None:
        """Nothing read ahead, every streamed unit out of RAM, until the next pass begins."""
        with self._cond:
            if self._closed:
                return
            self._paused = True
            self._cond.wait_for(lambda: self._reading is None or self._closed)
            self._read = self._done
            self.reads.restart(self._done)
        self.reads.wait_queued()
        for g in self.reads.held():
            self.finish(g)
        for unit in self.streamed:
            self._drop_unit(unit)
        self.reads.empty()

    def settle(self) -> None:
        """Wait until the reader has read as far ahead as it may (for measurements)."""
        with self._cond:
            # Judged afresh, not by the reader's last look: a unit let go of since may have freed room.
            self._cond.wait_for(lambda: self._closed or (self._reading is None and self._waiting()))

    def in_ram(self) -> int:
        """Bytes of the streamed units in RAM."""
        return self.reads.in_ram(lambda: sum(self.files.resident(*s) for u in self.streamed for s in u.spans))

    def close(self) -> bool:
        """Stop the thread and let go of what it holds; False if it was closed already."""
        with self._cond:
            if self._closed:
                return False
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        for g in self.reads.held():
            self.finish(g)
        self.reads.close()
        return True

    def _fits(self, g: int) -> bool:
        """Whether unit g may be read now: it and the units before it not yet finished by compute fit in
        the read-ahead window, and no unit is held twice (two passes' copies)."""
        n = len(self.streamed)
        if g >= self._done + n:
            return False
        held = sum(self._page_bytes[u % n] for u in range(self._done, g + 1))
        return held <= self._window

    def _next(self) -> int:
        """The unit to read next: a unit compute got to first is not worth reading now (the next pass
        reads it)."""
        return max(self._read, self._done)

    def _waiting(self) -> bool:
        g = self._next()
        return self._paused or not self._fits(g) or self.reads.blocked(g)

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._closed and self._waiting():
                    self._cond.wait()
                if self._closed:
                    return
                g = self._reading = self._next()
                self._read = g + 1
                last = self._read if self._fits(self._read) and not self._paused else g
                claim = self.reads.claim(g, last)
            outcome = self.reads.read(g, claim)
            with self._cond:
                late, self._drop_after_read = self._drop_after_read, False
                self.reads.record(g, outcome, late)
                if not late:
                    self._reading = None
                self._cond.notify_all()
            if late:  # compute finished it from the file meanwhile; reading until it is dropped
                self.finish(g)
                with self._cond:
                    self._reading = None
                    self._cond.notify_all()

    def _drop_unit(self, unit: Unit) -> None:
        for span in unit.spans:
            self.files.drop(*span)
