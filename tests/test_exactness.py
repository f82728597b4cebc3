"""Greedy exactness: every method reproduces Hugging Face's greedy `generate`, token for token.

The matrix is method x architecture x budget x draft, 64 new tokens each, in float32. Drafts: the target
itself (everything should be accepted), a perturbed copy of the target (partial acceptance) and an
unrelated one-layer model (almost nothing accepted). Acceptance is asserted too, so that a method which
silently fell back to one token per step, or never used its draft, could not pass.
"""

from __future__ import annotations

import functools

import pytest
import torch
from tiny_models import ARCHS, PERTURB_NOISE, greedy_margins, hf_greedy, perturbed, tiny_model

import specexec

PROMPT = [3, 17, 42, 5, 9, 11, 60, 2]
NEW = 64
BUDGETS = (1, 8, 64, 512)
DRAFTS = ("self", "perturbed", "random")
SPECULATIVE = ("sd", "specinfer", "specexec")


@functools.cache
def target(arch: str):
    return tiny_model(arch, seed=0)


@functools.cache
def draft(arch: str, kind: str):
    if kind == "self":
        return target(arch)
    if kind == "perturbed":
        return perturbed(target(arch), PERTURB_NOISE[arch])
    return tiny_model(arch, seed=123, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)


@functools.cache
def reference(arch: str) -> tuple[int, ...]:
    return tuple(hf_greedy(target(arch), PROMPT, NEW))


@functools.cache
def run(arch: str, method: str, budget: int, kind: str) -> specexec.GenerationOutput:
    return specexec.generate(
        target(arch), draft(arch, kind), PROMPT, method=method, max_new_tokens=NEW, budget=budget
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_reference_is_well_defined(arch: str) -> None:
    """Test design: no near-ties on the greedy path (so float32 tree forwards cannot flip an argmax), and
    a continuation that is not one repeated token."""
    ref = list(reference(arch))
    assert len(ref) == NEW
    assert float(greedy_margins(target(arch), PROMPT, ref).min()) > 1e-3
    assert len(set(ref)) >= 10


@pytest.mark.parametrize("arch", ARCHS)
def test_ar(arch: str) -> None:
    out = specexec.generate(target(arch), None, PROMPT, method="ar", max_new_tokens=NEW)
    assert out.tokens == list(reference(arch))
    assert out.finish_reason == "length"
    assert out.stats.target_calls == NEW
    assert out.stats.tokens_per_step == 1.0
    assert out.stats.tree_sizes == [0] * NEW


@pytest.mark.parametrize("kind", DRAFTS)
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("method", SPECULATIVE)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hugging_face(arch: str, method: str, budget: int, kind: str) -> None:
    out = run(arch, method, budget, kind)
    assert out.tokens == list(reference(arch))
    assert out.finish_reason == "length"
    stats = out.stats
    assert stats.new_tokens == NEW
    assert max(stats.tree_sizes) <= budget
    assert sum(stats.accepted) + stats.target_calls == NEW  # no step was cut: nothing past 64 drafted
    if kind == "self":
        # The draft's greedy choices are the target's, so everything the draft proposes along its own
        # greedy path is accepted.
        if method == "sd":
            assert stats.accepted == stats.tree_sizes, "a draft equal to the target was rejected"
        elif method == "specinfer":
            assert stats.accepted == stats.tree_depths, "the greedy branch was not accepted to its end"
        elif budget == 1:
            assert stats.accepted == [1] * 32
    if kind == "random":
        assert stats.tokens_per_step < 1.5


@pytest.mark.parametrize("arch", ARCHS)
def test_acceptance_ordering(arch: str) -> None:
    """Acceptance follows draft quality: target itself > perturbed copy > unrelated model."""
    tps = {
        (m, b, k): run(arch, m, b, k).stats.tokens_per_step
        for m in SPECULATIVE
        for b in BUDGETS
        for k in DRAFTS
    }
    # sd with the target as draft accepts whole chains: budget 8 -> 9 tokens per step, cut to 64.
    assert tps["sd", 8, "self"] == NEW / 8
    assert tps["sd", 64, "self"] == NEW  # one step: 63 accepted + 1 bonus
    assert tps["sd", 1, "self"] == tps["specinfer", 1, "self"] == tps["specexec", 1, "self"] == 2.0
    # SpecExec with its own target as draft follows the greedy path deep into large trees.
    assert tps["specexec", 64, "self"] >= 5
    assert tps["specexec", 512, "self"] >= 7
    assert max(run(arch, "specexec", 512, "self").stats.accepted) >= 10
    for method in SPECULATIVE:
        for budget in (8, 64, 512):
            self_, pert, rand = (tps[method, budget, k] for k in DRAFTS)
            assert self_ > pert > rand, (method, budget, self_, pert, rand)
    # The perturbed draft is partially accepted: some chains accepted in full, some cut short.
    stats = run(arch, "sd", 8, "perturbed").stats
    assert any(a < size for a, size in zip(stats.accepted, stats.tree_sizes, strict=True)), "no rejection"
    assert max(stats.accepted) > 0, "no acceptance"
    assert 1.5 < tps["sd", 8, "perturbed"] < 8


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_eager_attention(arch: str) -> None:
    """The eager attention path (Gemma2's only one, with attention-logit softcapping) is exact too."""
    model = tiny_model(arch, seed=5, attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    ref = hf_greedy(model, PROMPT, NEW)
    rand = tiny_model(arch, seed=6, hidden_size=32, num_layers=1, attn_implementation="eager")
    for drafter, method, budget in ((model, "specexec", 64), (rand, "specexec", 64), (model, "sd", 8)):
        out = specexec.generate(model, drafter, PROMPT, method=method, max_new_tokens=NEW, budget=budget)
        assert out.tokens == ref, (method, budget)
    assert out.stats.accepted == out.stats.tree_sizes


@pytest.mark.parametrize("kind", DRAFTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_dsl_greedy(arch: str, kind: str) -> None:
    """Dynamic lookahead (a chain cut where the draft is unsure) is exact too."""
    out = specexec.generate(
        target(arch), draft(arch, kind), PROMPT, method="dsl", max_new_tokens=NEW, budget=20
    )
    assert out.tokens == list(reference(arch))
    assert max(out.stats.tree_sizes) <= 20
    if kind == "self":
        assert out.stats.accepted == out.stats.tree_sizes


# -- end of sequence and length limits --------------------------------------------------------------------


@functools.cache
def eos_setup(arch: str) -> tuple[int, int]:
    """An eos id that greedy decoding first produces at a position >= 5; returns (eos id, position)."""
    ref = list(reference(arch))
    for pos, token in enumerate(ref):
        if pos >= 5 and token not in ref[:pos]:
            return token, pos
    raise AssertionError("test design: no fresh token in the greedy continuation")


@functools.cache
def eos_target(arch: str):
    eos, _ = eos_setup(arch)
    model = tiny_model(arch, seed=0, eos_token_id=eos)
    assert torch.equal(model.lm_head.weight, target(arch).lm_head.weight)
    return model


@pytest.mark.parametrize("kind", ["self", "random"])
@pytest.mark.parametrize("method", ["ar", *SPECULATIVE])
@pytest.mark.parametrize("arch", ARCHS)
def test_stops_at_eos(arch: str, method: str, kind: str) -> None:
    eos, pos = eos_setup(arch)
    model = eos_target(arch)
    expected = hf_greedy(model, PROMPT, NEW)
    assert expected == list(reference(arch))[: pos + 1], "Hugging Face stops right after eos"
    drafter = model if kind == "self" else draft(arch, "random")
    out = specexec.generate(model, drafter, PROMPT, method=method, max_new_tokens=NEW, budget=64)
    assert out.tokens == expected
    assert out.tokens[-1] == eos
    assert out.finish_reason == "stop"
    assert out.stats.new_tokens == pos + 1
    if kind == "self" and method in ("sd", "specexec"):
        assert out.stats.target_calls == 1, "the eos should have been drafted and accepted in one step"


@pytest.mark.parametrize("method", ["ar", *SPECULATIVE])
@pytest.mark.parametrize("arch", ARCHS)
def test_one_new_token(arch: str, method: str) -> None:
    out = specexec.generate(target(arch), target(arch), PROMPT, method=method, max_new_tokens=1, budget=8)
    assert out.tokens == list(reference(arch))[:1]
    assert out.finish_reason == "length"
    assert out.stats.target_calls == 1
    assert out.stats.tree_sizes == [0]


@pytest.mark.parametrize("method", SPECULATIVE)
@pytest.mark.parametrize("max_new", [2, 5, 9, 10])
def test_length_limit_inside_a_step(method: str, max_new: int) -> None:
    """With the target as draft a step could emit 9 tokens; the limit cuts exactly, and trees are never
    drafted past it."""
    arch = "llama"
    out = specexec.generate(
        target(arch), target(arch), PROMPT, method=method, max_new_tokens=max_new, budget=8
    )
    assert out.tokens == list(reference(arch))[:max_new]
    assert out.finish_reason == "length"
    assert out.stats.new_tokens == max_new
    assert sum(out.stats.accepted) + out.stats.target_calls == max_new
