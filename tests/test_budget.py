"""Lookahead schedules, the confidence stop and its adaptation, the cost model and the auto budget."""

from __future__ import annotations

import contextlib
import json
from collections import deque
from collections.abc import Iterator
from typing import Generic, Protocol

import pytest
import torch
from tiny_models import assert_cache_is_text_with_cut, budget_pair

import specexec
from specexec.backends.torch.runner import ModelRunner
from specexec.budget.acceptance import AcceptanceModel, ConfidenceStop, best_threshold
from specexec.budget.chains import ChainCostStop, HeuristicLookahead
from specexec.budget.costs import CostModel, chain_seconds
from specexec.budget.interfaces import ChainBudget, ChainStop, LookaheadSchedule, TreeBudget
from specexec.budget.policy import catch_up_window
from specexec.budget.trees import CHAIN_CHECK, AutoBudget
from specexec.drafters import BestFirstDrafter, ChainDrafter, DraftRequest
from specexec.prefix_cache import PrefixCache
from specexec.sampling import SamplingParams
from specexec.tree import DraftTree

# CPU, model in memory: verifying 64 tokens costs 2.2x one token (anchors.md, transformers bf16).
STEEP = CostModel({1: 0.26, 4: 0.26, 16: 0.29, 64: 0.58, 256: 1.03}, {1: 0.09, 4: 0.10, 16: 0.14, 64: 0.29})
# Offloaded target: every forward streams all weights, so 1024 tokens cost about what 1 does.
FLAT = CostModel({1: 5.0, 1024: 5.3, 4096: 6.5}, {1: 0.01, 64: 0.015})


@pytest.fixture(scope="module")
def models():
    """A tiny target, a draft close to it, and a prompt."""
    return budget_pair()


def test_heuristic_lookahead_grows_and_shrinks() -> None:
    schedule = HeuristicLookahead(5)
    schedule.observe(drafted=5, accepted=5)
    assert schedule.length == 7
    schedule.observe(drafted=7, accepted=3)
    assert schedule.length == 6
    for _ in range(10):
        schedule.observe(drafted=schedule.length, accepted=0)
    assert schedule.length == 1  # floor


def test_best_threshold_separates_classes_and_weights_false_negatives() -> None:
    accepted = [(c, True) for c in (0.9, 0.85, 0.8, 0.75, 0.7)]
    rejected = [(c, False) for c in (0.3, 0.2, 0.1)]
    assert best_threshold(accepted + rejected, 6, 0.4) == 0.7  # keeps every accepted sample
    # Two accepted tokens at low confidence: losing them costs 3x, so the threshold goes below them
    # (FPR 2/3 there, against FNR 2/7 weighted 3x above them); a single one is not worth it.
    assert best_threshold(accepted + rejected + [(0.15, True), (0.12, True)], 6, 0.4) == 0.12
    assert best_threshold(accepted + rejected + [(0.15, True)], 6, 0.4) == 0.7
    # Too few samples, or a single class: the current value stays.
    assert best_threshold(accepted[:3] + rejected[:2], 6, 0.4) == 0.4
    assert best_threshold(accepted * 3, 6, 0.4) == 0.4


def test_confidence_stop_labels_only_verified_tokens() -> None:
    stop = ConfidenceStop(0.4, adapt=False)
    stop.observe([0.9, 0.8, 0.2, 0.7, 0.6], accepted=2)  # 0.2 rejected; 0.7 and 0.6 never verified
    assert list(stop.history) == [(0.9, True), (0.8, True), (0.2, False)]
    stop.observe([0.5, 0.4], accepted=2)  # all accepted: no negative label
    assert list(stop.history)[-2:] == [(0.5, True), (0.4, True)]


@torch.inference_mode()
def test_adapted_threshold_applies_within_the_same_generation(models) -> None:
    target, draft, prompt = models
    runner = ModelRunner(draft, 64)
    runner.extend(prompt[:-1])
    stop = ConfidenceStop(threshold=0.0, adapt=False)
    drafter = ChainDrafter(8, stop=stop)
    request = DraftRequest(prompt, 20, torch.zeros(0, dtype=torch.long), 64, SamplingParams(), None, runner)
    assert drafter.propose(request).tree.size - 1 == 8  # never unsure enough to stop
    runner.keep(torch.arange(len(prompt) - 1))
    stop.threshold = 1.0  # what adaptation may do between two steps of one call
    assert drafter.propose(request).tree.size - 1 == 1  # the first token already falls below it
    # And the engine feeds verification results back into the same ConfidenceStop during a call.
    stop = ConfidenceStop(threshold=0.4, adapt=True, min_samples=2)
    drafter = ChainDrafter(8, stop=stop)
    for _ in range(4):
        runner.keep(torch.arange(len(prompt) - 1))
        draft_ = drafter.propose(request)
        drafter.observe(draft_, [], 0.1)  # every first token rejected
        drafter.observe(draft_, list(range(1, len(draft_.confidences) + 1)), 0.1)
    assert stop.threshold != 0.4


def test_dsl_and_heuristic_sd_are_exact_and_adapt(models) -> None:
    target, draft, prompt = models
    reference = target.generate(prompt[None], do_sample=False, max_new_tokens=64)[0, len(prompt) :].tolist()
    dsl = specexec.generate(target, draft, prompt, method="dsl", budget=20, max_new_tokens=64)
    assert dsl.tokens == reference
    assert len(set(dsl.stats.tree_sizes)) > 1  # draft lengths vary with confidence
    heuristic = specexec.generate(
        target, draft, prompt, method="sd", budget=2, lookahead_schedule="heuristic", max_new_tokens=64
    )
    assert heuristic.tokens == reference
    assert max(heuristic.stats.tree_sizes) > 2  # grew after fully accepted drafts
    with pytest.raises(specexec.GenerationError, match="lookahead_schedule"):
        specexec.generate(target, draft, prompt, method="sd", lookahead_schedule="fast")
    with pytest.raises(specexec.GenerationError, match="auto"):
        specexec.generate(target, draft, prompt, method="sd", budget="auto")


def test_cost_model_interpolates_extrapolates_and_round_trips() -> None:
    assert STEEP.target_seconds(1) == pytest.approx(0.26)
    assert STEEP.target_seconds(40) == pytest.approx(0.29 + (0.58 - 0.29) * 24 / 48)
    assert STEEP.target_seconds(512) == pytest.approx(1.03 + (1.03 - 0.58) * 256 / 192)
    again = CostModel.from_json(json.loads(json.dumps(STEEP.to_json())))
    assert again.target == STEEP.target and again.draft == STEEP.draft
    with pytest.raises(ValueError):
        CostModel({1: 1.0}, {1: 1.0})


def achieving(policy: AutoBudget | ChainCostStop, rate: float) -> None:
    """Record a drafted step after which the generation's achieved rate (λ) is `rate` tokens/s."""
    gate, seconds = policy.gate, 10.0
    gate.record(rate * (gate.seconds + seconds) - gate.tokens, seconds)
    assert gate.rate == pytest.approx(rate)


def test_auto_budget_picks_small_trees_when_verification_cost_grows_and_big_ones_when_flat() -> None:
    probs = torch.tensor(0.97) ** torch.arange(1, 1001)  # best-first acceptance probabilities of the nodes
    steep, flat = AutoBudget(STEEP), AutoBudget(FLAT, max_budget=2048)
    achieving(steep, 15.0)  # 4x plain decoding's 3.8 tok/s
    achieving(flat, 2.0)  # 10x plain decoding's 0.2 tok/s
    steep_size, _ = steep.best_size(probs, draft_seconds=0.5)
    flat_size, _ = flat.best_size(probs, draft_seconds=0.5)
    assert 16 <= steep_size <= 128
    assert flat_size >= 2 * steep_size
    # One more draft round: worth it when verification is flat and the frontier is likely, not otherwise.
    assert flat.frontier_size(probs[:64], probs[:32], 0.2, 0.8) > 0
    assert steep.frontier_size(probs, probs[-32:], 2.0, 0.1) == 0


def test_sizing_maximises_the_generations_rate_not_each_steps_own() -> None:
    """A node that lowers its own step's tokens/s but pays better than the generation's rate is taken."""
    cost = CostModel({1: 0.2, 2: 0.2, 3: 0.3}, {1: 0.1, 2: 0.1})  # plain decoding: 5 tok/s
    probs = torch.tensor([0.9, 0.6])
    # One node: 1.9 tokens in 0.3 s (6.3/s); two: 2.5 in 0.4 s (6.25/s), but the second node adds 0.6
    # tokens for 0.1 s, 6/s, more than the 5/s achieved so far.
    assert AutoBudget(cost).best_size(probs, draft_seconds=0.1)[0] == 2
    faster = AutoBudget(cost)
    achieving(faster, 7.0)  # now 6/s no longer pays
    assert faster.best_size(probs, draft_seconds=0.1)[0] == 1
    # The same for a chain, with draft passes of 0.05 s and tokens the draft is 95% sure of (accepted
    # at that rate by the prior): one token, 1.95 in 0.25 s (7.8/s); two, 2.85 in 0.4 s (7.1/s), the
    # second one adding 0.9 for 0.15 s (6/s).
    cost = CostModel(cost.target, {1: 0.05, 2: 0.05})
    chain = ChainCostStop(cost, max_length=2)
    assert not chain.should_stop(0.95)
    chain = ChainCostStop(cost, max_length=2)
    achieving(chain, 7.0)
    assert chain.should_stop(0.95)


def test_a_one_token_pass_after_a_tree_is_priced_with_its_reshape() -> None:
    """llama.cpp reuses the graph of a pass shaped as the one before (over RPC it then sends none), so a
    one-token pass costs `reshape` more after a tree than after another one-token pass. After a tree,
    verifying nothing beyond the root is priced with it, and a node that does not pay against a repeated
    one-token pass pays against that one; after a plain pass, not. A cost model without reshape (the
    negative control) decodes plainly in both."""
    cost = CostModel({1: 0.10, 2: 0.16, 3: 0.22}, {1: 0.01, 2: 0.01}, reshape=0.05)
    probs = torch.tensor([0.5])  # one node: 1.5 tokens in 0.16 s against 1 in 0.10 s (or 0.15 s)
    policy = AutoBudget(cost)
    achieving(policy, 10.0)  # plain decoding's rate
    policy.observe_pass(4, 0.0, 0.2)  # a tree
    assert policy.best_size(probs, draft_seconds=0.0)[0] == 1
    assert policy.step_seconds(0, 0.0) == pytest.approx(0.15)
    policy.observe_pass(1, 0.0, 0.1)  # a one-token pass
    assert policy.best_size(probs, draft_seconds=0.0)[0] == 0
    assert policy.step_seconds(0, 0.0) == pytest.approx(0.10)
    control = AutoBudget(CostModel(cost.target, cost.draft))
    achieving(control, 10.0)
    control.observe_pass(4, 0.0, 0.2)
    assert control.best_size(probs, draft_seconds=0.0)[0] == 0
    again = CostModel.from_json(json.loads(json.dumps(cost.to_json())))
    assert again.reshape == 0.05 and again.fingerprint() == cost.fingerprint()
    assert cost.with_target_pace(2.0).reshape == pytest.approx(0.10)


def test_sizing_values_time_at_least_at_plain_decodings_rate() -> None:
    """Drafting that lost so far puts the achieved rate below plain decoding's. Time must still be valued
    at plain decoding's rate, which not drafting achieves; at the achieved rate a losing generation
    would find drafting cheaper the more it lost, and draft on."""
    cost = CostModel({1: 0.2, 2: 0.3, 3: 0.4}, {1: 0.1, 2: 0.1})  # plain decoding: 5 tok/s
    # After the root's pass (0.1 s), one node accepted with P = 0.9: 1.9 tokens in 0.4 s. A second pass
    # for its best child (0.95 after it) adds 0.855 tokens for 0.2 s, 4.3 tok/s: worth it at 3 tok/s.
    ranked, frontier = torch.tensor([0.9]), torch.tensor([0.9])
    losing = AutoBudget(cost)
    achieving(losing, 3.0)
    assert losing.frontier_size(ranked, frontier, 0.1, 0.95) == 0
    # A chain after one token the draft is 95% sure of: 1.95 in 0.4 s; a second, 2.85 in 0.6 s (4.75/s).
    chain = ChainCostStop(cost, max_length=2)
    achieving(chain, 3.0)
    assert chain.should_stop(0.95)
    # Control: with draft passes at a tenth of the cost, the losing history does not stop growth.
    cheap = CostModel(cost.target, {1: 0.01, 2: 0.01})
    recovering = AutoBudget(cheap)
    achieving(recovering, 3.0)
    assert recovering.frontier_size(ranked, frontier, 0.01, 0.95) == 1
    chain = ChainCostStop(cheap, max_length=2)
    achieving(chain, 3.0)
    assert not chain.should_stop(0.95)


def test_auto_budget_expands_narrow_when_wide_draft_passes_cost_more() -> None:
    """A low-bit draft is cheap for a few rows and costs a bfloat16 pass beyond: expand only those few."""
    target = {1: 0.08, 4: 0.085, 16: 0.1, 64: 0.5}
    cheap_narrow = CostModel(target, {1: 0.03, 2: 0.045, 3: 0.06, 4: 0.10, 16: 0.11, 64: 0.2})
    flat_draft = CostModel(target, {1: 0.03, 64: 0.031})
    ranked = torch.tensor([0.9, 0.8, 0.7])
    frontier = torch.tensor([0.6, 0.5, 0.4] + [0.1] * 29)  # three likely nodes, then a tail
    narrow = AutoBudget(cheap_narrow).frontier_size(ranked, frontier, 0.05, 0.6)
    wide = AutoBudget(flat_draft).frontier_size(ranked, frontier, 0.05, 0.6)
    assert 1 <= narrow <= 3
    assert wide > 3


def test_acceptance_model_learns_conditional_rates() -> None:
    model = AcceptanceModel(prior_weight=2.0)
    assert float(model(torch.tensor([0.55]))) == pytest.approx(0.55)  # the prior: trust the draft
    model.observe(torch.full((8,), 0.55), torch.ones(8, dtype=torch.bool))  # under-confident draft
    assert float(model(torch.tensor([0.51]))) == pytest.approx((8 + 2 * 0.51) / 10)
    assert float(model(torch.tensor([0.95]))) == pytest.approx(0.95)  # other bins untouched


def test_acceptance_model_rates_unlikely_tokens_apart() -> None:
    # A sampled tree's many siblings far below 0.1: before any verification each is rated as the draft
    # says, not at a shared bin's middle; what is learnt about the rarest does not move the likelier.
    model = AcceptanceModel(prior_weight=2.0)
    assert model(torch.tensor([0.002, 0.02, 0.08])).tolist() == pytest.approx([0.002, 0.02, 0.08])
    model.observe(torch.full((20,), 0.0005), torch.zeros(20, dtype=torch.bool))
    model.observe(torch.full((20,), 0.05), torch.ones(20, dtype=torch.bool))  # an under-confident draft
    rare, fair = model(torch.tensor([0.0002, 0.06])).tolist()
    assert rare == pytest.approx(0.0004 / 22)
    assert fair == pytest.approx((20 + 0.12) / 22)


def test_auto_budget_labels_the_children_of_accepted_nodes_and_multiplies_rates() -> None:
    # root -> a (0.8) -> c (0.5); root -> b (0.23). Path: a. Tried: a, b (root's children), c (a's child).
    tree = DraftTree(0, 8)
    a, b = tree.add(torch.tensor([0, 0]), torch.tensor([1, 2]), torch.log(torch.tensor([0.8, 0.23])))
    (c,) = tree.add(a[None], torch.tensor([3]), torch.log(torch.tensor([0.8 * 0.5])))
    policy = AutoBudget(STEEP)
    probs = policy.node_probs(tree)
    assert probs.tolist() == pytest.approx([1.0, 0.8, 0.23, 0.8 * 0.5])  # the prior: the draft's own
    policy.observe(tree, [int(a)], drafted=tree.size)
    rates = policy.acceptance(torch.tensor([0.8, 0.23, 0.5]))
    assert rates.tolist() == pytest.approx([(1 + 1.6) / 3, 0.46 / 3, 1.0 / 3])


@pytest.fixture(scope="module")
def reference(models) -> list[int]:
    """The target's own greedy continuation of the prompt, 48 tokens."""
    target, _, prompt = models
    return target.generate(prompt[None], do_sample=False, max_new_tokens=48)[0, len(prompt) :].tolist()


def auto_generate(models, method: str, cost: CostModel) -> specexec.GenerationOutput:
    target, draft, prompt = models
    return specexec.generate(
        target, draft, prompt, method=method, budget="auto", cost_model=cost, max_new_tokens=48
    )


def test_auto_budget_generation_is_exact_and_follows_the_regime(models, reference) -> None:
    sizes = {}
    for name, cost in (("steep", STEEP), ("flat", FLAT)):
        out = auto_generate(models, "specexec", cost)
        assert out.tokens == reference
        sizes[name] = sum(out.stats.tree_sizes) / len(out.stats.tree_sizes)
    assert sizes["flat"] > 4 * sizes["steep"], sizes


def test_the_target_pace_follows_measured_passes() -> None:
    """A calibration whose target passes run twice as long as it says (a slower disk) is priced at that
    pace within a few dozen passes: the target's times, the overlap (the same read-ahead takes twice as
    long), plain decoding's rate and λ. Passes as calibrated bring it back; a hand-written cost model is
    priced as written."""
    cost = CostModel({1: 0.4, 16: 0.5, 64: 0.8}, {1: 0.02, 16: 0.1}, overlap=0.1, measured=True)
    slow_pass = 2 * cost.target_seconds(16) - 0.05  # after 0.05 s of drafting, within the doubled overlap
    for policy in (AutoBudget(cost, max_budget=64), ChainCostStop(cost)):
        rate = policy.gate.rate
        for _ in range(60):
            policy.observe_pass(16, 0.05, slow_pass)
        assert policy.pace.factor == pytest.approx(2.0, rel=0.01)
        assert policy.cost.target_seconds(16) == pytest.approx(1.0, rel=0.03)
        assert policy.cost.overlap == pytest.approx(0.2, rel=0.03)
        assert policy.gate.plain_rate == pytest.approx(1 / 0.8, rel=0.03)
        assert policy.gate.rate == pytest.approx(rate / 2, rel=0.03)
        longest = CHAIN_CHECK if isinstance(policy, AutoBudget) else policy.max_length
        paced = chain_seconds(cost.with_target_pace(2.0), longest)
        assert policy.chain_times == pytest.approx(paced, rel=0.03)
        if isinstance(policy, AutoBudget):
            assert policy.target_table.tolist() == pytest.approx(
                (2 * policy.measured_table).tolist(), rel=0.03
            )
        for _ in range(60):
            policy.observe_pass(16, 0.05, cost.target_seconds(16) - 0.05)
        assert policy.pace.factor == pytest.approx(1.0, rel=0.01)
        assert policy.cost.target_seconds(16) == pytest.approx(0.5, rel=0.03)
    written = AutoBudget(CostModel(cost.target, cost.draft, overlap=0.1), max_budget=64)
    written.observe_pass(16, 0.05, slow_pass)
    assert written.pace.factor == 1.0 and written.cost.target_seconds(16) == 0.5


def test_a_pace_near_the_calibration_keeps_its_prices() -> None:
    """Passes 20% slower than calibrated (within PACE_BAND: how a fresh calibration's own passes ran)
    leave the prices as calibrated; 40% slower prices them at the pace."""
    cost = CostModel({1: 0.4, 16: 0.5, 64: 0.8}, {1: 0.02, 16: 0.1}, measured=True)
    for slower, priced in ((1.2, 0.5), (1.4, 0.7)):
        policy = AutoBudget(cost, max_budget=64)
        for _ in range(60):
            policy.observe_pass(16, 0.0, slower * cost.target_seconds(16))
        assert policy.pace.factor == pytest.approx(slower, rel=0.01)
        assert policy.cost.target_seconds(16) == pytest.approx(priced, rel=0.03)


def test_a_slower_target_than_calibrated_drafts_more() -> None:
    """Drafting costs the same while each target pass costs more: expanding the frontier that does not
    pay at the calibrated pace pays at twice it (the failing rule: a λ left in the old units, which
    made the tree smaller)."""
    frontier = []
    for pace in (1.0, 2.0):
        cost = CostModel({1: 0.4, 16: 0.5, 64: 0.8}, {1: 0.25, 16: 0.5}, measured=True)
        policy = AutoBudget(cost, max_budget=16)
        for _ in range(60):
            policy.observe_pass(4, 0.0, pace * cost.target_seconds(4))
        frontier.append(
            policy.frontier_size(torch.tensor([0.6, 0.4, 0.3]), torch.tensor([0.6, 0.4]), 0.1, 0.5)
        )
    assert frontier == [0, 2]


def test_the_engine_tells_the_policy_each_verification_time(models, monkeypatch) -> None:
    """Every verification's target time reaches the pace, and they sum to the target's decode time."""
    seen = []
    observe = specexec.budget.costs.TargetPace.observe
    monkeypatch.setattr(
        specexec.budget.costs.TargetPace, "observe", lambda self, p, m: (seen.append(m), observe(self, p, m))
    )
    measured = CostModel(STEEP.target, STEEP.draft, measured=True)
    for method in ("specexec", "dsl"):
        seen.clear()
        out = auto_generate(models, method, measured)
        assert len(seen) == out.stats.target_calls > 1
        assert sum(seen) == pytest.approx(out.stats.target_seconds)


def test_drafting_that_the_target_pass_takes_back_is_free(models, reference) -> None:
    """With an overlap, the first draft passes of a step cost nothing: chains and trees grow, exactly."""
    overlapped = CostModel(STEEP.target, STEEP.draft, overlap=0.3)
    assert chain_seconds(overlapped, 3) == pytest.approx([STEEP.target_seconds(k + 1) for k in range(4)])
    assert chain_seconds(overlapped, 4)[4] == pytest.approx(0.06 + STEEP.target_seconds(5))
    # A draft pass (0.09 s) for a child of P 0.3: not worth its time, unless the target pass takes it back.
    ranked = torch.tensor([0.3])
    assert AutoBudget(STEEP).frontier_size(ranked, ranked, 0.0, 1.0) == 0
    assert AutoBudget(overlapped).frontier_size(ranked, ranked, 0.0, 1.0) == 1
    assert AutoBudget(overlapped).best_size(ranked, 0.25) == AutoBudget(overlapped).best_size(ranked, 0.0)
    assert AutoBudget(STEEP).best_size(ranked, 0.25)[1] < AutoBudget(STEEP).best_size(ranked, 0.0)[1]
    sizes, depths = {}, {}
    for name, cost in (("plain", STEEP), ("overlapped", overlapped)):
        tree = auto_generate(models, "specexec", cost)
        chain = auto_generate(models, "dsl", cost)
        assert tree.tokens == reference and chain.tokens == reference
        sizes[name] = sum(tree.stats.tree_sizes) / len(tree.stats.tree_sizes)
        depths[name] = sum(chain.stats.tree_depths) / len(chain.stats.tree_depths)
    assert sizes["overlapped"] > 1.5 * sizes["plain"], sizes
    assert depths["overlapped"] > depths["plain"], depths
    with pytest.raises(ValueError, match="overlap"):
        CostModel(STEEP.target, STEEP.draft, overlap=-0.1)


def chain_length(stop: ChainCostStop, confidence: float, limit: int = 20) -> int:
    stop.start()
    for k in range(1, limit + 1):
        if stop.should_stop(confidence):
            return k
    return limit


def test_chain_cost_stop_follows_costs_and_confidence() -> None:
    # A draft token at a third of a decode step and verification flat up to 4 tokens: short chains.
    cpu = CostModel({1: 0.26, 4: 0.26, 16: 0.29, 64: 0.58}, {1: 0.09, 64: 0.29})
    fast, slow = ChainCostStop(cpu), ChainCostStop(cpu)
    achieving(fast, 8.0)  # twice plain decoding's rate
    assert 2 <= chain_length(fast, 0.9) <= 8
    assert chain_length(fast, 0.9) > chain_length(fast, 0.5)
    assert chain_length(slow, 0.9) > chain_length(fast, 0.9)  # the lower the rate, the more a token pays
    # Offloaded: a draft token is nearly free next to a 5 s target pass, so a sure draft runs long.
    assert chain_length(ChainCostStop(FLAT), 0.97) == 20
    # A draft that turns out to be over-confident (nothing accepted) earns shorter chains.
    stop = ChainCostStop(cpu)
    before = chain_length(stop, 0.9)
    for _ in range(5):
        chain_length(stop, 0.9)
        stop.observe([0.9, 0.9], accepted=0, first_pass_tokens=1, target_seconds=cpu.target_seconds(3))
    assert chain_length(stop, 0.9) < before


def test_chain_cost_stop_charges_a_first_pass_that_caught_up() -> None:
    """A chain whose first draft pass took in 6 tokens (the draft catching up after plain steps) is
    recorded at its modelled time plus the extra 5 tokens' draft cost."""
    cost = CostModel({1: 0.1, 64: 0.2}, {1: 0.01, 6: 0.5, 64: 1.0})
    spent = {}
    for first in (6, 1):
        stop = ChainCostStop(cost)
        before = stop.gate.seconds
        stop.observe([0.9, 0.8], accepted=1, first_pass_tokens=first, target_seconds=cost.target_seconds(3))
        spent[first] = stop.gate.seconds - before
    assert spent[1] == pytest.approx(stop.chain_times[2])
    assert spent[6] == pytest.approx(spent[1] + 0.5 - 0.01)


def test_dsl_auto_is_exact_and_cuts_chains_by_cost(models, reference) -> None:
    depths = {}
    for name, cost in (("steep", STEEP), ("flat", FLAT)):
        out = auto_generate(models, "dsl", cost)
        assert out.tokens == reference
        depths[name] = max(out.stats.tree_depths)
    assert depths["flat"] > depths["steep"], depths


def test_auto_is_the_default_budget_of_specexec_and_dsl(models) -> None:
    target, draft, prompt = models
    for method in ("specexec", "dsl"):
        explicit = auto_generate(models, method, STEEP)
        default = specexec.generate(target, draft, prompt, method=method, cost_model=STEEP, max_new_tokens=48)
        assert default.tokens == explicit.tokens
        assert default.stats.tree_sizes == explicit.stats.tree_sizes, method  # the same cost-sized steps


def test_speculation_gate_backs_off_fast_where_drafting_has_been_losing() -> None:
    from specexec.budget.gate import LOSING_MAX_PAUSE, SpeculationGate

    gate = SpeculationGate(CostModel({1: 0.1, 64: 0.2}, {1: 0.05, 64: 0.1}), window=2, pause=2)
    for _ in range(2):
        assert gate.allows()
        gate.record(tokens=1, seconds=0.15)  # 6.7 tok/s drafted < 10 tok/s plain
    assert gate.rate < gate.plain_rate
    assert [gate.allows() for _ in range(3)] == [False, False, True]
    gate.record(1, 0.15)
    gate.record(1, 0.15)
    assert [gate.allows() for _ in range(9)] == [False] * 8 + [True]  # the pause grew fourfold
    gate.record(2, 0.15)
    gate.record(2, 0.15)  # a winning window (13 tok/s), but λ is still below plain decoding's rate
    assert gate.rate < gate.plain_rate and gate.pause == 16  # halved, not reset
    for _ in range(8):
        gate.record(1, 0.15)
    assert gate.pause == LOSING_MAX_PAUSE


def test_speculation_gate_forgives_a_losing_window_where_drafting_has_been_paying() -> None:
    from specexec.budget.gate import PAYING_MAX_PAUSE, SpeculationGate

    gate = SpeculationGate(CostModel({1: 0.1, 64: 0.2}, {1: 0.05, 64: 0.1}), window=2, pause=2)
    for _ in range(10):
        gate.record(3, 0.15)  # 20 tok/s
    gate.record(1, 0.15)
    gate.record(1, 0.15)  # a losing window
    assert gate.rate > gate.plain_rate
    assert [gate.allows() for _ in range(3)] == [False, False, True]
    gate.record(1, 0.15)
    gate.record(1, 0.15)
    assert [gate.allows() for _ in range(5)] == [False] * 4 + [True]  # the pause doubled
    gate.record(3, 0.15)
    gate.record(3, 0.15)  # drafting pays again
    assert gate.allows() and gate.pause == 2
    for _ in range(12):
        gate.record(1, 0.12)  # 8.3 tok/s: losing, while λ stays above plain decoding's rate
    assert gate.rate > gate.plain_rate and gate.pause == PAYING_MAX_PAUSE


def test_auto_methods_stop_drafting_where_it_cannot_pay_and_stay_exact(models, reference) -> None:
    hopeless = CostModel({1: 0.01, 64: 0.5}, {1: 0.5, 64: 1.0})  # a draft pass costs 50 target passes
    for method in ("specexec", "dsl"):
        out = auto_generate(models, method, hopeless)
        assert out.tokens == reference
        assert out.stats.tree_sizes.count(0) >= len(out.stats.tree_sizes) / 2, (method, out.stats.tree_sizes)


def test_chain_pays_only_where_speculation_can_win() -> None:
    from specexec.budget.costs import chain_seconds
    from specexec.budget.policy import chain_pays

    # llama.cpp on 2 AVX2 cores (shared/notes/llamacpp-backend.md): 4 tokens cost 2.5 one-token passes,
    # a draft pass half of one. Even a draft right 95% of the time loses to plain decoding.
    avx2 = CostModel({1: 0.051, 2: 0.087, 4: 0.128, 8: 0.319, 16: 0.42}, {1: 0.025, 8: 0.14})
    plain = 1 / 0.051
    assert not chain_pays(0.95, plain, chain_seconds(avx2, 32))
    assert chain_pays(1.0, plain, chain_seconds(avx2, 32))  # only a perfect draft edges ahead (k = 3)
    # Verification flat up to 4 tokens (PyTorch on a CPU), or flat throughout (offloading): fair drafts pay.
    assert chain_pays(0.8, 1 / 0.26, chain_seconds(STEEP, 32))
    assert chain_pays(0.6, 1 / 5.0, chain_seconds(FLAT, 32))
    assert not chain_pays(0.3, 1 / 0.26, chain_seconds(STEEP, 32))


def test_drafting_that_paid_well_does_not_talk_itself_out_of_drafting() -> None:
    """`worth_drafting` asks whether a chain could beat plain decoding. Asked against the achieved rate λ
    instead, a generation whose drafting had paid more than the next chain promises stopped drafting for
    good (a step that does not draft learns nothing, so λ stayed). Costs: the packaged pair's target on
    two RPC workers 20 ms away, calibrated (docs/cluster.md)."""
    from specexec.budget.costs import chain_seconds
    from specexec.budget.policy import chain_pays

    rpc = CostModel(
        {1: 0.119, 2: 0.181, 4: 0.258, 6: 0.303, 8: 0.448, 16: 0.502}, {1: 0.023, 8: 0.1, 16: 0.139}
    )
    times = chain_seconds(rpc, 32)
    assert chain_pays(0.95, 1 / 0.119, times)  # a chain beats plain decoding here
    assert not chain_pays(0.95, 14.0, times)  # the control: valued at a λ of 14 tok/s, it "does not"
    for policy in (AutoBudget(rpc), ChainCostStop(rpc, max_length=32)):
        policy.acceptance.observe(
            torch.full((200,), 0.95), torch.rand(200, generator=torch.Generator().manual_seed(0)) < 0.95
        )
        achieving(policy, 14.0)
        assert policy.gate.rate > 1.5 * policy.gate.plain_rate
        assert policy.worth_drafting() and policy.drafts_now(), type(policy).__name__


@contextlib.contextmanager
def forward_sizes(model) -> Iterator[list[int]]:
    """The tokens of each forward of `model` while the block runs, in order."""
    sizes: list[int] = []
    hook = model.get_input_embeddings().register_forward_hook(
        lambda _, args, __: sizes.append(args[0].shape[-1])
    )
    try:
        yield sizes
    finally:
        hook.remove()


def test_auto_methods_skip_the_draft_pass_where_no_chain_can_pay(models, reference) -> None:
    """On such a machine the default decodes plainly from the first step: no draft pass is spent, not
    even the prompt's prefill (the draft model is never run)."""
    avx2 = CostModel({1: 0.051, 2: 0.087, 4: 0.128, 8: 0.319, 16: 0.42}, {1: 0.025, 8: 0.14})
    with forward_sizes(models[1]) as draft_forwards:
        for method in ("specexec", "dsl"):
            out = auto_generate(models, method, avx2)
            assert out.tokens == reference
            assert out.stats.draft_calls == 0, method
            assert set(out.stats.tree_sizes) == {0}, method
        assert draft_forwards == []
        # The negative control: where drafting pays, the draft model runs.
        assert auto_generate(models, "specexec", FLAT).stats.draft_calls > 0 and draft_forwards


def test_a_generation_that_starts_in_a_pause_does_not_run_the_draft(models, reference) -> None:
    """A pause carried over from earlier generations (`LearntPolicies`) that outlasts this one: the draft
    model is not even prefilled. One that ends within it: the draft is prefilled with the prompt as
    usual, not made to catch up on everything inside decoding."""
    target, draft, prompt = models
    with forward_sizes(draft) as draft_forwards:
        for method in ("specexec", "dsl"):
            learnt = specexec.LearntPolicies()

            def run(learnt=learnt, method=method):
                return specexec.generate(
                    target, draft, prompt, method=method, budget="auto", cost_model=FLAT, max_new_tokens=48,
                    learnt=learnt,
                )  # fmt: skip

            assert run().stats.draft_calls > 0  # drafting pays here
            (policy,) = learnt._policies.values()
            for paused, drafts in ((100, False), (10, True)):
                policy.gate.paused, policy.gate.history = paused, []
                draft_forwards.clear()
                out = run()
                assert out.tokens == reference
                assert bool(out.stats.draft_calls) == bool(draft_forwards) == drafts, (method, paused)
                assert not any(out.stats.tree_sizes[:paused])
                if drafts:
                    assert draft_forwards[0] == len(prompt) - 1  # the prompt's prefill


def test_a_tree_padded_to_a_cheaper_batch_still_grows_deeper() -> None:
    """IQ4_NL's measured costs (4 tokens verify for less than 2 or 3, 5 for much more): after the first
    draft pass the best tree is the root's three children, the unlikely two only padding the batch to 4.
    Expanding the likely child pays, because its child can replace a padding sibling; judging growth as
    "the current tree plus new nodes" (5 tokens) stopped every step at depth 1 (2.00 tokens per call)."""
    cost = CostModel(
        {1: 0.083, 2: 0.128, 3: 0.174, 4: 0.115, 6: 0.222, 8: 0.245, 16: 0.315},
        {1: 0.036, 2: 0.052, 3: 0.066, 4: 0.059, 8: 0.101},
    )
    policy = AutoBudget(cost)
    children = torch.tensor([0.9, 0.03, 0.02])
    assert policy.best_size(children, 0.036)[0] == 3
    assert policy.frontier_size(children, children, 0.036, child_accept=0.9) == 1
    # The control: an unlikely draft child is not worth a pass.
    assert policy.frontier_size(children, children, 0.036, child_accept=0.02) == 0


def test_a_tree_grows_through_a_jump_in_the_targets_cost_to_the_flat_after_it() -> None:
    """Over RPC workers at 10 ms (the real pair on 2 cores), verifying 8 tokens cost 3.4x one token and 16
    cost about what 8 did. One more node past 6 loses, ten more win: judging only the next pass stopped
    every tree at about 5 nodes, where `dsl`'s chains, which look further, reached 20."""
    cost = CostModel({1: 0.1, 6: 0.25, 8: 0.4, 32: 0.42}, {1: 0.02, 2: 0.035})
    policy = AutoBudget(cost)
    chain = torch.tensor(0.95) ** torch.arange(1, 6)  # a chain of 5 nodes, each 95% sure
    assert policy.best_size(chain, 0.1)[0] == 5
    assert policy.frontier_size(chain, chain[-1:], 0.1, child_accept=0.95) == 1
    # The control: where every token costs as much as the first, the chain stops.
    linear = AutoBudget(CostModel({1: 0.1, 32: 3.2}, cost.draft))
    assert linear.frontier_size(chain, chain[-1:], 0.1, child_accept=0.95) == 0


def test_a_draft_that_batches_dearly_catches_up_on_the_latest_tokens_only() -> None:
    """This CPU's measured curves (default pair, llama.cpp, 2 threads): reading 8 missed tokens costs the
    draft 1.4 target passes, so a probe after a pause reads the last 4. Where the draft batches cheaply
    (a GPU), it reads everything it missed."""
    cpu = CostModel({1: 0.094, 16: 0.40}, {1: 0.040, 2: 0.055, 4: 0.075, 8: 0.127, 16: 0.208})
    assert catch_up_window(cpu) == 4
    assert catch_up_window(FLAT) is None


# Verification is flat, so drafting pays, but a draft forward over 4 or more tokens costs more than half
# a target pass: a draft back from plain steps reads only the last 3 tokens.
DEAR_BATCHES = CostModel({1: 1.0, 1024: 1.2}, {1: 0.05, 3: 0.5, 4: 0.8, 128: 0.9})


@pytest.mark.parametrize("method", ["specexec", "dsl"])
def test_after_a_pause_the_draft_skips_what_it_missed_and_the_cache_stays_consistent(
    models, reference, method: str
) -> None:
    """Where drafting has been losing, the first draft forward after a pause of 10 steps reads 3 tokens,
    not the 11 it missed; the output is still the target's, and the draft's cache at the end is exactly
    the committed text with the skipped tokens cut out (what a fresh draft reading that text computes).
    A follow-up that shares the whole text reuses the draft's cache only up to the cut."""
    target, draft, prompt = models
    assert catch_up_window(DEAR_BATCHES) == 3
    learnt, cache = specexec.LearntPolicies(), PrefixCache(1 << 30)

    def run(input_ids, cache=None, max_new_tokens=48):
        return specexec.generate(
            target, draft, input_ids, method=method, budget="auto", cost_model=DEAR_BATCHES,
            max_new_tokens=max_new_tokens, learnt=learnt, prefix_cache=cache,
        )  # fmt: skip

    assert run(prompt).stats.draft_calls > 0  # drafting pays here
    (policy,) = learnt._policies.values()
    gate = policy.gate
    gate.window = 10**6  # no later pause: at most one cut, which the check below reconstructs
    # Where drafting has been paying, the draft reads everything it missed: context matters there.
    gate.paused, gate.history = 10, []
    with forward_sizes(draft) as draft_forwards:
        assert run(prompt).tokens == reference
    assert draft_forwards[:2] == [len(prompt) - 1, 11]
    # Where it has been losing (λ a tenth of plain decoding's rate), the probe reads the latest 3.
    gate.paused, gate.tokens, gate.seconds = 10, 1.0, 10.0
    with forward_sizes(draft) as draft_forwards:
        out = run(prompt, cache)
    assert out.tokens == reference
    assert draft_forwards[0] == len(prompt) - 1  # the prompt's prefill
    assert draft_forwards[1] == 3  # after 10 plain steps: the last 3 of the 11 tokens it had not read
    assert all(out.stats.tree_sizes[10:-1])  # and drafts from then on

    (entry,) = cache._entries
    runner = entry.draft
    assert (runner.cut, runner.skipped) == (len(prompt) - 1, 11 - 3)
    assert_cache_is_text_with_cut(runner, entry.tokens, draft)

    # A follow-up turn: the target's cache is reused whole, the draft's only up to the cut.
    follow_up = torch.tensor([*entry.tokens, 7, 8])
    expected = target.generate(follow_up[None], do_sample=False, max_new_tokens=8)[0, len(follow_up) :]
    with forward_sizes(draft) as draft_forwards:
        out = run(follow_up, cache, max_new_tokens=8)
    assert out.tokens == expected.tolist()
    assert out.stats.cached_tokens == len(entry.tokens) - 1  # all the target had read (not the last token)
    assert draft_forwards[0] == len(follow_up) - 1 - runner.cut


class OnlyThe:
    """A policy seen through `protocol`: any other member is an AttributeError."""

    def __init__(self, protocol: type, policy: object) -> None:
        bases = [base for base in protocol.__mro__ if base not in (Protocol, Generic, object)]
        members = {name for base in bases for name in [*vars(base), *base.__annotations__]}
        object.__setattr__(self, "_members", members)
        object.__setattr__(self, "_policy", policy)

    def __getattr__(self, name: str) -> object:
        return getattr(self._policy, self._member(name))

    def __setattr__(self, name: str, value: object) -> None:
        setattr(self._policy, self._member(name), value)

    def _member(self, name: str) -> str:
        if name.startswith("_") or name not in self._members:
            raise AttributeError(f"{name!r} is not part of the drafter's interface")
        return name


def snapshot(value: object) -> object:
    """A comparable copy of everything a policy holds."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, list | tuple | deque):
        return [snapshot(v) for v in value]
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
    return snapshot(vars(value)) if hasattr(value, "__dict__") else value


@pytest.mark.parametrize(
    ("make_policy", "make_drafter", "protocol"),
    [
        (lambda: AutoBudget(FLAT, max_budget=16), lambda p: BestFirstDrafter(p, expand=4), TreeBudget),
        (lambda: ChainCostStop(FLAT, max_length=8), lambda p: ChainDrafter(8, cost_stop=p), ChainBudget),
        (lambda: ConfidenceStop(0.3), lambda p: ChainDrafter(8, stop=p), ChainStop),
        (
            lambda: HeuristicLookahead(9),
            lambda p: ChainDrafter(2, schedule=p, max_length=4),
            LookaheadSchedule,
        ),
    ],
)
def test_drafters_ask_their_policies_only_through_the_narrow_interface(
    models, make_policy, make_drafter, protocol
) -> None:
    """Seeing only the protocol's members, a drafter drafts what it drafts with the whole policy, and the
    policy learns the same."""
    _, draft, prompt = models
    no_eos = torch.zeros(0, dtype=torch.long)
    seen = []
    for narrow in (False, True):
        policy = make_policy()
        drafter = make_drafter(OnlyThe(protocol, policy) if narrow else policy)
        runner = ModelRunner(draft, 128)
        runner.extend(prompt[:-1])
        proposal = drafter.propose(DraftRequest(prompt, 20, no_eos, 64, SamplingParams(), None, runner))
        assert proposal.tree.size > 2  # test design: the policy let it draft
        drafter.observe(proposal, [1], 0.1)
        seen.append((proposal.tree.tokens[: proposal.tree.size].tolist(), snapshot(policy)))
    assert seen[0] == seen[1]


def test_auto_budget_verifies_larger_trees_where_amx_makes_blocks_cheap() -> None:
    """The 1.5B target on a 2-core Xeon with AMX, measured with llama.cpp's AMX kernels on and off
    (../shared/notes/amx-crash.md; the same 0.5B draft): the policy finds the cheap blocks from the costs
    alone, without being told, and grows its trees where verifying 4-16 tokens costs little more than one."""
    draft = {1: 0.0286, 8: 0.0734, 16: 0.1262}
    amx = CostModel({1: 0.0749, 4: 0.1345, 8: 0.1564, 16: 0.2121, 32: 0.3382, 64: 0.6349}, draft)
    plain = CostModel({1: 0.074, 2: 0.1058, 4: 0.1582, 8: 0.2446, 16: 0.2684, 32: 0.3588, 64: 0.670}, draft)
    ranked = torch.tensor([0.6 ** (i + 1) for i in range(32)])  # a chain, each token accepted at 0.6
    sizes = {name: AutoBudget(cost, max_budget=255).best_size(ranked, 0.0)[0] for name, cost in
             (("amx", amx), ("plain", plain))}  # fmt: skip
    assert sizes["amx"] > sizes["plain"] >= 1, sizes
