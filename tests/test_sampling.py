"""Temperature, top-k and top-p (`probs_from_logits`), and the samplers built on them."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import chi2_pvalue
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specexec.sampling import (
    NUCLEUS_FLOOR,
    SamplingParams,
    argmax,
    probs_from_logits,
    sample,
    sample_without_replacement,
)

P_THRESHOLD = 1e-3


def probs(values: list[float], **params) -> torch.Tensor:
    """`probs_from_logits` on the logits log(values)."""
    return probs_from_logits(torch.tensor(values).log(), SamplingParams(**params))


def kept(values: list[float], **params) -> list[int]:
    return probs(values, **params).nonzero().squeeze(-1).tolist()


# -- greedy and temperature ----------------------------------------------------------------------------


def test_greedy_is_one_hot_on_the_argmax_first_index_on_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [0.5, -1.0, 0.2, 0.5], [-2.0, -3.0, -1.0, -9.0]])
    out = probs_from_logits(logits, SamplingParams(temperature=0.0))
    expected = torch.tensor([[0.0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 1, 0]])
    assert out.dtype == torch.float32
    assert torch.equal(out, expected)


def test_greedy_ignores_top_k_and_top_p() -> None:
    logits = torch.tensor([0.0, 5.0, 1.0])
    out = probs_from_logits(logits, SamplingParams(temperature=0.0, top_k=2, top_p=0.3))
    assert out.tolist() == [0.0, 1.0, 0.0]


def test_temperature_one_is_softmax() -> None:
    logits = torch.tensor([0.3, -1.2, 2.0, 0.0, 0.7])
    out = probs_from_logits(logits, SamplingParams(temperature=1.0))
    torch.testing.assert_close(out, torch.softmax(logits, -1))


@pytest.mark.parametrize("temperature", [0.25, 0.7, 2.0])
def test_temperature_scales_logits(temperature: float) -> None:
    logits = [0.3, -1.2, 2.0, 0.0]
    weights = [math.exp(x / temperature) for x in logits]
    expected = torch.tensor([w / sum(weights) for w in weights])
    out = probs_from_logits(torch.tensor(logits), SamplingParams(temperature=temperature))
    torch.testing.assert_close(out, expected)


def test_half_precision_logits_give_float32_probabilities() -> None:
    logits = torch.tensor([0.5, 1.5, -0.5], dtype=torch.float16)
    out = probs_from_logits(logits, SamplingParams(temperature=1.0))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.softmax(logits.float(), -1))


# -- top-k ------------------------------------------------------------------------------------------------


def test_top_k_keeps_the_k_most_probable_renormalised() -> None:
    values = [0.1, 0.4, 0.2, 0.3]
    out = probs(values, temperature=1.0, top_k=2)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.4 / 0.7, 0.0, 0.3 / 0.7]))


def test_top_k_keeps_ties_with_the_kth() -> None:
    logits = torch.tensor([5.0, 3.0, 1.0, 3.0, 0.0])
    out = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert out.nonzero().squeeze(-1).tolist() == [0, 1, 3]
    assert out[1] == out[3]


def test_top_k_at_least_vocab_size_is_off() -> None:
    logits = torch.tensor([0.1, 0.2, 0.3])
    for k in (3, 10):
        out = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=k))
        torch.testing.assert_close(out, torch.softmax(logits, -1))


def test_top_k_one_is_greedy_support() -> None:
    out = probs([0.2, 0.5, 0.3], temperature=1.3, top_k=1)
    assert out.tolist() == [0.0, 1.0, 0.0]


def test_top_k_applies_after_temperature() -> None:
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0])
    out = probs_from_logits(logits, SamplingParams(temperature=0.5, top_k=2))
    expected = torch.softmax(torch.tensor([3.0, 4.0]) / 0.5, -1)
    torch.testing.assert_close(out[2:], expected)
    assert out[:2].tolist() == [0.0, 0.0]


# -- top-p ------------------------------------------------------------------------------------------------

PEAKED = [0.6, 0.2, 0.1, 0.05, 0.05]


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (0.9, [0, 1, 2]),  # 0.6 + 0.2 + 0.1 reaches 0.9
        (0.89, [0, 1, 2]),
        (0.91, [0, 1, 2, 3]),
        (0.6, [0]),  # the top token alone reaches 0.6
        (0.59, [0]),
        (0.61, [0, 1]),
        (0.05, [0]),  # the top token is always kept
        (0.99, [0, 1, 2, 3, 4]),
    ],
)
def test_top_p_peaked(top_p: float, expected: list[int]) -> None:
    assert kept(PEAKED, temperature=1.0, top_p=top_p) == expected


def test_top_p_renormalises() -> None:
    out = probs(PEAKED, temperature=1.0, top_p=0.85)
    torch.testing.assert_close(out, torch.tensor([0.6, 0.2, 0.1, 0.0, 0.0]) / 0.9)


def test_top_p_is_order_independent() -> None:
    """The nucleus is chosen by probability, not by index."""
    order = [3, 0, 4, 2, 1]
    shuffled = [PEAKED[i] for i in order]
    out = probs(shuffled, temperature=1.0, top_p=0.85)
    assert out.nonzero().squeeze(-1).tolist() == [1, 3, 4]  # where 0.6, 0.1, 0.2 went


@pytest.mark.parametrize(("top_p", "count"), [(0.5, 10), (0.48, 10), (0.52, 11), (0.03, 1), (0.97, 20)])
def test_top_p_flat(top_p: float, count: int) -> None:
    """20 tokens of 0.05: the nucleus is the smallest set whose mass reaches top_p."""
    out = probs([0.05] * 20, temperature=1.0, top_p=top_p)
    assert int((out > 0).sum()) == count
    torch.testing.assert_close(out[out > 0], torch.full((count,), 1.0 / count))


def test_top_k_then_top_p() -> None:
    """top_k=3 leaves [0.6, 0.2, 0.1]/0.9 = [0.667, 0.222, 0.111]; top_p=0.8 then keeps the first two."""
    out = probs(PEAKED, temperature=1.0, top_k=3, top_p=0.8)
    torch.testing.assert_close(out, torch.tensor([0.75, 0.25, 0.0, 0.0, 0.0]))
    # Without top-k, 0.6 + 0.2 = 0.8 sits on the boundary; 0.79 makes the point without rounding worries.
    assert kept(PEAKED, temperature=1.0, top_p=0.79) == [0, 1]
    # The order matters: top-p first would keep [0, 1, 2] at 0.85, and top-k=3 would keep them too.
    assert kept(PEAKED, temperature=1.0, top_k=3, top_p=0.85) == [0, 1]


def test_temperature_then_top_p() -> None:
    """At temperature 0.5 the distribution sharpens to 0.6^2:0.2^2:... so 0.9 needs only two tokens."""
    weights = torch.tensor(PEAKED) ** 2
    sharpened = weights / weights.sum()
    assert sharpened[0] + sharpened[1] > 0.9 > sharpened[0]
    assert kept(PEAKED, temperature=0.5, top_p=0.9) == [0, 1]


def test_rows_are_independent() -> None:
    rows = [PEAKED, [0.05] * 4 + [0.8], [0.25, 0.25, 0.25, 0.125, 0.125]]
    logits = torch.tensor(rows).log()
    for params in (
        SamplingParams(temperature=1.0, top_p=0.7),
        SamplingParams(temperature=0.8, top_k=2),
        SamplingParams(temperature=1.2, top_k=3, top_p=0.9),
        SamplingParams(temperature=0.0),
    ):
        batched = probs_from_logits(logits, params)
        single = torch.stack([probs_from_logits(row, params) for row in logits])
        torch.testing.assert_close(batched, single)
        batched3 = probs_from_logits(logits[None].expand(2, -1, -1), params)  # (2, 3, V)
        torch.testing.assert_close(batched3, single[None].expand(2, -1, -1))


# -- agreement with Hugging Face's own processors ---------------------------------------------------------


def hf_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Hugging Face's processing in `generate`'s order: temperature -> top-k -> top-p, then softmax."""
    scores = logits.clone()
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, dim=-1)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.0, 3, 1.0), (1.3, 5, 0.8), (0.5, 0, 0.5), (1.0, 10, 0.95)],
)
def test_matches_hugging_face_processors(temperature: float, top_k: int, top_p: float) -> None:
    gen = torch.Generator().manual_seed(0)
    scale = torch.tensor([0.3, 1.0, 3.0, 8.0]).repeat_interleave(50)[:, None]  # flat to peaked rows
    logits = torch.randn(200, 50, generator=gen) * scale  # (200, 50)
    ours = probs_from_logits(logits, SamplingParams(temperature, top_k, top_p))
    theirs = hf_probs(logits, temperature, top_k, top_p)
    assert torch.equal(ours > 0, theirs > 0), "different supports"
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


# -- parameter checks -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"top_k": -1},
        {"top_p": 0.0},
        {"top_p": -0.5},
        {"top_p": 1.5},
        {"top_p": float("nan")},
    ],
)
def test_bad_params_raise(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_default_params_are_greedy() -> None:
    params = SamplingParams()
    assert params.greedy
    assert not SamplingParams(temperature=0.5).greedy


# -- samplers ---------------------------------------------------------------------------------------------


def test_sample_matches_probs_row_by_row() -> None:
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.0, 0.1, 0.1, 0.8]])
    gen = torch.Generator().manual_seed(1)
    draws = sample(p[:, None, :].expand(2, 20000, 4), gen)  # (2, 20000)
    assert draws.shape == (2, 20000)
    for row in range(2):
        counts = torch.bincount(draws[row], minlength=4)
        assert chi2_pvalue(counts, p[row]) > P_THRESHOLD


def test_sample_never_draws_a_zero_probability_token(monkeypatch) -> None:
    weights = torch.tensor([[0.0, 2.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.5, 0.0, 0.0]])  # not normalised
    draws = sample(weights[:, None, :].expand(2, 20000, 5), torch.Generator().manual_seed(2))
    assert set(draws[0].tolist()) == {1, 3} and set(draws[1].tolist()) == {2}
    assert (
        chi2_pvalue(torch.bincount(draws[0], minlength=5)[[1, 3]], torch.tensor([2 / 3, 1 / 3])) > P_THRESHOLD
    )
    for extreme, expected in [(0.0, [1, 2]), (1.0 - 2.0**-53, [3, 2])]:  # the smallest and largest draws
        monkeypatch.setattr(
            torch, "rand", lambda shape, x=extreme, **kw: torch.full(shape, x, dtype=kw["dtype"])
        )
        assert sample(weights, None).tolist() == expected


def test_sample_is_deterministic_given_the_generator() -> None:
    p = torch.full((10,), 0.1)
    a = sample(p.expand(50, 10), torch.Generator().manual_seed(3))
    b = sample(p.expand(50, 10), torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


def test_sample_without_replacement_distinct_and_in_support() -> None:
    gen = torch.Generator().manual_seed(2)
    p = torch.tensor([0.0, 0.3, 0.0, 0.25, 0.2, 0.15, 0.1, 0.0])
    for n in (1, 3, 5):
        for _ in range(200):
            out = sample_without_replacement(p, n, gen)
            assert out.numel() == n
            assert len(set(out.tolist())) == n
            assert bool((p[out] > 0).all())
    # Fewer come back than asked when fewer have probability.
    out = sample_without_replacement(p, 8, gen)
    assert sorted(out.tolist()) == [1, 3, 4, 5, 6]
    one_hot = torch.tensor([0.0, 0.0, 1.0])
    assert sample_without_replacement(one_hot, 3, gen).tolist() == [2]


def test_sample_without_replacement_order_is_sequential_draws() -> None:
    """First draw ~ p; second ~ p with the first removed: P(second = j) = sum_i p_i p_j / (1 - p_i)."""
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    gen = torch.Generator().manual_seed(4)
    n = 20000
    draws = torch.stack([sample_without_replacement(p, 2, gen) for _ in range(n)])  # (n, 2)
    assert chi2_pvalue(torch.bincount(draws[:, 0], minlength=5), p) > P_THRESHOLD
    p64 = p.double()
    second = (p64[:, None] * p64[None, :] / (1 - p64[:, None])).fill_diagonal_(0).sum(0)
    assert chi2_pvalue(torch.bincount(draws[:, 1], minlength=5), second.float()) > P_THRESHOLD
    # Power: the second draw is clearly not distributed as p.
    assert chi2_pvalue(torch.bincount(draws[:, 1], minlength=5), p) < P_THRESHOLD


def test_top_p_over_a_large_vocabulary_is_the_full_sorts_nucleus() -> None:
    """A peaked row is settled among its candidates (tokens at least NUCLEUS_FLOOR as likely as its top
    one), a flat one has every token as a candidate, and a row whose long tail of non-candidates holds
    more than 1 - top_p takes the full sort: all three equal the nucleus of a full sort."""
    torch.manual_seed(0)
    vocab = 20000
    tail = torch.full((vocab,), math.log(2e-5))
    tail[0] = math.log(0.6)  # the other 19,999 tokens (0.4 in all) are below the floor
    logits = torch.stack([torch.randn(vocab) * 4, torch.zeros(vocab), tail])  # (3, V)
    full = torch.softmax(logits, -1)
    candidates = full >= full.amax(-1, keepdim=True) * NUCLEUS_FLOOR
    assert candidates[0].sum() < vocab and candidates[1].all() and int(candidates[2].sum()) == 1
    for top_p in (0.5, 0.9):
        out = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=top_p))
        ordered, order = full.sort(-1, descending=True)
        keep = (ordered.cumsum(-1) - ordered) < top_p
        keep[:, 0] = True
        expected = torch.zeros_like(full).scatter_(-1, order, ordered * keep)
        torch.testing.assert_close(out, expected / expected.sum(-1, keepdim=True))
    assert int((out[2] > 0).sum()) > 1  # at 0.9 the tail row keeps tokens that were not candidates


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_argmax_is_torchs_first_index_on_ties(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    rows = torch.randint(0, 4, (64, 1000)).to(dtype)  # many exact ties for the maximum
    assert torch.equal(argmax(rows), rows.argmax(-1))
    assert torch.equal(argmax(rows[3]), rows[3].argmax())
    assert torch.equal(argmax(rows[:, ::3]), rows[:, ::3].argmax(-1))  # a strided view
