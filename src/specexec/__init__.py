"""specexec: fast LLM generation on limited hardware through speculative decoding."""

from typing import Any

from specexec.learnt import LearntPolicies
from specexec.methods import METHODS
from specexec.prefix_cache import PrefixCache
from specexec.sampling import SamplingParams

# The engine brings in transformers and the model loaders (and their import-time settings), so it is
# imported when one of its names is first used: the pure modules (budget, drafters, tree) import without.
_ENGINE_NAMES = ("Chunk", "GenerationError", "GenerationOutput", "Stats", "generate", "stream")


def __getattr__(name: str) -> Any:
    if name in _ENGINE_NAMES:
        from specexec import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'specexec' has no attribute {name!r}")


__all__ = [
    "METHODS",
    "Chunk",
    "GenerationError",
    "GenerationOutput",
    "LearntPolicies",
    "PrefixCache",
    "SamplingParams",
    "Stats",
    "generate",
    "stream",
]
