"""How to load a model (`LoadOptions`), passed whole from the command line, the server, the bench and the
Python API to the backend that loads it. Each field says, in its metadata, the option a backend may lack
("key", matched against the backend's OPTIONS), how the user wrote it, what it is for, and whether it
applies to the target only; `LoadOptions.given` and `LoadOptions.for_draft` read that, so a new option
is a field here, its flag in `specexec.cli_args` and its use in the backend, and nothing between.
Importing this module loads neither torch nor transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any, NamedTuple

# What `LoadOptions.quant` may ask: weights as stored, or converted at load to a low-bit form for the CPU
# kernels (the torch backend has them all; llama.cpp runs the GGUF's own types), or for a GGUF draft on
# llama.cpp a copy requantized by llama.cpp's own quantizer (`backends.llamacpp.draft_gguf`).
QUANT_MODES = ("none", "int8", "int4", "w4a8")
GGUF_QUANTS = ("q8_0", "q4_0")


def quant_option(quant: str) -> str:
    """The option key a quantization asks for, as backends' `refusal` reads it."""
    return "gguf_quant" if quant in GGUF_QUANTS else "quant"


class Given(NamedTuple):
    """A load option that was given: its key (in a backend's OPTIONS or not), the user's words for it, and
    what it is for (a refusal's reason)."""

    key: str
    words: str
    purpose: str


def _option(
    default: Any,
    key: str | Callable[[Any], str] | None,
    words: str | Callable[[Any], str] = "",
    purpose: str = "",
    target_only: bool = False,
) -> Any:
    """A `LoadOptions` field. `key` None: every backend takes it, and it is never refused."""
    meta = {"key": key, "words": words, "purpose": purpose, "target_only": target_only}
    return field(default=default, metadata=meta)


def _quant_words(quant: str) -> str:
    return f"--draft-quant {quant}" if quant in GGUF_QUANTS else f"--quant {quant}"  # GGUF's: drafts only


def _quant_purpose(quant: str) -> str:
    return "a GGUF draft requantized by llama.cpp" if quant in GGUF_QUANTS else "low-bit CPU weights"


@dataclass(frozen=True)
class LoadOptions:
    """How to load one model; each backend refuses the options it has not (`refusal`)."""

    # The in-memory dtype by name, "bfloat16" or "float32" (torch; None: its default)
    dtype: str | None = _option(None, "dtype", "--dtype {}", "the in-memory dtype")
    # Low-bit weights: one of QUANT_MODES (torch) or GGUF_QUANTS (a llama.cpp draft's requantized copy)
    quant: str = _option("none", quant_option, _quant_words, _quant_purpose)
    threads: int | None = _option(None, None)  # compute threads (llama.cpp; torch uses torch's setting)
    # Decoder layers streamed to a GPU (torch): `backends.torch.offload.offload_model` arguments
    offload: dict | None = _option(None, "offload", "--offload", "offloading to a GPU", target_only=True)
    # Charge every forward the time to stream its weights at this many GB/s (torch)
    simulate_offload_gbps: float | None = _option(
        None, "offload", "--simulate-offload-gbps", "simulated offloading", target_only=True
    )
    # Bytes of RAM its weights may use, the rest read from disk every pass (llama.cpp); "auto" until
    # `specexec.loading.resolve_ram` sizes it
    ram: int | str | None = _option(
        None, "ram", "--ram", "a GGUF target streamed from disk", target_only=True
    )
    # Weights locked in RAM (llama.cpp's mmap+mlock load mode): memory pressure cannot page them out
    mlock: bool = _option(False, "mlock", "--mlock", "weights locked in RAM")
    # Verification whose rows do not depend on the block they are decoded in, so that greedy output is
    # plain decoding's own bit for bit (llama.cpp: `backends.llamacpp.library.batch_invariant_kernels`)
    batch_invariant: bool = _option(
        False, "batch_invariant", "--batch-invariant", "verification bit for bit as plain decoding",
        target_only=True,
    )  # fmt: skip
    # The target's layers on llama.cpp RPC workers ("HOST:PORT" each), the output head kept here; `split`:
    # their shares of the layers (None: by each worker's free memory)
    rpc: tuple[str, ...] = _option((), "rpc", "--rpc", "layers on other machines", target_only=True)
    split: tuple[float, ...] | None = _option(
        None, "rpc", "--split", "layers on other machines", target_only=True
    )
    vocab: int = _option(0, None)  # > 0: a draft scoring only its first `vocab` ids (`specexec.draft_vocab`)
    always: tuple[int, ...] = _option((), None)  # ids a reduced head keeps whatever `vocab` (special tokens)

    def __post_init__(self) -> None:
        if self.dtype is not None and not isinstance(self.dtype, str):  # a torch.dtype from the Python API
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))

    def given(self) -> list[Given]:
        """The options set away from their defaults that some backend may lack, in the user's words."""
        found = []
        for option in fields(self):
            key, words, purpose = (option.metadata[name] for name in ("key", "words", "purpose"))
            value = getattr(self, option.name)
            if key is None or value == option.default:
                continue
            said = words(value) if callable(words) else words.format(value)
            found.append(
                Given(
                    key(value) if callable(key) else key,
                    said,
                    purpose(value) if callable(purpose) else purpose,
                )
            )
        return found

    def for_draft(self) -> LoadOptions:
        """These options less the target's own (offloading, --ram): what a draft loads with."""
        return replace(self, **{f.name: f.default for f in fields(self) if f.metadata["target_only"]})


def load_options(options: LoadOptions | None = None, **changes: Any) -> LoadOptions:
    """`options` (default: every default) with `changes`, fields by name, set over them: how the loaders
    take options whole or, from Python, field by field."""
    return replace(options or LoadOptions(), **changes)
