"""What every drafter shares: the proposal it returns and the draft forwards over a tree."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specexec.backends.base import PREFILL_CHUNK, Runner, prefill
from specexec.sampling import SamplingParams
from specexec.tree import DraftTree


@dataclass
class Draft:
    """A proposal for one step: the tree to verify and, for sampled drafts, the distribution q that the
    children of each expanded node were drawn from (node -> (V,) probabilities)."""

    tree: DraftTree
    draft_probs: dict[int, torch.Tensor] = field(default_factory=dict)
    draft_calls: int = 0
    confidences: list[float] = field(default_factory=list)  # a chain's own token probabilities, in order
    grafted: int = 0  # the tree's last `grafted` nodes are prompt-lookup guesses, not draft samples
    # Tokens the draft's first forward took in: the root and any committed tokens the draft had not seen
    # (after a path ending at an unexpanded node, that node; after plain steps, all of theirs).
    first_pass_tokens: int = 0


@dataclass
class DraftRequest:
    """What a drafter needs to know about the sequence so far."""

    committed: torch.Tensor  # (n,) prompt and emitted tokens; the last one is the tree root
    max_depth: int  # deepest useful node: the step emits at most max_depth + 1 tokens
    eos_token_ids: torch.Tensor  # (E,) tokens after which nothing is generated
    vocab_size: int  # the target's: draft tokens beyond it can never be accepted
    sampling: SamplingParams
    generator: torch.Generator | None
    runner: Runner | None  # the draft model's runner (None for `ar`)
    # A tree the draft already grew from this root while the last step was verified (`draft_ahead`), its
    # expanded nodes' KV in place in the runner; None: draft from scratch.
    head_start: DraftTree | None = None


def plain_step(request: DraftRequest) -> Draft:
    """The proposal of a step that does not draft: the root alone, so the target samples one token."""
    return Draft(DraftTree(int(request.committed[-1]), 1, request.committed.device))


class Drafter(Protocol):
    max_tree_size: int

    def propose(self, request: DraftRequest) -> Draft: ...

    def may_draft(self, steps: int = 1) -> bool: ...

    def observe(self, draft: Draft, path: Sequence[int], target_seconds: float) -> None: ...

    def draft_ahead(
        self, draft: Draft, request: DraftRequest, verifying: Callable[[], bool], most: int
    ) -> Draft | None: ...


class DrafterBase:
    """Default behaviour: drafters that do not learn from verification results ignore them."""

    max_tree_size: int

    def may_draft(self, steps: int = 1) -> bool:
        """Whether this drafter may draft within the next `steps` steps; if not, the engine does not
        prefill the draft model (it catches up on the committed tokens when it first drafts). An auto
        budget may not where drafting cannot pay, or while its gate pauses drafting for longer (a pause
        carried over from earlier generations by `LearntPolicies`)."""
        return True

    def observe(self, draft: Draft, path: Sequence[int], target_seconds: float) -> None:
        """Called after each verification with the accepted tree nodes, root excluded, in order, and the
        seconds the target's forward took."""

    def draft_ahead(
        self, draft: Draft, request: DraftRequest, verifying: Callable[[], bool], most: int
    ) -> Draft | None:
        """While `verifying()` (the target checks `draft` on another thread), grow a copy of its tree
        further (its first nodes `draft`'s, numbered alike), with at most `most` nodes expanded (the
        draft cache's limit); the next step starts from the part below the token the verification ends
        on, if the copy has it (`DraftTree.subtree`). None: nothing grown.
        """
        return None


class TreeDraftRunner:
    """The draft model's forwards for one step: catch up on the committed tokens, then expand tree nodes.

    Tree node i lives in KV slot `root_slot + i`, the layout the target uses for verification (shifted
    down by the committed tokens the draft skipped).
    """

    def __init__(self, request: DraftRequest, tree: DraftTree, catch_up: int | None = None) -> None:
        """`catch_up`: how many of the committed tokens the draft has not read it reads, the latest ones
        (the others it skips for good, `SlotRunner.skip`); None: all of them."""
        self.runner = request.runner
        self.request = request
        self.tree = tree
        self.catch_up = catch_up
        self.calls = 0
        self.first_pass_tokens = 0  # what `expand_root` forwarded: the root and what the draft had not seen

    @property
    def root_slot(self) -> int:
        return self.runner.slot(self.request.committed.numel() - 1)

    def expand_root(self) -> torch.Tensor:
        """Draft logits (1, V) for the root's children; also feeds the committed tokens it has not seen
        (the latest `catch_up` of them)."""
        unread = self.request.committed.numel() - self.runner.read
        if self.catch_up is not None and unread > self.catch_up:
            self.runner.skip(unread - self.catch_up)
        missing = self.request.committed[self.runner.read :]  # (m,), ends with the root
        self.first_pass_tokens = missing.numel()
        # The last chunk, root included, in one forward (after a chain accepted whole: its last draft
        # token and the bonus token); anything before it (a draft that has not drafted for a while, or
        # ever) in chunks.
        prefill(self.runner, missing[:-PREFILL_CHUNK])
        logits = self.runner.extend(missing[-PREFILL_CHUNK:], logits_to_keep=1)
        self.tree.expanded[0] = True
        self.calls += 1
        return self._fit_vocab(logits)

    def expand(self, nodes: torch.Tensor) -> torch.Tensor:
        """Draft logits (len(nodes), V) for the children of `nodes`, whose ancestors are all expanded."""
        logits = tree_forward(self.runner, self.tree, nodes, self.root_slot)
        self.tree.expanded[nodes] = True
        self.calls += 1
        return self._fit_vocab(logits)

    def keep_nodes(self, nodes: torch.Tensor) -> None:
        """Renumber the tree to `nodes` and move their draft KV along with them (if any was computed)."""
        if self.tree.expanded[0]:
            self.runner.move(self.root_slot + nodes, self.root_slot)
        self.tree.keep(nodes)

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        vocab = self.request.vocab_size
        if logits.shape[-1] >= vocab:
            return logits[:, :vocab]
        pad = logits.new_full((logits.shape[0], vocab - logits.shape[-1]), float("-inf"))
        return torch.cat([logits, pad], dim=-1)


def tree_forward(runner: Runner, tree: DraftTree, nodes: torch.Tensor, root_slot: int) -> torch.Tensor:
    """Forward tree `nodes` (ascending) into slots root_slot + node; returns logits (len(nodes), V).

    Each node attends to the committed prefix [0, root_slot) and to its own ancestors in the tree.
    """
    size = tree.size
    prefix = torch.ones(nodes.numel(), root_slot, dtype=torch.bool, device=nodes.device)
    allowed = torch.cat([prefix, tree.ancestors[nodes, :size]], dim=1)  # (n, root_slot + size)
    positions = root_slot + tree.depths[nodes]  # depth, not slot: siblings share a position
    return runner.forward_tree(tree.tokens[nodes], positions, root_slot + nodes, allowed)


def expandable(tree: DraftTree, request: DraftRequest) -> torch.Tensor:
    """Nodes that may still get children: not expanded, not end-of-sequence, not at the depth limit."""
    size = tree.size
    ok = ~tree.expanded[:size] & (tree.depths[:size] < request.max_depth)
    return ok & ~torch.isin(tree.tokens[:size], request.eos_token_ids)
