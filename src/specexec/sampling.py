"""Temperature, top-k and top-p, implemented once and shared by every method.

Every acceptance rule compares distributions produced here, so the draft's q and the target's p always
go through exactly the same processing. Temperature 0 (or below MIN_TEMPERATURE) means greedy: the
distribution is one-hot on the arg-max (first index on exact ties, as `torch.argmax` and Hugging Face
`generate` do).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

MIN_TEMPERATURE = 1e-5  # below this, sampling is greedy
# Top-p looks for its set first among the tokens at least this fraction as likely as the row's most
# likely one (`_nucleus`).
NUCLEUS_FLOOR = 1e-4


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        # Dividing logits by a vanishing temperature overflows; that limit is the arg-max anyway.
        return self.temperature < MIN_TEMPERATURE


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Return the sampling distribution, float32, same shape as `logits` (..., V)."""
    logits = logits.float()
    if params.greedy:
        one_hot = torch.zeros_like(logits)
        return one_hot.scatter_(-1, argmax(logits)[..., None], 1.0)
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))  # ties with the k-th are kept
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = _nucleus(probs, params.top_p)
    return probs


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest top set of each row whose mass reaches top_p (the top token always), renormalised.

    The set is looked for among the candidates, the tokens at least NUCLEUS_FLOOR as likely as the row's
    top one, which nearly always hold that mass: sorting a few hundred candidates is cheaper than even a
    partial sort of a 152k-token row, and a tree verification processes a row per node. A row whose
    candidates fall short takes the full sort; either way the kept set is the same, since every other
    token has the candidates' whole mass above it.
    """
    rows = probs.reshape(-1, probs.shape[-1])  # (N, V)
    candidates = rows >= rows.amax(-1, keepdim=True) * NUCLEUS_FLOOR  # (N, V)
    kept = torch.zeros_like(rows)
    for row, is_candidate, out in zip(rows, candidates, kept, strict=True):
        index = _nonzero(is_candidate)  # (C,)
        top, order = torch.sort(row[index], descending=True)
        mass = top.cumsum(-1)
        if mass[-1] < top_p:
            top, index = torch.sort(row, descending=True)
            mass = top.cumsum(-1)
        else:
            index = index[order]
        keep = (mass - top) < top_p  # the mass strictly above each token is still short of top_p
        keep[0] = True
        out[index] = top * keep
    kept = kept.reshape(probs.shape)
    return kept / kept.sum(-1, keepdim=True)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value, (..., V) -> (...), the first one on exact ties.

    On the CPU through numpy: over a 152k-token row torch's arg-max took 0.27 ms and numpy's 0.013 ms
    (Ice Lake Xeon, torch 2.13), and a greedy step takes one per draft token and per verified row.
    """
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(np.asarray(x.detach().numpy().argmax(-1)))
    return x.argmax(-1)


def _nonzero(mask: torch.Tensor) -> torch.Tensor:
    """Indices of the true entries of a 1-D mask (numpy's on the CPU, 4x faster than torch's here)."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    return mask.nonzero().squeeze(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of `probs` (..., V) -> (...), each row drawn independently.

    Inverse transform: the first token whose cumulative probability (float64) exceeds a uniform draw in
    [0, 1) times the row's total, a product that rounds to below the total. So a zero-probability token,
    whose cumulative probability equals the one before it, is never drawn. Over a 152k-token vocabulary
    this costs 0.3-1.5 ms against torch.multinomial's 8 ms, paid on every sampled step and draft token.
    """
    flat = probs.reshape(-1, probs.shape[-1])  # (N, V)
    cdf = flat.double().cumsum(-1)  # (N, V)
    total = cdf[:, -1:]  # (N, 1)
    draw = torch.rand(total.shape, generator=generator, dtype=torch.float64, device=probs.device) * total
    tokens = torch.searchsorted(cdf, draw, right=True).squeeze(-1)  # (N,)
    return tokens.reshape(probs.shape[:-1])


def sample_without_replacement(
    probs: torch.Tensor, n: int, generator: torch.Generator | None
) -> torch.Tensor:
    """Up to `n` distinct tokens from `probs` (V,), in the order sequential draws would produce them.

    Gumbel-top-k: the top n of log p + Gumbel noise is an ordered sample without replacement. Fewer than
    n tokens come back when fewer than n have non-zero probability.
    """
    n = min(n, int((probs > 0).sum()))
    uniform = torch.rand(probs.shape, generator=generator, dtype=torch.float64).clamp_(min=1e-300)
    keys = probs.double().log() - (-uniform.log()).log()  # (V,) log p + Gumbel
    return torch.topk(keys, n).indices
