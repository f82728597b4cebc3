"""Running a GGUF target in less RAM than its weights: what does not fit is read from disk on every pass.

llama.cpp maps the GGUF read-only and its CPU kernels read the weights straight from the mapping (with
repacking off: `use_extra_bufts = False`, else some tensor types are copied into anonymous memory, which
cannot be streamed). Left to the page cache, its LRU evicts each page just before the next pass needs
it. `Streamer` decides instead, in units of one layer (`blk.N`) plus the output head:

- **resident** units stay in the page cache (populated at load, never dropped): the head, then layers
  spread evenly over the pass (`plan`);
- **streamed** units are read ahead of compute by a thread of ours, as many as fit in the read-ahead
  window (the bytes of the largest `AHEAD` + 1 units in a row) with the one computing, and let go of
  as soon as llama.cpp's eval callback reports the layer's output; after a pass the reader reads the
  next pass's first units into the whole window while the draft works (with a large output head, many
  layers). Where the file system takes O_DIRECT (`_Ring`), a unit is read past the page cache into
  memory of our own, mapped over the unit's pages in llama.cpp's mapping once read whole (compute waits
  for it at the layer before), and the file is mapped back there when compute is done. Elsewhere it
  goes through the page cache: `posix_fadvise(WILLNEED)` to queue large reads,
  `madvise(MADV_POPULATE_READ)` to wait for them and map them, and `madvise(MADV_DONTNEED)` then
  `posix_fadvise(DONTNEED)` to drop them;
- the token embedding table is gathered a few rows a pass: it is never read ahead, and the rows a pass
  touched are dropped after it.

A split GGUF (NAME-00001-of-0000N.gguf and its siblings, which llama.cpp maps one by one) is streamed as
one model: offsets here are `specexec.backends.gguf_files`'s global ones, which name the file too.

Neither way can change a result: a unit's addresses hold the file's bytes at all times, mapped from the
file (read again if touched again) or from a copy read whole. The file is checked before every pass: one
that changed on disk is an error (`LlamaCppError`), since the kernels would be handed other weights.
"""

from __future__ import annotations

import atexit
import ctypes
import mmap
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specexec.backends.gguf_files import file_tensor_spans, shards, split, tensor_spans
from specexec.backends.llamacpp.library import LlamaCppError, tensor_name
from specexec.sizes import format_bytes

PAGE = mmap.PAGESIZE
AHEAD = 2  # the window holds the unit computing and AHEAD more of the largest: reads overlap compute
# <asm-generic/mman-common.h>, <bits/mman-linux.h>
MADV_RANDOM, MADV_WILLNEED, MADV_DONTNEED, MADV_REMOVE, MADV_POPULATE_READ = 1, 3, 4, 9, 22
PROT_READ, PROT_WRITE, MAP_SHARED, MAP_FIXED, MAP_POPULATE = 1, 2, 0x01, 0x10, 0x8000
MAP_FAILED = ctypes.c_void_p(-1).value
EMBEDDING = "token_embd.weight"
READ_CHUNK = 2**22  # bytes per readahead request (4 MiB, within the kernel's usual limits)
LAYER_OUTPUT = b"l_out-"  # llama.cpp names each layer's output "l_out-<layer>" (llama-graph.cpp, `cb`)

# This process's C library (`plan` refuses systems other than Linux before any call).
_libc = ctypes.CDLL(None, use_errno=True) if os.name == "posix" else None
if _libc is not None:
    _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    _libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    _libc.mmap.restype = ctypes.c_void_p
    _int = ctypes.c_int
    _libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, _int, _int, _int, ctypes.c_long)
    _libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    _libc.pread.restype = ctypes.c_ssize_t
    _libc.pread.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long)


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
    return _window([u.nbytes for u in units if u.name in streamed])


def _window(sizes: list[int]) -> int:
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
    in one process against the largest layers first: 6% faster on HumanEval, docs/benchmarks.md).
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


def mapping_bases(gguf: Path, before: set[str]) -> tuple[int, ...]:
    """For each of the GGUF's files (`shards`), the address where llama.cpp's mapping of it would put the
    file's byte 0 (it maps from the tensor data's page on), found in /proc/self/maps among the lines not
    in `before` (the maps read before loading: the same file may be mapped twice)."""
    bases = []
    new = mapped() - before
    for path in shards(gguf):
        found = _mappings_of(path, new)
        if found:
            start, _, offset = found[0]
            bases.append(start - offset)
        elif file_tensor_spans(path):
            raise LlamaCppError(f"llama.cpp did not map {path}; it cannot be streamed")
        else:  # metadata only (`llama-gguf-split --no-tensor-first-split`): never mapped, never used
            bases.append(0)
    return tuple(bases)


def mapped() -> set[str]:
    """The lines of /proc/self/maps: what this process has mapped."""
    with open("/proc/self/maps") as maps:
        return set(maps)


def _mappings_of(gguf: Path, lines: set[str]) -> list[tuple[int, int, int]]:
    """(start, end, file offset) of each line of /proc/self/maps that maps `gguf`, found by inode (an
    overlay filesystem's maps name another device than `stat` does)."""
    inode = gguf.stat().st_ino
    found = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and int(fields[4]) == inode:
            start, end = (int(address, 16) for address in fields[0].split("-"))
            found.append((start, end, int(fields[2], 16)))
    return found


def _inner(start: int, end: int) -> tuple[int, int]:
    """The pages wholly inside start..end (a page shared with a neighbour is not)."""
    return -(-start // PAGE) * PAGE, end // PAGE * PAGE


def _edges(start: int, end: int) -> list[tuple[int, int]]:
    """The pages start..end shares with a neighbour (all of its pages if it has no whole one)."""
    first, last = start // PAGE * PAGE, -(-end // PAGE) * PAGE
    inner_first, inner_last = _inner(start, end)
    if inner_last <= inner_first:
        return [(first, last)]
    return [(a, b) for a, b in ((first, inner_first), (inner_last, last)) if b > a]


def request_reads(fd: int, start: int, end: int) -> None:
    """Queue asynchronous reads of the file's start..end into the page cache (the kernel reads at most its
    readahead size, read_ahead_kb, per request)."""
    for chunk in range(start, end, READ_CHUNK):
        os.posix_fadvise(fd, chunk, min(READ_CHUNK, end - chunk), os.POSIX_FADV_WILLNEED)


def map_read(base: int, start: int, end: int) -> None:
    """Wait for the file's start..end to be read and map it into the mapping at `base`."""
    first, last = start // PAGE * PAGE, -(-end // PAGE) * PAGE
    if _libc.madvise(base + first, last - first, MADV_POPULATE_READ) != 0:
        _libc.madvise(base + first, last - first, MADV_WILLNEED)  # kernels before 5.14


def populate(base: int, fd: int, start: int, end: int) -> None:
    """Read the file's start..end into the page cache and map it into the mapping at `base`."""
    request_reads(fd, start, end)
    map_read(base, start, end)


def pages_in_ram(address: int, nbytes: int) -> int:
    """Bytes of the pages at address..address + nbytes (page-aligned) that are in RAM (mincore)."""
    vec = (ctypes.c_ubyte * (nbytes // PAGE))()
    if _libc.mincore(address, nbytes, vec) != 0:
        return 0
    return int(np.count_nonzero(np.frombuffer(vec, np.uint8) & 1)) * PAGE


def drop(base: int, fd: int, start: int, end: int) -> None:
    """Evict the file's pages wholly inside start..end from RAM: unmap them from the mapping at `base`,
    then drop them from the page cache."""
    first, last = _inner(start, end)
    if last > first:
        _libc.madvise(base + first, last - first, MADV_DONTNEED)
        os.posix_fadvise(fd, first, last - first, os.POSIX_FADV_DONTNEED)


def evict(gguf: Path) -> None:
    """Evict every page of `gguf` from RAM: plain llama.cpp short of memory, whose LRU evicts each page
    before the next pass needs it (the bench). Every mapping of the file in this process lets go of its
    pages first (a page still mapped stays in the page cache), a streamed model's resident units too:
    `restore_resident` reads those back."""
    for path in shards(gguf):
        for start, end, _ in _mappings_of(path, mapped()):
            _libc.madvise(start, end - start, MADV_DONTNEED)  # clean file pages: read again if touched
        fd = os.open(path, os.O_RDONLY)  # for the call only
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def restore_resident(gguf: Path) -> None:
    """Read back the resident units of every open streamer of `gguf` (after `evict`)."""
    for streamer in list(_open):
        if streamer.gguf.samefile(gguf):
            streamer.populate_resident()


class _Ring:
    """Where streamed units are read when the file system takes O_DIRECT: past the page cache, into shared
    memory of our own (a memfd, `size` bytes used as a ring), which is then mapped over the unit's pages
    in llama.cpp's mapping (MAP_FIXED), until compute is done with it and the file is mapped back there.

    The page cache's way costs CPU for every 4 KiB page: read ahead, mapped, unmapped and dropped, 0.17-0.19
    s of CPU per 504 MiB on a 2-core VM, while O_DIRECT into memory that stays allocated, then mapping it
    in and out, took 0.08 s, and read faster (benchmarks/read_paths.py, docs/bigger-than-ram.md). The
    unit's addresses always hold its bytes: the file's, or the ring's once they are read whole. Only
    whole pages are mapped over; a page shared with a neighbouring unit stays the file's."""

    def __init__(self, files: tuple[Path, ...], size: int) -> None:
        self.size = size
        self.fds: list[int] = []  # one per file of the GGUF (`shards`)
        self.memfd = -1
        self.address = 0
        try:
            for path in files:
                self.fds.append(os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC))
            self.memfd = os.memfd_create("specexec-stream", os.MFD_CLOEXEC)
            os.ftruncate(self.memfd, size)
            address = _libc.mmap(None, size, PROT_READ | PROT_WRITE, MAP_SHARED, self.memfd, 0)
            if address in (None, MAP_FAILED):
                raise OSError(ctypes.get_errno(), "cannot map the read buffer")
            self.address = address
            # A file system may accept O_DIRECT at open and refuse it at the first read (EINVAL).
            if _libc.pread(self.fds[0], self.address, PAGE, 0) < 0:
                raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        except OSError:
            self.close()
            raise
        self.head = 0  # bytes handed out since the start, ring positions modulo `size`
        self.placed: dict[int, int] = {}  # unit (counted across passes) -> where its bytes start

    def free_bytes(self) -> int:
        tail = min(self.placed.values(), default=self.head)
        return self.size - (self.head - tail)

    def take(self, g: int, nbytes: int) -> int:
        """Room for unit g's `nbytes` (the caller made sure there is): where its bytes start."""
        self.placed[g], self.head = self.head, self.head + nbytes
        return self.placed[g]

    def give_back(self, g: int) -> None:
        self.placed.pop(g, None)

    def read(self, start: int, pages: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
        """Read the page ranges `pages` (global offsets) into the ring from `start` on: (global offset, ring
        offset, bytes) for each piece contiguous in both."""
        pieces: list[tuple[int, int, int]] = []
        at = start
        for first, last in pages:
            offset = first
            while offset < last:
                position = at % self.size
                n = min(last - offset, self.size - position, READ_CHUNK)
                k, local = split(offset)
                got = _libc.pread(self.fds[k], self.address + position, n, local)
                if got != n:
                    error = ctypes.get_errno() if got < 0 else 0
                    raise OSError(error, f"read {got} of {n} bytes at {offset}: {os.strerror(error)}")
                last_offset, last_position, last_n = pieces[-1] if pieces else (-1, -1, 0)
                if last_offset + last_n == offset and last_position + last_n == position:
                    pieces[-1] = (last_offset, last_position, last_n + n)
                else:
                    pieces.append((offset, position, n))
                offset += n
                at += n
        return pieces

    def map_in(self, bases: tuple[int, ...], pieces: list[tuple[int, int, int]]) -> None:
        """Map the ring's pieces over the files' pages in their mappings at `bases`."""
        for offset, position, n in pieces:
            k, local = split(offset)
            flags = MAP_SHARED | MAP_FIXED | MAP_POPULATE
            at = bases[k] + local
            if _libc.mmap(at, n, PROT_READ, flags, self.memfd, position) != at:
                raise OSError(ctypes.get_errno(), "cannot map read pages into llama.cpp's mapping")

    @staticmethod
    def map_out(bases: tuple[int, ...], fds: list[int], pieces: list[tuple[int, int, int]]) -> None:
        """Map the files (`fds`) back where `pieces` were mapped in, as llama.cpp mapped them."""
        for offset, _, n in pieces:
            k, local = split(offset)
            at = bases[k] + local
            if _libc.mmap(at, n, PROT_READ, MAP_SHARED | MAP_FIXED, fds[k], local) != at:
                raise OSError(ctypes.get_errno(), "cannot map the file back into llama.cpp's mapping")
            _libc.madvise(at, n, MADV_RANDOM)

    def empty(self) -> None:
        """Free the ring's memory (read into again, it is allocated again)."""
        _libc.madvise(self.address, self.size, MADV_REMOVE)

    def in_ram(self) -> int:
        """Bytes of the ring in RAM."""
        return pages_in_ram(self.address, self.size)

    def close(self) -> None:
        if self.address:
            _libc.munmap(self.address, self.size)
            self.address = 0
        for fd in (*self.fds, self.memfd):
            if fd >= 0:
                os.close(fd)
        self.fds, self.memfd = [], -1


class Streamer:
    """Streams a plan's units through llama.cpp's mapping at `base` (see the module's docstring).

    The runner calls `begin` before and `end` after each `llama_decode`; llama.cpp's eval callback calls
    `layer_done` at each layer's output, which lets go of the layer at once (a few system calls), unless
    the reader is reading it right then: a read in flight would land after the drop and stay, so the
    reader lets go of it when its read is over. With a ring, `begin` and `layer_done` also wait until the
    next streamed unit is mapped in. Units are counted across passes (unit i of pass p is p * n + i), so
    the reader runs on into the next pass's first units while the draft works."""

    def __init__(self, gguf: Path, bases: tuple[int, ...], plan: Plan) -> None:
        self.plan = plan
        self.gguf = gguf
        self.files = shards(gguf)
        self.bases = bases  # where llama.cpp maps each file (`mapping_bases`)
        self.fds = [os.open(path, os.O_RDONLY) for path in self.files]
        self._identity = self._stats()
        self.streamed = [u for u in plan.units if u.name in plan.streamed]
        self._by_layer = {u.layer: i for i, u in enumerate(self.streamed) if u.layer is not None}
        # Each streamed unit's whole pages (what a ring holds), and which streamed unit follows each layer,
        # and opens the pass, if one does: compute waits for it there when reads go through a ring.
        self._pages = [[p for p in (_inner(*s) for s in u.spans) if p[1] > p[0]] for u in self.streamed]
        self._page_bytes = [sum(e - s for s, e in pages) for pages in self._pages]
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
        self._done = 0  # units finished by compute, counted across passes
        self._read = 0  # units read ahead
        self._requested = -1  # the last unit whose reads are queued
        self._reading: int | None = None  # the unit the reader is reading
        self._mapped = 0  # with a ring: every unit before this one was mapped in (or skipped)
        self._pieces: dict[int, list[tuple[int, int, int]]] = {}  # with a ring: each unit mapped in
        self._failed: OSError | None = None  # a read or a mapping of the ring failed
        self._drop_after_read = False  # compute finished it meanwhile: the reader drops it
        self._remapping = 0  # ring mappings in or out under way
        self._remaps = 0  # ring mappings in or out done
        self._cond = threading.Condition()
        self._closed = False
        self._paused = True  # read nothing ahead until the first pass begins, or after `release`
        self._idle = False  # the reader has read as far ahead as it may
        # No readahead on page faults: the kernel's window (read_ahead_kb, 8 MiB on some disks) would read
        # into the next unit behind the reader's back, and land after that unit's drop. The reader asks
        # for exactly the units it reads.
        spans = [s for u in plan.units for s in u.spans] + ([plan.embedding] if plan.embedding[1] else [])
        for k, base in enumerate(bases):
            local = [self._local(*s)[2:] for s in spans if split(s[0])[0] == k]
            if local:  # a file may hold metadata only
                first, last = (
                    min(s for s, _ in local) // PAGE * PAGE,
                    -(-max(e for _, e in local) // PAGE) * PAGE,
                )
                _libc.madvise(base + first, last - first, MADV_RANDOM)
        # Pages another mapping just let go of, or just written, can take a moment to become evictable.
        for wait in (0.0, 0.05, 0.2, 0.5):
            time.sleep(wait)
            for unit in self.streamed:
                self._drop_unit(unit)
            self._drop(*plan.embedding)
            inner = [_inner(*s) for u in self.streamed for s in u.spans]
            if sum(self.resident(*s) for s in inner if s[1] > s[0]) <= sum(e - s for s, e in inner) // 10:
                break
        else:
            for fd in self.fds:
                os.close(fd)
            raise LlamaCppError(
                f"--ram cannot be kept: the pages of {gguf} do not leave RAM (is it mapped by another "
                "program, or still being written?)"
            )
        self.disk_bytes_per_second = self._read_speed()
        self._window = _window(self._page_bytes)  # the window over the units' whole pages (a ring's size)
        self.ring = self._open_ring()
        self.eval_callback = eval_callback(self)  # a context's `cb_eval`
        self._reader = threading.Thread(target=self._work, name="specexec-stream", daemon=True)
        self._reader.start()
        _open.add(self)

    def _read_speed(self, most: int = 256 * 2**20) -> float:
        """The storage's sequential read speed, bytes per second: up to `most` bytes of the streamed
        units read with O_DIRECT (past the page cache, as `dd iflag=direct` does), 16 MiB a request;
        where O_DIRECT is refused, read into the page cache as the reader does, and dropped after."""
        start = min(s[0] for u in self.streamed for s in u.spans) // PAGE * PAGE
        k = split(start)[0]  # in the first file that streams
        end = min(start + most, max(e for u in self.streamed for s, e in u.spans if split(s)[0] == k))
        block = mmap.mmap(-1, 16 * 2**20)  # page-aligned, as O_DIRECT needs
        try:
            fd = os.open(self.files[k], os.O_RDONLY | os.O_DIRECT)
        except OSError:
            fd = None
        begin = time.perf_counter()
        try:
            if fd is not None:
                first, last = split(start)[1], split(end)[1]
                offset = first
                while offset < last and (n := os.preadv(fd, [block], offset)) > 0:
                    offset += n
                return (offset - first) / max(time.perf_counter() - begin, 1e-9)
        except OSError:
            pass
        finally:
            if fd is not None:
                os.close(fd)
        self._populate(start, end)
        seconds = time.perf_counter() - begin
        self._drop(start, end)
        return (end - start) / max(seconds, 1e-9)

    def _open_ring(self) -> _Ring | None:
        """A ring for the units in RAM at once, or None where the file system refuses O_DIRECT (the
        reader then reads through the page cache)."""
        try:
            return _Ring(self.files, self._window) if self._window else None
        except (OSError, AttributeError):  # AttributeError: no os.memfd_create (a C library before 2.27)
            return None

    def populate_resident(self) -> None:
        """Read the resident units into RAM and map them (as at load)."""
        for unit in self.plan.units:
            if unit.name not in self.plan.streamed:
                for span in unit.spans:
                    self._populate(*span)

    def begin(self) -> None:
        with self._cond:
            if self._paused:
                self._paused, self._idle = False, False
                self._cond.notify_all()
        if self._stats() != self._identity:
            raise LlamaCppError(f"{self.gguf} changed on disk during the run; load it again")
        if self._failed is not None:
            raise LlamaCppError(f"reading {self.gguf} failed: {self._failed}")
        self._last_layer = -1
        if self._first is not None:
            self._wait_mapped(self._first)

    def layer_done(self, layer: int) -> None:
        if layer <= self._last_layer:
            # A new graph without `end` and `begin` between: llama.cpp split a batch (llama-cpp-python's
            # `eval` of a prompt longer than its batch). Its first units were computed from the file.
            self._pass_over()
        self._last_layer = layer
        index = self._by_layer.get(layer)
        if index is not None:
            self._advance(self.passes * len(self.streamed) + index + 1)
        following = self._next.get(layer)
        if following is not None:
            self._wait_mapped(following)

    def end(self) -> None:
        """After a pass: every unit of it is finished (the head has no layer output of its own), and the
        embedding rows it gathered are dropped."""
        self._pass_over()
        self._last_layer = -1
        self._drop(*self.plan.embedding)

    def _pass_over(self) -> None:
        self.passes += 1
        self._advance(self.passes * len(self.streamed))

    def _wait_mapped(self, index: int) -> None:
        """With a ring, wait until streamed unit `index` of this pass is mapped in: compute reading it from
        the file instead would fault it in a page at a time."""
        if self.ring is None:
            return
        g = self.passes * len(self.streamed) + index
        with self._cond:
            self._cond.wait_for(
                lambda: self._mapped > g or self._done > g or self._failed or self._closed or self._paused
            )

    def release(self) -> None:
        """Between generations: nothing read ahead, every streamed unit out of RAM, until the next pass
        begins (the RAM is the other programs', and another model of the same file can run)."""
        with self._cond:
            if self._closed:
                return
            self._paused = True
            self._cond.wait_for(lambda: self._reading is None or self._closed)
            self._read, self._requested, self._mapped = self._done, self._done - 1, self._done
            mapped = list(self._pieces)
        for g in mapped:
            self._finish(g)
        for unit in self.streamed:
            self._drop_unit(unit)
        if self.ring is not None and not self._pieces:
            self.ring.empty()

    def settle(self) -> None:
        """Wait until the reader has read as far ahead as it may (for measurements)."""
        with self._cond:
            self._cond.wait_for(lambda: self._idle or self._closed)

    def _advance(self, done: int) -> None:
        """Compute finished every unit before `done`: drop those it had not, but the one being read."""
        with self._cond:
            first, self._done = self._done, max(self._done, done)
            finished = range(first, self._done)
            if self._reading in finished:
                self._drop_after_read = True
            finished = [g for g in finished if g != self._reading]
            self._idle = False
            self._cond.notify_all()
        for g in finished:
            self._finish(g)

    def _finish(self, g: int) -> None:
        """Compute is done with unit g: out of RAM (with a ring, the file mapped back over it first)."""
        if self.ring is not None:
            with self._cond:
                pieces = self._pieces.pop(g, None)
                self._remapping += 1
            try:
                self.ring.map_out(self.bases, self.fds, pieces or [])
            except OSError as error:  # its ring bytes stay mapped, so they are never read into again
                with self._cond:
                    self._failed = error
                    self._remapped()
                return
            with self._cond:
                self.ring.give_back(g)
                self._remapped()
        self._drop_unit(self.streamed[g % len(self.streamed)])

    def _fits(self, g: int) -> bool:
        """Whether unit g may be read now: it and the units before it not yet finished by compute fit in
        the read-ahead window, and no unit is held twice (two passes' copies)."""
        n = len(self.streamed)
        if g >= self._done + n:
            return False
        held = sum(self._page_bytes[u % n] for u in range(self._done, g + 1))
        return held <= self._window

    def _work(self) -> None:
        n = len(self.streamed)

        def waiting() -> bool:
            if self._paused or not self._fits(self._read):
                return True
            return self.ring is not None and (
                self._failed is not None or self.ring.free_bytes() < self._page_bytes[self._read % n]
            )

        while True:
            with self._cond:
                # A unit compute got to first is not worth reading now; the next pass reads it.
                self._read = max(self._read, self._done)
                while not self._closed and waiting():
                    self._idle = True
                    self._cond.notify_all()
                    self._cond.wait()
                    self._read = max(self._read, self._done)
                if self._closed:
                    return
                g = self._reading = self._read
                self._read += 1
                if self.ring is not None:
                    start = self.ring.take(g, self._page_bytes[g % n])
                else:
                    # Queue the next unit's reads too, so the disk has work while this one is mapped in.
                    ahead = self._read if self._fits(self._read) and not self._paused else g
                    first, self._requested = max(self._requested + 1, g), max(self._requested, ahead)
            if self.ring is not None:
                self._read_into_ring(g, start)
                continue
            for g in range(first, ahead + 1):
                for span in self.streamed[g % n].spans:
                    _, fd, start, end = self._local(*span)
                    request_reads(fd, start, end)
            unit = self.streamed[self._reading % n]
            for span in unit.spans:
                base, _, start, end = self._local(*span)
                map_read(base, start, end)
            with self._cond:
                late, self._drop_after_read, self._reading = self._drop_after_read, False, None
                self._cond.notify_all()
            if late:
                self._drop_unit(unit)

    def _read_into_ring(self, g: int, start: int) -> None:
        """Read unit g's whole pages past the page cache and map them in; its edge pages (shared with a
        neighbour) through the page cache."""
        unit = self.streamed[g % len(self.streamed)]
        mapping = False
        try:
            pieces = self.ring.read(start, self._pages[g % len(self.streamed)])
            for span in unit.spans:
                for edge in _edges(*span):
                    self._populate(*edge)
            with self._cond:
                self._remapping += 1
            mapping = True
            self.ring.map_in(self.bases, pieces)
        except OSError as error:
            pieces, failed = [], error
        else:
            failed = None
        with self._cond:
            late, self._drop_after_read, self._reading = self._drop_after_read, False, None
            self._failed = self._failed or failed
            self._pieces[g] = pieces
            if not late and failed is None:
                self._mapped = max(self._mapped, g + 1)
            if mapping:
                self._remapped()
            self._cond.notify_all()
        if late:  # compute finished it from the file meanwhile
            self._finish(g)

    def _drop_unit(self, unit: Unit) -> None:
        for span in unit.spans:
            self._drop(*span)

    def _local(self, start: int, end: int) -> tuple[int, int, int, int]:
        """(mapping base, fd, start, end) of the global start..end in its file."""
        k, local = split(start)
        return self.bases[k], self.fds[k], local, local + end - start

    def _stats(self) -> list[tuple[int, int]]:
        """Each file's size and modification time: a file changed on disk is an error."""
        return [(stat.st_size, stat.st_mtime_ns) for stat in map(os.fstat, self.fds)]

    def _populate(self, start: int, end: int) -> None:
        populate(*self._local(start, end))

    def _drop(self, start: int, end: int) -> None:
        drop(*self._local(start, end))

    def resident(self, start: int, end: int) -> int:
        """Bytes of the file's start..end in the page cache (mincore over the mapping)."""
        base, _, start, end = self._local(start, end)
        first, last = start // PAGE * PAGE, -(-end // PAGE) * PAGE
        return pages_in_ram(base + first, last - first)

    def _remapped(self) -> None:
        """A ring mapping in or out is over and recorded (called holding `_cond`)."""
        self._remapping -= 1
        self._remaps += 1
        self._cond.notify_all()

    def residency(self) -> tuple[int, int]:
        """(bytes of the resident units in RAM, bytes of the streamed units in RAM). With a ring, the
        second counts all of the ring's memory in RAM, holding a unit mapped in or not, and the pages of
        units mapped in once only: counted between two mappings in or out, retried otherwise (a unit
        being mapped in or out is in both places at once)."""
        kept = sum(
            self.resident(*s) for u in self.plan.units if u.name not in self.plan.streamed for s in u.spans
        )  # resident units are never remapped
        while True:
            with self._cond:
                settled, remaps = self._remapping == 0, self._remaps
                mapped_in = sum(n for pieces in self._pieces.values() for _, _, n in pieces)
            if settled:
                streamed = sum(self.resident(*s) for u in self.streamed for s in u.spans)
                if self.ring is not None:
                    streamed += self.ring.in_ram() - mapped_in
                with self._cond:
                    if self._remapping == 0 and self._remaps == remaps:
                        return kept, streamed
            time.sleep(0.0005)

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._reader.join()
        if self.ring is not None:
            for g in list(self._pieces):
                self._finish(g)
            self.ring.close()
        for fd in self.fds:
            os.close(fd)


_open: weakref.WeakSet[Streamer] = weakref.WeakSet()


@atexit.register
def _close_open_streamers() -> None:
    """At exit, before the interpreter freezes daemon threads: a reader frozen in the middle of a read
    would never let `release` (a runner's last act) return, and the process would hang."""
    for streamer in list(_open):
        streamer.close()


def eval_callback(streamer: Streamer):
    """llama.cpp's eval callback (a context's `cb_eval`) telling `streamer` (anything with `layer_done`)
    of each layer's output. It holds the streamer, not the model, so the model is freed when its last
    user lets go."""
    import llama_cpp

    def on_eval(tensor: int, ask: bool, user_data: int) -> bool:
        name = tensor_name(tensor)
        if ask:
            return name.startswith(LAYER_OUTPUT)
        streamer.layer_done(int(name[len(LAYER_OUTPUT) :]))
        return True  # go on computing

    return llama_cpp.ggml_backend_sched_eval_callback(on_eval)
