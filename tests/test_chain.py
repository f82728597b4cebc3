"""The chain drafter: its tokens and draft distributions against sequential forwards, its catch-up after
a whole accepted chain or plain steps, and its stop at end of sequence."""

from __future__ import annotations

import pytest
import torch
from drafting import CAPACITY, PROMPT, check_structure, path_logits, request

from specexec.backends.torch.runner import ModelRunner
from specexec.drafters import BestFirstDrafter, ChainDrafter
from specexec.sampling import SamplingParams, probs_from_logits

pytestmark = pytest.mark.usefixtures("inference_mode")


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
