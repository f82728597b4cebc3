"""specexec: fast LLM generation on limited hardware through speculative decoding."""

from specexec.budget import LearntPolicies
from specexec.engine import Chunk, GenerationError, GenerationOutput, Stats, generate, stream
from specexec.methods import METHODS
from specexec.prefix_cache import PrefixCache
from specexec.sampling import SamplingParams

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
