"""The llama.cpp backend's model: a GGUF model run by ggml's kernels (llama-cpp-python's low-level API) behind
the same runner interface as the PyTorch backend (`extend`, `forward_tree`, `keep`, `move`).

llama.cpp addresses its KV cache by sequence ids and positions, not by slots. A cached token (cell) is
visible to a new token when the cell belongs to the new token's first sequence id and its position is
not later (llama-kv-cache.cpp, `set_input_kq_mask`). So a tree is verified in one `llama_decode`:

- the committed sequence is sequence 0; a context holds no other sequence until it needs one (llama.cpp
  reserves a row of logits per sequence), and meanwhile a one-token block on the committed prefix
  (plain decoding) is written into sequence 0 itself;
- every leaf of the block being decoded gets a fresh sequence id, and every token of the block carries
  the ids of the leaves below it; the cached path above the block joins those sequences by `seq_cp`
  (restricted to positions before the block), so each token sees exactly the prefix, its ancestors and
  itself;
- a slot (the engine's name for a tree node's KV) is remembered as (position, a sequence whose cells are
  exactly its path); keeping the accepted path relabels its cells to sequence 0 and drops every other
  sequence (`seq_keep`), which frees the cells of rejected branches.

llama.cpp aborts the whole process on some bad arguments (a batch above `n_batch`, `n_batch` below
`n_seq_max`); they are checked here first.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from specexec.backends.base import WeightsMemory
from specexec.backends.gguf_files import shards, version
from specexec.backends.llamacpp import rpc
from specexec.backends.llamacpp.draft_gguf import derived_draft
from specexec.backends.llamacpp.extra_buffers import library_build
from specexec.backends.llamacpp.library import CPU, MAX_SEQUENCES, LlamaCppError, llama_cpp_library
from specexec.backends.llamacpp.runner import LlamaCppRunner
from specexec.backends.llamacpp.weights import load_weights
from specexec.backends.options import LoadOptions, load_options

if TYPE_CHECKING:
    from specexec.backends.llamacpp.stream import Streamer

# Idle contexts a model keeps for its next runners (`LlamaCppModel.give_context`): one bounds the memory
# they hold and serves the dear case, a generation's 256-sequence context handed to the next generation.
SPARE_CONTEXTS = 1


class LlamaCppModel:
    """A GGUF model loaded by llama.cpp (weights memory-mapped, shared by every runner on it).

    Implements `specexec.backends.base.Model`, loaded as `options` ask (`fields`, `LoadOptions`' fields by
    name, set over them). `threads` sets llama.cpp's thread count (default: torch's).

    `vocab` > 0 makes a draft score only its first `vocab` token ids and the ids in `always`
    (`specexec.draft_vocab`): llama.cpp runs a copy of the GGUF whose output layer has those rows only
    (written once under the cache root), takes every input as an embedding looked up here from the full
    table, and the logits of the other ids are -inf. `quant` "q8_0" or "q4_0" runs a copy whose weights
    llama.cpp requantized to that type (`specexec.backends.llamacpp.draft_gguf`); "none" the GGUF's own.

    A runner's context outlives it as a spare (`give_context`): the next runner of the same shape takes
    it instead of making one, which costs 45 ms (one sequence) to 190 ms (256 sequences) for the 1.5B
    target on 2 cores, on every generation and on a generation's first tree.

    `ram` (bytes) caps the RAM its weights use: what does not fit is read from disk on every pass
    (`specexec.backends.llamacpp.weights`; 0 streams all it can). None, or a cap above the weights, loads
    them as usual.
    """

    runtime = "llama.cpp"
    cost_label = ""
    device = CPU
    max_tree_leaves = MAX_SEQUENCES - 1  # every leaf of a verified tree is a sequence of its own

    def __init__(self, gguf: str | os.PathLike, *, options: LoadOptions | None = None, **fields: Any) -> None:
        options = load_options(options, **fields)
        vocab, quant = options.vocab, options.quant
        self._llama_cpp = llama_cpp = llama_cpp_library()
        self.gguf = Path(gguf)
        if not self.gguf.is_file():
            raise LlamaCppError(f"GGUF file not found: {self.gguf}")
        shards(self.gguf)  # a split GGUF's first file, with every part beside it, or an error
        self.threads = options.threads or torch.get_num_threads()
        self.batch_invariant = options.batch_invariant
        if self.batch_invariant:
            self.max_tree_leaves = MAX_SEQUENCES - 2  # a runner's last sequence holds its dropped cells
        self.quantization = quant  # "none": the GGUF's own weights, whatever their types
        self.head: torch.Tensor | None = None  # (V',) the token ids of a reduced head's rows
        if options.ram is not None and (vocab or quant != "none"):
            raise LlamaCppError(
                "--ram streams a target's own GGUF, not a draft's copy (--draft-vocab, --draft-quant)"
            )
        loaded = derived_draft(self.gguf, vocab, options.always, quant, self.threads)
        if vocab:
            folder = loaded.parent
            head = json.loads((folder / "head.json").read_text())
            self.head = torch.tensor(head["kept"])
            self._embedding = np.load(folder / "embedding.npy", mmap_mode="r")  # (V, row bytes or n_embd)
            self._embedding_type = head["embedding_type"]

        def load(params, eval_callback) -> int:  # its contexts are the runners', made later
            # Kept at once: `__del__` frees it should the streamer fail to start.
            self.handle = llama_cpp.llama_model_load_from_file(str(loaded).encode(), params)
            if not self.handle:
                raise LlamaCppError(f"llama.cpp cannot load {self.gguf} (not a GGUF model it supports)")
            return self.handle

        loaded_weights = load_weights(self.gguf, options, load)
        self.extra_buffers = loaded_weights.extra_buffers
        self.stream: Streamer | None = loaded_weights.streamer
        self.workers = loaded_weights.placement  # its layers on RPC workers, or None
        vocab_handle = llama_cpp.llama_model_get_vocab(self.handle)
        self.head_rows = llama_cpp.llama_vocab_n_tokens(vocab_handle)  # rows of logits llama.cpp returns
        eos = [
            t
            for t in (llama_cpp.llama_vocab_eos(vocab_handle), llama_cpp.llama_vocab_eot(vocab_handle))
            if 0 <= t < self.head_rows
        ]
        n_vocab = self.head_rows
        if self.head is not None:
            n_vocab = head["vocab"]
            eos = [int(self.head[t]) for t in eos]
        self.vocab_size = n_vocab
        self.context_window = llama_cpp.llama_model_n_ctx_train(self.handle)
        self._eos = sorted(set(eos))
        self.num_parameters = llama_cpp.llama_model_n_params(self.handle)
        self.weights = _weight_type(llama_cpp, self.handle)  # e.g. "qwen2 1.5B Q4_K - Medium"
        self.width = llama_cpp.llama_model_n_embd(self.handle)
        # float16 keys and values (llama.cpp's default cache type) for every layer's KV heads.
        head_dim = self.width // llama_cpp.llama_model_n_head(self.handle)
        kv_width = llama_cpp.llama_model_n_head_kv(self.handle) * head_dim
        self.kv_bytes_per_token = 2 * 2 * kv_width * llama_cpp.llama_model_n_layer(self.handle)
        self.version = llama_cpp.__version__
        self._spares: list[tuple[tuple[int, int], int]] = []  # ((capacity, sequences), context pointer)
        self._spares_lock = threading.Lock()
        if self.workers is not None and self.batch_invariant and not _rows_as_alone(self):
            self._free()  # now, while the workers are there: the error's traceback keeps this object
            raise LlamaCppError(
                "--batch-invariant: the RPC workers compute a row of a block other than the row alone "
                "(ggml's tiled matmul is on there): start each with `specexec worker --batch-invariant`"
            )

    def take_context(self, capacity: int, sequences: int) -> int | None:
        """A spare context of a runner of `capacity` slots and `sequences` sequences, its cache empty, or
        None."""
        with self._spares_lock:
            for i, (shape, ctx) in enumerate(self._spares):
                if shape == (capacity, sequences):
                    del self._spares[i]
                    return ctx
        return None

    def give_context(self, ctx: int, capacity: int, sequences: int) -> None:
        """Keep a context its runner no longer uses as a spare (the newest SPARE_CONTEXTS are kept, older
        ones freed). Its cells are emptied and zeroed, as in a new context (a value left in an unused
        cell is masked out, but a NaN there would not be)."""
        llama_cpp = self._llama_cpp
        with self.on_workers():
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        with self._spares_lock:
            self._spares.append(((capacity, sequences), ctx))
            excess = max(0, len(self._spares) - SPARE_CONTEXTS)
            dropped, self._spares = self._spares[:excess], self._spares[excess:]
        with self.on_workers():
            for _, old in dropped:
                llama_cpp.llama_free(old)

    def on_workers(self) -> contextlib.AbstractContextManager:
        """What a call into llama.cpp that may wait on this model's RPC workers runs within: one that a
        worker's missed heartbeats or Ctrl-C may end (`rpc.on_workers`)."""
        return rpc.on_workers() if getattr(self, "workers", None) is not None else contextlib.nullcontext()

    def memory(self) -> WeightsMemory | None:
        """What stays in RAM and what streams, when `ram` made part of the weights stream."""
        if self.stream is None:
            return None
        plan = self.stream.plan
        return WeightsMemory(
            plan.resident_bytes, plan.streamed_bytes, plan.window_bytes, sum(self.stream.residency()),
            self.stream.disk_bytes_per_second,
        )  # fmt: skip

    def placement(self) -> str:
        """Which layers run on which RPC worker ("" where all run here)."""
        return self.workers.describe() if self.workers is not None else ""

    def eos_token_ids(self) -> list[int]:
        """The end-of-sequence and end-of-turn ids of the GGUF's vocabulary."""
        return list(self._eos)

    def cost_key(self) -> str:
        """What the calibration cache keys on: file, size, weight type, threads, library version and
        build, whether extra buffer types (AMX, repacking) are off, when streamed, how much and how it is
        read (past the page cache or through it), and over RPC, the workers, their layers and the round
        trip to each."""
        head = f":head{self.head_rows}" if self.head is not None else ""
        buffers = "" if self.extra_buffers else ":plain-buffers"
        buffers += ":batch-invariant" if self.batch_invariant else ""
        where = ""  # all in RAM here
        if self.stream is not None:
            where = f":streamed{self.stream.plan.streamed_bytes}-{self.stream.reads}"
        if self.workers is not None:
            where = f":rpc{self.workers.key()}"
        return (
            f"llamacpp:{self.gguf.name}:{version(self.gguf)}:{self.weights}{head}{where}{buffers}:"
            f"{self.threads}t:{self.version}:{library_build()}"
        )

    def make_runner(self, capacity: int, trees: bool = True) -> LlamaCppRunner:
        return LlamaCppRunner(self, capacity, trees=trees)

    def embed(self, tokens: list[int]) -> np.ndarray:
        """Input embeddings (n, width) of `tokens` for a model with a reduced head: the rows of the full
        table, dequantized as llama.cpp's own lookup does (float32)."""
        from gguf.quants import dequantize

        rows = dequantize(self._embedding[tokens], self._embedding_type)
        return np.ascontiguousarray(rows, dtype=np.float32)

    def __del__(self) -> None:
        self._free()

    def _free(self) -> None:
        if getattr(self, "workers", None) is not None and rpc.exiting():
            return
        with self.on_workers():
            for _, ctx in getattr(self, "_spares", []):
                self._llama_cpp.llama_free(ctx)  # contexts before the model they were made from
        self._spares = []
        if getattr(self, "stream", None) is not None:
            self.stream.close()
            self.stream = None
        if getattr(self, "handle", None):
            with self.on_workers():
                self._llama_cpp.llama_model_free(self.handle)
            self.handle = None


CHECKED_PREFIX, CHECKED_ROWS = 4, 16  # the block `_rows_as_alone` checks, after that many cached tokens


def _rows_as_alone(model: LlamaCppModel) -> bool:
    """Whether the first row of a block of CHECKED_ROWS rows gets bit for bit the logits of its token
    decoded alone, after a short prefix. What runs here is the mode's own (`batch_invariant_kernels`);
    what runs on RPC workers is theirs to choose, and ggml's tiled matmul, on unless a worker turns it
    off, takes blocks from 8 rows up."""
    prefix, rows = CHECKED_PREFIX, CHECKED_ROWS
    tokens = torch.tensor([(7919 * i) % model.vocab_size for i in range(1, prefix + rows + 1)])
    runner = LlamaCppRunner(model, prefix + rows)
    runner.extend(tokens[:prefix])
    positions = torch.arange(prefix, prefix + rows)
    chain = torch.ones(rows, prefix + rows, dtype=torch.bool).tril(prefix)  # row i sees rows <= i
    block = runner.forward_tree(tokens[prefix:], positions, positions, chain, rows)  # (rows, V)
    runner.keep(torch.arange(prefix))
    alone = runner.extend(tokens[prefix : prefix + 1])  # (1, V)
    return torch.equal(block[:1], alone)


def _weight_type(llama_cpp, handle) -> str:
    """The model's description, e.g. "qwen2 1.5B Q4_K - Medium"."""
    buf = ctypes.create_string_buffer(256)
    llama_cpp.llama_model_desc(handle, buf, len(buf))
    return buf.value.decode("utf-8", "replace")
