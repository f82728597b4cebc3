"""The system calls streaming makes: where llama.cpp mapped the GGUF (/proc/self/maps), reading pages in and
letting them go (madvise, posix_fadvise), O_DIRECT reads into memory of our own mapped over llama.cpp's
(`Ring`), and which pages are in RAM (mincore). Offsets are `specexec.backends.gguf_files`' global ones,
which name the file of a split GGUF too."""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from pathlib import Path

import numpy as np

from specexec.backends.gguf_files import file_tensor_spans, shards, split
from specexec.backends.llamacpp.library import LlamaCppError

PAGE = mmap.PAGESIZE
# <asm-generic/mman-common.h>, <bits/mman-linux.h>
MADV_RANDOM, MADV_WILLNEED, MADV_DONTNEED, MADV_REMOVE, MADV_POPULATE_READ = 1, 3, 4, 9, 22
PROT_READ, PROT_WRITE, MAP_SHARED, MAP_FIXED, MAP_POPULATE = 1, 2, 0x01, 0x10, 0x8000
MAP_FAILED = ctypes.c_void_p(-1).value
READ_CHUNK = 2**22  # bytes per readahead request (4 MiB, within the kernel's usual limits)

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


# -- llama.cpp's mappings ---------------------------------------------------------------------------------


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


class MappedFiles:
    """The GGUF's files as llama.cpp maps them: a descriptor of our own for each (`shards`) and where its
    mapping puts the file's byte 0 (`mapping_bases`). Takes global offsets."""

    def __init__(self, gguf: Path, bases: tuple[int, ...]) -> None:
        self.paths = shards(gguf)
        self.bases = bases
        self.fds = [os.open(path, os.O_RDONLY) for path in self.paths]

    def local(self, start: int, end: int) -> tuple[int, int, int, int]:
        """(mapping base, fd, start, end) of the global start..end in its file."""
        k, local = split(start)
        return self.bases[k], self.fds[k], local, local + end - start

    def populate(self, start: int, end: int) -> None:
        populate(*self.local(start, end))

    def drop(self, start: int, end: int) -> None:
        drop(*self.local(start, end))

    def resident(self, start: int, end: int) -> int:
        """Bytes of the file's start..end in the page cache (mincore over the mapping)."""
        base, _, start, end = self.local(start, end)
        first, last = start // PAGE * PAGE, -(-end // PAGE) * PAGE
        return pages_in_ram(base + first, last - first)

    def advise_random(self, spans: list[tuple[int, int]]) -> None:
        """No readahead on page faults over `spans`, in each file from the first to the last."""
        for k, base in enumerate(self.bases):
            local = [self.local(*s)[2:] for s in spans if split(s[0])[0] == k]
            if local:  # a file may hold metadata only
                first, last = (
                    min(s for s, _ in local) // PAGE * PAGE,
                    -(-max(e for _, e in local) // PAGE) * PAGE,
                )
                _libc.madvise(base + first, last - first, MADV_RANDOM)

    def stats(self) -> list[tuple[int, int]]:
        """Each file's size and modification time: a file changed on disk is an error."""
        return [(stat.st_size, stat.st_mtime_ns) for stat in map(os.fstat, self.fds)]

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


# -- pages in, pages out ----------------------------------------------------------------------------------


def inner(start: int, end: int) -> tuple[int, int]:
    """The pages wholly inside start..end (a page shared with a neighbour is not)."""
    return -(-start // PAGE) * PAGE, end // PAGE * PAGE


def edges(start: int, end: int) -> list[tuple[int, int]]:
    """The pages start..end shares with a neighbour (all of its pages if it has no whole one)."""
    first, last = start // PAGE * PAGE, -(-end // PAGE) * PAGE
    inner_first, inner_last = inner(start, end)
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
    first, last = inner(start, end)
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


def read_speed(files: MappedFiles, start: int, end: int) -> float:
    """The storage's sequential read speed, bytes per second, over the global start..end (page-aligned,
    in one file): read with O_DIRECT (past the page cache, as `dd iflag=direct` does), 16 MiB a request;
    where O_DIRECT is refused, read into the page cache as the reader does, and dropped after."""
    k = split(start)[0]
    block = mmap.mmap(-1, 16 * 2**20)  # page-aligned, as O_DIRECT needs
    try:
        fd = os.open(files.paths[k], os.O_RDONLY | os.O_DIRECT)
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
    files.populate(start, end)
    seconds = time.perf_counter() - begin
    files.drop(start, end)
    return (end - start) / max(seconds, 1e-9)


# -- reads past the page cache ----------------------------------------------------------------------------


class Ring:
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
