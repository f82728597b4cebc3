"""Prompt-lookup grafting: n-gram matching, and grafted nodes never break the tree's invariants."""

from __future__ import annotations

import random

import pytest
import torch
from test_tree import check_structure, random_tree
from tiny_models import chi2_pvalue, hf_greedy, perturbed, tiny_model

import specexec
from specexec.backends.torch.runner import ModelRunner
from specexec.drafters import BestFirstDrafter, DraftRequest
from specexec.drafters.lookup import graft_chain, ngram_continuation
from specexec.sampling import SamplingParams, probs_from_logits
from specexec.tree import DraftTree

NO_EOS = torch.tensor([], dtype=torch.long)


def ids(*tokens: int) -> torch.Tensor:
    return torch.tensor(tokens, dtype=torch.long)


def test_ngram_continuation_takes_the_latest_longest_match() -> None:
    # "7 8" occurred twice; the later occurrence (followed by 5 6) wins over the earlier (1 2).
    assert ngram_continuation(ids(7, 8, 1, 2, 7, 8, 5, 6, 9, 7, 8), 3).tolist() == [5, 6, 9]
    # The 3-gram "4 7 8" beats the more recent 2-gram "7 8".
    assert ngram_continuation(ids(4, 7, 8, 1, 2, 7, 8, 3, 4, 7, 8), 2).tolist() == [1, 2]
    # Falls back to a 1-gram, and the continuation may run into the suffix itself.
    assert ngram_continuation(ids(5, 9, 1, 5), 4).tolist() == [9, 1, 5]
    assert ngram_continuation(ids(1, 2, 3), 4).numel() == 0  # no earlier occurrence
    assert ngram_continuation(ids(1), 4).numel() == 0


def test_graft_reuses_existing_children_and_adds_the_rest() -> None:
    tree = DraftTree(0, 16)
    a = int(tree.add(ids(0), ids(5), torch.tensor([-0.1]))[0])
    tree.add(ids(a), ids(6), torch.tensor([-0.5]))
    added = graft_chain(tree, 0, ids(5, 6, 7, 8), max_depth=10, eos_token_ids=NO_EOS)
    check_structure(tree)
    assert [int(tree.tokens[n]) for n in added] == [7, 8]  # 5 and 6 were already there
    assert tree.tokens[tree.path_to(added[-1])].tolist() == [5, 6, 7, 8]
    assert float(tree.scores[added[-1]]) == pytest.approx(-0.5)  # the parent's score: no draft mass
    assert not tree.expanded[added].any()


def test_graft_stops_at_depth_eos_and_capacity() -> None:
    tree = DraftTree(0, 16)
    assert len(graft_chain(tree, 0, ids(1, 2, 3, 4, 5), max_depth=3, eos_token_ids=NO_EOS)) == 3
    tree = DraftTree(0, 16)
    added = graft_chain(tree, 0, ids(1, 2, 9, 4, 5), max_depth=10, eos_token_ids=ids(9))
    assert tree.tokens[added].tolist() == [1, 2, 9]  # nothing after an end-of-sequence token
    tree = DraftTree(0, 3)
    assert len(graft_chain(tree, 0, ids(1, 2, 3, 4), max_depth=10, eos_token_ids=NO_EOS)) == 2


def test_grafting_into_random_trees_keeps_every_invariant() -> None:
    rng = random.Random(0)
    for _ in range(200):
        tree = random_tree(rng, rng.randint(1, 20))
        tree.capacity = tree.tokens.numel()
        node = rng.randrange(tree.size)
        chain = torch.tensor([rng.randrange(4) for _ in range(rng.randint(0, 8))], dtype=torch.long)
        parent_scores = tree.scores[: tree.size].clone()
        added = graft_chain(tree, node, chain, max_depth=rng.randint(1, 12), eos_token_ids=ids(3))
        check_structure(tree)
        for n in added:
            assert tree.scores[n] == tree.scores[tree.parents[n]]  # never above the parent
        torch.testing.assert_close(tree.scores[: len(parent_scores)], parent_scores)


def test_best_first_drafter_grafts_below_root_and_best_leaf() -> None:
    model = tiny_model("llama", seed=0)
    prompt = ids(5, 6, 7, 8, 9, 10, 11, 5, 6, 7)  # "5 6 7" was followed by "8 9 10 11"
    runner = ModelRunner(model, 64)
    runner.extend(prompt[:-1])
    request = DraftRequest(prompt, 10, NO_EOS, 96, SamplingParams(0.0), None, runner)
    draft = BestFirstDrafter(4, expand=2, width=2, ngram=4).propose(request)
    tree = draft.tree
    check_structure(tree)
    assert draft.grafted > 0
    paths = [tree.tokens[tree.path_to(i)].tolist() for i in range(tree.size)]
    assert [8, 9, 10, 11] in paths  # grafted below the root
    grafted = range(tree.size - draft.grafted, tree.size)
    assert not tree.expanded[list(grafted)].any()  # the draft cache never claims their KV


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_grafted_specexec_is_greedy_exact_and_uses_the_grafts(arch: str) -> None:
    target = tiny_model(arch, seed=0)
    draft = perturbed(target, 0.3)  # a weak draft: grafts carry part of the acceptance
    prompt = [3, 17, 42, 5, 9, 11, 60, 2] * 3
    plain = specexec.generate(target, draft, prompt, method="specexec", budget=8, max_new_tokens=64)
    grafted = specexec.generate(
        target, draft, prompt, method="specexec", budget=8, ngram=8, max_new_tokens=64
    )
    assert grafted.tokens == plain.tokens == hf_greedy(target, prompt, 64)
    assert sum(grafted.stats.tree_sizes) > sum(plain.stats.tree_sizes)


def test_ngram_is_for_specexec_only() -> None:
    model = tiny_model("llama", seed=0)
    with pytest.raises(specexec.GenerationError, match="ngram"):
        specexec.generate(model, model, [1, 2], method="sd", ngram=4)
    with pytest.raises(specexec.GenerationError, match="ngram"):
        specexec.generate(model, model, [1, 2], method="specexec", ngram=-1)


def test_grafted_specexec_samples_the_target_distribution() -> None:
    """At temperature 1 the cache walk stays exact with grafted chains in the tree (chi-square against the
    target's enumerated joint of two new tokens); the prompt makes the root's lookup propose [5, 3]."""
    vocab, prompt, draws = 10, [3, 5, 3], 1_200
    small = dict(vocab_size=vocab, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1)
    target = tiny_model("llama", seed=0, init_range=0.2, **small)
    draft = tiny_model("llama", seed=7, init_range=0.6, **small)
    with torch.inference_mode():
        logits = target(torch.tensor([prompt + [a] for a in range(vocab)])).logits  # (V, 4, V)
    params = SamplingParams(1.0)
    joint = probs_from_logits(logits[0, 2], params)[:, None] * probs_from_logits(logits[:, 3], params)
    counts = torch.zeros(vocab, vocab)
    args = dict(method="specexec", budget=3, expand=1, width=2, max_new_tokens=2, temperature=1.0)
    for seed in range(draws):
        out = specexec.generate(target, draft, prompt, ngram=2, seed=seed, **args)
        counts[tuple(out.tokens)] += 1
    plain = specexec.generate(target, draft, prompt, seed=0, **args)
    assert (
        out.stats.tree_sizes[0] > plain.stats.tree_sizes[0]
    )  # test design: the grafts are in the verified trees
    assert chi2_pvalue(counts, joint) > 1e-4
