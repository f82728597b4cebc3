"""Byte sizes as people write them: "20GiB", "20GB" (powers of ten), "512M" (bare letters are binary) or a
plain number, read by `parse_size` for memory options (the offload GPU budget, and so on) and written
back by `format_bytes` for messages and logs. A leaf module (standard library only), so command-line
parsing can use it without importing torch; a size it cannot read raises `SizeError`, a ValueError (so
argparse reports it as an invalid value when `parse_size` is an option's type).
"""

from __future__ import annotations

import re


class SizeError(ValueError):
    """A memory size that cannot be read, or is not positive; the one-line message says how to write it."""


_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "kib": 2**10, "kb": 10**3,
    "m": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gib": 2**30, "gb": 10**9,
    "t": 2**40, "tib": 2**40, "tb": 10**12,
}  # fmt: skip


def parse_size(text: str | int, zero: bool = False) -> int:
    """Bytes from "20GiB", "20GB" (10^9), "512M" (bare letters are binary) or a plain number; 0 only
    where `zero` allows it."""
    if isinstance(text, int):
        value = text
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
        unit = match.group(2).lower() if match else None
        if unit not in _UNITS:
            raise SizeError(f"cannot read {text!r} as a memory size; write it like 20GiB, 20GB or 512MiB")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value < 0 or (value == 0 and not zero):
        raise SizeError(f"a memory size must be {'0 or more' if zero else 'positive'}, got {text!r}")
    return value


def format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return ""  # unreachable
