"""The llama.cpp backend: GGUF models run by ggml's maintained kernels (llama-cpp-python's low-level API),
trees verified in one `llama_decode` with a sequence id per leaf."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from specexec.backends.llamacpp.draft_gguf import DEFAULT_DRAFT_VOCAB, STREAMED_DRAFT_QUANT
from specexec.backends.llamacpp.library import INSTALL_HINT, LlamaCppError
from specexec.backends.llamacpp.model import LlamaCppModel
from specexec.backends.options import Given, LoadOptions

LABEL = "llama.cpp"
WEIGHTS = "gguf"
Error = LlamaCppError  # what `load` raises for a file llama.cpp cannot run


def unavailable() -> str | None:
    if importlib.util.find_spec("llama_cpp") is None:
        return f"the llama.cpp backend needs llama-cpp-python: {INSTALL_HINT}"
    return None


# The load options it takes: it runs the GGUF's own weights, or for a draft a copy of its own (`gguf_quant`)
OPTIONS = ("threads", "vocab", "ram", "gguf_quant", "mlock", "batch_invariant", "rpc")
MAX_TREE_LEAVES = LlamaCppModel.max_tree_leaves


def refusal(given: list[Given]) -> str | None:
    """Every option but OPTIONS is the torch backend's."""
    for option in given:
        if option.key not in OPTIONS:
            return f"{option.words} is for the torch backend; llama.cpp runs the GGUF's own weights"
    return None


def load(path: Path, options: LoadOptions) -> LlamaCppModel:
    return LlamaCppModel(path, options=options)


def least_ram(path: Path) -> int:
    """The least `ram` above 0 that `path` runs streamed with (below it, only 0: everything streams)."""
    from specexec.backends.llamacpp.stream import least_ram

    return least_ram(path)


def default_draft_vocab(vocab_size: int) -> int:
    """`--draft-vocab auto`: DEFAULT_DRAFT_VOCAB ids for a draft with a larger vocabulary."""
    return DEFAULT_DRAFT_VOCAB if vocab_size > DEFAULT_DRAFT_VOCAB else 0


def default_draft_quant(streamed_target: bool) -> str:
    """STREAMED_DRAFT_QUANT beside a target streamed from disk, else the GGUF's own weights."""
    return STREAMED_DRAFT_QUANT if streamed_target else "none"
