"""SpecExec's best-first drafter: the tree it grows is the draft's most probable continuations, checked
against sequential forwards; it stops at end of sequence, goes on after a commit and drafts ahead."""

from __future__ import annotations

import pytest
import torch
from drafting import CAPACITY, PROMPT, TOL, check_structure, log_probs, path_logits, request

from specexec.backends.torch.runner import ModelRunner
from specexec.drafters import BestFirstDrafter, DraftRequest
from specexec.drafters.base import tree_forward
from specexec.sampling import SamplingParams, probs_from_logits
from specexec.tree import DraftTree

pytestmark = pytest.mark.usefixtures("inference_mode")


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
