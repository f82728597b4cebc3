"""Sampling exactness: speculative methods draw from exactly the target's distribution.

Two levels:
- rule level (no model): `rejection_walk` and `cache_walk` on hand-built trees with synthetic target
  and draft distributions, tens of thousands of draws;
- engine level: `specexec.generate` on a tiny-vocabulary target with an unrelated draft, ENGINE_DRAWS
  seeded calls of 3 new tokens per check, whose (x1, x2) and (x2, x3) joints must follow the target's
  exact distribution, enumerated from the target's logits with `probs_from_logits` (itself checked
  against Hugging Face's logits processors).

Every test statistic is a chi-square goodness of fit with small cells pooled. The seeds are fixed, so the
outcomes are deterministic; the threshold is P_THRESHOLD. Each check has a negative control: a subtly or
plainly wrong acceptance rule, patched in, that the same statistic must reject.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
from collections.abc import Callable
from unittest import mock

import pytest
import torch
from tiny_models import chi2_pvalue, tiny_model
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import specexec
from specexec import verify
from specexec.backends.torch.draft_vocab import restrict_draft_vocab
from specexec.budget.costs import CostModel
from specexec.sampling import SamplingParams, probs_from_logits, sample, sample_without_replacement
from specexec.tree import DraftTree

# 28 engine-level and 3 rule-level goodness-of-fit tests share this threshold: with every rule exact, the
# chance that any of them falls below it is about 0.3% (for another platform's random streams); every
# negative control lands many orders of magnitude below it (the weakest at p ~ 1e-26).
P_THRESHOLD = 1e-4
RULE_DRAWS = 20_000  # per rule-level exactness check
RULE_CONTROL_DRAWS = 5_000  # per rule-level negative control: fewer draws, so a harder test to fail
ENGINE_DRAWS = 1_200  # generate calls per engine-level check, negative controls included


@pytest.fixture(autouse=True)
def inference_mode():
    with torch.inference_mode():  # as in the engine
        yield


# -- biased rules for the negative controls ---------------------------------------------------------------


def _normalized(x: torch.Tensor) -> torch.Tensor:
    return x / x.sum() if x.sum() > 0 else x


def biased_rejection_walk(tree, logits, draft_probs, params, generator, *, bug: str):
    """`rejection_walk` with one deliberate mistake (`bug`):
    "resample_p": after a rejection, sample from p instead of the residual norm(max(p - q, 0));
    "keep_q": draws were without replacement, but a rejected token is not removed from q;
    "accept": accept the first child whatever p and q are."""
    path, node = [], 0
    while True:
        p = probs_from_logits(logits[node], params)
        children = tree.children(node)
        accepted = None
        if children.numel():
            q = draft_probs[node].clone()
            for child in children.tolist():
                x = int(tree.tokens[child])
                u = torch.rand((), generator=generator, dtype=torch.float64)
                if bug == "accept" or u * q[x] < p[x]:
                    accepted = child
                    break
                if bug != "resample_p":
                    p = _normalized((p - q).clamp(min=0.0))
                if bug != "keep_q":
                    q[x] = 0.0
                    q = _normalized(q)
        if accepted is None:
            return path, int(sample(p, generator))
        node = accepted
        path.append(node)


def biased_cache_walk(tree, logits, params, generator):
    """`cache_walk` that, when the target's sample is not a child, follows the first child anyway."""
    path, node = [], 0
    while True:
        token = int(sample(probs_from_logits(logits[node], params), generator))
        children = tree.children(node)
        match = children[tree.tokens[children] == token]
        if match.numel():
            node = int(match[0])
        elif children.numel():
            node = int(children[0])
        else:
            return path, token
        path.append(node)


# -- rule level: synthetic distributions --------------------------------------------------------------------

V_RULE = 6


def synthetic(seed: int, sharpness: float) -> dict[tuple[int, ...], torch.Tensor]:
    """Next-token distributions for every prefix of up to 2 tokens: prefix tuple -> (V,) probabilities."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for depth in range(3):
        for prefix in itertools.product(range(V_RULE), repeat=depth):
            logits = torch.randn(V_RULE, generator=gen) * sharpness
            out[prefix] = torch.softmax(logits, -1)
    return out


P_TABLE = synthetic(0, 1.0)
Q_TABLE = synthetic(1, 2.5)  # a sharper, unrelated draft


def test_synthetic_draft_differs_from_target() -> None:
    """Test design: acceptance happens often and fails often."""
    overlap = float(torch.minimum(P_TABLE[()], Q_TABLE[()]).sum())
    assert 0.2 < overlap < 0.8


LOG_P = {prefix: p.log() for prefix, p in P_TABLE.items()}


def draft_tree(
    widths: tuple[int, ...], gen: torch.Generator
) -> tuple[DraftTree, dict[int, torch.Tensor], list]:
    """A tree drawn from the draft like the SpecInfer drafter: widths[d] children per node at depth d,
    without replacement from the draft's q at that node. Returns the tree, q per expanded node, and the
    token path (a tuple) of every node."""
    tree = DraftTree(0, 64)
    q_at: dict[int, torch.Tensor] = {}
    paths: list[tuple[int, ...]] = [()]
    frontier = [0]
    for width in widths:
        parents, tokens = [], []
        for node in frontier:
            q_at[node] = Q_TABLE[paths[node]]
            drawn = sample_without_replacement(q_at[node], width, gen).tolist()
            parents += [node] * len(drawn)
            tokens += drawn
            paths += [(*paths[node], t) for t in drawn]
        frontier = tree.add(torch.tensor(parents), torch.tensor(tokens)).tolist()
    return tree, q_at, paths


def target_logits(paths: list[tuple[int, ...]]) -> torch.Tensor:
    """Row i: log of the target distribution after node i's path (beyond depth 2, after its first two)."""
    return torch.stack([LOG_P[path[:2]] for path in paths])


def complete(tokens: list[int], n: int, gen: torch.Generator) -> tuple[int, ...]:
    """Extend emitted tokens to n tokens by exact target sampling (what the next steps would do)."""
    tokens = list(tokens[:n])
    while len(tokens) < n:
        tokens.append(int(sample(P_TABLE[tuple(tokens)], gen)))
    return tuple(tokens)


def exact_pairs() -> torch.Tensor:
    """P(x1, x2) under the synthetic target, (V, V)."""
    return torch.stack([P_TABLE[()][a] * P_TABLE[(a,)] for a in range(V_RULE)])


def rule_pvalue(walk: Callable, widths: tuple[int, ...], seed: int, draws: int = RULE_DRAWS) -> float:
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V_RULE, V_RULE)
    for _ in range(draws):
        tree, q_at, paths = draft_tree(widths, gen)
        path, bonus = walk(tree, target_logits(paths), q_at, T1, gen)
        assert [int(tree.parents[n]) for n in path] == [0, *path][: len(path)], "not a root-down path"
        emitted = [*paths[path[-1]], bonus] if path else [bonus]
        counts[complete(emitted, 2, gen)] += 1
    return chi2_pvalue(counts, exact_pairs())


T1 = SamplingParams(temperature=1.0)


# Children per level: a chain link (Leviathan/Chen); 4 root children then 2 under each (SpecInfer).
@pytest.mark.parametrize("widths", [(1,), (4, 2)])
def test_rejection_walk_is_exact(widths: tuple[int, ...]) -> None:
    assert rule_pvalue(verify.rejection_walk, widths, seed=10) > P_THRESHOLD


@pytest.mark.parametrize(
    ("bug", "widths"), [("resample_p", (1,)), ("resample_p", (4, 2)), ("keep_q", (4, 2)), ("accept", (3,))]
)
def test_rejection_walk_negative_control(bug: str, widths: tuple[int, ...]) -> None:
    walk = functools.partial(biased_rejection_walk, bug=bug)
    assert rule_pvalue(walk, widths, seed=10, draws=RULE_CONTROL_DRAWS) < P_THRESHOLD


def fixed_tree() -> DraftTree:
    """An arbitrary deterministic tree: a repeated-token branch, a deep chain, unlikely tokens."""
    tree = DraftTree(0, 32)
    level1 = tree.add(torch.tensor([0, 0, 0, 0]), torch.tensor([5, 0, 2, 3]))
    tree.add(torch.tensor([int(level1[0])] * 3 + [int(level1[2])]), torch.tensor([5, 1, 4, 0]))
    deep = tree.add(torch.tensor([int(level1[1])]), torch.tensor([0]))
    deep = tree.add(deep, torch.tensor([1]))
    return tree


def cache_pvalue(walk: Callable, seed: int, draws: int = RULE_DRAWS) -> float:
    gen = torch.Generator().manual_seed(seed)
    tree = fixed_tree()
    logits = target_logits([tuple(tree.tokens[tree.path_to(i)].tolist()) for i in range(tree.size)])
    counts = torch.zeros(V_RULE, V_RULE)
    for _ in range(draws):
        path, bonus = walk(tree, logits, T1, gen)
        counts[complete([*tree.tokens[path].tolist(), bonus], 2, gen)] += 1
    return chi2_pvalue(counts, exact_pairs())


def test_cache_walk_is_exact() -> None:
    assert cache_pvalue(verify.cache_walk, seed=20) > P_THRESHOLD


def test_cache_walk_negative_control() -> None:
    assert cache_pvalue(biased_cache_walk, seed=20, draws=RULE_CONTROL_DRAWS) < P_THRESHOLD


# -- engine level: a tiny-vocabulary model pair -------------------------------------------------------------

V = 10
PROMPT = [3]  # one token: no prefill forwards, the cheapest call
NEW = 3  # trees two levels deep, then a bonus token
SMALL = dict(vocab_size=V, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1)

SETTINGS = {
    "t1": dict(temperature=1.0),
    "t0.7-p0.9": dict(temperature=0.7, top_p=0.9),
    "t1-k3": dict(temperature=1.0, top_k=3),
}
METHOD_ARGS = {
    "ar": dict(method="ar"),
    "sd": dict(method="sd", budget=2),  # chain of 2
    "specinfer": dict(method="specinfer", budget=8, branches=4),  # 4 branches, 2 deep
    "specexec": dict(method="specexec", budget=12, expand=4, width=4),  # best-first, 2 levels
    "dsl": dict(method="dsl", budget=2, confidence_threshold=0.05),  # a chain cut where the draft is unsure
    # Cut by cost as well; flat costs let chains reach the depth limit.
    "dsl-auto": dict(
        method="dsl",
        budget="auto",
        confidence_threshold=0.05,
        cost_model=CostModel({1: 1.0, 64: 1.0}, {1: 0.01, 64: 0.01}),
    ),
}


@functools.cache
def models():
    target = tiny_model("llama", seed=0, init_range=0.2, **SMALL)
    draft = tiny_model("llama", seed=7, init_range=0.6, **SMALL)  # sharper and unrelated
    return target, draft


@functools.cache
def exact_joint(setting: str) -> torch.Tensor:
    """P(x1, x2, x3) of the target under the setting's processing, (V, V, V), by enumeration."""
    target, _ = models()
    params = SamplingParams(**SETTINGS[setting])
    with torch.inference_mode():
        seqs = torch.tensor([PROMPT + [a, b] for a in range(V) for b in range(V)])  # (V*V, 4)
        logits = target(seqs).logits  # (V*V, 4, V)
    n = len(PROMPT)
    p1 = probs_from_logits(logits[0, n - 1], params)  # (V,)
    p2 = probs_from_logits(logits[::V, n], params)  # (V, V): row a = after [a]
    p3 = probs_from_logits(logits[:, n + 1], params).reshape(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


@functools.cache
def restricted_draft(size: int):
    """The draft scoring token ids < size only (probability 0 for the others)."""
    return restrict_draft_vocab(copy.deepcopy(models()[1]), size, multiple=1)


@functools.cache
def engine_run(
    method: str, setting: str, patch: str = "", draft_vocab: int = 0
) -> tuple[torch.Tensor, dict[str, int]]:
    """Counts of the 3 new tokens over ENGINE_DRAWS seeded calls, and what the first steps looked like."""
    target, draft = models()
    if draft_vocab:
        draft = restricted_draft(draft_vocab)
    counts = torch.zeros(V, V, V)
    design = {"deepest tree": 0, "steps with an acceptance": 0, "steps with a rejection": 0}
    with patched(patch):
        for i in range(ENGINE_DRAWS):
            out = specexec.generate(
                target,
                draft,
                PROMPT,
                max_new_tokens=NEW,
                seed=1000 + i,
                **SETTINGS[setting],
                **METHOD_ARGS[method],
            )
            counts[tuple(out.tokens)] += 1
            stats = out.stats
            design["deepest tree"] = max(design["deepest tree"], stats.tree_depths[0])
            design["steps with an acceptance"] += stats.accepted[0] > 0
            design["steps with a rejection"] += stats.accepted[0] < stats.tree_depths[0]
    return counts, design


def patched(patch: str):
    if patch == "cache_walk":
        return mock.patch("specexec.methods.cache_walk", biased_cache_walk)
    if patch:
        return mock.patch(
            "specexec.methods.rejection_walk", functools.partial(biased_rejection_walk, bug=patch)
        )
    return contextlib.nullcontext()


def engine_pvalues(counts: torch.Tensor, setting: str) -> tuple[float, float]:
    """Goodness of fit of the (x1, x2) and (x2, x3) joints."""
    joint = exact_joint(setting)
    return chi2_pvalue(counts.sum(2), joint.sum(2)), chi2_pvalue(counts.sum(0), joint.sum(0))


def test_model_pair_design() -> None:
    """Test design: the draft is far from the target, and the target's distribution is spread out."""
    joint = exact_joint("t1")
    p1 = joint.sum((1, 2))
    target, draft = models()
    with torch.inference_mode():
        q1 = torch.softmax(draft(torch.tensor([PROMPT])).logits[0, -1], -1)
    assert float(p1.max()) < 0.5
    assert 0.2 < float(torch.minimum(p1, q1).sum()) < 0.7
    torch.testing.assert_close(joint.sum(), torch.tensor(1.0))


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_probs_match_hugging_face_on_the_target(setting: str) -> None:
    target, _ = models()
    params = SamplingParams(**SETTINGS[setting])
    with torch.inference_mode():
        seqs = torch.tensor([PROMPT + [a, b] for a in range(V) for b in range(V)])
        logits = target(seqs).logits.reshape(-1, V)
    scores = TemperatureLogitsWarper(params.temperature)(None, logits.clone())
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    torch.testing.assert_close(
        probs_from_logits(logits, params), torch.softmax(scores, -1), atol=1e-6, rtol=1e-5
    )


@pytest.mark.parametrize(
    ("method", "setting"),
    [*itertools.product(("ar", "sd", "specinfer", "specexec"), SETTINGS), ("dsl", "t1"), ("dsl-auto", "t1")],
)
def test_engine_samples_the_target_distribution(method: str, setting: str) -> None:
    counts, design = engine_run(method, setting)
    if method != "ar":  # test design: two-level trees, partly accepted, partly rejected
        assert design["deepest tree"] == 2, design
        assert design["steps with an acceptance"] > ENGINE_DRAWS // 20, design
        assert design["steps with a rejection"] > ENGINE_DRAWS // 20, design
    p12, p23 = engine_pvalues(counts, setting)
    assert p12 > P_THRESHOLD and p23 > P_THRESHOLD, (p12, p23)


@pytest.mark.parametrize("method", ["sd", "specexec"])
def test_a_draft_with_a_restricted_vocabulary_still_samples_the_target(method: str) -> None:
    size = 6
    assert int(restricted_draft(size).get_output_embeddings().kept.max()) < V - 1  # some ids cut off
    counts, design = engine_run(method, "t1", draft_vocab=size)
    assert design["steps with an acceptance"] > ENGINE_DRAWS // 20, design
    assert counts[size:].sum() > ENGINE_DRAWS // 20  # ids the draft never proposes are still sampled
    p12, p23 = engine_pvalues(counts, "t1")
    assert p12 > P_THRESHOLD and p23 > P_THRESHOLD, (p12, p23)


@pytest.mark.parametrize(
    ("method", "patch"),
    [("sd", "resample_p"), ("specinfer", "resample_p"), ("specinfer", "accept"), ("specexec", "cache_walk")],
)
def test_engine_negative_control(method: str, patch: str) -> None:
    p12, p23 = engine_pvalues(engine_run(method, "t1", patch)[0], "t1")
    assert min(p12, p23) < P_THRESHOLD, (p12, p23)
