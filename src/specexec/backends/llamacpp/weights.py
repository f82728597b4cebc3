"""Loading a GGUF's weights with llama.cpp as its options ask: in RAM (llama.cpp's extra buffer types on
where they run), streamed from disk within `ram` bytes (`specexec.backends.llamacpp.stream`), or with its
layers on RPC workers (`specexec.backends.llamacpp.rpc`). Our backend's
models and the benchmark's llama-cpp-python peers load this way alike (only the extra buffers probe loads
with llama.cpp's defaults, on purpose); the rest of the package reaches streaming through this module."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from specexec.backends.llamacpp import rpc, stream
from specexec.backends.llamacpp.extra_buffers import extra_buffers_usable
from specexec.backends.llamacpp.lazy_load import libllama_path, unpopulated
from specexec.backends.llamacpp.library import LlamaCppError, batch_invariant_kernels, llama_cpp_library
from specexec.backends.llamacpp.stream import Streamer, evict, restore_resident
from specexec.backends.options import LoadOptions

__all__ = ["LoadedWeights", "evict", "load_weights", "restore_resident"]  # evict: for the bench's peers

Loaded = TypeVar("Loaded")


@dataclass
class LoadedWeights(Generic[Loaded]):
    """What `load_weights` loaded: `load`'s own result, the streamer when part of the weights streams."""

    loaded: Loaded
    streamer: Streamer | None
    extra_buffers: bool  # llama.cpp's extra buffer types (AMX tiles, repacked weights) on
    placement: rpc.Placement | None = None  # its layers on RPC workers


def load_weights(
    gguf: Path, options: LoadOptions, load: Callable[[Any, Any], Loaded], extra_buffers: bool = True
) -> LoadedWeights[Loaded]:
    """Load `gguf`'s weights with `load(params, eval_callback)`: `params` are the llama.cpp model
    parameters to load with (llama.cpp's defaults but what this sets), `eval_callback` what any context
    `load` makes must take as its `cb_eval` (None when nothing streams; a streamed model's contexts made
    later take `Streamer.eval_callback`, the same).

    `options.ram` None: in RAM. Else `stream.plan`: a model that fits loads as usual, else its file is mapped
    without being read whole, and a `Streamer` reads in the resident units and streams the rest.
    `extra_buffers` False keeps llama.cpp's extra buffer types off even where they run."""
    _refuse_combinations(options)
    llama_cpp = llama_cpp_library()
    params = llama_cpp.llama_model_default_params()
    plan = stream.plan(gguf, options.ram) if options.ram is not None else None
    if options.mlock:
        params.load_mode = llama_cpp.LLAMA_LOAD_MODE_MMAP_MLOCK
    if options.batch_invariant:
        batch_invariant_kernels()
        extra_buffers = False  # repacked weights' kernels sum a row differently from 4 rows up
    placement = None
    on_workers = contextlib.nullcontext()
    if options.rpc:
        placement = rpc.placement(options.rpc, rpc.model_layers(gguf), options.split)
        placement.apply(params)
        placement.watch()  # from the load on: it sends the workers their layers
        on_workers = rpc.on_workers()
    if plan is None or not plan.streamed:
        if not (extra_buffers and extra_buffers_usable()):
            params.use_extra_bufts = False  # asked, or AMX or repacked kernels would kill the process
        # graph_reuse_off: for a context `load` makes (the bench's peers); on_workers: the load is watched
        with rpc.graph_reuse_off(placement is not None), on_workers:
            loaded = load(params, None)
        if placement is not None:
            placement.watch()  # the connections the load opened too
        return LoadedWeights(loaded, None, bool(params.use_extra_bufts), placement)
    # Weights read straight from llama.cpp's mapping: not repacked into anonymous memory.
    params.use_extra_bufts = False
    params.load_mode = llama_cpp.LLAMA_LOAD_MODE_MMAP
    events = stream.LayerEvents()
    maps = stream.mapped()
    # A streamed target's file is not read whole at load: the streamer reads in what stays resident.
    with unpopulated(libllama_path()):
        loaded = load(params, events.callback)
    streamer = Streamer(gguf, stream.mapping_bases(gguf, maps), plan, events)
    streamer.populate_resident()
    return LoadedWeights(loaded, streamer, False)


def _refuse_combinations(options: LoadOptions) -> None:
    """One-line errors for options that exclude each other."""
    if options.mlock and options.ram is not None:
        raise LlamaCppError("--mlock keeps every weight in RAM, --ram streams some from disk: choose one")
    if options.split is not None and not options.rpc:
        raise LlamaCppError("--split gives the shares of RPC workers: it needs --rpc")
    if options.rpc and options.ram is not None:
        raise LlamaCppError(
            "--rpc puts the target's layers on workers, --ram streams them from disk: choose one"
        )
