"""SpecInfer's sampled-tree drafter: `branches` sampled chains, checked against sequential forwards."""

from __future__ import annotations

import pytest
import torch
from drafting import CAPACITY, PROMPT, check_structure, path_logits, request

from specexec.backends.torch.runner import ModelRunner
from specexec.drafters import SampledTreeDrafter
from specexec.sampling import SamplingParams, probs_from_logits

pytestmark = pytest.mark.usefixtures("inference_mode")


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
