"""The memory this process may still take (MemAvailable and memory cgroups), and `--ram auto`'s size."""

from __future__ import annotations

from pathlib import Path

import pytest

from specexec.host_memory import RUNTIME_RESERVE, auto_ram, available_memory

GiB = 2**30


def machine(root: Path, available_kb: int, membership: str) -> tuple[Path, Path]:
    """A fake /proc (meminfo and self/cgroup) and an empty cgroup tree under `root`."""
    proc, cgroups = root / "proc", root / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal:       24000000 kB\nMemAvailable:   {available_kb} kB\n")
    (proc / "self" / "cgroup").write_text(membership)
    cgroups.mkdir()
    return proc, cgroups


def group(folder: Path, files: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)


def test_without_a_memory_cgroup_it_is_the_machines_available_memory(tmp_path: Path) -> None:
    proc, cgroups = machine(tmp_path, 8 * 2**20, "0::/\n")
    assert available_memory(proc, cgroups) == 8 * GiB


def test_a_cgroup_v2_limit_counts_its_working_set(tmp_path: Path) -> None:
    proc, cgroups = machine(tmp_path, 20 * 2**20, "0::/box/job\n")
    # The job's own limit is loose; its parent's is the tighter one: 6 GiB less 3 GiB in use, of which
    # 1 GiB is inactive page cache the kernel reclaims.
    group(cgroups / "box", {"memory.max": str(6 * GiB), "memory.current": str(3 * GiB),
                            "memory.stat": f"anon {2 * GiB}\ninactive_file {GiB}\n"})  # fmt: skip
    group(cgroups / "box" / "job", {"memory.max": "max", "memory.current": str(3 * GiB)})
    assert available_memory(proc, cgroups) == 4 * GiB


def test_a_cgroup_v1_limit_counts_too(tmp_path: Path) -> None:
    proc, cgroups = machine(tmp_path, 20 * 2**20, "5:cpu:/\n4:memory:/job\n")
    group(cgroups / "memory", {"memory.limit_in_bytes": "9223372036854771712", "memory.usage_in_bytes": "1"})
    group(cgroups / "memory" / "job", {"memory.limit_in_bytes": str(3 * GiB),
                                       "memory.usage_in_bytes": str(GiB),
                                       "memory.stat": "cache 5\ntotal_inactive_file 0\n"})  # fmt: skip
    assert available_memory(proc, cgroups) == 2 * GiB


def test_a_container_sees_its_group_as_the_root(tmp_path: Path) -> None:
    """Inside a container /proc/self/cgroup names a path the container's /sys/fs/cgroup does not hold:
    the group mounted there is its own."""
    proc, cgroups = machine(tmp_path, 20 * 2**20, "0::/kubepods/pod1/abc\n")
    group(cgroups, {"memory.max": str(2 * GiB), "memory.current": str(GiB)})
    assert available_memory(proc, cgroups) == GiB


def test_nothing_to_read_is_none(tmp_path: Path) -> None:
    assert available_memory(tmp_path / "no-proc", tmp_path / "no-cgroup") is None


def test_this_machine_says_how_much_is_available() -> None:
    if not Path("/proc/meminfo").exists():
        pytest.skip("not Linux")
    total = next(
        line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal")
    )
    assert 0 < available_memory() <= int(total.split()[1]) * 1024


@pytest.mark.parametrize(
    ("available", "expected"),
    [
        (20 * GiB, None),  # the target fits beside the draft and the reserve: nothing streams
        (RUNTIME_RESERVE + GiB + 3 * GiB, 3 * GiB),  # what is left after the draft and the reserve
        (RUNTIME_RESERVE + GiB + GiB // 2, 0),  # below the least SIZE it streams in: everything streams
        (GiB, 0),  # less than the draft and the reserve
    ],
)
def test_auto_ram_is_what_is_left_for_the_target(available: int, expected: int | None) -> None:
    assert auto_ram(target=8 * GiB, draft=GiB, available=available, least=GiB) == expected
