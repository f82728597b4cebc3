"""SpecExec: grow the draft's most probable continuations best-first, up to a token budget.

Each round runs one draft forward over the `expand` best unexpanded nodes, adds their `width` most
probable children scored by cumulative draft log-probability, and keeps the `budget` best nodes. A child
never scores above its parent, and ties are broken towards the shallower node, so "the best B nodes" is
always ancestor-closed: pruning never orphans a node.

With `ngram` > 0, prompt-lookup chains of up to `ngram` tokens are grafted at no draft cost below the root
and below the best leaf once the tree is final (`specexec.drafters.lookup`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from specexec.budget.interfaces import TreeBudget
from specexec.drafters.base import Draft, DrafterBase, DraftRequest, TreeDraftRunner, expandable, plain_step
from specexec.drafters.lookup import graft_chain, ngram_continuation
from specexec.sampling import SamplingParams, probs_from_logits
from specexec.tree import DraftTree

Children = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # parents, tokens, scores: `DraftTree.add`'s
AHEAD_EXPAND = 4  # nodes per draft pass while the target verifies: the likeliest few next roots first
AHEAD_NODES = 64  # the most nodes a step expands ahead (room for their children is kept in the tree)
# Passes drafted ahead however soon the target is done: the next step can only start from a node two
# levels below a verified leaf (the leaf, then the bonus token's node, drafted on).
AHEAD_MIN_PASSES = 2


class BestFirstDrafter(DrafterBase):
    """`budget` is a node count, or an auto budget (`TreeBudget`) that sizes each step's tree, and how
    many nodes each draft pass expands (at most `expand`), by expected speed."""

    def __init__(
        self,
        budget: int | TreeBudget,
        expand: int = 32,
        width: int = 8,
        max_rounds: int = 32,
        ngram: int = 0,
        ahead: bool = False,
    ) -> None:
        self.policy = None if isinstance(budget, int) else budget
        budget = self.policy.max_budget if self.policy else budget
        self.budget = budget
        self.expand = max(1, min(expand, budget))
        self.width = max(1, min(width, budget))
        self.max_rounds = max_rounds
        self.ngram = ngram
        self.last_seconds = 0.0  # the auto budget's estimate of the last step's time
        self.last_drafting = 0.0  # and of its drafting
        self.max_tree_size = budget + 1 + self.expand * self.width + 2 * ngram
        self.ahead = ahead
        # The last proposal's children of verified nodes that its final cut left out (parents, tokens,
        # scores): drafting ahead starts from them, where the verification may well end.
        self.spare: Children | None = None
        if ahead:
            self.max_tree_size += AHEAD_NODES * self.width

    def may_draft(self, steps: int = 1) -> bool:
        return self.policy is None or self.policy.may_draft(steps)

    def propose(self, request: DraftRequest) -> Draft:
        self.spare = None
        self.last_drafting = 0.0
        drafting = request.max_depth >= 1 and (self.policy is None or self.policy.drafts_now())
        if not drafting and not self.ngram:  # a plain step: the root alone, at a plain step's cost
            return plain_step(request)
        head = request.head_start if drafting else None
        tree = head
        if tree is None:
            tree = DraftTree(int(request.committed[-1]), self.max_tree_size, request.committed.device)
        steps = TreeDraftRunner(request, tree, self.policy.catch_up if self.policy else None)
        draft_seconds = 0.0  # the cost model's estimate, for the auto budget; a head start came free
        if head is not None:
            # Drafted while the last step was verified: verified as it is, for drafting on now would delay
            # the pass that the next draft-ahead overlaps (measured: faster than drafting on first).
            self._prune(tree, steps)
        frontier = torch.zeros(1, dtype=torch.long, device=tree.tokens.device)
        for round_ in range(self.max_rounds if drafting and head is None else 0):
            logits = steps.expand_root() if round_ == 0 else steps.expand(frontier)  # (F, V)
            first_new = tree.size
            log_probs = self._add_children(tree, frontier, logits, request.sampling)  # (F, W)
            child_accept = 0.0
            if self.policy:
                tokens = steps.first_pass_tokens if round_ == 0 else len(frontier)
                draft_seconds += self.policy.draft_pass_seconds(tokens)
                # How likely a best child is to be accepted after its parent, judging by this round.
                child_accept = self.policy.child_acceptance(log_probs[:, 0].exp())
            if not self._prune(tree, steps, first_new):
                break  # no new child made the cut: more rounds would not change the tree
            frontier = self._frontier(tree, request, draft_seconds, child_accept)
            if frontier is None:
                break
        if self.policy:
            probs = self.policy.node_probs(tree)
            ranked = self._ranked(tree, key=probs)
            size, _ = self.policy.best_size(probs[ranked], draft_seconds)
            kept = torch.cat([ranked.new_zeros(1), ranked[:size].sort().values])
            self.spare = _left_out_children(tree, kept) if self.ahead else None
            steps.keep_nodes(kept)
            self.last_seconds = self.policy.step_seconds(size, draft_seconds)
            self.last_drafting = draft_seconds
        drafted = tree.size
        if self.ngram:
            self._graft(tree, request)
        return Draft(tree, draft_calls=steps.calls, grafted=tree.size - drafted)

    def _prune(self, tree: DraftTree, steps: TreeDraftRunner, first_new: int = 0) -> bool:
        """Keep the `budget` best nodes; False if none of the nodes from `first_new` on made the cut."""
        if tree.size - 1 <= self.budget:
            return True
        kept = self._ranked(tree)[: self.budget]
        steps.keep_nodes(torch.cat([kept.new_zeros(1), kept.sort().values]))
        return bool((kept >= first_new).any())

    def _frontier(
        self, tree: DraftTree, request: DraftRequest, draft_seconds: float, child_accept: float
    ) -> torch.Tensor | None:
        """The nodes the next draft pass expands (ascending), or None when no pass would pay or change the
        tree."""
        candidates = self._ranked(tree, expandable(tree, request))
        if tree.size - 1 == self.budget:
            # A full tree only changes if a child beats its worst node, which the worst node's own
            # children (never above their parent, placed after it on ties) cannot do.
            worst = tree.scores[1 : tree.size].min()
            candidates = candidates[tree.scores[candidates] > worst]
        if not candidates.numel():
            return None
        frontier = candidates[: self.expand]
        if self.policy:
            probs = self.policy.node_probs(tree)  # (size,)
            likely = self._ranked(tree, expandable(tree, request), key=probs)[: self.expand]
            ranked = probs[self._ranked(tree, key=probs)]
            count = self.policy.frontier_size(ranked, probs[likely], draft_seconds, child_accept)
            if not count:
                return None
            frontier = likely[:count]
        return frontier.sort().values

    def draft_ahead(
        self, draft: Draft, request: DraftRequest, verifying: Callable[[], bool], most: int
    ) -> Draft | None:
        """Grow a copy of `draft`'s tree best-first (by the auto budget's acceptance estimate, else by
        draft score), AHEAD_EXPAND nodes a pass, unpruned: AHEAD_MIN_PASSES passes, then more while
        `verifying()`, up to AHEAD_NODES nodes, with at most `most` expanded in all."""
        if draft.grafted or not bool(draft.tree.expanded[0]):
            return None
        tree = draft.tree.clone()
        if self.spare is not None:
            tree.add(*self.spare)
            self.spare = None
        steps = TreeDraftRunner(request, tree)
        before = int(tree.expanded[: tree.size].sum())
        while steps.calls < AHEAD_MIN_PASSES or verifying():
            size = tree.size
            # Only nodes whose parent the draft has read: grafted chains are not drafted into.
            open_ = expandable(tree, request) & tree.expanded[tree.parents[:size].clamp(min=0)]
            key = self.policy.node_probs(tree) if self.policy else None
            frontier = self._ranked(tree, open_, key)[:AHEAD_EXPAND]
            expanded = int(tree.expanded[:size].sum())
            room = min(most, before + AHEAD_NODES) - expanded  # both bound the nodes expanded
            room = min(room, (tree.capacity - size) // self.width)
            frontier = frontier[: max(room, 0)].sort().values
            if not frontier.numel():
                break
            self._add_children(tree, frontier, steps.expand(frontier), request.sampling)
        return Draft(tree, draft_calls=steps.calls) if steps.calls else None

    def _add_children(
        self, tree: DraftTree, frontier: torch.Tensor, logits: torch.Tensor, sampling: SamplingParams
    ) -> torch.Tensor:
        """Add each `frontier` node's `width` most probable children (logits (F, V)), scored by cumulative
        draft log-probability; returns their log-probabilities given the parent, (F, W).

        When sampling, the probabilities are the draft's under the generation's temperature and top-k, the
        target's own for a draft that agreed with it. Not under its top-p: the draft's nucleus is often a
        single token where the target's holds a second one, and a sibling that the target may sample is
        worth a node (the auto budget learns how often each draft probability is accepted). Greedy ranks by
        the draft's plain probabilities."""
        width = min(self.width, logits.shape[-1])
        if sampling.greedy:
            top = torch.topk(logits, width)  # (F, W)
            log_probs = top.values - torch.logsumexp(logits, dim=-1, keepdim=True)
        else:
            top = torch.topk(probs_from_logits(logits, replace(sampling, top_p=1.0)), width)  # (F, W)
            log_probs = top.values.log()  # -inf outside top-k
        log_probs = log_probs.clamp(max=0.0)  # (F, W)
        scores = tree.scores[frontier, None] + log_probs  # cumulative log-probability
        fresh = scores.isfinite()
        tree.add(frontier[:, None].expand_as(scores)[fresh], top.indices[fresh], scores[fresh])
        return log_probs

    def _graft(self, tree: DraftTree, request: DraftRequest) -> None:
        """Prompt-lookup chains below the root and below the best leaf (the deepest on ties)."""
        leaves = torch.arange(tree.size, device=tree.tokens.device)
        leaves = leaves[~torch.isin(leaves, tree.parents[: tree.size])]
        best = leaves[torch.argsort(tree.depths[leaves], descending=True, stable=True)]
        best = int(best[torch.argmax(tree.scores[best])])
        for anchor in dict.fromkeys((0, best)):
            context = torch.cat([request.committed, tree.tokens[tree.path_to(anchor)]])
            chain = ngram_continuation(context, self.ngram)
            graft_chain(tree, anchor, chain, request.max_depth, request.eos_token_ids)

    def observe(self, draft: Draft, path: Sequence[int], target_seconds: float) -> None:
        if not self.policy:
            return
        self.policy.observe_pass(draft.tree.size, self.last_drafting, target_seconds)
        if draft.tree.expanded[0]:  # grafted guesses carry no draft probability to learn from
            self.policy.observe(draft.tree, path, draft.tree.size - draft.grafted)
            self.policy.record(len(path) + 1, self.last_seconds)

    @staticmethod
    def _ranked(
        tree: DraftTree, among: torch.Tensor | None = None, key: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Non-root node indices, best first: `key` (default: the draft score) descending, then depth
        ascending. Any key that never ranks a child above its parent keeps every prefix ancestor-closed."""
        key = tree.scores if key is None else key.to(tree.scores.device)
        nodes = torch.arange(1, tree.size, device=tree.tokens.device)
        if among is not None:
            nodes = nodes[among[1:]]
        by_depth = nodes[torch.argsort(tree.depths[nodes], stable=True)]
        return by_depth[torch.argsort(key[by_depth], descending=True, stable=True)]


def _left_out_children(tree: DraftTree, kept: torch.Tensor) -> Children:
    """The children of `kept` nodes (ascending, ancestor-closed) left out of them and never expanded (no
    KV to keep): their parents renumbered as `DraftTree.keep(kept)` does, tokens and scores."""
    size = tree.size
    chosen = torch.zeros(size, dtype=torch.bool, device=kept.device)
    chosen[kept] = True
    parents = tree.parents[:size].clamp(min=0)
    left = (~chosen & chosen[parents] & ~tree.expanded[:size]).nonzero().flatten()
    return torch.searchsorted(kept, parents[left]), tree.tokens[left], tree.scores[left]
