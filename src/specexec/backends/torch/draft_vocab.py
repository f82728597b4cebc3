"""A draft that scores only its first N token ids on the torch backend: its LM head swapped for a smaller
`nn.Linear` (`specexec.draft_vocab` says which ids and why)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PreTrainedModel

from specexec.draft_vocab import DraftVocabError, full_vocab_logits, kept_token_ids


class ReducedHead(nn.Module):
    """The rows `kept` of an LM head; logits of the other ids are -inf, in a full-vocabulary tensor."""

    def __init__(self, head: nn.Linear, kept: torch.Tensor) -> None:
        super().__init__()
        self.vocab_size = head.out_features
        self.register_buffer("kept", kept)  # (V',) ascending token ids
        self.linear = nn.Linear(
            head.in_features, kept.numel(), bias=head.bias is not None, device=head.weight.device,
            dtype=head.weight.dtype,
        )  # fmt: skip
        with torch.no_grad():
            self.linear.weight.copy_(head.weight[kept])  # a copy: the input embedding may share the head
            if head.bias is not None:
                self.linear.bias.copy_(head.bias[kept])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return full_vocab_logits(self.linear(x), self.kept, self.vocab_size)


def restrict_draft_vocab(
    model: PreTrainedModel, size: int, always: Iterable[int] = (), multiple: int = 64
) -> PreTrainedModel:
    """Make `model` score only token ids < `size`, plus its end-of-sequence ids and the ids in `always`,
    and the next ids up to a whole `multiple` of rows (64 suits the low-bit kernels; int4 needs 16).

    In place; returns the model. `size` 0 leaves the model as it is.
    """
    if size == 0:
        return model
    head = model.get_output_embeddings()
    if isinstance(head, ReducedHead):
        raise DraftVocabError("the draft's vocabulary is already restricted")
    if not isinstance(head, nn.Linear):
        raise DraftVocabError(f"cannot restrict the LM head of {type(model).__name__}")
    config = model.config.get_text_config()
    generation = getattr(model, "generation_config", None)
    extra = [*always, *_ids(config.eos_token_id), *_ids(getattr(generation, "eos_token_id", None))]
    kept = kept_token_ids(size, head.out_features, extra, multiple)
    model.set_output_embeddings(ReducedHead(head, torch.tensor(kept, device=head.weight.device)))
    return model


def draft_vocab_size(model: nn.Module) -> int:
    """How many token ids the model's head scores (its full vocabulary unless restricted)."""
    head = model.get_output_embeddings()
    return head.kept.numel() if isinstance(head, ReducedHead) else head.out_features


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)
