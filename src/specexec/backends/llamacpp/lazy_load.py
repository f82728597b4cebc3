"""Loading a streamed target without reading its whole file first.

llama.cpp maps a GGUF with `MAP_POPULATE` and then advises `MADV_WILLNEED` over the whole mapping
(llama-mmap.cpp, `llama_mmap`: prefetch is on for every load on Linux; seen with strace on 0.3.36):
the kernel reads every byte of the file at load. For a target streamed from disk that is one read of
all the weights that `--ram` said would not fit, pushing other programs' pages (and the resident part)
out on the way, before the streamer drops them again (the default 1.5B target at --ram 0: 1.1 GB
read at load, of which nothing stays).

`unpopulated()` turns both off while llama.cpp loads: it points libllama's own entries for `mmap`,
`madvise` and `posix_madvise` (its global offset table, the slots the dynamic linker fills) at wrappers
that drop `MAP_POPULATE` and `WILLNEED`, and puts the entries back after. Nothing else changes: the
mapping is the same, and the streamer reads the resident units in itself (`Streamer.populate_resident`).
Where the entries cannot be found (another libc, a statically linked build), llama.cpp loads as it
would, and a streamed load reads the whole file once, as before.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

MAP_POPULATE = 0x8000
WILLNEED = 3  # MADV_WILLNEED and POSIX_MADV_WILLNEED on Linux
PROT_READ, PROT_WRITE = 1, 2
# Relocations that fill a pointer slot with a function's address: GLOB_DAT and JUMP_SLOT (x86-64, AArch64)
_SLOT_RELOCATIONS = {6, 7, 1025, 1026}
_SHT_RELA, _SHT_DYNSYM = 4, 11

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_MMAP = ctypes.CFUNCTYPE(
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
)
_ADVISE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_real_mmap = _MMAP(("mmap", _libc))
_real_madvise = _ADVISE(("madvise", _libc))
_real_posix_madvise = _ADVISE(("posix_madvise", _libc))


@_MMAP
def _mmap_lazily(address, length, prot, flags, fd, offset):
    return _real_mmap(address, length, prot, flags & ~MAP_POPULATE, fd, offset)


@_ADVISE
def _madvise_but_willneed(address, length, advice):
    return 0 if advice == WILLNEED else _real_madvise(address, length, advice)


@_ADVISE
def _posix_madvise_but_willneed(address, length, advice):
    return 0 if advice == WILLNEED else _real_posix_madvise(address, length, advice)


_WRAPPERS = {
    b"mmap": _mmap_lazily,
    b"mmap64": _mmap_lazily,
    b"madvise": _madvise_but_willneed,
    b"posix_madvise": _posix_madvise_but_willneed,
}


@contextmanager
def unpopulated(library: Path | None) -> Iterator[None]:
    """While the block runs, the shared library `library` (libllama) maps files without MAP_POPULATE and
    its WILLNEED advice does nothing (where its entries are found: else it loads as it would)."""
    slots = _slots(library) if library is not None else []
    saved = []
    try:
        for slot, wrapper in slots:
            saved.append((slot, _swap(slot, ctypes.cast(wrapper, ctypes.c_void_p).value)))
        yield
    finally:
        for slot, original in reversed(saved):
            _swap(slot, original)


def _swap(slot: int, value: int) -> int:
    """Write the pointer at `slot`, making its page writable meanwhile; return what it held."""
    page = slot // mmap.PAGESIZE * mmap.PAGESIZE
    protection = _protection(slot)
    if not protection & PROT_WRITE and _libc.mprotect(page, mmap.PAGESIZE, protection | PROT_WRITE) != 0:
        raise OSError(ctypes.get_errno(), "mprotect failed on libllama's offset table")
    cell = ctypes.c_void_p.from_address(slot)
    old, cell.value = cell.value, value
    if not protection & PROT_WRITE:
        _libc.mprotect(page, mmap.PAGESIZE, protection)
    return old


def _protection(address: int) -> int:
    """The protection of the mapping holding `address` (/proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            start, end = (int(x, 16) for x in span.split("-"))
            if start <= address < end:
                return (PROT_READ if perms[0] == "r" else 0) | (PROT_WRITE if perms[1] == "w" else 0)
    raise OSError(f"no mapping holds {address:#x}")


def _slots(library: Path) -> list[tuple[int, object]]:
    """(address, wrapper) of each of the library's slots for a function in _WRAPPERS, in this process."""
    base = _load_base(library)
    if base is None:
        return []
    try:
        image = library.read_bytes()
        return [(base + offset, _WRAPPERS[name]) for offset, name in _relocations(image) if name in _WRAPPERS]
    except (OSError, struct.error, IndexError, ValueError):
        return []


def _load_base(library: Path) -> int | None:
    """Where the library's first loadable segment (virtual address 0 in a shared object) is mapped."""
    try:
        inode = library.stat().st_ino
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                if len(fields) >= 6 and int(fields[4]) == inode and int(fields[2], 16) == 0:
                    return int(fields[0].split("-")[0], 16)
    except (OSError, ValueError):
        pass
    return None


def _relocations(image: bytes) -> list[tuple[int, bytes]]:
    """(slot offset, symbol name) of every pointer-slot relocation of a little-endian ELF64 image."""
    if image[:4] != b"\x7fELF" or image[4] != 2 or image[5] != 1:
        return []
    (shoff,) = struct.unpack_from("<Q", image, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", image, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", image, shoff + i * shentsize) for i in range(shnum)]
    found = []
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != _SHT_RELA or sections[link][1] != _SHT_DYNSYM:
            continue
        symbols, names = sections[link][4], sections[sections[link][6]][4]
        for at in range(offset, offset + size, entsize or 24):
            slot, info, _ = struct.unpack_from("<QQq", image, at)
            if info & 0xFFFFFFFF not in _SLOT_RELOCATIONS:
                continue
            (name_at,) = struct.unpack_from("<I", image, symbols + (info >> 32) * 24)
            start = names + name_at
            found.append((slot, image[start : image.index(b"\0", start)]))
    return found


def libllama_path() -> Path | None:
    """The libllama llama-cpp-python loaded, where it says."""
    import llama_cpp

    lib = getattr(getattr(llama_cpp, "llama_cpp", None), "_lib", None)
    name = getattr(lib, "_name", None)
    return Path(os.path.realpath(name)) if name else None
