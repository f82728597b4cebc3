"""The draft tree as flat tensors.

Node 0 is the root: the last committed token, whose target distribution gives the first new token.
Nodes are kept in topological order (a parent's index is below its children's), so any prefix of the
node list is a valid tree and the KV slot of node i can simply be `root_slot + i` in both caches.
"""

from __future__ import annotations

import torch


class DraftTree:
    """Tokens, parents, depths, cumulative draft log-probabilities and the ancestor mask of a tree."""

    def __init__(self, root_token: int, capacity: int, device: torch.device | str = "cpu") -> None:
        self.capacity = capacity
        self.size = 1
        self.tokens = torch.zeros(capacity, dtype=torch.long, device=device)
        self.parents = torch.full((capacity,), -1, dtype=torch.long, device=device)
        self.depths = torch.zeros(capacity, dtype=torch.long, device=device)
        self.scores = torch.zeros(capacity, dtype=torch.float32, device=device)
        # ancestors[i, j]: j is i or an ancestor of i.
        self.ancestors = torch.zeros(capacity, capacity, dtype=torch.bool, device=device)
        # expanded[i]: the draft has processed node i (its KV is in the draft cache, its children drawn).
        self.expanded = torch.zeros(capacity, dtype=torch.bool, device=device)
        self.tokens[0] = root_token
        self.ancestors[0, 0] = True

    def add(
        self, parents: torch.Tensor, tokens: torch.Tensor, scores: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Append children (parents[i] -> tokens[i]); returns their node indices."""
        n = parents.numel()
        if self.size + n > self.capacity:
            raise RuntimeError(f"draft tree over capacity ({self.size} + {n} > {self.capacity})")
        new = torch.arange(self.size, self.size + n, device=self.tokens.device)  # (n,)
        self.tokens[new] = tokens
        self.parents[new] = parents
        self.depths[new] = self.depths[parents] + 1
        self.scores[new] = 0.0 if scores is None else scores
        self.expanded[new] = False  # the slot may have held a pruned node
        self.ancestors[new, : self.size] = self.ancestors[parents, : self.size]  # rows past size are clear
        self.ancestors[new, new] = True
        self.size += n
        return new

    def keep(self, nodes: torch.Tensor) -> None:
        """Keep only `nodes` (ascending, ancestor-closed, including the root), renumbered 0..len-1."""
        n = nodes.numel()
        remap = torch.full((self.capacity,), -1, dtype=torch.long, device=nodes.device)
        remap[nodes] = torch.arange(n, device=nodes.device)
        parents = self.parents[nodes]
        self.parents[:n] = torch.where(parents >= 0, remap[parents.clamp(min=0)], parents)
        for field in (self.tokens, self.depths, self.scores, self.expanded):
            field[:n] = field[nodes].clone()
        self.ancestors[:n, :n] = self.ancestors[nodes[:, None], nodes[None, :]]
        self.ancestors[n : self.size, : self.size] = False
        self.ancestors[:n, n : self.size] = False
        self.size = n

    def clone(self) -> DraftTree:
        tree = DraftTree.__new__(DraftTree)
        tree.capacity, tree.size = self.capacity, self.size
        for name in ("tokens", "parents", "depths", "scores", "ancestors", "expanded"):
            setattr(tree, name, getattr(self, name).clone())
        return tree

    def subtree(self, node: int) -> tuple[DraftTree, torch.Tensor]:
        """`node` and its descendants as a tree of their own, rooted at `node` (depths and scores counted
        from it), and their indices here in the new tree's order (ascending: still topological)."""
        nodes = self.ancestors[: self.size, node].nonzero().squeeze(-1)  # (n,) node first
        n = nodes.numel()
        tree = DraftTree(int(self.tokens[node]), self.capacity, self.tokens.device)
        remap = torch.full((self.capacity,), -1, dtype=torch.long, device=nodes.device)
        remap[nodes] = torch.arange(n, device=nodes.device)
        tree.parents[1:n] = remap[self.parents[nodes[1:]]]
        tree.tokens[:n] = self.tokens[nodes]
        tree.depths[:n] = self.depths[nodes] - self.depths[node]
        tree.scores[:n] = self.scores[nodes] - self.scores[node]
        tree.expanded[:n] = self.expanded[nodes]
        tree.ancestors[:n, :n] = self.ancestors[nodes[:, None], nodes[None, :]]
        tree.size = n
        return tree, nodes

    def children(self, node: int) -> torch.Tensor:
        """Indices of `node`'s children in the order they were added (the drafter's sampling order)."""
        return (self.parents[: self.size] == node).nonzero().squeeze(-1)

    def path_to(self, node: int) -> torch.Tensor:
        """Nodes from the root's first child down to `node` (empty for the root)."""
        path = self.ancestors[node, : self.size].nonzero().squeeze(-1)  # ascending = root first
        return path[1:]
