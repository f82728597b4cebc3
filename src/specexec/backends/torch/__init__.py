"""The torch backend: Hugging Face causal LMs (float32/bfloat16, low-bit CPU weights, GPU offloading), run
by a native Llama-family forward or the model's own forward over slot-addressed KV buffers."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from specexec.backends.options import Given, LoadOptions

if TYPE_CHECKING:
    from transformers import PreTrainedModel

LABEL = "torch"
WEIGHTS = "folder"
OPTIONS = ("dtype", "offload", "quant", "threads", "vocab")  # the load options it takes
MAX_TREE_LEAVES = None  # slot-addressed buffers: any tree fits


def unavailable() -> str | None:
    return None  # torch is a dependency of specexec itself


def refusal(given: list[Given]) -> str | None:
    """Every option but OPTIONS is llama.cpp's."""
    for option in given:
        if option.key not in OPTIONS:
            return f"{option.words} is for the llama.cpp backend ({option.purpose})"
    return None


def load(path: Path, options: LoadOptions) -> PreTrainedModel:
    """The model in the Hugging Face folder `path`, in eval mode on the CPU, as `options` ask. It stays a
    `transformers` model (the benchmark's Hugging Face methods run it as one); `as_model` adapts it."""
    from specexec.backends.torch.loading import load_folder

    return load_folder(path, options)


def default_draft_vocab(vocab_size: int) -> int:
    """`--draft-vocab auto` keeps the whole head: the reduced head was not measured faster here."""
    return 0


def default_draft_quant(streamed_target: bool) -> str:
    """A draft runs its weights as loaded unless --draft-quant or --quant asks otherwise."""
    return "none"
