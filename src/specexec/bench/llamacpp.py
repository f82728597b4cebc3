"""llama.cpp as a benchmark method: plain decoding of the target's GGUF through llama-cpp-python.

Same prompts (token ids, no re-tokenization), same end-of-sequence ids, same clock and the same sampling
rule (`specexec.sampling`, applied to llama.cpp's logits) as the engine's `ar`. Prefill is llama.cpp's
evaluation of the prompt minus its last token; decode is one evaluation per new token from there on,
the engine's accounting exactly.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from specexec.runner import clock
from specexec.sampling import SamplingParams, probs_from_logits, sample

CPU = torch.device("cpu")
INSTALL_HINT = "pip install 'specexec[llamacpp]' (pip builds llama.cpp from source, about 10 minutes)"


class LlamaCpp:
    """One loaded GGUF model, decoding with `threads` threads (default: torch's thread count)."""

    def __init__(self, gguf: str | os.PathLike, context: int, threads: int | None = None) -> None:
        from specexec.bench.core import BenchError

        try:
            import llama_cpp
        except ImportError:
            raise BenchError(f"method 'llamacpp' needs llama-cpp-python: {INSTALL_HINT}") from None
        self.gguf = Path(gguf)
        self.threads = threads or torch.get_num_threads()
        self.llm = llama_cpp.Llama(
            model_path=str(self.gguf),
            n_ctx=context,
            n_threads=self.threads,
            n_threads_batch=self.threads,
            verbose=False,
        )
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
        start = clock(CPU)
        if len(input_ids) > 1:
            llm.eval(input_ids[:-1])
        prefill = clock(CPU) - start
        tokens: list[int] = []
        step_input = input_ids[-1]
        while len(tokens) < max_new_tokens:
            llm.eval([step_input])
            logits = torch.from_numpy(
                np.ctypeslib.as_array(self._logits_of_last(), shape=(self.vocab,))
            )  # (V,)
            if sampling.greedy:
                token = int(logits.argmax())
            else:
                token = int(sample(probs_from_logits(logits[None], sampling), generator)[0])
            tokens.append(token)
            if token in eos:
                break
            step_input = token
        wall = clock(CPU) - start
        return {
            "prompt_tokens": len(input_ids),
            "new_tokens": len(tokens),
            "tokens": tokens,
            "finish_reason": "stop" if tokens[-1] in eos else "length",
            "target_calls": len(tokens),
            "draft_calls": 0,
            "prefill_seconds": prefill,
            "decode_seconds": wall - prefill,
            "wall_seconds": wall,
            "draft_seconds": 0.0,
            "target_seconds": wall - prefill,  # llama.cpp's forwards and its sampling, inseparable here
            "tree_sizes": [0] * len(tokens),
            "tree_depths": [0] * len(tokens),
            "accepted": None,
            "prefill_timing": "llamacpp",
            "hf_settings": {
                "gguf": self.gguf.name,
                "threads": self.threads,
                "llama_cpp_python": self.version,
            },
        }
