"""A draft that only proposes the most common tokens: a smaller LM head, so a cheaper draft pass.

The LM head of a small draft is a large share of its weights (Qwen2.5 0.5B: 136M of 494M parameters,
151,936 rows), and every draft pass reads all of it. A draft that scores only the first `size` token ids
reads `size` rows instead. Byte-level BPE vocabularies list their tokens in merge order, which follows
frequency, so the first ids are the common ones (the first 32,000 Qwen2.5 ids cover about 94% of the
tokens of Python's standard library source). Every end-of-sequence id, and the ids the caller names (the
tokenizer's special tokens), are always kept.

The other ids get logit -inf: the draft gives them probability 0. That costs acceptance where the target
wants a rare token, never correctness, since every method verifies with the target's full distribution
(the rejection rules take the draft's probabilities as they are, zeros included).

Two forms of the same restriction: `restrict_draft_vocab` swaps a torch model's head for a `ReducedHead`;
`write_reduced_head_gguf` writes a GGUF whose output layer holds only the kept rows, for llama.cpp, which
then reads the token embedding from the caller (the input ids are not restricted).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedModel

# What `--draft-vocab auto` keeps for a llama.cpp draft: the packaged 0.5B draft's head is 37% of the bytes
# a pass reads; its first 64,000 ids hold 98% of the tokens the target writes on HumanEval and MT-Bench,
# and on 2 cores this draft made `sd@3` and `specexec` auto 3-8% faster than the whole head and than
# 32,000 ids (docs/benchmarks.md, "A draft that scores fewer tokens"). Where drafting loses (chat text at
# T=0.6) the cheaper pass once made the policies draft more, until the speculation gate learnt to stop
# sooner ("When drafting loses", session 7).
LLAMACPP_DRAFT_VOCAB = 64000


class DraftVocabError(ValueError):
    """A vocabulary restriction that cannot be applied as asked."""


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


def full_vocab_logits(logits: torch.Tensor, kept: torch.Tensor, vocab: int) -> torch.Tensor:
    """Logits (..., V') of the ids `kept` as rows over the whole vocabulary (..., `vocab`), -inf elsewhere."""
    full = logits.new_full((*logits.shape[:-1], vocab), float("-inf"))  # (..., V)
    return full.index_copy_(-1, kept, logits)


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


def kept_token_ids(size: int, vocab: int, always: Iterable[int] = (), multiple: int = 64) -> list[int]:
    """The ids a head restricted to `size` of `vocab` ids scores, ascending: ids < `size`, the ids in
    `always`, and the next ids up to a whole `multiple` of rows."""
    check_draft_vocab(size, vocab)
    kept = {*range(size), *(i for i in always if 0 <= i < vocab)}
    padding = [i for i in range(size, vocab) if i not in kept][: -len(kept) % multiple]
    return sorted(kept.union(padding))


def write_reduced_head_gguf(source: Path, size: int, always: Iterable[int], dest: Path) -> None:
    """Write into the folder `dest` the GGUF `source` with a head of `kept_token_ids(size, ...)` only.

    `model.gguf` keeps every tensor but the output layer (the kept rows) and the token embedding (cut
    to the same rows: llama.cpp sizes both by its vocabulary, which becomes the kept tokens, renumbered
    0..n-1); `embedding.npy` holds the full token embedding as stored (quantized rows), for inputs fed as
    embeddings; `head.json` the kept ids, the full vocabulary and the embedding's GGML type.
    """
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(source)
    tensors = {t.name: t for t in reader.tensors}
    embedding = tensors["token_embd.weight"]
    vocab = int(embedding.shape[1])  # GGML order: (n_embd, n_vocab)
    kept = kept_token_ids(size, vocab, always)
    position = {token: i for i, token in enumerate(kept)}
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dest / "model.gguf", arch)
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value, kind = f.contents(), f.types[0]
        if name == f"{arch}.vocab_size":
            value = len(kept)
        elif name.startswith("tokenizer.ggml.") and name.endswith("_token_id"):
            if value not in position:
                continue  # a special id outside the head: the reduced vocabulary has no such token
            value = position[value]
        elif kind == GGUFValueType.ARRAY and name != "tokenizer.ggml.merges" and len(value) == vocab:
            value = [value[i] for i in kept]  # tokens, their types and scores
        writer.add_key_value(name, value, kind, sub_type=f.types[-1] if kind == GGUFValueType.ARRAY else None)
    for name, t in tensors.items():
        data = t.data
        if name == "token_embd.weight" or (name == "output.weight" and t.shape[1] == vocab):
            data = data[kept]  # rows are tokens, in every storage type
        writer.add_tensor(name, np.ascontiguousarray(data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    np.save(dest / "embedding.npy", np.asarray(embedding.data))
    head = {"kept": kept, "vocab": vocab, "embedding_type": int(embedding.tensor_type)}
    (dest / "head.json").write_text(json.dumps(head))


def check_draft_vocab(size: int, vocab: int) -> None:
    """Refuse a restriction that keeps nothing or everything of a `vocab`-token head."""
    if not 0 < size < vocab:
        raise DraftVocabError(f"--draft-vocab must be between 1 and {vocab - 1} (the vocabulary), got {size}")


def draft_vocab_size(model: nn.Module) -> int:
    """How many token ids the model's head scores (its full vocabulary unless restricted)."""
    head = model.get_output_embeddings()
    return head.kept.numel() if isinstance(head, ReducedHead) else head.out_features


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)
