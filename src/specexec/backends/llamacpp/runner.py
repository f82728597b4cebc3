"""The llama.cpp backend's runner: the slot interface of `specexec.backends.base.Runner` over a llama.cpp
context, trees verified in one `llama_decode` with a sequence id per leaf (`model.py` says how)."""

from __future__ import annotations

import contextlib
import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from specexec.backends.base import SlotRunner, grown_capacity
from specexec.backends.llamacpp import rpc
from specexec.backends.llamacpp.library import (
    CPU,
    MAX_SEQUENCES,
    LlamaCppError,
    llama_cpp_library,
    note_context,
)
from specexec.draft_vocab import full_vocab_logits
from specexec.timing import clock

if TYPE_CHECKING:
    from specexec.backends.llamacpp.stream import Streamer

GGML_TYPE_Q8_0 = 8  # ggml_type
BATCH = 512  # tokens per llama_decode call (n_batch = n_ubatch); longer blocks are split
CELL_BLOCK = 1024  # a context's cells come in whole blocks of this many (see _in_blocks)
# Dropped cells a batch-invariant runner keeps taken (`_drop_cells`) before it lays its cache out again: a
# context has BATCH cells beyond its capacity, and half of them stay free for the next tree.
KEPT_DROPPED_CELLS = BATCH // 2


@dataclass
class _Slot:
    position: int
    sequence: int  # a sequence whose cells at positions <= `position` are exactly this slot's path
    depth: int  # cached tokens on the path above the committed prefix, this one included
    parent: int | None  # the parent's slot, None when the parent is the committed prefix


class RunnerModel(Protocol):
    """What a runner reads of its model (`specexec.backends.llamacpp.model.LlamaCppModel`)."""

    handle: int  # the llama_model
    threads: int
    head: torch.Tensor | None  # (V',) the token ids of a reduced head's rows, None for the whole head
    head_rows: int  # rows of logits llama.cpp returns
    kv_bytes_per_token: int
    stream: Streamer | None  # the streamer of weights read from disk every pass
    batch_invariant: bool  # a row's logits must not depend on the block it is decoded in
    workers: rpc.Placement | None  # its layers on RPC workers

    vocab_size: int  # token ids it scores
    width: int  # n_embd: a reduced head's model takes embeddings this wide

    def take_context(self, capacity: int, sequences: int) -> int | None: ...

    def give_context(self, ctx: int, capacity: int, sequences: int) -> None: ...

    def embed(self, tokens: list[int]) -> np.ndarray: ...

    def on_workers(self) -> contextlib.AbstractContextManager: ...


class LlamaCppRunner(SlotRunner):
    """Drives one `LlamaCppModel` over its own llama.cpp context: `extend`, `forward_tree`, `keep`,
    `move`, with the slot semantics of `specexec.backends.base.Runner`."""

    def __init__(self, model: RunnerModel, capacity: int, trees: bool = True) -> None:
        self.llama_cpp = llama_cpp = llama_cpp_library()
        self.model = model
        self.device = CPU
        self.capacity = _in_blocks(capacity)
        # Without trees, sequence 0 only until the first block that needs a sequence of its own:
        # llama.cpp reserves a logits row per sequence (148 MiB at 256 sequences of a 151,936-token
        # vocabulary), wasted by plain decoding, whose one-token blocks go straight into sequence 0.
        self.sequences = MAX_SEQUENCES if trees else 1
        self.length = 0
        self.forward_seconds = 0.0
        self.vocab = model.vocab_size
        self.ctx = self._new_context(self.capacity, self.sequences)
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        # A reduced head's model takes embeddings: its own table holds only the head's tokens.
        embedded = model.width if model.head is not None else 0
        self.batch = llama_cpp.llama_batch_init(BATCH, embedded, MAX_SEQUENCES)
        self.slots: dict[int, _Slot] = {}
        self.dropped = 0  # cells `_drop_cells` kept taken since the cache was last laid out
        self._reset_sequences()

    def __del__(self) -> None:
        llama_cpp = getattr(self, "llama_cpp", None)
        if getattr(self, "model", None) is not None and self.model.workers is not None and rpc.exiting():
            return
        if llama_cpp is not None and getattr(self, "ctx", None):
            llama_cpp.llama_batch_free(self.batch)
            self.model.give_context(self.ctx, self.capacity, self.sequences)
            self.ctx = None
            self.idle()  # a runner no generation released (a calibration's, a test's)

    def idle(self) -> None:
        """No forward until the next generation: a streamed model holds its resident part only."""
        if self.model.stream is not None:
            self.model.stream.release()

    # The runner interface.

    @property
    def nbytes(self) -> int:
        """Memory this context holds: its KV cells (llama.cpp allocates every cell when the context is
        made) and its logits buffer, which llama.cpp reserves for one row per sequence (n_seq_max rows of
        float32: 148 MiB at 256 sequences of a 151,936-token vocabulary; measured, a context's resident
        set is within 10% of this sum)."""
        logits = self.sequences * self.model.head_rows * 4
        return (self.capacity + BATCH) * self.model.kv_bytes_per_token + logits

    def reserve(self, slots: int, most: int | None = None) -> None:
        """Make room for at least `slots` slots (twice the capacity where that is more, up to `most`):
        a larger context, the committed sequence copied into it, any tree dropped."""
        if slots <= self.capacity:
            return
        self._drop_tree()
        self._rebuild(_in_blocks(grown_capacity(self.capacity, slots, most)), self.sequences)

    def extend(self, tokens: torch.Tensor, logits_to_keep: int | torch.Tensor = 1) -> torch.Tensor:
        """Append `tokens` (n,) to the committed sequence (dropping any tree); logits (m, V) of the kept
        rows."""
        self._drop_tree()
        n = tokens.numel()
        if self.length + n > self.capacity:
            raise LlamaCppError(f"KV cache overflow: {self.length + n} > {self.capacity} slots")
        positions = list(range(self.length, self.length + n))
        rows = [[0]] * n
        logits = self._decode(tokens.tolist(), positions, rows, _kept_rows(logits_to_keep, n))
        self.length += n
        return logits

    def forward_tree(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        allowed: torch.Tensor,
        logits_to_keep: int | torch.Tensor = 0,
    ) -> torch.Tensor:
        """Forward tokens (n,) at `positions` into `slots`, row i seeing the slots j with allowed[i, j]
        (n, width). Every row must see the whole committed prefix, and its other visible slots must be
        its ancestors in a tree (one more position per level): the masks tree drafting and verification
        build. Does not change the committed length."""
        n = tokens.numel()
        width = allowed.shape[1]
        if width > self.capacity:
            raise LlamaCppError(f"KV cache overflow: {width} > {self.capacity} slots")
        length = self.length
        if not bool(allowed[:, :length].all()):
            raise LlamaCppError("llama.cpp backend: every row must see the whole committed prefix")
        slot_list, position_list = slots.tolist(), positions.tolist()
        for slot in slot_list:
            if slot < length:
                raise LlamaCppError(f"slot {slot} is committed; a tree writes above slot {length - 1}")
            self._release(slot)
        visible = allowed[:, length:]  # (n, width - length)
        # Each row's parent: the visible slot other than its own with the latest position.
        batch_row = {slot: i for i, slot in enumerate(slot_list)}
        parents: list[int | None] = []
        depths: list[int] = []
        for i, (slot, position) in enumerate(zip(slot_list, position_list, strict=True)):
            seen = [length + j for j in visible[i].nonzero().flatten().tolist() if length + j != slot]
            parent = max(seen, key=self._position_of(position_list, batch_row), default=None)
            if parent is None:
                depth, parent_position = 1, length - 1
            elif parent in batch_row:
                if batch_row[parent] >= i:
                    raise LlamaCppError("llama.cpp backend: tree rows must come after their parent")
                depth, parent_position = depths[batch_row[parent]] + 1, position_list[batch_row[parent]]
            elif parent in self.slots:
                depth, parent_position = self.slots[parent].depth + 1, self.slots[parent].position
            else:
                raise LlamaCppError(f"llama.cpp backend: row {i} sees slot {parent}, which holds nothing")
            if len(seen) + 1 != depth or position != parent_position + 1:
                raise LlamaCppError(
                    "llama.cpp backend: a row's visible slots must be its ancestors, one position apart"
                )
            parents.append(parent)
            depths.append(depth)
        if self.sequences == 1 and n == 1 and parents[0] is None and not self.slots:
            # One token on the committed prefix (plain decoding): written into sequence 0 itself;
            # `keep` commits it, `_drop_tree` or `_release` removes it.
            return self._decode_into(slot_list, position_list, [[0]], depths, parents, tokens, logits_to_keep)
        if self.sequences < MAX_SEQUENCES:
            # Every cell, and any slot, is sequence 0's, which the copy keeps.
            self._rebuild(self.capacity, MAX_SEQUENCES)
        # A fresh sequence per leaf of the block; each row carries the sequences of the leaves below it.
        has_child = {batch_row[p] for p in parents if p in batch_row}
        leaves = [i for i in range(n) if i not in has_child]
        if len(leaves) > len(self.free_sequences):
            raise LlamaCppError(
                f"llama.cpp backend: a tree with {len(leaves)} leaves needs more than the "
                f"{len(self._leaf_sequences())} sequences this context gives leaves; use a smaller budget"
            )
        rows: list[list[int]] = [[] for _ in range(n)]
        for i in leaves:
            rows[i].append(self.free_sequences.pop())
        for i in reversed(range(n)):
            parent = parents[i]
            if parent in batch_row:
                rows[batch_row[parent]].extend(rows[i])
        # The cached path above each block root joins the sequences of the leaves below that root.
        seq_cp = self.llama_cpp.llama_memory_seq_cp
        for i in range(n):
            parent = parents[i]
            if parent in batch_row:
                continue
            anchor = 0 if parent is None else self.slots[parent].sequence
            for sequence in rows[i]:
                seq_cp(self.memory, anchor, sequence, -1, position_list[i])
        return self._decode_into(slot_list, position_list, rows, depths, parents, tokens, logits_to_keep)

    def keep(self, slots: torch.Tensor, subtree: torch.Tensor | None = None) -> None:
        """Make the committed sequence exactly `slots`: a prefix of the committed slots, then (if the
        whole committed sequence is kept) a path of tree slots in order. `subtree`: tree slots below the
        path's last one (ascending), renumbered to follow the new committed sequence; the other tree
        slots are dropped."""
        slot_list = slots.tolist()
        k = 0
        while k < len(slot_list) and k < self.length and slot_list[k] == k:
            k += 1
        tail = slot_list[k:]
        memory, llama_cpp = self.memory, self.llama_cpp
        if tail:
            if k != self.length:
                raise LlamaCppError("llama.cpp backend: a kept path must follow the whole committed prefix")
            last = self.slots.get(tail[-1])
            path = self._path(tail[-1]) if last is not None else []
            if path != tail:
                raise LlamaCppError("llama.cpp backend: kept tree slots must be one root-to-node path")
            if last.sequence:
                llama_cpp.llama_memory_seq_cp(memory, last.sequence, 0, k, k + len(tail))
        elif k < self.length:
            llama_cpp.llama_memory_seq_rm(memory, 0, k, -1)
        self.length = k + len(tail)
        if subtree is None or not subtree.numel():
            self._drop_tree(committed=len(tail))
            if self.dropped > KEPT_DROPPED_CELLS:
                self._compact()
            return
        if not tail or self.sequences < MAX_SEQUENCES:
            raise LlamaCppError("llama.cpp backend: a kept subtree must hang below a kept tree path")
        below = subtree.tolist()  # some may hold nothing yet (nodes not forwarded)
        held = [s for s in below if s in self.slots]
        if any(self.slots[s].parent not in (tail[-1], *below) for s in held) or min(below) < self.length:
            raise LlamaCppError("llama.cpp backend: a kept subtree must hang below the kept path's end")
        # Each subtree slot's own sequence holds the committed cells and its ancestors': once the path is
        # in sequence 0 too, every other slot can go, the path's included.
        for slot in [s for s in self.slots if s not in set(held)]:
            self._release(slot)
        for slot in held:
            info = self.slots[slot]
            info.depth -= len(tail)
            info.parent = None if info.parent == tail[-1] else info.parent
        self.move(subtree, self.length)

    def move(self, src: torch.Tensor, dst_start: int) -> None:
        """Renumber tree slots: slot src[j] becomes dst_start + j; every other slot at or above
        `dst_start` is released (its cells freed once nothing else needs them)."""
        src_list = src.tolist()
        if src_list and min(src_list) < dst_start:
            raise LlamaCppError("llama.cpp backend: tree slots only move down")
        moved = {dst_start + j: self.slots[s] for j, s in enumerate(src_list) if s in self.slots}
        renamed = {s: dst_start + j for j, s in enumerate(src_list)}
        for slot in [s for s in self.slots if s >= dst_start]:
            if slot not in renamed:
                self._release(slot)
            else:
                del self.slots[slot]
        for info in moved.values():
            if info.parent is not None:
                info.parent = renamed.get(info.parent, info.parent)
        self.slots.update(moved)

    def share_cpu(self, shared: bool) -> None:
        """One thread while `shared`: beside a streamed target's pass, one draft thread took less from it
        than two (2 cores, a 16-token pass at --ram 0: 0.49 s alone, 0.57 s beside one draft thread, 0.61
        s beside two) and ran about as fast as two did there."""
        threads = 1 if shared else self.model.threads
        self.llama_cpp.llama_set_n_threads(self.ctx, threads, threads)

    # Internals.

    def _decode_into(self, slot_list, position_list, rows, depths, parents, tokens, logits_to_keep):
        """Decode a block whose sequences are assigned (`rows`) and record its slots."""
        kept = _kept_rows(logits_to_keep, len(slot_list))
        logits = self._decode(tokens.tolist(), position_list, rows, kept)
        for i, slot in enumerate(slot_list):
            sequence = rows[i][0]
            self.slots[slot] = _Slot(position_list[i], sequence, depths[i], parents[i])
            self.users[sequence] += sequence > 0  # sequence 0 is never freed: not counted
        return logits

    def _rebuild(self, capacity: int, sequences: int) -> None:
        """Move to a new context of `capacity` slots and `sequences` sequences, with sequence 0's cells
        copied into it (the other sequences must be empty)."""
        llama_cpp = self.llama_cpp
        with self.model.on_workers():  # the cache read from the workers and written to them
            size = llama_cpp.llama_state_seq_get_size(self.ctx, 0)
            state = (ctypes.c_uint8 * size)()
            written = llama_cpp.llama_state_seq_get_data(self.ctx, state, size, 0)
            ctx = self._new_context(capacity, sequences)
            cached = self.length or self.slots
            if cached and llama_cpp.llama_state_seq_set_data(ctx, state, written, 0) == 0:
                llama_cpp.llama_free(ctx)
                ctx = None
        if ctx is None:
            raise LlamaCppError("llama.cpp could not copy the KV cache into a new context")
        self.model.give_context(self.ctx, self.capacity, self.sequences)
        self.ctx, self.memory = ctx, llama_cpp.llama_get_memory(ctx)
        self.capacity, self.sequences = capacity, sequences
        self.dropped = 0
        self._reset_sequences()

    def _new_context(self, capacity: int, sequences: int):
        spare = self.model.take_context(capacity, sequences)
        if spare:
            return spare
        llama_cpp = self.llama_cpp
        params = llama_cpp.llama_context_default_params()
        # Cells: the committed tokens plus every tree node of a step (pruned ones are freed at once).
        params.n_ctx = capacity + BATCH
        params.n_batch = params.n_ubatch = BATCH
        params.n_seq_max = sequences
        params.kv_unified = True  # one cell may belong to many sequences: required for trees
        params.n_threads = params.n_threads_batch = self.model.threads
        params.no_perf = True
        if self.model.stream is not None:
            params.cb_eval = self.model.stream.eval_callback  # each layer's end: drop it, read further ahead
        # Flash attention off: ggml's CPU flash attention sums over cache cells in cell order with
        # float16 rounding, and accepted paths leave cells out of position order (rejected nodes' cells
        # are holes the next tree fills), which moved logits by up to 1% on the test models; it also
        # switches kernels at 64 query rows. Without it, a tree row's logits are the one-token logits
        # (bit for bit with 8-bit weights in the tests), whatever the tree's size or cell layout.
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        if self.model.batch_invariant:
            # Without flash attention the attention matmuls go to llamafile's sgemm, whose sums follow
            # the block's shape. Flash attention over an 8-bit cache takes its one-row path for any
            # block (its tiled and thread-split paths are for float caches) and sums in float32.
            params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
            params.type_k = params.type_v = GGML_TYPE_Q8_0
        note_context()
        with rpc.graph_reuse_off(self.model.workers is not None), self.model.on_workers():
            ctx = llama_cpp.llama_init_from_model(self.model.handle, params)
        if not ctx:
            raise LlamaCppError(f"llama.cpp could not create a context of {params.n_ctx} tokens")
        return ctx

    def _decode(
        self, tokens: list[int], positions: list[int], rows: list[list[int]], kept: list[int]
    ) -> torch.Tensor:
        """llama_decode over the rows, BATCH at a time; logits (len(kept), V) of rows `kept`."""
        llama_cpp, batch = self.llama_cpp, self.batch
        wanted = set(kept)
        head, streamer = self.model.head, self.model.stream
        # One array for every kept row, filled batch by batch. Concatenating the batches' copies after cost
        # a second copy into fresh memory, slow beside the streaming reader: 80 ms a streamed pass on
        # average (the real pair at --ram 0, T=0.6), against 0.6 ms for the same copy on its own.
        out = np.empty((len(wanted), self.model.head_rows), np.float32)  # rows in batch order
        filled = 0
        start = clock(CPU)
        for first in range(0, len(tokens), BATCH):
            count = min(BATCH, len(tokens) - first)
            if head is not None:
                inputs = self.model.embed(tokens[first : first + count])  # (count, width)
                ctypes.memmove(batch.embd, inputs.ctypes.data, inputs.nbytes)
            outputs = 0
            for j in range(count):
                i = first + j
                if head is None:
                    batch.token[j] = tokens[i]
                batch.pos[j] = positions[i]
                batch.n_seq_id[j] = len(rows[i])
                for k, sequence in enumerate(rows[i]):
                    batch.seq_id[j][k] = sequence
                batch.logits[j] = i in wanted
                outputs += i in wanted
            batch.n_tokens = count
            if streamer is not None:
                streamer.begin()
            with self.model.on_workers():  # llama_get_logits waits for the pass too
                status = llama_cpp.llama_decode(self.ctx, batch)
                if status == 0 and outputs:
                    rows_out = llama_cpp.llama_get_logits(self.ctx)
            if streamer is not None:
                streamer.end()
            if status != 0:
                raise LlamaCppError(f"llama_decode failed with status {status} (KV cache full or bad batch)")
            if outputs:
                out[filled : filled + outputs] = np.ctypeslib.as_array(
                    rows_out, shape=(outputs, self.model.head_rows)
                )  # (outputs, V')
                filled += outputs
        self.forward_seconds += clock(CPU) - start
        if not filled:
            return torch.empty(0, self.vocab)
        logits = torch.from_numpy(out[:filled])  # (m, V')
        if head is not None:
            logits = full_vocab_logits(logits, head, self.vocab)  # (m, V)
        order = sorted(kept)
        if order == kept:
            return logits
        index = {row: j for j, row in enumerate(order)}
        return logits[[index[row] for row in kept]]

    def _compact(self) -> None:
        """Lay sequence 0's cells out again in position order from cell 0, as plain decoding leaves them,
        and free the dropped cells (`_drop_cells`). Only between trees: every other sequence is empty."""
        llama_cpp = self.llama_cpp
        with self.model.on_workers():  # the cache read from the workers and written to them
            size = llama_cpp.llama_state_seq_get_size(self.ctx, 0)
            state = (ctypes.c_uint8 * size)()
            written = llama_cpp.llama_state_seq_get_data(self.ctx, state, size, 0)
            llama_cpp.llama_memory_clear(self.memory, False)  # every cell free: placed from cell 0 on
            laid_out = llama_cpp.llama_state_seq_set_data(self.ctx, state, written, 0)
        if laid_out == 0:
            raise LlamaCppError("llama.cpp could not lay the KV cache out again")
        self.dropped = 0

    def _position_of(self, position_list: list[int], batch_row: dict[int, int]):
        def position(slot: int) -> int:
            if slot in batch_row:
                return position_list[batch_row[slot]]
            info = self.slots.get(slot)
            return info.position if info is not None else -1

        return position

    def _path(self, slot: int) -> list[int]:
        path = []
        while slot is not None:
            path.append(slot)
            slot = self.slots[slot].parent
        return path[::-1]

    def _release(self, slot: int) -> None:
        info = self.slots.pop(slot, None)
        if info is None:
            return
        sequence = info.sequence
        self.dropped += self._dropped_sequence() is not None
        if not sequence:  # a token decoded into sequence 0 and not committed
            self._drop_cells(0, info.position, info.position + 1)
            return
        self.users[sequence] -= 1
        if not self.users[sequence] and sequence not in self.free_sequences:
            self._drop_cells(sequence, -1, -1)
            self.free_sequences.append(sequence)

    def _drop_tree(self, committed: int = 0) -> None:
        """Forget every tree slot: only sequence 0's cells stay. `committed`: how many of the slots
        `keep` just made sequence 0's."""
        if not self.slots and len(self.free_sequences) == len(self._leaf_sequences()):
            return
        if self._dropped_sequence() is None:
            self.llama_cpp.llama_memory_seq_keep(self.memory, 0)
            self.llama_cpp.llama_memory_seq_rm(self.memory, 0, self.length, -1)  # uncommitted tokens
        else:
            for sequence in set(self._leaf_sequences()) - set(self.free_sequences):
                self._drop_cells(sequence, -1, -1)
            self._drop_cells(0, self.length, -1)
            self.dropped += len(self.slots) - committed
        self.slots.clear()
        self._reset_sequences()

    def _drop_cells(self, sequence: int, start: int, stop: int) -> None:
        """Take `sequence` off its cells at positions [start, stop) (-1: open). A batch-invariant runner's
        cells stay taken, by a sequence no token sees, until `_compact`: freed, they would be holes below
        committed cells, which the next tree's nodes fill, and committed tokens would come to sit out of
        position order. Flash attention sums over cells in cell order (skipping the ones a row does not
        see), so a cache in position order gives every row plain decoding's sums."""
        dropped = self._dropped_sequence()
        if dropped is not None:
            self.llama_cpp.llama_memory_seq_cp(self.memory, sequence, dropped, start, stop)
        self.llama_cpp.llama_memory_seq_rm(self.memory, sequence, start, stop)

    def _dropped_sequence(self) -> int | None:
        """The sequence that holds a batch-invariant runner's dropped cells (its context's last), None where
        dropped cells are freed."""
        if self.model.batch_invariant and self.sequences == MAX_SEQUENCES:
            return self.sequences - 1
        return None

    def _leaf_sequences(self) -> range:
        """The sequence ids a tree's leaves may take."""
        return range(1, self.sequences if self._dropped_sequence() is None else self.sequences - 1)

    def _reset_sequences(self) -> None:
        self.free_sequences = list(reversed(self._leaf_sequences()))  # pop() hands out 1 first
        self.users = [0] * self.sequences  # slots whose `sequence` is this id


def _in_blocks(cells: int) -> int:
    """`cells` rounded up to whole CELL_BLOCKs: a new context costs about 90 ms and holds fixed buffers
    (a 148 MiB logits reserve for a 151,936-token vocabulary) that dwarf a block's KV (28 MiB for a
    1.5B Qwen2.5), so contexts grow in large steps and rarely."""
    return -(-cells // CELL_BLOCK) * CELL_BLOCK


def _kept_rows(logits_to_keep: int | torch.Tensor, n: int) -> list[int]:
    """Row indices for the runner's `logits_to_keep` (0 = all, k = last k, or a tensor of rows)."""
    if isinstance(logits_to_keep, torch.Tensor):
        return logits_to_keep.tolist()
    if logits_to_keep == 0:
        return list(range(n))
    return list(range(max(0, n - logits_to_keep), n))
