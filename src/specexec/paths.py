"""Where specexec keeps what it makes once: converted models, calibrations, compiled kernels, head copies."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The cache folder (``SPECEXEC_CACHE``, default ``~/.cache/specexec``)."""
    return Path(os.environ.get("SPECEXEC_CACHE") or Path.home() / ".cache" / "specexec").expanduser()
