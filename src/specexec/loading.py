"""Loading the model pair a command runs: the tokenizer, the target and the draft, each on its backend.

`PairSpec` says what to load (the command line's model options as plain values) and `load_pair` loads
it into a `LoadedPair`. The backend decisions are small functions of their own: `target_backend`,
`draft_backend`, `draft_quant` (the draft's weights beside a target streamed from disk), `draft_vocab` (what
"auto" means for the draft's vocabulary) and `backend_label`.
Importing this module loads neither torch nor transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class PairSpec:
    """What to load. `draft` None loads no draft; `draft_backend` None follows `backend`, `draft_quant`
    None follows `quant` (but see `draft_quant`). `dtype` None is `specexec.models.default_dtype()`.
    `draft_vocab`: the token ids the draft scores (0 = all, "auto": `draft_vocab`). The offloading
    options apply to the target only."""

    target: str
    draft: str | None
    backend: str = "auto"
    draft_backend: str | None = None
    dtype: str | None = None
    quant: str = "none"
    draft_quant: str | None = None
    draft_vocab: int | str = "auto"
    threads: int | None = None
    offload: bool = False
    ring_size: int = 2
    gpu_memory: str | None = None
    quant_offload: str | None = None
    simulate_offload_gbps: float | None = None
    # Bytes of RAM the target's weights may use (llama.cpp streams the rest); "auto": `resolve_ram`
    ram: int | str | None = None

    @property
    def offloads(self) -> bool:
        """Whether the target streams its layers (--gpu-memory and --quant-offload imply --offload)."""
        return bool(self.offload or self.gpu_memory or self.quant_offload)


@dataclass
class LoadedDraft:
    model: Any
    backend: str
    vocab: int  # the token ids it scores, 0 = all


@dataclass
class LoadedPair:
    tokenizer: PreTrainedTokenizerBase
    target: Any
    target_backend: str
    draft: Any | None = None
    draft_backend: str | None = None
    draft_vocab: int = 0
    simulated: str | None = None  # the simulated offloading's label: every timing is simulated

    @property
    def memory(self) -> str:
        """Where the target's weights are, when part of them streams from disk ("" when all in RAM)."""
        from specexec.backends import as_model

        memory = as_model(self.target).memory()
        return memory.describe() if memory is not None else ""

    @property
    def backend_label(self) -> str:
        return backend_label(self.target_backend, self.draft_backend)


def load_pair(spec: PairSpec) -> LoadedPair:
    """Tokenizer, target and draft (None without `spec.draft`) as `spec` asks, each on its backend; a
    torch target is offloaded, or its offloading simulated, if asked (a line on stderr says so)."""
    import torch

    from specexec.backends import as_model
    from specexec.models import load_model, load_tokenizer

    if spec.threads:
        torch.set_num_threads(spec.threads)
    spec = resolve_ram(spec)
    backend = target_backend(spec)
    tokenizer = load_tokenizer(spec.target)
    draft = load_draft(spec, tokenizer) if spec.draft is not None else None
    target = load_model(
        spec.target, _dtype(spec.dtype, backend), offload=_offload_options(spec), quant=spec.quant,
        backend=backend, threads=spec.threads, simulate_offload_gbps=spec.simulate_offload_gbps,
        ram=spec.ram,
    )  # fmt: skip
    pair = LoadedPair(tokenizer, target, backend)
    if spec.simulate_offload_gbps is not None:
        pair.simulated = as_model(target).cost_label
    if draft is not None:
        if target.device.type == "cuda":
            draft.model = draft.model.to(target.device)  # the draft stays resident on the GPU
        pair.draft, pair.draft_backend, pair.draft_vocab = draft.model, draft.backend, draft.vocab
    return pair


def resolve_ram(spec: PairSpec) -> PairSpec:
    """`spec` with `ram` "auto" in bytes (`host_memory.auto_ram`: the memory available now, less the
    draft's weights and a reserve; None where the target fits), said in a line on stderr. Without --ram,
    a line says when a target that could stream does not fit: left to the page cache, each pass would
    read it all again."""
    import sys

    from specexec.backends import backend as runtime
    from specexec.backends.base import BackendError, StreamingRuntime
    from specexec.host_memory import RUNTIME_RESERVE, auto_ram, available_memory
    from specexec.models import ModelSourceError, gguf_file, weights_bytes
    from specexec.sizes import format_bytes as size

    if spec.ram not in (None, "auto"):
        return spec
    backend = runtime(target_backend(spec))
    if not isinstance(backend, StreamingRuntime):
        return spec
    available = available_memory()
    if available is None:
        if spec.ram is None:
            return spec
        raise BackendError("--ram auto reads the memory available from /proc/meminfo: give a SIZE here")
    try:
        target, draft = weights_bytes(spec.target), weights_bytes(spec.draft) if spec.draft is not None else 0
        ram = auto_ram(target, draft, available, backend.least_ram(gguf_file(spec.target)))
    except (ModelSourceError, BackendError, OSError):
        if spec.ram is None:
            return spec  # loading the models says what is wrong with them
        raise
    if spec.ram is None:
        if ram is not None:
            print(
                f"[the target's {size(target)} of weights do not fit in the {size(available)} of memory "
                "available: left to the page cache, every pass reads them all again; --ram auto keeps "
                "what fits resident and streams the rest]",
                file=sys.stderr,
            )
        return spec
    if ram is None:
        said = f"the target's {size(target)} fit in the {size(available)} available: nothing streams"
    elif ram:
        drafts = f"the draft's {size(draft)} and " if draft else ""
        said = (
            f"{size(ram)} for the target's weights ({size(available)} available, less {drafts}"
            f"{size(RUNTIME_RESERVE)} for caches and buffers)"
        )
    else:
        said = f"{size(available)} available is too little to keep any of the target resident: --ram 0"
    print(f"[--ram auto: {said}]", file=sys.stderr)
    return replace(spec, ram=ram)


def load_draft(spec: PairSpec, target_tokenizer: PreTrainedTokenizerBase) -> LoadedDraft:
    """The draft as `spec` asks, after checking that it shares the target's vocabulary."""
    from specexec.models import check_same_vocab, load_model, load_tokenizer

    backend = draft_backend(spec)
    tokenizer = load_tokenizer(spec.draft)
    check_same_vocab(target_tokenizer, tokenizer)
    vocab = draft_vocab(spec.draft_vocab, backend, len(tokenizer))
    model = load_model(
        spec.draft, _dtype(spec.dtype, backend), quant=draft_quant(spec, backend), vocab=vocab,
        backend=backend, threads=spec.threads,
    )  # fmt: skip
    return LoadedDraft(model, backend, vocab)


def torch_dtype(name: str | None) -> torch.dtype:
    """The dtype named "bfloat16" or "float32"; None: the hardware's default."""
    import torch

    from specexec.models import default_dtype

    return getattr(torch, name) if name else default_dtype()


def target_backend(spec: PairSpec) -> str:
    """The backend the target runs on: a backend without one of the options given is ruled out."""
    from specexec.models import choose_backend

    given = [("dtype", f"--dtype {spec.dtype}")] if spec.dtype else []
    given += [("quant", f"--quant {spec.quant}")] if spec.quant != "none" else []
    given += [("offload", "--offload")] if spec.offloads else []
    given += [("offload", "--simulate-offload-gbps")] if spec.simulate_offload_gbps is not None else []
    given += [("ram", "--ram")] if spec.ram is not None else []
    return choose_backend(spec.backend, spec.target, given)


def draft_backend(spec: PairSpec) -> str:
    """The backend the draft runs on, at its own quantization level (`draft_quant`, else `quant`)."""
    from specexec.backends.base import quant_option
    from specexec.models import choose_backend

    quant = spec.draft_quant or spec.quant
    key = quant_option(quant)
    flag = "--draft-quant" if key == "gguf_quant" else "--quant"  # the GGUF ones are a draft's alone
    given = [("dtype", f"--dtype {spec.dtype}")] if spec.dtype else []
    given += [(key, f"{flag} {quant}")] if quant != "none" else []
    return choose_backend(spec.draft_backend or spec.backend, spec.draft, given)


def draft_quant(spec: PairSpec, backend: str) -> str:
    """The draft's quantization on `backend`: `draft_quant`, else `quant`; when neither is given, the
    backend's default beside a target streamed from disk (`ram`) or not (`default_draft_quant`: a Q4_0
    copy for a llama.cpp draft beside a streamed target, measured faster there, docs/benchmarks.md)."""
    from specexec.backends import backend as runtime

    quant = spec.draft_quant or spec.quant
    if spec.draft_quant is None and quant == "none":
        return runtime(backend).default_draft_quant(spec.ram is not None)
    return quant


def draft_vocab(value: int | str, backend: str, vocab_size: int) -> int:
    """A draft vocabulary request as a number: "auto" is the backend's default for a draft of
    `vocab_size` ids (`default_draft_vocab`: 64,000 on llama.cpp where the vocabulary is larger, measured
    faster there, docs/benchmarks.md; else 0, the whole vocabulary)."""
    from specexec.backends import backend as runtime

    if value != "auto":
        return int(value)
    return runtime(backend).default_draft_vocab(vocab_size)


def _dtype(name: str | None, backend: str) -> torch.dtype | None:
    """The in-memory dtype to load with on `backend`: None where it has no such option."""
    from specexec.backends import backend as runtime

    return torch_dtype(name) if "dtype" in runtime(backend).OPTIONS else None


def backend_label(target: str, draft: str | None) -> str:
    """The target's backend, or "target X, draft Y" where they differ, for the stats line."""
    return target if draft in (None, target) else f"target {target}, draft {draft}"


def _offload_options(spec: PairSpec) -> dict | None:
    if not spec.offloads:
        return None
    return {"ring_size": spec.ring_size, "gpu_memory": spec.gpu_memory, "codec": spec.quant_offload}
