"""How much memory this process may still take, and what `--ram auto` gives a target from it (a leaf module:
standard library only).

The kernel's MemAvailable counts free memory and what it can reclaim (clean page cache), but not a
container's limit: in a memory cgroup the process is stopped at the group's limit whatever the machine
has free, so the group's headroom counts too (its limit less its usage, less the inactive page cache
it can reclaim: the working set, as container runtimes count it). cgroup v2 and v1 are both read.
"""

from __future__ import annotations

from pathlib import Path

# Set aside for what --ram does not count: the KV caches, llama.cpp's compute buffers and the runtime (the
# default pair: 271 MiB of caches and buffers, and about 0.5 GiB of Python, torch and the tokenizer).
RUNTIME_RESERVE = 2**30
UNLIMITED = 2**60  # cgroup v1 writes "no limit" as a page-rounded 2^63 - 1


def available_memory(proc: Path = Path("/proc"), cgroups: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process may still take: the machine's MemAvailable, or less where a memory cgroup
    (this process's or an ancestor's) has less headroom; None where the kernel says neither (not Linux)."""
    candidates = [_mem_available(proc / "meminfo")]
    candidates += [_headroom(folder) for folder in _memory_cgroups(proc / "self" / "cgroup", cgroups)]
    known = [c for c in candidates if c is not None]
    return min(known) if known else None


def auto_ram(target: int, draft: int, available: int, least: int) -> int | None:
    """`--ram auto` in bytes: what is `available` less the `draft`'s weights and RUNTIME_RESERVE; None
    where all `target` bytes fit in that (nothing streams), 0 where it is below `least` (the least a
    positive SIZE may be: the whole target streams)."""
    size = available - draft - RUNTIME_RESERVE
    if size >= target:
        return None
    return size if size >= least else 0


def _mem_available(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _memory_cgroups(membership: Path, root: Path) -> list[Path]:
    """The folders of this process's memory cgroup and its ancestors that exist under `root`: cgroup v2's
    unified tree ("0::/path") or v1's memory controller ("N:memory:/path"). Inside a container the group
    is often mounted as the root itself, which is then the folder."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return []
    folders = []
    for line in lines:
        number, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if number == "0" and not controllers:
            base = root
        elif "memory" in controllers.split(","):
            base = root / "memory"
        else:
            continue
        parts = [p for p in path.strip().split("/") if p]
        for depth in range(len(parts), -1, -1):
            folder = base.joinpath(*parts[:depth])
            if folder.is_dir() and folder not in folders:
                folders.append(folder)
    return folders


def _headroom(folder: Path) -> int | None:
    """A memory cgroup's limit less its working set, or None where it has no limit (or none is read)."""
    v2 = (folder / "memory.max").exists()
    limit = _number(folder / ("memory.max" if v2 else "memory.limit_in_bytes"))
    usage = _number(folder / ("memory.current" if v2 else "memory.usage_in_bytes"))
    if limit is None or usage is None or limit >= UNLIMITED:
        return None
    reclaimable = _stat(folder / "memory.stat", "inactive_file" if v2 else "total_inactive_file") or 0
    return max(0, limit - max(0, usage - reclaimable))


def _number(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return UNLIMITED
    return int(text) if text.isdigit() else None


def _stat(path: Path, key: str) -> int | None:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return None
