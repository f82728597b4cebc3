"""Loading a streamed target without llama.cpp's MAP_POPULATE and WILLNEED (`lazy_load`): libllama's own
entries for them are found from its dynamic segment (as the dynamic linker finds them, section headers or
not), pointed at the wrappers for the length of a load and put back, on a page that is writable or
read-only (a library linked with full RELRO), one load at a time. Where they cannot be found (another
machine, no C library, no such entries) the load goes on as llama.cpp's and one line on stderr says why,
once. What a load then reads is test_stream.py's."""

from __future__ import annotations

import ctypes
import importlib
import mmap
import struct
import threading
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")

from specexec.backends.llamacpp import lazy_load  # noqa: E402
from specexec.backends.llamacpp.library import llama_cpp_library  # noqa: E402

_SHT_RELA, _SHT_DYNSYM = 4, 11


def libllama() -> Path:
    llama_cpp_library()
    library = lazy_load.libllama_path()
    assert library is not None and library.exists()
    return library


def entries() -> dict[int, int]:
    """libllama's slots for the wrapped functions and what each holds now."""
    return {slot: ctypes.c_void_p.from_address(slot).value for slot, _ in lazy_load._slots(libllama())}


def wrapper_addresses() -> set[int]:
    return {lazy_load._c_library().address(name) for name in lazy_load._WRAPPED}


def relocations_from_section_headers(image: bytes) -> list[tuple[int, bytes]]:
    """The pointer-slot relocations read the other way, from the section headers (each SHT_RELA section
    whose symbols are the SHT_DYNSYM one): what the dynamic segment's reading is checked against."""
    (shoff,) = struct.unpack_from("<Q", image, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", image, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", image, shoff + i * shentsize) for i in range(shnum)]
    found = []
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != _SHT_RELA or sections[link][1] != _SHT_DYNSYM:
            continue
        symbols, names = sections[link][4], sections[sections[link][6]][4]
        for at in range(offset, offset + size, entsize):
            slot, info, _ = struct.unpack_from("<QQq", image, at)
            if info & 0xFFFFFFFF in {6, 7, 1025, 1026}:
                (name_at,) = struct.unpack_from("<I", image, symbols + (info >> 32) * 24)
                found.append((slot, image[names + name_at : image.index(b"\0", names + name_at)]))
    return found


def altered_copy(folder: Path, changes: dict[int, bytes]) -> Path:
    """A copy of libllama with the bytes at each offset in `changes` replaced."""
    image = bytearray(libllama().read_bytes())
    for offset, new in changes.items():
        image[offset : offset + len(new)] = new
    copy = folder / "libllama-altered.so"
    copy.write_bytes(bytes(image))
    return copy


@pytest.fixture
def copies_at_libllamas_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy of libllama, never loaded itself, taken for the loaded one: what is read from the copy then
    acts on the real entries."""
    base = lazy_load._load_base(libllama())
    assert base is not None
    monkeypatch.setattr(lazy_load, "_load_base", lambda library: base)


@pytest.fixture
def untold(monkeypatch: pytest.MonkeyPatch) -> None:
    """As in a fresh process: the notice not given yet."""
    monkeypatch.setattr(lazy_load, "_told_why", False)


def test_libllamas_entries_are_found_pointed_at_the_wrappers_and_put_back() -> None:
    before = entries()
    assert len(before) >= 2  # mmap and madvise at least (the build of llama-cpp-python this ran on)
    with lazy_load.unpopulated(lazy_load.libllama_path()):
        assert all(value in wrapper_addresses() for value in entries().values())
    assert entries() == before


def test_an_entry_on_a_read_only_page_is_written_and_the_page_left_read_only() -> None:
    mprotect = lazy_load._c_library().mprotect
    with mmap.mmap(-1, mmap.PAGESIZE) as page:
        address = ctypes.addressof(ctypes.c_char.from_buffer(page))
        slot = address + 64
        ctypes.c_void_p.from_address(slot).value = 0x1234
        assert mprotect(address, mmap.PAGESIZE, lazy_load.PROT_READ) == 0
        try:
            assert lazy_load._swap(slot, 0x5678) == 0x1234
            assert ctypes.c_void_p.from_address(slot).value == 0x5678
            assert lazy_load._protection(slot) == lazy_load.PROT_READ
        finally:
            mprotect(address, mmap.PAGESIZE, lazy_load.PROT_READ | lazy_load.PROT_WRITE)


def test_the_dynamic_segment_gives_the_relocations_the_section_headers_give() -> None:
    image = libllama().read_bytes()
    found = lazy_load._relocations(image)
    assert sorted(found) == sorted(relocations_from_section_headers(image))
    assert {name for _, name in found} >= {b"mmap", b"madvise"}


def test_a_copy_without_section_headers_gives_the_same_slots(
    tmp_path: Path, copies_at_libllamas_address: None
) -> None:
    image = libllama().read_bytes()
    (shoff,) = struct.unpack_from("<Q", image, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", image, 0x3A)
    table = bytes(shentsize * shnum)
    # e_shoff, e_shnum and e_shstrndx zero, and the table itself overwritten
    stripped = altered_copy(tmp_path, {0x28: bytes(8), 0x3C: bytes(4), shoff: table})
    assert relocations_from_section_headers(stripped.read_bytes()) == []
    assert lazy_load._slots(stripped) == lazy_load._slots(libllama())
    assert len(lazy_load._slots(stripped)) >= 2


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({0x12: struct.pack("<H", 3)}, "unsupported machine"),  # EM_386: its relocation numbers differ
        ({0x12: struct.pack("<H", 243)}, "unsupported machine"),  # EM_RISCV
        ({4: b"\x01"}, "64-bit little-endian"),  # ELFCLASS32
        ({5: b"\x02"}, "64-bit little-endian"),  # ELFDATA2MSB
    ],
)
def test_a_library_for_another_machine_gives_no_slots_and_loads_as_it_would(
    tmp_path: Path,
    copies_at_libllamas_address: None,
    untold: None,
    capsys: pytest.CaptureFixture[str],
    change: dict[int, bytes],
    why: str,
) -> None:
    before = entries()
    other = altered_copy(tmp_path, change)
    with lazy_load.unpopulated(other):
        assert entries() == before
    assert entries() == before
    assert why in capsys.readouterr().err


def test_two_loads_at_once_take_turns_and_leave_the_entries_as_they_were() -> None:
    before = entries()
    library = libllama()
    first_inside, first_may_leave = threading.Event(), threading.Event()
    second_inside, second_may_leave = threading.Event(), threading.Event()
    failures: list[BaseException] = []

    def load(inside: threading.Event, may_leave: threading.Event) -> None:
        try:
            with lazy_load.unpopulated(library):
                inside.set()
                assert may_leave.wait(timeout=30)
        except BaseException as failure:  # reported by the test's thread
            failures.append(failure)

    first = threading.Thread(target=load, args=(first_inside, first_may_leave))
    second = threading.Thread(target=load, args=(second_inside, second_may_leave))
    first.start()
    assert first_inside.wait(timeout=30)
    assert lazy_load._patching.locked()
    second.start()
    second_went_in_early = second_inside.wait(timeout=0.5)  # else it waits for the first to put them back
    first_may_leave.set()
    first.join(timeout=30)
    assert second_inside.wait(timeout=30)
    second_may_leave.set()
    second.join(timeout=30)
    assert not failures
    # Had the second gone in early, it would have saved the first's wrappers and put them back last.
    assert entries() == before
    assert not second_went_in_early
    assert not lazy_load._patching.locked()


def test_an_elf_file_without_the_entries_is_read_and_loads_as_it_would(
    untold: None, capsys: pytest.CaptureFixture[str]
) -> None:
    other = Path("/bin/true")  # a dynamically linked executable calling neither mmap nor madvise
    if not other.exists() or other.read_bytes()[:4] != b"\x7fELF":
        pytest.skip("no /bin/true ELF executable here")
    relocations = lazy_load._relocations(other.read_bytes())
    assert relocations  # its dynamic segment was found and read
    assert not {name for _, name in relocations} & set(lazy_load._WRAPPED)
    assert lazy_load._slots(other) == []
    ran = False
    with lazy_load.unpopulated(other):
        ran = True
    assert ran
    assert "has no entries for mmap" in capsys.readouterr().err


def test_why_the_file_is_read_whole_is_said_once_in_one_line(
    untold: None, capsys: pytest.CaptureFixture[str]
) -> None:
    with lazy_load.unpopulated(None):
        pass
    first = capsys.readouterr().err.splitlines()
    assert len(first) == 1
    assert first[0].startswith("specexec: ") and "read whole at load" in first[0]
    assert "does not say where its libllama is" in first[0]
    with lazy_load.unpopulated(None):
        pass
    assert capsys.readouterr().err == ""


def test_the_module_imports_without_a_c_library_and_loads_as_it_would(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    library = libllama()
    before = entries()

    def no_c_library(*args: object, **kwargs: object) -> ctypes.CDLL:
        raise OSError("no C library here")

    ran = False
    monkeypatch.setattr(ctypes, "CDLL", no_c_library)
    try:
        importlib.reload(lazy_load)
        with lazy_load.unpopulated(library):
            ran = True
            assert entries() == before
    finally:
        monkeypatch.undo()
        importlib.reload(lazy_load)
    assert ran
    err = capsys.readouterr().err
    assert err.startswith("specexec: ") and "no C library to call" in err
