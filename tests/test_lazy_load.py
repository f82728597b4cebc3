"""Loading a streamed target without llama.cpp's MAP_POPULATE and WILLNEED (`lazy_load`): libllama's own
entries for them are found, pointed at the wrappers for the length of a load and put back, on a page
that is writable or read-only (a library linked with full RELRO). What a load then reads is
test_stream.py's."""

from __future__ import annotations

import ctypes
import mmap

import pytest

pytest.importorskip("llama_cpp")

from specexec.backends.llamacpp import lazy_load  # noqa: E402
from specexec.backends.llamacpp.library import llama_cpp_library  # noqa: E402


def entries() -> dict[int, int]:
    """libllama's slots for the wrapped functions and what each holds now."""
    llama_cpp_library()
    library = lazy_load.libllama_path()
    assert library is not None and library.exists()
    return {slot: ctypes.c_void_p.from_address(slot).value for slot, _ in lazy_load._slots(library)}


def test_libllamas_entries_are_found_pointed_at_the_wrappers_and_put_back() -> None:
    before = entries()
    assert len(before) >= 2  # mmap and madvise at least (the build of llama-cpp-python this ran on)
    wrappers = {ctypes.cast(w, ctypes.c_void_p).value for w in lazy_load._WRAPPERS.values()}
    with lazy_load.unpopulated(lazy_load.libllama_path()):
        assert all(value in wrappers for value in entries().values())
    assert entries() == before


def test_an_entry_on_a_read_only_page_is_written_and_the_page_left_read_only() -> None:
    with mmap.mmap(-1, mmap.PAGESIZE) as page:
        address = ctypes.addressof(ctypes.c_char.from_buffer(page))
        slot = address + 64
        ctypes.c_void_p.from_address(slot).value = 0x1234
        assert lazy_load._libc.mprotect(address, mmap.PAGESIZE, lazy_load.PROT_READ) == 0
        try:
            assert lazy_load._swap(slot, 0x5678) == 0x1234
            assert ctypes.c_void_p.from_address(slot).value == 0x5678
            assert lazy_load._protection(slot) == lazy_load.PROT_READ
        finally:
            lazy_load._libc.mprotect(address, mmap.PAGESIZE, lazy_load.PROT_READ | lazy_load.PROT_WRITE)


def test_a_library_without_the_entries_loads_as_it_would(tmp_path) -> None:
    other = tmp_path / "not-a-library.so"
    other.write_bytes(b"not an ELF file")
    assert lazy_load._slots(other) == []
    with lazy_load.unpopulated(other):  # nothing to change, nothing raised
        pass
