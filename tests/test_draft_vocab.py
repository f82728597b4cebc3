"""A draft restricted to the first token ids: the kept logits are the full head's, the rest -inf, the
special ids survive, it quantizes, and every method stays exact with it (the sampling distribution test
with such a draft is in test_distribution.py)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import hf_greedy, perturbed, tiny_model

import specexec
from specexec.backends.torch.draft_vocab import ReducedHead, draft_vocab_size, restrict_draft_vocab
from specexec.backends.torch.quant import QuantLinear, quantize_model
from specexec.draft_vocab import DraftVocabError

SHAPE = dict(vocab_size=256, hidden_size=64, num_heads=4, num_kv_heads=2)
PROMPT = [3, 17, 42, 5, 9, 11, 60, 2, 17, 42]
NEW = 40


def test_kept_logits_are_the_full_heads_and_the_rest_minus_infinity() -> None:
    model = tiny_model("qwen2", seed=0, **SHAPE)
    model.generation_config.eos_token_id = [200, 250]
    with torch.inference_mode():
        full = model(torch.tensor([PROMPT])).logits[0]  # (T, V)
        restrict_draft_vocab(model, 40, always=[230])
        reduced = model(torch.tensor([PROMPT])).logits[0]
    kept = model.get_output_embeddings().kept
    assert {*range(40), 200, 250, 230} <= set(kept.tolist())
    assert kept.numel() % 64 == 0 and draft_vocab_size(model) == kept.numel() == 64
    torch.testing.assert_close(reduced[:, kept], full[:, kept])
    # Padding counts only new ids, also when a kept special id lies right after the first `size`.
    shifted = restrict_draft_vocab(tiny_model("qwen2", seed=0, **SHAPE), 40, always=[40, 41, 42])
    assert shifted.get_output_embeddings().kept.numel() == 64
    cut = torch.ones(256, dtype=torch.bool)
    cut[kept] = False
    assert torch.isneginf(reduced[:, cut]).all()
    assert draft_vocab_size(tiny_model("qwen2", seed=0, **SHAPE)) == 256


def test_tied_input_embeddings_are_left_alone() -> None:
    model = tiny_model("qwen2", seed=0, tie_word_embeddings=True, **SHAPE)
    embedding = model.get_input_embeddings().weight.clone()
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied
    restrict_draft_vocab(model, 64)
    assert model.get_input_embeddings().weight.shape == (256, 64)
    torch.testing.assert_close(model.get_input_embeddings().weight, embedding)


def test_errors() -> None:
    with pytest.raises(DraftVocabError, match="between 1 and 255"):
        restrict_draft_vocab(tiny_model("llama", seed=0, **SHAPE), 256)
    model = restrict_draft_vocab(tiny_model("llama", seed=0, **SHAPE), 64)
    with pytest.raises(DraftVocabError, match="already restricted"):
        restrict_draft_vocab(model, 64)
    plain = tiny_model("llama", seed=0, **SHAPE)
    assert restrict_draft_vocab(plain, 0) is plain and draft_vocab_size(plain) == 256


def test_a_restricted_head_is_quantized_too() -> None:
    model = quantize_model(restrict_draft_vocab(tiny_model("qwen2", seed=0, **SHAPE), 64), "int4")
    head = model.get_output_embeddings()
    assert isinstance(head, ReducedHead) and isinstance(head.linear, QuantLinear)
    assert head.linear.mode == "int4"
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT])).logits[0]  # (T, V)
    assert torch.isfinite(logits[:, :64]).all() and torch.isneginf(logits[:, 64:]).all()


@pytest.mark.parametrize(
    "case",
    [
        dict(method="sd", budget=4),
        dict(method="dsl", budget=20),
        dict(method="specinfer", budget=16),
        dict(method="specexec", budget=24),
        dict(method="specexec", budget=24, ngram=6),
    ],
    ids=lambda case: "-".join(str(v) for v in case.values()),
)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_is_the_targets_with_a_restricted_draft(arch: str, case: dict) -> None:
    target = tiny_model(arch, seed=0, **SHAPE)
    # The draft knows only half the vocabulary: where the target picks a cut id, the draft cannot follow.
    draft = restrict_draft_vocab(perturbed(tiny_model(arch, seed=0, **SHAPE), 0.01), 128, multiple=1)
    reference = hf_greedy(target, PROMPT, NEW)
    out = specexec.generate(target, draft, PROMPT, max_new_tokens=NEW, **case)
    assert out.tokens == reference
    assert any(token >= 128 for token in reference)  # test design: the target does use cut ids
    assert out.stats.tokens_per_step > 1.2  # and the draft still helps elsewhere


def test_a_restricted_draft_gets_its_own_calibration() -> None:
    from specexec.calibration import _calibration_path

    target = quantize_model(tiny_model("qwen2", seed=0, **SHAPE), "int4")
    full = quantize_model(tiny_model("qwen2", seed=0, **SHAPE), "int4")
    restricted = quantize_model(restrict_draft_vocab(tiny_model("qwen2", seed=0, **SHAPE), 64), "int4")
    # Quantized heads hold buffers, not parameters: the parameter count alone cannot tell them apart.
    assert sum(p.numel() for p in full.parameters()) == sum(p.numel() for p in restricted.parameters())
    assert _calibration_path(target, full) != _calibration_path(target, restricted)
