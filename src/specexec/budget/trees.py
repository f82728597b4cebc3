"""The SpecExec tree per step, sized from the cost model and the learnt acceptance (`AutoBudget`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specexec.budget.costs import CostModel
from specexec.budget.policy import DraftingPolicy
from specexec.tree import DraftTree

CHAIN_CHECK = 32  # the longest chain `worth_drafting` and the look past the next draft pass consider


class AutoBudget(DraftingPolicy):
    """Chooses the SpecExec tree per step from a cost model and learnt acceptance rates.

    A node is accepted with probability P = the product, along its path, of the `AcceptanceModel` rate of
    each token's conditional draft probability. The tree of size b (the b most likely nodes) is expected
    to emit E(b) = 1 + the sum of their P in T(b) = draft time spent (less the cost model's `overlap`)
    + target time for b + 1 tokens; for b = 0 after a pass of more tokens, plus the cost model's
    `reshape` (the one-token pass is timed right after another).
    What a generation maximises is its total tokens over its total time, not each step's own E / T: a node
    is worth adding whenever it pays better than the rate the generation achieves, even if it lowers an
    already fast step's ratio. So each step maximises the value E(b) - λ T(b), λ being the achieved rate
    floored at plain decoding's (`SpeculationGate.floor_rate`; Dinkelbach's method for ratio objectives).
    A draft pass continues while expanding some number of the best unexpanded nodes (chosen too) raises
    the best value, or a chain drafted on below the likeliest of them would within CHAIN_CHECK passes;
    the verified tree is the b that maximises it.
    """

    def __init__(self, cost: CostModel, max_budget: int = 1024) -> None:
        self.max_budget = max_budget
        self._fresh(cost, CHAIN_CHECK)
        # Target time for 1 .. max_budget + 1 tokens and draft time for 1 .. max_budget nodes, looked up
        # every draft round (the target's as measured, then as priced: interpolation scales with it).
        self.measured_table = torch.tensor([cost.target_seconds(n) for n in range(1, max_budget + 2)])
        self._target_tables(self.measured_table)
        self.draft_table = torch.tensor([cost.draft_seconds(n) for n in range(1, max_budget + 1)])

    def _price(self, factor: float) -> None:
        super()._price(factor)
        self._target_tables(self.measured_table * factor)

    def _target_tables(self, table: torch.Tensor) -> None:
        """The target's time for 1 .. max_budget + 1 tokens, as priced: after a one-token pass, and after
        a pass of more tokens (one token then costs `reshape` more)."""
        self.target_table = table
        self.after_tree_table = torch.cat([table[:1] + self.cost.reshape, table[1:]])

    def draft_pass_seconds(self, nodes: int) -> float:
        """The cost model's time for a draft pass over `nodes` nodes."""
        return self.cost.draft_seconds(nodes)

    def child_acceptance(self, best_child_probs: torch.Tensor) -> float:
        """How likely a best child is to be accepted after its parent: the mean learnt rate of the draft
        probabilities of a round's best children, (F,)."""
        return float(self.acceptance(best_child_probs).mean())

    def node_probs(self, tree: DraftTree) -> torch.Tensor:
        """P for every node of `tree` (the root: 1), (size,)."""
        size = tree.size
        rates = self.acceptance(_conditional_probs(tree)).clamp(min=1e-6)  # (size,)
        rates[0] = 1.0
        log_p = tree.ancestors[:size, :size].float().cpu() @ rates.log()  # sum over each path
        return log_p.exp()

    def _targets(self) -> torch.Tensor:
        """The target's time for 1 .. max_budget + 1 tokens in this step: one token costs `reshape` more
        unless the last pass took one too."""
        return self.target_table if self.after_plain else self.after_tree_table

    def best_size(self, ranked_probs: torch.Tensor, draft_seconds: float) -> tuple[int, float]:
        """(b, value) maximising E(b) - λ T(b) over b = 0..len(ranked_probs), nodes best first."""
        gains = torch.cat([torch.ones(1), 1 + ranked_probs.cumsum(0)])  # (n+1,)
        seconds = self.cost.exposed(torch.tensor(draft_seconds)) + self._targets()[: len(gains)]  # (n+1,)
        values = gains - self.gate.floor_rate * seconds
        best = int(values.argmax())
        return best, float(values[best])

    def step_seconds(self, size: int, draft_seconds: float) -> float:
        """T(b) of a step that spent `draft_seconds` drafting and verifies `size` draft nodes."""
        return float(self.cost.exposed(torch.tensor(draft_seconds)) + self._targets()[size])

    def frontier_size(
        self, ranked: torch.Tensor, frontier: torch.Tensor, draft_seconds: float, child_accept: float
    ) -> int:
        """How many of the `frontier` nodes (their P, best first; each one's best child accepted with
        probability about `child_accept` after it) the next draft pass should expand to raise the value
        of the best tree from the `ranked` node P most; 0 when no count raises it. The draft's cost per
        pass decides between narrow and wide passes. Each count is judged by the best tree it makes
        possible (`_best_values`); where none pays, a chain drafted on below the likeliest node may
        (then 1).
        """
        _, value = self.best_size(ranked, draft_seconds)
        count = len(frontier)
        children = frontier * child_accept  # (F,) each expanded node's best child, best first
        # Row c - 1: the children of the first c frontier nodes (-1: not drafted).
        widths = torch.arange(1, count + 1)
        grown = torch.where(torch.arange(count) < widths[:, None], children, -1.0)  # (F, F)
        best = self._best_values(ranked, grown, draft_seconds + self.draft_table[:count, None])  # (F,)
        c = int(best.argmax())
        if float(best[c]) > value:
            return c + 1
        # No pass pays at once; a chain down from the likeliest node may still pay a few passes on, as in
        # `ChainCostStop`: where the target's cost jumps and is flat after (llama.cpp's kernels past a
        # batch size, a network's round trips), one node more loses and ten more win. Its nodes are
        # assumed as likely after their parent as a best child now is.
        depths = torch.arange(1, CHAIN_CHECK + 1)
        chain = frontier[0] * child_accept**depths  # (H,)
        grown = torch.where(depths <= depths[:, None], chain, -1.0)  # (H, H) row h - 1: h nodes deep
        drafting = draft_seconds + depths[:, None] * self.draft_table[0]  # (H, 1) one node a pass
        return 1 if float(self._best_values(ranked, grown, drafting).max()) > value else 0

    def _best_values(self, ranked: torch.Tensor, grown: torch.Tensor, drafting: torch.Tensor) -> torch.Tensor:
        """For each row of `grown` (the P of the nodes more draft passes would add, -1 past them) and of
        `drafting` (the draft's seconds with them, (R, 1)): the value of the best tree of the `ranked`
        nodes and those, (R,). The best tree may leave out nodes the best tree now has: where a larger
        batch costs less (llama.cpp's grouped kernels: 4 tokens below 3), the best tree is padded with
        unlikely siblings that a deeper node should replace, not join."""
        rows = len(grown)
        nodes = torch.cat([ranked.expand(rows, -1), grown], dim=1)  # (R, n + G)
        nodes = nodes.sort(dim=1, descending=True).values[:, : self.max_budget]
        gains = torch.cat([torch.ones(rows, 1), 1 + nodes.clamp(min=0).cumsum(1)], dim=1)  # (R, b + 1)
        sizes = gains.shape[1]
        seconds = self.cost.exposed(drafting) + self._targets()[None, :sizes]
        values = gains - self.gate.floor_rate * seconds  # (R, b + 1)
        drafted = torch.arange(sizes) <= len(ranked) + (grown >= 0).sum(dim=1, keepdim=True)
        return values.masked_fill(~drafted, float("-inf")).amax(dim=1)

    def observe(self, tree: DraftTree, path: Sequence[int], drafted: int) -> None:
        """Label the verified draft nodes (among the first `drafted`): every child of the root and of an
        accepted node was tried by the verification, and the one on the path was accepted."""
        on_path = torch.zeros(tree.size, dtype=torch.bool)
        on_path[[0, *path]] = True
        nodes = torch.arange(1, drafted)
        tried = nodes[on_path[tree.parents[1:drafted].cpu()]]
        self.acceptance.observe(_conditional_probs(tree)[tried], on_path[tried])

    def record(self, tokens: int, seconds: float) -> None:
        """A drafted step's emitted tokens and its estimated time T(b), for the gate and λ."""
        self.gate.record(tokens, seconds)


def _conditional_probs(tree: DraftTree) -> torch.Tensor:
    """Each node's draft probability given its parent, (size,) (the root's is meaningless)."""
    size = tree.size
    parents = tree.parents[:size].clamp(min=0)
    return (tree.scores[:size] - tree.scores[parents]).exp().cpu()
