"""Loading the model pair a command runs: the tokenizer, the target and the draft, each on its backend.

`PairSpec` says what to load (the target's `LoadOptions`, as the command line gave them, and the draft's
own choices) and `load_pair` loads it into a `LoadedPair`. The backend decisions are small functions of
their own: `target_backend`, `draft_backend`, `draft_quant` (the draft's weights beside a target streamed
from disk), `draft_vocab` (what "auto" means for the draft's vocabulary) and `backend_label`.
Importing this module loads neither torch nor transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from specexec.backends.options import LoadOptions

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class PairSpec:
    """What to load. `load`: the target's options; the draft's are the same less the target's own
    (`LoadOptions.for_draft`), at its own quantization and vocabulary. `draft` None loads no draft;
    `draft_backend` None follows `backend`, `draft_quant` None follows `load.quant` (but see
    `draft_quant`). A `load.dtype` of None is `specexec.models.default_dtype()` on the torch backend.
    `draft_vocab`: the token ids the draft scores (0 = all, "auto": `draft_vocab`)."""

    target: str
    draft: str | None
    load: LoadOptions = field(default_factory=LoadOptions)
    backend: str = "auto"
    draft_backend: str | None = None
    draft_quant: str | None = None
    draft_vocab: int | str = "auto"

    def with_load(self, **changes: Any) -> PairSpec:
        """This spec with the target's load options changed as `changes` say."""
        return replace(self, load=replace(self.load, **changes))


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
    def placement(self) -> str:
        """Which of the target's layers run on which RPC worker ("" when all run here)."""
        from specexec.backends import as_model

        return as_model(self.target).placement()

    @property
    def backend_label(self) -> str:
        return backend_label(self.target_backend, self.draft_backend)


def load_pair(spec: PairSpec) -> LoadedPair:
    """Tokenizer, target and draft (None without `spec.draft`) as `spec` asks, each on its backend; a
    torch target is offloaded, or its offloading simulated, if asked (a line on stderr says so)."""
    import torch

    from specexec.backends import as_model
    from specexec.models import load_model, load_tokenizer

    if spec.load.threads:
        torch.set_num_threads(spec.load.threads)
    spec = resolve_ram(spec)
    backend = target_backend(spec)
    tokenizer = load_tokenizer(spec.target)
    draft = load_draft(spec, tokenizer) if spec.draft is not None else None
    target = load_model(spec.target, _dtype(spec.load.dtype, backend), backend, spec.load)
    pair = LoadedPair(tokenizer, target, backend)
    if spec.load.simulate_offload_gbps is not None:
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

    if spec.load.ram not in (None, "auto"):
        return spec
    backend = runtime(target_backend(spec))
    if not isinstance(backend, StreamingRuntime):
        return spec
    available = available_memory()
    if available is None:
        if spec.load.ram is None:
            return spec
        raise BackendError("--ram auto reads the memory available from /proc/meminfo: give a SIZE here")
    try:
        target, draft = weights_bytes(spec.target), weights_bytes(spec.draft) if spec.draft is not None else 0
        ram = auto_ram(target, draft, available, backend.least_ram(gguf_file(spec.target)))
    except (ModelSourceError, BackendError, OSError):
        if spec.load.ram is None:
            return spec  # loading the models says what is wrong with them
        raise
    if spec.load.ram is None:
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
    return spec.with_load(ram=ram)


def load_draft(spec: PairSpec, target_tokenizer: PreTrainedTokenizerBase) -> LoadedDraft:
    """The draft as `spec` asks, after checking that it shares the target's vocabulary."""
    from specexec.models import check_same_vocab, load_model, load_tokenizer

    backend = draft_backend(spec)
    tokenizer = load_tokenizer(spec.draft)
    check_same_vocab(target_tokenizer, tokenizer)
    vocab = draft_vocab(spec.draft_vocab, backend, len(tokenizer))
    options = replace(spec.load.for_draft(), quant=draft_quant(spec, backend), vocab=vocab)
    model = load_model(spec.draft, _dtype(spec.load.dtype, backend), backend, options)
    return LoadedDraft(model, backend, vocab)


def torch_dtype(name: str | None) -> torch.dtype:
    """The dtype named "bfloat16" or "float32"; None: the hardware's default."""
    import torch

    from specexec.models import default_dtype

    return getattr(torch, name) if name else default_dtype()


def target_backend(spec: PairSpec) -> str:
    """The backend the target runs on: a backend without one of the options given is ruled out."""
    from specexec.models import choose_backend

    return choose_backend(spec.backend, spec.target, spec.load.given())


def draft_backend(spec: PairSpec) -> str:
    """The backend the draft runs on, at its own quantization level (`draft_quant`, else `quant`)."""
    from specexec.models import choose_backend

    given = replace(spec.load.for_draft(), quant=spec.draft_quant or spec.load.quant).given()
    return choose_backend(spec.draft_backend or spec.backend, spec.draft, given)


def draft_quant(spec: PairSpec, backend: str) -> str:
    """The draft's quantization on `backend`: `draft_quant`, else `quant`; when neither is given, the
    backend's default beside a target streamed from disk (`ram`) or not (`default_draft_quant`: a Q4_0
    copy for a llama.cpp draft beside a streamed target, measured faster there, docs/benchmarks.md)."""
    from specexec.backends import backend as runtime

    quant = spec.draft_quant or spec.load.quant
    if spec.draft_quant is None and quant == "none":
        return runtime(backend).default_draft_quant(spec.load.ram is not None)
    return quant


def draft_vocab(value: int | str, backend: str, vocab_size: int) -> int:
    """A draft vocabulary request as a number: "auto" is the backend's default for a draft of
    `vocab_size` ids (`default_draft_vocab`: 64,000 on llama.cpp where the vocabulary is larger, measured
    faster there, docs/benchmarks.md; else 0, the whole vocabulary)."""
    from specexec.backends import backend as runtime

    if value != "auto":
        return int(value)
    return runtime(backend).default_draft_vocab(vocab_size)


def _dtype(name: str | None, backend: str) -> str | None:
    """The in-memory dtype to load with on `backend` (`name`, else the hardware's default): None where
    it has no such option."""
    from specexec.backends import backend as runtime

    return str(torch_dtype(name)).removeprefix("torch.") if "dtype" in runtime(backend).OPTIONS else None


def backend_label(target: str, draft: str | None) -> str:
    """The target's backend, or "target X, draft Y" where they differ, for the stats line."""
    return target if draft in (None, target) else f"target {target}, draft {draft}"
