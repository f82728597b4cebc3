"""llama.cpp as benchmark methods, through llama-cpp-python's high-level `Llama` class, its defaults kept.

- `llamacpp`: plain decoding of the target's GGUF. Same prompts (token ids, no re-tokenization), same
  end-of-sequence ids, same clock and the same sampling rule (`specexec.sampling`, applied to llama.cpp's
  logits) as the engine's `ar`. Prefill is llama.cpp's evaluation of the prompt minus its last token;
  decode is one evaluation per new token from there on, the engine's accounting exactly.
- `llamacpp-spec`: llama-cpp-python's own speculative decoding (`Llama.generate` with a `draft_model`):
  the draft GGUF proposes `budget` greedy tokens, the target evaluates them in one batch and samples
  each position with llama.cpp's own sampler, keeping the draft tokens up to the first mismatch. Prefill
  (target and draft, the prompt minus its last token) is timed apart, as for the engine.

With `ram` (the bench's --ram), both run the target as llama.cpp would in that much memory, repacking off
(repacked weights are anonymous memory, which cannot be streamed):
- `llamacpp`: plain llama.cpp when its model does not fit, at its best: the page cache's LRU evicts each
  page before the next pass needs it again, so the whole file is evicted before every pass, the pages
  our streamed targets keep resident included (in one process they would stay cached for it too); they
  are read back after its run, and neither the eviction nor that read is counted;
- `llamacpp-spec`: its target loaded and streamed by `specexec.backends.llamacpp.weights.load_weights`,
  as our own models' are.

Both load their models through `load_weights` too, so they get the model parameters our models get
(extra buffer types off where they do not run, or with `ram`).
"""

from __future__ import annotations

import functools
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from specexec.backends.gguf_files import file_bytes
from specexec.backends.llamacpp.draft_gguf import COPY_FILE
from specexec.backends.llamacpp.extra_buffers import kernels
from specexec.backends.llamacpp.library import INSTALL_HINT
from specexec.backends.llamacpp.weights import LoadedWeights, evict, load_weights, restore_resident
from specexec.backends.options import LoadOptions, load_options
from specexec.sampling import SamplingParams, argmax, probs_from_logits, sample
from specexec.timing import clock

CPU = torch.device("cpu")
PLAIN = "llamacpp"  # the bench method: the target's GGUF decoded by llama.cpp alone
SPECULATIVE = "llamacpp-spec"  # the bench method: llama.cpp's own speculative decoding (budget: draft length)


class LlamaCpp:
    """One loaded GGUF model, loaded as our target would be with `options` (`fields`, `LoadOptions`' fields
    by name, set over them): on `options.threads` threads (default: torch's thread count)."""

    def __init__(
        self, gguf: str | os.PathLike, context: int, *, options: LoadOptions | None = None, **fields: Any
    ) -> None:
        from specexec.bench.errors import BenchError

        try:
            import llama_cpp
        except ImportError:
            raise BenchError(f"method 'llamacpp' needs llama-cpp-python: {INSTALL_HINT}") from None
        options = load_options(options, **fields)
        ram = options.ram
        self.gguf = Path(gguf)
        self.threads = options.threads or torch.get_num_threads()
        # Loaded whole whatever `ram`: short of memory, it is evicted before every pass instead.
        loaded = _llama(
            self.gguf, replace(options, ram=None), ram is None, n_ctx=context, n_threads=self.threads
        )
        self.llm, self.extra_buffers = loaded.loaded, loaded.extra_buffers
        self.workers = loaded.placement  # kept with the model: its workers are watched while it lives
        self.short = ram is not None and ram < file_bytes(self.gguf)  # else it all stays in RAM
        if self.short:  # loading read it all
            evict(self.gguf)
            restore_resident(self.gguf)
        self.version = llama_cpp.__version__
        self.vocab = self.llm.n_vocab()
        self._logits_of_last = lambda: llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)

    def run(
        self,
        input_ids: list[int],
        max_new_tokens: int,
        seed: int,
        eos: list[int],
        *,
        temperature: float,
        top_p: float,
        top_k: int,
    ) -> dict:
        llm = self.llm
        sampling = SamplingParams(temperature, top_k, top_p)
        generator = torch.Generator().manual_seed(seed)
        llm.reset()
        evicting = 0.0  # seconds spent evicting, not counted
        if self.short:
            evicting -= clock(CPU)
            evict(self.gguf)
            evicting += clock(CPU)
        start = clock(CPU)
        if len(input_ids) > 1:
            llm.eval(input_ids[:-1])
        prefill = clock(CPU) - start
        tokens: list[int] = []
        step_input = input_ids[-1]
        while len(tokens) < max_new_tokens:
            if self.short:
                evicting -= clock(CPU)
                evict(self.gguf)
                evicting += clock(CPU)
            llm.eval([step_input])
            logits = torch.from_numpy(
                np.ctypeslib.as_array(self._logits_of_last(), shape=(self.vocab,))
            )  # (V,)
            if sampling.greedy:
                token = int(argmax(logits))
            else:
                token = int(sample(probs_from_logits(logits[None], sampling), generator)[0])
            tokens.append(token)
            if token in eos:
                break
            step_input = token
        wall = clock(CPU) - start - evicting
        settings = {
            "gguf": self.gguf.name, "threads": self.threads, "llama_cpp_python": self.version,
            **kernels(self.extra_buffers),
        }  # fmt: skip
        if self.short:
            settings["evicted_before_every_pass"] = True
            evict(self.gguf)  # its pages mapped would stay in RAM through the other methods' runs
            restore_resident(self.gguf)
        # llama.cpp's forwards and its sampling are inseparable here: all of decode is target time.
        record = _record(input_ids, tokens, eos, prefill, wall, len(tokens), 0, 0.0, settings)
        return {**record, "tree_sizes": [0] * len(tokens), "tree_depths": [0] * len(tokens)}


class LlamaCppSpeculative:
    """llama-cpp-python's speculative decoding: `target` verifies the greedy drafts of `draft` (GGUFs),
    loaded as our pair would be with `options` (`fields` set over them; the draft without the target's
    own, `LoadOptions.for_draft`)."""

    def __init__(
        self,
        target: str | os.PathLike,
        draft: str | os.PathLike,
        context: int,
        *,
        options: LoadOptions | None = None,
        **fields: Any,
    ) -> None:
        from specexec.bench.errors import BenchError

        try:
            import llama_cpp
        except ImportError:
            raise BenchError(f"method 'llamacpp-spec' needs llama-cpp-python: {INSTALL_HINT}") from None
        options = load_options(options, **fields)
        self.threads = options.threads or torch.get_num_threads()
        draft_options = options.for_draft()
        draft_llm = _llama(Path(draft), draft_options, True, n_ctx=context, n_threads=self.threads).loaded
        self.drafter = _GreedyDraft(draft_llm, lambda: llama_cpp.llama_get_logits_ith(draft_llm.ctx, -1))
        # The target's buffers: off with `ram` whether or not it streams, as for the plain peer.
        loaded = _llama(
            Path(target), options, options.ram is None, n_ctx=context, n_threads=self.threads,
            draft_model=self.drafter,
        )  # fmt: skip
        self.llm, self.streamer, self.extra_buffers = loaded.loaded, loaded.streamer, loaded.extra_buffers
        self.workers = loaded.placement  # kept with the model: its workers are watched while it lives
        # Every derived draft copy has the same file name: its folder says which copy it is.
        draft_name = (
            Path(draft).name if Path(draft).name != COPY_FILE else f"{Path(draft).parent.name}/{COPY_FILE}"
        )
        self.names = (Path(target).name, draft_name)
        self.version = llama_cpp.__version__
        self.target_calls = 0
        evaluate = self.llm.eval

        def counted(tokens) -> None:  # each eval during generation is one verification batch
            self.target_calls += 1
            if self.streamer is not None:
                self.streamer.begin()
            evaluate(tokens)
            if self.streamer is not None:
                self.streamer.end()

        self.llm.eval = counted

    def run(
        self,
        input_ids: list[int],
        max_new_tokens: int,
        seed: int,
        eos: list[int],
        *,
        draft_length: int,
        temperature: float,
        top_p: float,
        top_k: int,
    ) -> dict:
        llm, drafter = self.llm, self.drafter
        drafter.length = draft_length
        llm.reset()
        llm.set_seed(seed)
        start = clock(CPU)
        drafter.prefill(input_ids[:-1])
        if len(input_ids) > 1:
            llm.eval(input_ids[:-1])
        prefill = clock(CPU) - start
        drafter.calls, drafter.seconds, self.target_calls = 0, 0.0, 0
        tokens: list[int] = []
        # The prompt minus its last token is cached, so generate evaluates the last token only. llama.cpp's
        # sampler with every other transformation off: temperature, top-k, top-p only.
        for token in llm.generate(
            input_ids, temp=temperature, top_p=top_p, top_k=top_k, min_p=0.0,
            typical_p=1.0, repeat_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
        ):  # fmt: skip
            tokens.append(int(token))
            if token in eos or len(tokens) >= max_new_tokens:
                break
        wall = clock(CPU) - start
        if self.streamer is not None:
            self.streamer.release()
        settings = {
            "gguf": self.names[0],
            "draft_gguf": self.names[1],
            "draft_length": draft_length,
            "threads": self.threads,
            "llama_cpp_python": self.version,
            **kernels(self.extra_buffers),
        }
        record = _record(
            input_ids, tokens, eos, prefill, wall, self.target_calls, int(drafter.calls), drafter.seconds,
            settings,
        )  # fmt: skip
        return {**record, "tree_sizes": [], "tree_depths": []}


def _record(
    input_ids: list[int],
    tokens: list[int],
    eos: list[int],
    prefill: float,
    wall: float,
    target_calls: int,
    draft_calls: int,
    draft_seconds: float,
    settings: dict,
) -> dict:
    """A bench record of a llama.cpp run, with the engine's accounting: decode = wall - prefill, target
    time = decode minus the draft's."""
    return {
        "prompt_tokens": len(input_ids),
        "new_tokens": len(tokens),
        "tokens": tokens,
        "finish_reason": "stop" if tokens[-1] in eos else "length",
        "target_calls": target_calls,
        "draft_calls": draft_calls,
        "prefill_seconds": prefill,
        "decode_seconds": wall - prefill,
        "wall_seconds": wall,
        "draft_seconds": draft_seconds,
        "target_seconds": wall - prefill - draft_seconds,
        "accepted": None,
        "target_pace": None,
        "prefill_timing": "llamacpp",
        "hf_settings": settings,
    }


class _GreedyDraft:
    """A `llama_cpp.llama_speculative.LlamaDraftModel`: `length` greedy tokens of a second `Llama`,
    whose cache follows the target's tokens (the common prefix is kept, the rest re-evaluated)."""

    def __init__(self, llm, last_logits) -> None:
        self.llm = llm
        self.vocab = llm.n_vocab()
        self.last_logits = last_logits  # the logits of the last token evaluated (a ctypes pointer)
        self.length = 3
        self.calls = 0
        self.seconds = 0.0

    def prefill(self, ids: list[int]) -> None:
        self.llm.reset()
        if ids:
            self.llm.eval(ids)

    def __call__(self, input_ids: npt.NDArray[np.intc], /, **kwargs) -> npt.NDArray[np.intc]:
        start = clock(CPU)
        llm = self.llm
        cached = llm.input_ids[: llm.n_tokens]
        common = 0
        limit = min(len(cached), len(input_ids) - 1)  # the last token is always evaluated: its logits
        while common < limit and cached[common] == input_ids[common]:
            common += 1
        llm.n_tokens = common  # eval drops the cache past n_tokens first
        llm.eval(list(input_ids[common:]))
        drafted = []
        for i in range(self.length):
            token = int(np.argmax(np.ctypeslib.as_array(self.last_logits(), shape=(self.vocab,))))
            drafted.append(token)
            if i + 1 < self.length:
                llm.eval([token])
        self.calls += self.length
        self.seconds += clock(CPU) - start
        return np.array(drafted, dtype=np.intc)


def _llama(
    gguf: Path, options: LoadOptions, extra_buffers: bool, *, n_threads: int, **arguments
) -> LoadedWeights:
    """llama-cpp-python's `Llama` of `gguf` (its other arguments `arguments`, quiet), loaded by
    `load_weights` (`options`, `extra_buffers`): its model takes the parameters that sets, its context the
    eval callback of a streamed model."""
    llama = _llama_taking_params()

    def load(params, eval_callback):
        return llama(
            str(gguf), model_params=params, eval_callback=eval_callback, n_threads=n_threads,
            n_threads_batch=n_threads, verbose=False, **arguments,
        )  # fmt: skip

    return load_weights(gguf, options, load, extra_buffers)


@functools.cache
def _llama_taking_params() -> type:
    """`llama_cpp.Llama`, loading with the model parameters it is given and making its context with the
    eval callback it is given. `Llama.__init__` takes neither: it starts its `model_params` and
    `context_params` from llama.cpp's defaults, sets its own arguments on them, and loads at once. These
    properties hand it the given model parameters (llama.cpp's defaults but what `load_weights` set), a
    copy at each read so that its own settings (its load mode, no layers on devices) do not land, and
    set the callback on its context parameters."""
    import llama_cpp

    class Llama(llama_cpp.Llama):
        def __init__(self, model_path: str, *, model_params, eval_callback, **arguments) -> None:
            self._given_model_params, self._eval_callback = model_params, eval_callback
            super().__init__(model_path, **arguments)

        def close(self) -> None:
            from specexec.backends.llamacpp import rpc

            if not (self._given_model_params.devices and rpc.exiting()):  # see `rpc.exiting`
                super().close()

        @property
        def model_params(self):
            given = self._given_model_params
            return type(given).from_buffer_copy(given)

        @model_params.setter
        def model_params(self, defaults) -> None:
            pass  # its defaults: the given parameters stand instead

        @property
        def context_params(self):
            return self._context_params

        @context_params.setter
        def context_params(self, params) -> None:
            if self._eval_callback is not None:
                params.cb_eval = self._eval_callback
            self._context_params = params

    return Llama
