"""The `DraftTree` structure: adding nodes, keeping a closed subset, subtrees and clones (the trees the
drafters grow are checked in test_best_first.py, test_chain.py and test_sampled_tree.py)."""

from __future__ import annotations

import random

import pytest
import torch
from drafting import VOCAB, check_structure

from specexec.tree import DraftTree

# -- structural invariants --------------------------------------------------------------------------------


def random_tree(rng: random.Random, size: int) -> DraftTree:
    tree = DraftTree(rng.randrange(VOCAB), size + 5)
    while tree.size < size:
        k = rng.randint(1, min(4, size - tree.size))
        parents = torch.tensor([rng.randrange(tree.size) for _ in range(k)])
        tree.add(parents, torch.tensor([rng.randrange(VOCAB) for _ in range(k)]), -torch.rand(k) * 10)
    return tree


def random_closed_subset(rng: random.Random, tree: DraftTree) -> torch.Tensor:
    """A random ancestor-closed node set containing the root, ascending."""
    chosen = {0}
    for node in rng.sample(range(tree.size), rng.randint(0, tree.size // 2)):
        chosen.update(tree.ancestors[node, : tree.size].nonzero().squeeze(-1).tolist())
    return torch.tensor(sorted(chosen))


def test_add_builds_a_consistent_tree() -> None:
    tree = DraftTree(7, 10)
    a = tree.add(torch.tensor([0, 0]), torch.tensor([3, 4]), torch.tensor([-0.5, -1.0]))
    b = tree.add(torch.tensor([int(a[1]), int(a[0]), int(a[1])]), torch.tensor([8, 9, 1]))
    assert a.tolist() == [1, 2] and b.tolist() == [3, 4, 5]
    assert tree.size == 6
    assert tree.tokens[:6].tolist() == [7, 3, 4, 8, 9, 1]
    assert tree.parents[:6].tolist() == [-1, 0, 0, 2, 1, 2]
    assert tree.depths[:6].tolist() == [0, 1, 1, 2, 2, 2]
    assert tree.children(2).tolist() == [3, 5]
    assert tree.path_to(5).tolist() == [2, 5]
    assert tree.path_to(0).tolist() == []
    assert not tree.expanded[:6].any()
    check_structure(tree)
    with pytest.raises(RuntimeError, match="capacity"):
        tree.add(torch.zeros(5, dtype=torch.long), torch.zeros(5, dtype=torch.long))


@pytest.mark.parametrize("seed", range(20))
def test_keep_random_closed_subset(seed: int) -> None:
    rng = random.Random(seed)
    tree = random_tree(rng, rng.randint(2, 40))
    tree.expanded[: tree.size] = torch.rand(tree.size) < 0.5
    old = {
        field: getattr(tree, field)[: tree.size].clone()
        for field in ("tokens", "depths", "scores", "expanded")
    }
    old_parents = tree.parents[: tree.size].clone()
    nodes = random_closed_subset(rng, tree)
    tree.keep(nodes)

    assert tree.size == nodes.numel()
    for field, values in old.items():
        assert torch.equal(getattr(tree, field)[: tree.size], values[nodes]), field
    remap = {int(o): i for i, o in enumerate(nodes)}
    for i, o in enumerate(nodes.tolist()):
        assert int(tree.parents[i]) == (-1 if i == 0 else remap[int(old_parents[o])])
    check_structure(tree)


@pytest.mark.parametrize("seed", range(10))
def test_keep_and_add_repeatedly(seed: int) -> None:
    """Interleaved growth and compaction (what the best-first drafter does) keeps every invariant."""
    rng = random.Random(100 + seed)
    tree = DraftTree(1, 64)
    reference = [(1, -1)]  # (token, parent) per node
    for _ in range(30):
        if rng.random() < 0.6 and tree.size < 60:
            k = rng.randint(1, min(4, 60 - tree.size))
            parents = [rng.randrange(tree.size) for _ in range(k)]
            tokens = [rng.randrange(VOCAB) for _ in range(k)]
            tree.add(torch.tensor(parents), torch.tensor(tokens))
            reference += list(zip(tokens, parents, strict=True))
        else:
            nodes = random_closed_subset(rng, tree)
            tree.keep(nodes)
            remap = {int(o): i for i, o in enumerate(nodes)}
            reference = [
                (reference[o][0], -1 if i == 0 else remap[reference[o][1]])
                for i, o in enumerate(nodes.tolist())
            ]
        check_structure(tree)
        assert tree.tokens[: tree.size].tolist() == [t for t, _ in reference]
        assert tree.parents[: tree.size].tolist() == [p for _, p in reference]


def test_added_nodes_are_not_expanded_after_keep() -> None:
    """A node that `add` creates has never been drafted, even when its index held an expanded node before
    a `keep` shrank the tree (the drafters and the engine trust `expanded` to say which nodes have KV)."""
    tree = DraftTree(0, 8)
    tree.add(torch.tensor([0, 0, 1]), torch.tensor([1, 2, 3]))
    tree.expanded[:4] = True  # all four drafted
    tree.keep(torch.tensor([0, 1]))
    new = tree.add(torch.tensor([1, 0]), torch.tensor([5, 6]))
    assert new.tolist() == [2, 3]
    assert tree.expanded[:2].tolist() == [True, True]
    assert tree.expanded[new].tolist() == [False, False], "stale `expanded` flags from before keep()"


def test_subtree_is_a_tree_rooted_at_the_node() -> None:
    for seed in range(10):
        rng = random.Random(200 + seed)
        tree = random_tree(rng, rng.randint(2, 40))
        tree.expanded[: tree.size] = torch.rand(tree.size) < 0.5
        node = rng.randrange(tree.size)
        sub, nodes = tree.subtree(node)
        check_structure(sub)
        below = [n for n in range(tree.size) if tree.ancestors[n, node]]
        assert nodes.tolist() == below
        assert sub.tokens[: sub.size].tolist() == tree.tokens[nodes].tolist()
        assert sub.depths[: sub.size].tolist() == (tree.depths[nodes] - tree.depths[node]).tolist()
        assert torch.equal(sub.scores[: sub.size], tree.scores[nodes] - tree.scores[node])
        assert torch.equal(sub.expanded[: sub.size], tree.expanded[nodes])
        copy = tree.clone()
        copy.add(torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.long))
        assert copy.size == tree.size + 1 and not tree.ancestors[tree.size].any(), "clone shares storage"
