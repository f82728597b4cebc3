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
The entries are found as the dynamic linker finds them: from the library's dynamic segment.
Where they cannot be found (no C library to call, another machine, a statically linked build),
llama.cpp loads as it would, a streamed load reads the whole file once, and one line on stderr says why.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import struct
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

MAP_POPULATE = 0x8000
WILLNEED = 3  # MADV_WILLNEED and POSIX_MADV_WILLNEED on Linux
PROT_READ, PROT_WRITE = 1, 2
_WRAPPED = (b"mmap", b"mmap64", b"madvise", b"posix_madvise")

# ELF (64-bit): the identification bytes, machines, segment kinds and dynamic entry tags read here
_ELF_MAGIC, _ELFCLASS64, _ELFDATA2LSB = b"\x7fELF", 2, 1
_EM_X86_64, _EM_AARCH64 = 62, 183
# Relocations that fill a pointer slot with a function's address (GLOB_DAT, JUMP_SLOT): numbered per machine
_SLOT_RELOCATIONS = {_EM_X86_64: {6, 7}, _EM_AARCH64: {1025, 1026}}
_PT_LOAD, _PT_DYNAMIC = 1, 2
_DT_NULL, _DT_PLTRELSZ, _DT_STRTAB, _DT_SYMTAB, _DT_RELA, _DT_RELASZ = 0, 2, 5, 6, 7, 8
_DT_RELAENT, _DT_SYMENT, _DT_PLTREL, _DT_JMPREL = 9, 11, 20, 23
_ELF64_RELA_SIZE = _ELF64_SYM_SIZE = 24

_MMAP = ctypes.CFUNCTYPE(
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
)
_ADVISE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)

# One load at a time: a second one would save the first one's wrappers as the entries to put back.
_patching = threading.Lock()
_told_why = False


class _NotFound(Exception):
    """Why libllama's entries cannot be pointed at the wrappers: the load then goes on as llama.cpp's."""


class _CLibrary:
    """The C library's `mprotect`, and a wrapper of each function in _WRAPPED calling the real one."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.mprotect = libc.mprotect
        self.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        real_mmap = _MMAP(("mmap", libc))
        real_madvise = _ADVISE(("madvise", libc))
        real_posix_madvise = _ADVISE(("posix_madvise", libc))

        @_MMAP
        def mmap_lazily(address, length, prot, flags, fd, offset):
            return real_mmap(address, length, prot, flags & ~MAP_POPULATE, fd, offset)

        @_ADVISE
        def madvise_but_willneed(address, length, advice):
            return 0 if advice == WILLNEED else real_madvise(address, length, advice)

        @_ADVISE
        def posix_madvise_but_willneed(address, length, advice):
            return 0 if advice == WILLNEED else real_posix_madvise(address, length, advice)

        # Kept here, alive for the process: an entry may point at them while llama.cpp loads.
        self.wrappers = {
            b"mmap": mmap_lazily,
            b"mmap64": mmap_lazily,
            b"madvise": madvise_but_willneed,
            b"posix_madvise": posix_madvise_but_willneed,
        }

    def address(self, name: bytes) -> int:
        return ctypes.cast(self.wrappers[name], ctypes.c_void_p).value


@functools.cache
def _c_library() -> _CLibrary:
    """Looked up on first use, not at import: importing the backend must not need a C library reachable
    through `dlopen(NULL)` (Windows has none)."""
    try:
        return _CLibrary()
    except (OSError, TypeError, AttributeError) as error:
        raise _NotFound(f"no C library to call: {error}") from None


@contextmanager
def unpopulated(library: Path | None) -> Iterator[None]:
    """While the block runs, the shared library `library` (libllama) maps files without MAP_POPULATE and
    its WILLNEED advice does nothing (where its entries are found: else it loads as it would)."""
    with _patching:
        try:
            entries = _entries(library)
        except _NotFound as why:
            _tell_once(str(why))
            entries = []
        saved = []
        try:
            for slot, wrapper in entries:
                saved.append((slot, _swap(slot, wrapper)))
            yield
        finally:
            for slot, original in reversed(saved):
                _swap(slot, original)


def _entries(library: Path | None) -> list[tuple[int, int]]:
    """(slot address, wrapper address) for each of the library's entries to point at a wrapper."""
    if library is None:
        raise _NotFound("llama-cpp-python does not say where its libllama is")
    c_library = _c_library()
    try:
        slots = _slots(library)
    except _NotFound as why:
        raise _NotFound(f"{library.name}: {why}") from None
    if not slots:
        raise _NotFound(f"{library.name} has no entries for {', '.join(n.decode() for n in _WRAPPED)}")
    return [(slot, c_library.address(name)) for slot, name in slots]


def _tell_once(why: str) -> None:
    """One line on stderr, the first time only: a load reading the whole file is slow, not wrong."""
    global _told_why
    if not _told_why:
        _told_why = True
        print(
            f"specexec: a streamed model's file will be read whole at load, as llama.cpp reads it ({why})",
            file=sys.stderr,
        )


def _swap(slot: int, value: int) -> int:
    """Write the pointer at `slot`, making its page writable meanwhile; return what it held."""
    mprotect = _c_library().mprotect
    page = slot // mmap.PAGESIZE * mmap.PAGESIZE
    protection = _protection(slot)
    if not protection & PROT_WRITE and mprotect(page, mmap.PAGESIZE, protection | PROT_WRITE) != 0:
        raise OSError(ctypes.get_errno(), "mprotect failed on libllama's offset table")
    cell = ctypes.c_void_p.from_address(slot)
    old, cell.value = cell.value, value
    if not protection & PROT_WRITE:
        mprotect(page, mmap.PAGESIZE, protection)
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


def _slots(library: Path) -> list[tuple[int, bytes]]:
    """(address in this process, function name) of each of the library's slots for a function in
    _WRAPPED. Raises _NotFound where the library cannot be read or is not loaded."""
    try:
        image = library.read_bytes()
    except OSError as error:
        raise _NotFound(f"cannot be read ({error.strerror})") from None
    try:
        wrapped = [(slot, name) for slot, name in _relocations(image) if name in _WRAPPED]
    except (struct.error, IndexError, KeyError, ValueError):
        raise _NotFound("a malformed ELF file") from None
    if not wrapped:
        return []
    base = _load_base(library)
    if base is None:
        raise _NotFound("not found in this process's memory map")
    return [(base + slot, name) for slot, name in wrapped]


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
    """(slot's virtual address, symbol name) of every pointer-slot relocation of an ELF image, read as the
    dynamic linker reads them: from the dynamic segment (section headers may be stripped)."""
    slot_kinds = _SLOT_RELOCATIONS[_machine(image)]
    (phoff,) = struct.unpack_from("<Q", image, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", image, 0x36)
    segments = [struct.unpack_from("<IIQQQQQQ", image, phoff + i * phentsize) for i in range(phnum)]
    # (file offset, virtual address, size in the file) of each PT_LOAD segment
    loads = [
        (offset, vaddr, filesz) for kind, _, offset, vaddr, _, filesz, _, _ in segments if kind == _PT_LOAD
    ]
    dynamic = [(offset, filesz) for kind, _, offset, _, _, filesz, _, _ in segments if kind == _PT_DYNAMIC]
    if not dynamic:
        raise _NotFound("no dynamic segment (a statically linked build?)")
    entries = _dynamic_entries(image, *dynamic[0])

    def file_offset(address: int) -> int:
        for offset, vaddr, filesz in loads:
            if vaddr <= address < vaddr + filesz:
                return offset + address - vaddr
        raise _NotFound(f"dynamic entry address {address:#x} is in no loaded segment")

    tables = []  # (virtual address, size) of each table of relocations with addends: general, then PLT
    if _DT_RELA in entries:
        tables.append((entries[_DT_RELA], entries[_DT_RELASZ]))
    if _DT_JMPREL in entries:
        if entries.get(_DT_PLTREL) != _DT_RELA:
            raise _NotFound("its PLT relocations are not of the RELA kind these machines use")
        tables.append((entries[_DT_JMPREL], entries[_DT_PLTRELSZ]))
    if not tables:
        return []
    symbols, names = file_offset(entries[_DT_SYMTAB]), file_offset(entries[_DT_STRTAB])
    relocation_size = entries.get(_DT_RELAENT, _ELF64_RELA_SIZE)
    symbol_size = entries.get(_DT_SYMENT, _ELF64_SYM_SIZE)
    found = []
    for address, size in tables:
        start = file_offset(address)
        for at in range(start, start + size, relocation_size):
            slot, info, _ = struct.unpack_from("<QQq", image, at)
            if info & 0xFFFFFFFF not in slot_kinds:
                continue
            (name_at,) = struct.unpack_from("<I", image, symbols + (info >> 32) * symbol_size)
            name_start = names + name_at
            found.append((slot, image[name_start : image.index(b"\0", name_start)]))
    return found


def _machine(image: bytes) -> int:
    """The image's e_machine, where it is a 64-bit little-endian ELF file for a machine whose slot
    relocations are known here; else _NotFound."""
    if image[:4] != _ELF_MAGIC:
        raise _NotFound("not an ELF file")
    if image[4] != _ELFCLASS64 or image[5] != _ELFDATA2LSB:
        raise _NotFound("not a 64-bit little-endian ELF file")
    (machine,) = struct.unpack_from("<H", image, 0x12)
    if machine not in _SLOT_RELOCATIONS:
        raise _NotFound(f"unsupported machine, ELF e_machine {machine}")
    return machine


def _dynamic_entries(image: bytes, offset: int, size: int) -> dict[int, int]:
    """The dynamic segment's entries, tag to value, up to DT_NULL."""
    entries = {}
    for at in range(offset, offset + size, 16):
        tag, value = struct.unpack_from("<qQ", image, at)
        if tag == _DT_NULL:
            break
        entries[tag] = value
    return entries


def libllama_path() -> Path | None:
    """The libllama llama-cpp-python loaded, where it says."""
    import llama_cpp

    lib = getattr(getattr(llama_cpp, "llama_cpp", None), "_lib", None)
    name = getattr(lib, "_name", None)
    return Path(os.path.realpath(name)) if name else None
