"""A third backend, written against `specexec.backends.base` alone, to prove the seam: a tiny Hugging Face
model run with no KV cache at all. Each forward recomputes every slot a row can see from the tokens and
positions the runner remembers per slot, under a mask built from the visible sets it remembers per slot.

It shares no code with the torch or llama.cpp runners, so a method that runs exactly on it relies on the
`Runner` contract only, not on either real runtime's internals.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from specexec.backends.base import SlotRunner
from specexec.backends.options import Given


class ToyModel:
    """A `specexec.backends.base.Model` over `module` (a float32 Hugging Face causal LM)."""

    runtime = "toy"
    weights = "float32"
    quantization = "none"
    cost_label = ""
    max_tree_leaves = None
    device = torch.device("cpu")

    def __init__(self, module: PreTrainedModel) -> None:
        self.module = module
        self.forwards = 0  # every forward this model ran, for the tests

    @property
    def vocab_size(self) -> int:
        return self.module.config.vocab_size

    @property
    def context_window(self) -> int | None:
        return self.module.config.max_position_embeddings

    def eos_token_ids(self) -> list[int]:
        eos = self.module.config.eos_token_id
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    def cost_key(self) -> str:
        return f"toy:{sum(p.numel() for p in self.module.parameters())}:{self.module.config.vocab_size}"

    def memory(self) -> None:
        return None

    def placement(self) -> str:
        return ""  # every layer runs in this process

    def make_runner(self, capacity: int, trees: bool = True) -> ToyRunner:
        return ToyRunner(self, capacity)


class ToyRunner(SlotRunner):
    """Slots as plain Python records: slot -> (token, position, the slots it sees, itself included)."""

    def __init__(self, model: ToyModel, capacity: int) -> None:
        self.model = model
        self.device = model.device
        self.capacity = capacity
        self.length = 0
        self.forward_seconds = 0.0
        self.records: dict[int, tuple[int, int, frozenset[int]]] = {}

    @property
    def nbytes(self) -> int:
        return 0

    def reserve(self, slots: int, most: int | None = None) -> None:
        self.capacity = max(self.capacity, slots)

    def extend(self, tokens: torch.Tensor, logits_to_keep: int | torch.Tensor = 1) -> torch.Tensor:
        n, start = tokens.numel(), self.length
        slots = torch.arange(start, start + n)
        allowed = torch.arange(start + n)[None, :] <= slots[:, None]  # (n, width) causal
        logits = self.forward_tree(tokens, slots, slots, allowed, logits_to_keep)
        self.length = start + n
        return logits

    def forward_tree(self, tokens, positions, slots, allowed, logits_to_keep=0) -> torch.Tensor:
        if allowed.shape[1] > self.capacity:
            raise RuntimeError(f"KV cache overflow: {allowed.shape[1]} > {self.capacity} slots")
        for token, position, slot, row in zip(
            tokens.tolist(), positions.tolist(), slots.tolist(), allowed, strict=True
        ):
            self.records[slot] = (token, position, frozenset(row.nonzero().flatten().tolist()))
        rows = slots.tolist()
        if isinstance(logits_to_keep, torch.Tensor):
            rows = [rows[i] for i in logits_to_keep.tolist()]
        elif logits_to_keep:
            rows = rows[-logits_to_keep:]
        return self._logits(rows)

    def keep(self, slots: torch.Tensor, subtree: torch.Tensor | None = None) -> None:
        kept = [self.records[s][:2] for s in slots.tolist()]
        below = [] if subtree is None else subtree.tolist()
        renamed = {s: i for i, s in enumerate(slots.tolist() + below)}
        moved = {renamed[s]: self.records[s] for s in below}
        self.records = {
            i: (token, position, frozenset(range(i + 1))) for i, (token, position) in enumerate(kept)
        }
        for slot, (token, position, seen) in moved.items():
            self.records[slot] = (token, position, frozenset(renamed[v] for v in seen))
        self.length = len(kept)

    def move(self, src: torch.Tensor, dst_start: int) -> None:
        renamed = {s: dst_start + j for j, s in enumerate(src.tolist())}
        moved = {renamed[s]: self.records[s] for s in renamed if s in self.records}  # some hold nothing yet
        for slot in [s for s in self.records if s >= dst_start]:
            del self.records[slot]
        for slot, (token, position, seen) in moved.items():
            self.records[slot] = (token, position, frozenset(renamed.get(v, v) for v in seen))

    def _logits(self, rows: list[int]) -> torch.Tensor:
        """Logits (len(rows), V): one forward over every slot the rows see, each row under its own mask."""
        needed = sorted(set().union(*(self.records[r][2] for r in rows)))
        index = {slot: i for i, slot in enumerate(needed)}
        tokens = torch.tensor([[self.records[s][0] for s in needed]])  # (1, n)
        positions = torch.tensor([[self.records[s][1] for s in needed]])  # (1, n)
        sees = torch.zeros(len(needed), len(needed), dtype=torch.bool)  # (n, n)
        for slot in needed:
            for seen in self.records[slot][2]:
                if seen in index:
                    sees[index[slot], index[seen]] = True
        mask = torch.zeros(sees.shape).masked_fill_(~sees, torch.finfo(torch.float32).min)[None, None]
        self.model.forwards += 1
        with torch.no_grad():
            out = self.model.module(
                input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=False
            )
        return out.logits[0, [index[r] for r in rows]]  # (m, V)


# The toy as a runtime (`specexec.backends.base.Runtime`): a Hugging Face folder, no load options.
LABEL = "toy"
WEIGHTS = "folder"
OPTIONS: tuple[str, ...] = ()
MAX_TREE_LEAVES = None


def unavailable() -> str | None:
    return None


def refusal(given: list[Given]) -> str | None:
    return f"{given[0].words} is not for the toy backend" if given else None


def load(path, options) -> ToyModel:
    from transformers import AutoModelForCausalLM

    return ToyModel(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())


def default_draft_vocab(vocab_size: int) -> int:
    return 0


def default_draft_quant(streamed_target: bool) -> str:
    return "none"
