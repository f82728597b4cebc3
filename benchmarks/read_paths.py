"""CPU and wall time of the two ways `--ram` can read streamed units, on the model file itself.

    python benchmarks/read_paths.py [--target qwen2.5-coder-1.5b] [--mib 512] [--unit-mib 28] [--repeats 2]

- `page cache`: per unit, `posix_fadvise(WILLNEED)` in 4 MiB requests, `madvise(MADV_POPULATE_READ)` on a
  mapping of the file, then `madvise(MADV_DONTNEED)` and `posix_fadvise(DONTNEED)`: what the reader and
  the drop behind it did until 2026-12-04, one unit after another;
- `O_DIRECT + ring`: per unit, `os_calls.Ring` as the reader uses it: `O_DIRECT` reads into a ring of three
  units (a memfd, allocated once), mapped over the unit's pages (`MAP_FIXED | MAP_POPULATE`), then the
  file mapped back.
Both start with the file out of the page cache. CPU is this process's (user + system), from getrusage.
"""

from __future__ import annotations

import argparse
import os
import resource
import time

from specexec.backends.llamacpp.stream import os_calls
from specexec.models import DEFAULT_TARGET, gguf_file

MADV_POPULATE_WRITE = 23  # <asm-generic/mman-common.h>


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def page_cache(base: int, fd: int, units: list[tuple[int, int]]) -> None:
    for start, end in units:
        os_calls.populate(base, fd, start, end)
        os_calls.drop(base, fd, start, end)


def direct(ring: os_calls.Ring, base: int, fd: int, units: list[tuple[int, int]]) -> None:
    for g, (start, end) in enumerate(units):
        at = ring.take(g, end - start)
        pieces = ring.read(at, [(start, end)])
        ring.map_in((base,), pieces)
        ring.map_out((base,), [fd], pieces)
        ring.give_back(g)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--mib", type=int, default=512, help="MiB read, from 1 MiB into the file on")
    parser.add_argument("--unit-mib", type=int, default=28, help="MiB per unit (a layer of the 1.5B target)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    gguf = gguf_file(args.target)
    unit = args.unit_mib * 2**20
    units = [(2**20 + i * unit, 2**20 + (i + 1) * unit) for i in range(args.mib * 2**20 // unit)]
    fd = os.open(gguf, os.O_RDONLY)
    size = os.fstat(fd).st_size
    # As llama.cpp maps it.
    base = os_calls._libc.mmap(None, size, os_calls.PROT_READ, os_calls.MAP_SHARED, fd, 0)
    os_calls._libc.madvise(base, size, os_calls.MADV_RANDOM)
    # The ring's memory allocated first, as after a generation's first pass (not timed).
    ring = os_calls.Ring((gguf,), 3 * unit)
    os_calls._libc.madvise(ring.address, ring.size, MADV_POPULATE_WRITE)
    ways = {
        "page cache": lambda: page_cache(base, fd, units),
        "O_DIRECT + ring": lambda: direct(ring, base, fd, units),
    }
    print(f"{gguf.name}: {len(units)} units of {args.unit_mib} MiB ({len(units) * unit / 2**20:.0f} MiB)")
    print("| way | wall s | CPU s |\n|---|---:|---:|")
    for _ in range(args.repeats):
        for name, read in ways.items():
            os_calls.evict(gguf)
            wall, cpu = time.perf_counter(), cpu_seconds()
            read()
            print(f"| {name} | {time.perf_counter() - wall:.3f} | {cpu_seconds() - cpu:.3f} |")
    ring.close()
    os_calls._libc.munmap(base, size)
    os.close(fd)


if __name__ == "__main__":
    main()
