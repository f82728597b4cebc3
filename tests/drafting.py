"""What the drafter tests share: the tiny draft model, requests on it, and the recomputation every
drafted tree is checked against (ancestors from `parents`, depths from parent depths, cumulative draft
log-probabilities from plain sequential forwards of the draft model over each root-to-node path)."""

from __future__ import annotations

from dataclasses import replace

import torch
from tiny_models import tiny_model
from transformers import PreTrainedModel

from specexec.drafters import DraftRequest
from specexec.sampling import SamplingParams, probs_from_logits
from specexec.tree import DraftTree

VOCAB = 64
PROMPT = [5, 17, 33, 2, 9, 41, 12]
TOL = 2e-4
CAPACITY = 512  # KV slots: prompt + the largest tree below (budget 100 + 16 * 8 + 1)


def drafting_model() -> PreTrainedModel:
    """The drafter tests' draft model: a tiny llama."""
    return tiny_model("llama", seed=3, vocab_size=VOCAB, hidden_size=32, num_layers=2, init_range=0.5)


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
