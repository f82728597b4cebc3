"""Model runtimes behind one seam: `base.Model` (what a loaded model tells) and `base.Runner` (one
generation's KV cache on it). Each runtime is a subpackage that is a `base.Runtime` (a
`base.StreamingRuntime` where it streams weights from disk): its name, the weights it loads, the load
options it takes, and how it loads a model.

A model that has its own `make_runner` is a `Model` already; a PyTorch module is adapted by the torch
backend (`as_model`). Nothing above this package names a runtime. `gguf_files` reads a GGUF's files (a
split GGUF's too) for any runtime and for `specexec.models`.
"""

from __future__ import annotations

import importlib
from typing import cast

from specexec.backends.base import BackendError, Model, Runner, Runtime
from specexec.backends.options import Given

# The runtimes that load model sources, in the order "auto" prefers them: llama.cpp's kernels are faster
# than PyTorch's bf16/fp32 on every CPU measured (docs/benchmarks.md), and it runs the GGUF's own weights.
BACKENDS = ("llamacpp", "torch")


class BackendChoiceError(BackendError):
    """A backend that cannot run the given source or options; the message says why."""


def backend(name: str) -> Runtime:
    """The runtime subpackage called `name`."""
    if name not in BACKENDS:
        raise BackendChoiceError(
            f"unknown backend {name!r}; choose {', '.join(sorted(BACKENDS, reverse=True))} or auto"
        )
    return cast(Runtime, importlib.import_module(f"specexec.backends.{name}"))


def choose_backend(requested: str, source: str, is_gguf: bool, given: list[Given], gguf_names: str) -> str:
    """The backend that loads `source` (`is_gguf`: whether it is a GGUF) with the options `given` (see
    `refusal`): `requested` if it can, or for "auto" the first of BACKENDS that is installed and can.
    `gguf_names` lists the packaged GGUF sources, for the message to a GGUF-only backend given something
    else."""
    if requested == "auto":
        for name in BACKENDS:
            runtime = backend(name)
            gguf_ok = is_gguf or runtime.WEIGHTS != "gguf"
            if gguf_ok and runtime.refusal(given) is None and runtime.unavailable() is None:
                return name
        raise BackendChoiceError(f"no installed backend loads {source!r} with these options")
    runtime = backend(requested)
    reason = runtime.refusal(given)
    if reason is None and runtime.WEIGHTS == "gguf" and not is_gguf:
        reason = (
            f"the {runtime.LABEL} backend runs GGUF models, and {source!r} is not one; pass a .gguf file or "
            f"one of {gguf_names}"
        )
    reason = reason or runtime.unavailable()
    if reason is not None:
        raise BackendChoiceError(reason)
    return requested


def as_model(model) -> Model:
    """`model` as the engine sees it: a runtime's own model as it is; a PyTorch module through the torch
    backend's adapter (one adapter per module, so identities stay stable)."""
    if callable(getattr(type(model), "make_runner", None)):
        return model
    from specexec.backends.torch.model import TorchModel

    return TorchModel.of(model)


def make_runner(model, capacity: int, trees: bool = True) -> Runner:
    """A runner on `model` (`Model.make_runner`)."""
    return as_model(model).make_runner(capacity, trees=trees)
