"""How a benchmark that cannot run fails."""

from __future__ import annotations


class BenchError(ValueError):
    """A benchmark that cannot run as asked (bad method or budget list, no prompts, missing draft, ...)."""
