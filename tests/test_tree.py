"""Draft-tree invariants: the `DraftTree` structure itself, and the trees the real drafters grow.

Every drafter tree is checked against a recomputation from scratch: ancestors from `parents`, depths from
parent depths, and cumulative draft log-probabilities (or the drafter's q) from plain sequential forwards
of the draft model over each root-to-node path.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from tiny_models import tiny_model

from specexec.backends.torch.runner import ModelRunner
from specexec.drafters import BestFirstDrafter, ChainDrafter, DraftRequest, SampledTreeDrafter
from specexec.drafters.base import tree_forward
from specexec.sampling import SamplingParams, probs_from_logits
from specexec.tree import DraftTree

VOCAB = 64
PROMPT = [5, 17, 33, 2, 9, 41, 12]
TOL = 2e-4
CAPACITY = 512  # KV slots: prompt + the largest tree below (budget 100 + 16 * 8 + 1)


# -- structural invariants --------------------------------------------------------------------------------


def check_structure(tree: DraftTree) -> None:
    """parents[i] < i, depths and the ancestor mask agree with `parents`, nothing set past `size`."""
    n = tree.size
    parents = tree.parents[:n].tolist()
    assert parents[0] == -1, "node 0 is the root"
    assert tree.depths[0] == 0
    expected_anc = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        if i:
            assert 0 <= parents[i] < i, f"node {i} has parent {parents[i]}"
            assert tree.depths[i] == tree.depths[parents[i]] + 1
        j = i
        while j >= 0:
            expected_anc[i, j] = True
            j = parents[j]
    assert torch.equal(tree.ancestors[:n, :n], expected_anc)
    assert not tree.ancestors[:n, n:].any(), "ancestor bits past size"
    assert not tree.ancestors[n:].any(), "ancestor rows past size"
    for i in range(n):
        path = tree.path_to(i).tolist()
        assert len(path) == tree.depths[i]
        assert path == expected_anc[i].nonzero().squeeze(-1).tolist()[1:]
        assert tree.children(i).tolist() == [c for c in range(n) if parents[c] == i]


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


# -- trees from the real drafters -------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def inference_mode():
    with torch.inference_mode():  # as in the engine
        yield


@pytest.fixture(scope="module")
def draft_model():
    return tiny_model("llama", seed=3, vocab_size=VOCAB, hidden_size=32, num_layers=2, init_range=0.5)


def path_logits(model, committed: list[int], tree: DraftTree, nodes) -> dict[int, torch.Tensor]:
    """Draft logits at each node, from a plain forward over committed[:-1] + root-to-node tokens."""
    out = {}
    with torch.no_grad():
        for node in nodes:
            path = tree.tokens[tree.path_to(node)].tolist()
            out[node] = model(torch.tensor([committed + path])).logits[0, -1].float()
    return out


def request(runner, committed, max_depth=100, eos=(), sampling=None, seed=0) -> DraftRequest:
    return DraftRequest(
        torch.tensor(committed),
        max_depth,
        torch.tensor(list(eos), dtype=torch.long),
        VOCAB,
        sampling or SamplingParams(),
        torch.Generator().manual_seed(seed),
        runner,
    )


def log_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """What a best-first tree scores by: the draft's log-probabilities, under the temperature and top-k when
    sampling (-inf outside top-k; top-p left out)."""
    if sampling.greedy:
        return torch.log_softmax(logits, -1)
    return probs_from_logits(logits, replace(sampling, top_p=1.0)).log()


def check_best_first(model, committed, tree: DraftTree, budget: int, width: int, req: DraftRequest) -> None:
    check_structure(tree)
    n = tree.size
    assert n >= 1 and n - 1 <= budget
    assert tree.scores[0] == 0
    assert int(tree.depths[:n].max()) <= req.max_depth
    parents = tree.parents[:n].tolist()
    internal = sorted({p for p in parents[1:]})
    assert all(tree.expanded[p] for p in internal), "a node with children was never drafted"
    if n > 1:
        assert tree.expanded[0]
    eos = set(req.eos_token_ids.tolist())
    for p in internal:
        assert int(tree.tokens[p]) not in eos or p == 0, "an end-of-sequence node was expanded"
        tokens = tree.tokens[tree.children(p)].tolist()
        assert len(tokens) == len(set(tokens)), "siblings with the same token"
    # Scores are cumulative draft log-probabilities, recomputed from sequential forwards.
    expanded = tree.expanded[:n].nonzero().squeeze(-1).tolist()
    logp = {k: log_probs(v, req.sampling) for k, v in path_logits(model, committed, tree, expanded).items()}
    scores = tree.scores[:n]
    for c in range(1, n):
        expected = scores[parents[c]] + logp[parents[c]][tree.tokens[c]]
        assert abs(float(scores[c] - expected)) < TOL, f"node {c}: {float(scores[c])} vs {float(expected)}"
        assert scores[c] <= scores[parents[c]] + TOL
    # The tree holds the best nodes: every top-`width` child of a drafted node is in the tree, unless the
    # tree is full and the child scores no better than the worst node kept.
    worst = float(scores[1:n].min()) if n > 1 else float("inf")
    for p in expanded:
        top = torch.topk(logp[p], width)
        present = set(tree.tokens[tree.children(p)].tolist())
        for value, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            if token not in present:
                assert n - 1 == budget, f"node {p}: child {token} missing from a tree below budget"
                assert float(scores[p]) + value <= worst + TOL, f"node {p}: dropped a better child {token}"
        # ... and only those: a child's log-probability is within the node's top `width`.
        for c in tree.children(p).tolist():
            assert float(logp[p][tree.tokens[c]]) >= float(top.values[-1]) - TOL


BEST_FIRST_CASES = [
    # budget, expand, width, max_rounds, max_depth
    (1, 32, 8, 32, 100),
    (8, 8, 8, 32, 100),
    (8, 2, 3, 32, 100),
    (30, 8, 4, 32, 100),
    (64, 32, 8, 32, 100),
    (100, 16, 8, 4, 100),
    (40, 8, 4, 32, 3),
    (20, 1, 2, 32, 100),
]


@pytest.mark.parametrize(("budget", "expand", "width", "max_rounds", "max_depth"), BEST_FIRST_CASES)
def test_best_first_tree(draft_model, budget, expand, width, max_rounds, max_depth) -> None:
    drafter = BestFirstDrafter(budget, expand, width, max_rounds)
    req = request(ModelRunner(draft_model, CAPACITY), PROMPT, max_depth)
    tree = drafter.propose(req).tree
    check_best_first(draft_model, PROMPT, tree, budget, min(width, budget), req)
    if budget > 1:
        assert int(tree.depths[: tree.size].max()) >= 2, "test design: expected a multi-level tree"


@pytest.mark.parametrize(
    "sampling", [SamplingParams(temperature=0.6, top_p=0.5), SamplingParams(temperature=1.5, top_k=3)]
)
def test_best_first_tree_ranks_by_the_sampling_distribution(draft_model, sampling) -> None:
    """When sampling, children are the most likely under the generation's temperature and top-k, scored so.
    Tokens outside the top-k get no node; tokens outside the draft's top-p do, for the target's nucleus may
    hold them."""
    drafter = BestFirstDrafter(30, 8, 8)
    req = request(ModelRunner(draft_model, CAPACITY), PROMPT, sampling=sampling)
    tree = drafter.propose(req).tree
    check_best_first(draft_model, PROMPT, tree, 30, 8, req)
    expanded = tree.expanded[: tree.size].nonzero().squeeze(-1).tolist()
    children = {p: tree.children(p).numel() for p in expanded}
    if sampling.top_k:
        assert max(children.values()) == sampling.top_k
    else:
        logits = path_logits(draft_model, PROMPT, tree, expanded)
        nucleus = {p: int((probs_from_logits(v, sampling) > 0).sum()) for p, v in logits.items()}
        assert any(children[p] > nucleus[p] for p in expanded), "no node has a child outside the nucleus"


def test_best_first_stops_at_end_of_sequence(draft_model) -> None:
    with torch.no_grad():
        first = int(draft_model(torch.tensor([PROMPT])).logits[0, -1].argmax())
    drafter = BestFirstDrafter(40, 8, 4)
    req = request(ModelRunner(draft_model, CAPACITY), PROMPT, eos=[first])
    tree = drafter.propose(req).tree
    eos_nodes = (tree.tokens[: tree.size] == first).nonzero().squeeze(-1).tolist()
    assert 1 in [int(tree.depths[i]) for i in eos_nodes], "test design: the top child is the eos token"
    for node in eos_nodes:
        if node:
            assert not tree.children(node).numel()
            assert not tree.expanded[node]
    check_best_first(draft_model, PROMPT, tree, 40, 4, req)


def test_best_first_second_step_after_commit(draft_model) -> None:
    """A second proposal after committing part of the first tree (as the engine does) is still exact."""
    runner = ModelRunner(draft_model, CAPACITY)
    drafter = BestFirstDrafter(24, 8, 4)
    runner.extend(torch.tensor(PROMPT[:-1]))  # the engine's prefill
    tree = drafter.propose(request(runner, PROMPT)).tree
    deepest = int(tree.depths[: tree.size].argmax())
    path = tree.path_to(deepest)[:-1]  # accept all but the leaf, then a bonus token
    root_slot = len(PROMPT) - 1
    nodes = torch.cat([torch.zeros(1, dtype=torch.long), path])
    seen = nodes[tree.expanded[nodes]]
    runner.keep(torch.cat([torch.arange(min(runner.length, root_slot)), root_slot + seen]))
    committed = PROMPT + tree.tokens[path].tolist() + [11]
    req = request(runner, committed)
    tree2 = drafter.propose(req).tree
    check_best_first(draft_model, committed, tree2, 24, 4, req)
    assert runner.length == len(committed)


def test_chain_after_a_whole_accepted_chain_catches_up_in_one_forward(draft_model) -> None:
    """The chain's last draft token was never fed to the draft; with the bonus token it goes in the same
    forward as the new root (llama.cpp's speculation does the same), and the next chain is still exact."""
    runner = ModelRunner(draft_model, CAPACITY)
    runner.extend(torch.tensor(PROMPT[:-1]))  # the engine's prefill
    drafter = ChainDrafter(3)
    first = drafter.propose(request(runner, PROMPT)).tree
    # All three accepted, then a bonus token. The engine keeps the draft's cache of the accepted nodes it
    # fed (the root and the first two); the third was drafted but never fed.
    root_slot = len(PROMPT) - 1
    fed = first.expanded[: first.size].nonzero().flatten()
    assert fed.tolist() == [0, 1, 2]
    runner.keep(torch.cat([torch.arange(root_slot), root_slot + fed]))
    committed = PROMPT + first.tokens[1:4].tolist() + [11]
    forwards: list[int] = []  # tokens per draft forward
    forward_tree = runner.forward_tree

    def counted(tokens, *args, **kwargs):
        forwards.append(tokens.numel())
        return forward_tree(tokens, *args, **kwargs)

    runner.forward_tree = counted
    draft = drafter.propose(request(runner, committed))
    assert forwards[0] == 2  # the third draft token and the bonus token (the new root), at once
    assert len(forwards) == 3  # and one forward per further draft token
    logits = path_logits(draft_model, committed, draft.tree, range(3))
    for node in range(3):
        assert int(draft.tree.tokens[node + 1]) == int(logits[node].argmax())


def test_a_draft_behind_the_committed_tokens_is_charged_for_its_catch_up(draft_model) -> None:
    """After plain steps the draft's first pass takes in every committed token it has not seen. The
    chain reports that pass's size, and an auto tree charges it at the draft's cost for that many
    tokens, not one (resuming after a pause cost up to 18 draft tokens in one pass on MT-Bench)."""
    from specexec.budget.costs import CostModel
    from specexec.budget.trees import AutoBudget

    committed = PROMPT + [3, 8, 21, 30, 4]  # five tokens decoded plainly since the draft's prefill
    cost = CostModel({1: 0.1, 64: 0.2}, {1: 0.01, 2: 0.02, 6: 0.5, 64: 1.0})
    for make in (lambda: BestFirstDrafter(AutoBudget(cost, max_budget=4)), lambda: ChainDrafter(2)):
        runner = ModelRunner(draft_model, CAPACITY)
        runner.extend(torch.tensor(PROMPT[:-1]))
        drafter = make()
        draft = drafter.propose(request(runner, committed))
        if isinstance(drafter, ChainDrafter):
            assert draft.first_pass_tokens == 6  # the five and the root
        else:
            assert draft.draft_calls >= 1
            assert drafter.last_seconds >= cost.draft_seconds(6)


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize(("budget", "branches"), [(1, 4), (8, 4), (12, 3), (9, 1)])
def test_sampled_tree(draft_model, budget: int, branches: int, greedy: bool) -> None:
    sampling = SamplingParams() if greedy else SamplingParams(temperature=1.0, top_k=20)
    drafter = SampledTreeDrafter(budget, branches)
    req = request(ModelRunner(draft_model, CAPACITY), PROMPT, sampling=sampling, seed=budget)
    draft = drafter.propose(req)
    tree = draft.tree
    check_structure(tree)
    n = tree.size
    branches = min(branches, budget)
    depth = max(1, budget // branches)
    assert n - 1 <= budget and n - 1 <= drafter.max_tree_size - 1
    assert int(tree.depths[:n].max()) == depth
    root_children = tree.children(0)
    assert root_children.numel() == branches
    assert len(set(tree.tokens[root_children].tolist())) == branches, "root children not distinct"
    for node in range(1, n):
        assert tree.children(node).numel() <= 1, "branches are chains"
    # q at every expanded node is the draft's processed distribution given the node's path.
    expanded = tree.expanded[:n].nonzero().squeeze(-1).tolist()
    assert sorted(draft.draft_probs) == expanded
    logits = path_logits(draft_model, PROMPT, tree, expanded)
    for node in expanded:
        q = probs_from_logits(logits[node], sampling)
        torch.testing.assert_close(draft.draft_probs[node], q, atol=1e-5, rtol=1e-4)
        children = tree.children(node)
        if not (greedy and node == 0):  # greedy root children are the draft's top tokens, q is one-hot
            assert bool((q[tree.tokens[children]] > 0).all()), "a child the draft could not have sampled"
        if greedy and node:
            assert tree.tokens[children].tolist() == [int(logits[node].argmax())]
    if greedy:
        expected_first = torch.topk(logits[0], branches).indices.tolist()
        assert tree.tokens[root_children].tolist() == expected_first


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize(("length", "max_depth"), [(1, 10), (5, 10), (8, 3), (4, 0)])
def test_chain(draft_model, length: int, max_depth: int, greedy: bool) -> None:
    sampling = SamplingParams() if greedy else SamplingParams(temperature=0.8, top_p=0.9)
    drafter = ChainDrafter(length)
    draft = drafter.propose(
        request(ModelRunner(draft_model, CAPACITY), PROMPT, max_depth, sampling=sampling, seed=length)
    )
    tree = draft.tree
    check_structure(tree)
    n = tree.size
    assert n - 1 == min(length, max_depth)
    assert tree.parents[:n].tolist() == list(range(-1, n - 1)), "not a chain"
    # A greedy chain is verified by the cache walk, which needs no draft distributions.
    assert sorted(draft.draft_probs) == ([] if greedy else list(range(n - 1)))
    logits = path_logits(draft_model, PROMPT, tree, range(n - 1))
    for node in range(n - 1):
        if greedy:
            assert int(tree.tokens[node + 1]) == int(logits[node].argmax())
            continue
        q = probs_from_logits(logits[node], sampling)
        torch.testing.assert_close(draft.draft_probs[node], q, atol=1e-5, rtol=1e-4)
        assert q[tree.tokens[node + 1]] > 0


def test_chain_stops_after_end_of_sequence(draft_model) -> None:
    with torch.no_grad():
        first = int(draft_model(torch.tensor([PROMPT])).logits[0, -1].argmax())
    drafter = ChainDrafter(6)
    tree = drafter.propose(request(ModelRunner(draft_model, CAPACITY), PROMPT, eos=[first])).tree
    assert tree.size == 2 and int(tree.tokens[1]) == first


# -- drafting ahead ---------------------------------------------------------------------------------------


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


@pytest.mark.parametrize("passes", [3, 6])
def test_a_step_from_a_tree_drafted_ahead_is_still_exact(draft_model, passes: int) -> None:
    """The engine's way while the target verifies: grow the tree on, commit a path and the bonus token's
    node with the subtree below it in the draft cache (`Runner.keep(..., subtree=...)`), and start the
    next step from that subtree. Its scores match sequential forwards, and so do new nodes below carried
    ones, which read the KV `keep` moved."""
    runner = ModelRunner(draft_model, CAPACITY)
    drafter = BestFirstDrafter(24, 4, 4, max_rounds=3, ahead=True)  # few rounds: leaves left to draft ahead
    runner.extend(torch.tensor(PROMPT[:-1]))
    req = request(runner, PROMPT)
    draft = drafter.propose(req)
    size = draft.tree.size
    left = iter(range(passes - 2))  # two passes whatever `verifying` says
    ahead = drafter.draft_ahead(draft, req, lambda: next(left, None) is not None, most=255)
    assert ahead is not None and ahead.draft_calls == passes
    tree = ahead.tree
    assert tree.size > size and torch.equal(tree.tokens[:size], draft.tree.tokens[:size])
    check_structure(tree)
    grown = (tree.expanded[: tree.size] & ~draft.tree.expanded[: tree.size]).nonzero().flatten().tolist()
    assert len(grown) <= passes * 4
    for node, logits in path_logits(draft_model, PROMPT, tree, grown).items():
        children = tree.children(node)
        expected = tree.scores[node] + torch.log_softmax(logits, -1)[tree.tokens[children]]
        torch.testing.assert_close(tree.scores[children], expected, atol=TOL, rtol=0)
    # A verified leaf the draft expanded ahead, and the child of it with the deepest subtree drafted on,
    # as the bonus token.
    leaf, bonus = max(
        ((n, int(c)) for n in grown if n < size for c in tree.children(n)),
        key=lambda pair: int(tree.subtree(pair[1])[0].expanded.sum()),
    )
    head, nodes = tree.subtree(bonus)
    path = torch.cat([torch.zeros(1, dtype=torch.long), tree.path_to(leaf), nodes[:1]])
    root_slot = len(PROMPT) - 1
    runner.keep(torch.cat([torch.arange(root_slot), root_slot + path]), subtree=root_slot + nodes[1:])
    committed = PROMPT + tree.tokens[path[1:]].tolist()
    assert runner.length == len(committed)
    # Nodes below carried nodes other than the root read KV that `keep` moved.
    below = [n for n in range(1, head.size) if head.depths[n] >= 2 and not head.expanded[n]]
    assert below, "test design: carried nodes below the new root"
    moved = tree_forward(runner, head, torch.tensor(below), len(committed) - 1)
    for row, expected in zip(moved, path_logits(draft_model, committed, head, below).values(), strict=True):
        torch.testing.assert_close(row.float(), expected, atol=TOL, rtol=0)
    req2 = request(runner, committed)
    req2.head_start = head
    step = drafter.propose(req2)
    assert step.draft_calls == 0, "a carried tree is verified as it is"
    check_best_first(draft_model, committed, step.tree, 24, 4, req2)
