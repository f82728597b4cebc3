"""Tiny randomly initialised Hugging Face causal LMs for the core tests.

Every model is float32, in eval mode and built from a config alone (no download). The weights are drawn
with a large `initializer_range`, so next-token distributions are peaked: greedy decoding has clear
margins (no near-ties in float32) and a draft equal to the target is accepted deep into its tree.
"""

from __future__ import annotations

import copy

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

ARCHS = ("llama", "qwen2", "gemma3")  # the exactness matrix
SLIDING_WINDOW = 16  # small enough that 64 new tokens run well past it
INIT_RANGE = 1.0  # tuned: peaked distributions (mean top probability ~0.7), clear greedy margins (>= 0.01)
# Relative weight noise of the perturbed draft, tuned per architecture for partial acceptance (Gemma's
# norms and logit softcapping absorb more noise).
PERTURB_NOISE = {"llama": 0.02, "qwen2": 0.02, "gemma3": 0.1, "gemma2": 0.1, "mistral": 0.02}

_CONFIGS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),  # every layer slides
}


def tiny_config(
    arch: str,
    *,
    vocab_size: int = 96,
    hidden_size: int = 48,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    init_range: float = INIT_RANGE,
    eos_token_id: int | None = None,
    max_position_embeddings: int = 512,
    sliding_window: int = SLIDING_WINDOW,
    attn_implementation: str | None = None,
    tie_word_embeddings: bool = False,
):
    config_cls, _ = _CONFIGS[arch]
    head_dim = hidden_size // num_heads
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        initializer_range=init_range,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=tie_word_embeddings,
    )
    if arch == "mistral":
        kwargs.update(sliding_window=sliding_window)
    if arch in ("gemma2", "gemma3"):
        # One sliding-window layer and one global layer, whatever the depth.
        layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
        kwargs.update(sliding_window=sliding_window, layer_types=layer_types, query_pre_attn_scalar=head_dim)
        if arch == "gemma2":
            kwargs.update(attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
        else:
            kwargs.update(final_logit_softcapping=30.0)
    config = config_cls(**kwargs)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    return config


def tiny_model(arch: str, seed: int = 0, **config_kwargs) -> PreTrainedModel:
    """A float32 eval-mode model whose weights depend only on `arch`, `seed` and the config."""
    _, model_cls = _CONFIGS[arch]
    attn = config_kwargs.pop("attn_implementation", None)
    config = tiny_config(arch, **config_kwargs)
    torch.manual_seed(seed)
    kwargs = {"attn_implementation": attn} if attn is not None else {}
    model = model_cls._from_config(config, dtype=torch.float32, **kwargs)
    return model.eval()


def perturbed(model: PreTrainedModel, noise: float, seed: int = 1) -> PreTrainedModel:
    """A copy of `model` with Gaussian noise of `noise` times each tensor's own std added to its weights."""
    noisy = copy.deepcopy(model)  # the target stays untouched
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in noisy.parameters():
            scale = param.std() if param.numel() > 1 else param.abs()
            param.add_(torch.randn(param.shape, generator=gen) * scale * noise)
    return noisy.eval()


def hf_greedy(model: PreTrainedModel, prompt: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    """Hugging Face's own greedy continuation (new tokens only)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            **kwargs,
        )
    return out[0, len(prompt) :].tolist()


def greedy_margins(model: PreTrainedModel, prompt: list[int], new_tokens: list[int]) -> torch.Tensor:
    """Top-1 minus top-2 logit at each greedy step (one full forward over prompt + new tokens)."""
    ids = torch.tensor([prompt + new_tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]  # (new, V)
    top2 = logits.topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def assert_cache_is_text_with_cut(runner, tokens: list[int], model) -> None:
    """`runner`, a draft's runner that skipped committed tokens once (`SlotRunner.skip`), holds `tokens`
    with them cut out: one more token gives the logits a fresh runner of `model` gives after reading
    that text, up to float32 reassociation noise (1.9e-5 seen on AVX2; a cache of the uncut text is off
    by whole units)."""
    from specexec.backends import make_runner

    text = torch.tensor(tokens)
    seen = torch.cat([text[: runner.cut], text[runner.cut + runner.skipped : runner.read]])
    assert runner.length == len(seen)
    with torch.inference_mode():  # the engine's buffers are inference tensors
        fresh = make_runner(model, len(seen) + 1)
        fresh.extend(seen)
        probe = torch.tensor([5])
        runner.reserve(runner.length + 1)
        assert torch.allclose(runner.extend(probe), fresh.extend(probe), atol=1e-4)


def chi2_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit of observed `counts` to exact `probs` (same shape, any number of cells).

    Cells with expected count below `min_expected` are pooled into one cell (and that one into the
    smallest other cell if it is still too small). A sample on a cell of probability zero fails outright.
    """
    from scipy.stats import chisquare

    counts = torch.as_tensor(counts).flatten().double()
    probs = torch.as_tensor(probs).flatten().double()
    impossible = float(counts[probs <= 0].sum())
    assert impossible == 0, f"{impossible:.0f} samples landed on zero-probability outcomes"
    counts, probs = counts[probs > 0], probs[probs > 0]
    expected = probs / probs.sum() * counts.sum()
    small = expected < min_expected
    observed_cells = [*counts[~small].tolist()]
    expected_cells = [*expected[~small].tolist()]
    if small.any():
        observed_cells.append(float(counts[small].sum()))
        expected_cells.append(float(expected[small].sum()))
        if expected_cells[-1] < min_expected and len(expected_cells) > 1:
            j = min(range(len(expected_cells) - 1), key=expected_cells.__getitem__)
            observed_cells[j] += observed_cells.pop()
            expected_cells[j] += expected_cells.pop()
    assert len(expected_cells) >= 2, "test design: too few cells for a chi-square test"
    return float(chisquare(observed_cells, expected_cells).pvalue)


def tiny_qwen(seed: int, noise: float = 0.0) -> Qwen2ForCausalLM:
    """A tiny Qwen2 with peaked distributions (initializer range 0.6), every weight perturbed by `noise`
    (relative to a standard normal draw): the budget policies' test pair."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.6, eos_token_id=None,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * torch.randn_like(p))
    return model


def budget_pair() -> tuple[Qwen2ForCausalLM, Qwen2ForCausalLM, torch.Tensor]:
    """A tiny target, a draft close to it, and a 7-token prompt."""
    prompt = torch.randint(0, 64, (7,), generator=torch.Generator().manual_seed(1))
    return tiny_qwen(0), tiny_qwen(0, noise=0.05), prompt
