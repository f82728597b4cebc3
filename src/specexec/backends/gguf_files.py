"""A GGUF model's files, and where its tensors' bytes lie in them, read from the headers alone.

A model is one GGUF file, or a split GGUF (`llama-gguf-split`: NAME-00001-of-0000N.gguf to
NAME-0000N-of-0000N.gguf in one folder, given by its first file, which may hold metadata only), as
llama.cpp loads it. Offsets are global: file k's byte b is at (k << SHARD_SHIFT) + b, so one number says
which file and where (`split`), and no span of one file runs into another's.
"""

from __future__ import annotations

import functools
import math
import mmap
import struct
from pathlib import Path

from specexec.backends.base import BackendError

SHARD_SHIFT = 48  # file k of a split GGUF holds the global offsets from k << SHARD_SHIFT on
SPLIT_COUNT = "split.count"  # the key of a split GGUF's files that says how many there are


class GGUFFileError(BackendError):
    """A file that is not a readable GGUF, or a split GGUF given by another file than its first or with a
    file missing."""


def tensor_spans(gguf: Path) -> dict[str, tuple[int, int]]:
    """Each tensor's bytes (global offsets: in one file, the offsets llama.cpp maps), from the headers of
    every file of the GGUF (`shards`)."""
    spans = {}
    for k, path in enumerate(shards(gguf)):
        origin = k << SHARD_SHIFT
        spans.update({name: (origin + a, origin + b) for name, (a, b) in _header(path)[0].items()})
    return spans


def shards(gguf: Path) -> tuple[Path, ...]:
    """The files of the GGUF `gguf`: itself, or all of a split GGUF's given its first, named as llama.cpp
    looks for them (`llama_split_path`: NAME-00002-of-00003.gguf beside NAME-00001-of-00003.gguf)."""
    stat = gguf.stat()
    count = _split_count(gguf.resolve(), stat.st_size, stat.st_mtime_ns)
    if count <= 1:
        return (gguf,)
    first = f"-00001-of-{count:05d}.gguf"
    if not gguf.name.endswith(first):
        raise GGUFFileError(f"{gguf} is part of a split GGUF of {count} files: give its first, NAME{first}")
    prefix = gguf.name[: -len(first)]
    paths = tuple(gguf.with_name(f"{prefix}-{k:05d}-of-{count:05d}.gguf") for k in range(1, count + 1))
    for part, path in enumerate(paths[1:], start=2):
        if not path.is_file():
            raise GGUFFileError(f"{path.name}, part {part} of the split GGUF {gguf.name}, is missing")
    return paths


@functools.lru_cache(maxsize=64)
def _split_count(gguf: Path, size: int, mtime_ns: int) -> int:
    """The file's split count, read once per version of the file (a header of 150,000 vocabulary strings
    takes about 0.1 s to skip, and the bench evicts a model's files before every pass)."""
    return _header(gguf)[1]


def file_bytes(gguf: Path) -> int:
    """The bytes of the GGUF's files (`shards`)."""
    return sum(path.stat().st_size for path in shards(gguf))


def version(gguf: Path) -> str:
    """Each of the GGUF's files' size and modification time ("size:mtime", comma-separated): what caches
    of anything derived from it are keyed on, so that a changed part of a split GGUF counts too."""
    return ",".join(f"{stat.st_size}:{stat.st_mtime_ns}" for stat in (path.stat() for path in shards(gguf)))


def file_tensor_spans(path: Path) -> dict[str, tuple[int, int]]:
    """One file's tensors' bytes (offsets in that file): none for a split GGUF's file of metadata only."""
    return _header(path)[0]


def _header(gguf: Path) -> tuple[dict[str, tuple[int, int]], int]:
    """One file's tensors' bytes (offsets in that file) and its split count (1 if not split).

    Only the header is parsed, the metadata values skipped: `gguf.GGUFReader` decodes every value (the
    vocabulary's 150,000 strings among them), which took 6 s for the 1.5B target on every streamed load."""
    with open(gguf, "rb") as file:
        if file.read(4) != b"GGUF":
            raise GGUFFileError(f"{gguf} is not a GGUF file")
        try:
            with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _tensor_spans(data)
        except (KeyError, ValueError, struct.error) as error:  # UnicodeDecodeError is a ValueError
            why = f"{type(error).__name__}: {error}"
            raise GGUFFileError(f"{gguf} is not a readable GGUF file ({why})") from None


def split(offset: int) -> tuple[int, int]:
    """(file index, offset in that file) of a global offset (`SHARD_SHIFT`)."""
    return offset >> SHARD_SHIFT, offset & ((1 << SHARD_SHIFT) - 1)


def _tensor_spans(data: mmap.mmap) -> tuple[dict[str, tuple[int, int]], int]:
    from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUFValueType

    fixed = {GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
             GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4, GGUFValueType.BOOL: 1,
             GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8}  # fmt: skip
    n_tensors, n_values = struct.unpack_from("<QQ", data, 8)  # after the magic and the version
    at = 24

    def take(fmt: str):
        nonlocal at
        values = struct.unpack_from(fmt, data, at)
        at += struct.calcsize(fmt)
        return values[0] if len(values) == 1 else values

    def text() -> str:
        nonlocal at
        n = take("<Q")
        at += n
        return bytes(data[at - n : at]).decode()

    def skip(kind: int) -> None:
        nonlocal at
        if kind == GGUFValueType.STRING:
            n = take("<Q")  # read before `at` is: `at += take(...)` would add to the old `at`
            at += n
        elif kind == GGUFValueType.ARRAY:
            item, count = take("<IQ")
            if item in fixed:
                at += fixed[item] * count
            else:
                for _ in range(count):
                    skip(item)
        else:
            at += fixed[kind]

    alignment, count = GGUF_DEFAULT_ALIGNMENT, 1
    for _ in range(n_values):
        key, kind = text(), take("<I")
        if key == "general.alignment":
            alignment = take("<I")
        elif key == SPLIT_COUNT:
            count = take("<H")  # uint16
        else:
            skip(kind)
    infos = []
    for _ in range(n_tensors):
        name, dims = text(), take("<I")
        shape = struct.unpack_from(f"<{dims}Q", data, at)
        at += 8 * dims
        kind, offset = take("<IQ")
        block, size = GGML_QUANT_SIZES[kind]
        infos.append((name, offset, math.prod(shape) // block * size))
    start = -(-at // alignment) * alignment  # the tensor data begins at the next alignment boundary
    return {name: (start + offset, start + offset + n) for name, offset, n in infos}, count
