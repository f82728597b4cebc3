"""`GraphedDecoder`: padded blocks over the whole KV buffer give every real row what the plain native
forward gives it. On the CPU the padded forward runs without graphs (`capture=False`); on a CUDA GPU
(skipped elsewhere) the graphs are captured and replayed.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tiny_models import tiny_model

import specexec
from specexec.backends.torch.graphs import BLOCK_SIZES, GraphedDecoder
from specexec.backends.torch.native import NativeDecoder
from specexec.backends.torch.runner import ModelRunner
from specexec.drafters.base import tree_forward
from specexec.tree import DraftTree

VOCAB = 96
SEQ = [(7 * i + 3) % VOCAB for i in range(300)]
CAPACITY = 320

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def runners(model, capture: bool = False) -> tuple[ModelRunner, ModelRunner]:
    """A plain native runner and one whose decoder pads (and, with `capture`, replays graphs)."""
    plain = ModelRunner(model, CAPACITY)
    padded = ModelRunner(model, CAPACITY)
    plain.backend = NativeDecoder(model, CAPACITY)  # on a GPU the runner's own choice is graphs
    padded.backend = GraphedDecoder(model, CAPACITY, capture=capture)
    return plain, padded


def tree_of(root: int, device: torch.device) -> DraftTree:
    """Five nodes (padded to a block of 8): two children of the root, a grandchild, a great-grandchild."""
    tree = DraftTree(root, 16, device)
    a = tree.add(torch.tensor([0, 0], device=device), torch.tensor([11, 12], device=device))
    b = tree.add(a[:1], torch.tensor([13], device=device))
    tree.add(b, torch.tensor([14], device=device))
    return tree


def same_sequence(plain: ModelRunner, padded: ModelRunner, close) -> None:
    """Extends of several block sizes (some padded, one past the largest block), a tree, a keep, a grow:
    every logit and every committed slot's keys and values agree."""
    device = plain.device
    for chunk in (SEQ[:5], SEQ[5:6], SEQ[6:40]):
        tokens = torch.tensor(chunk, device=device)
        close(padded.extend(tokens, 0), plain.extend(tokens, 0))
    tree = tree_of(SEQ[40], device)
    root = plain.length
    nodes = torch.arange(tree.size, device=device)
    close(tree_forward(padded, tree, nodes, root), tree_forward(plain, tree, nodes, root))
    kept = torch.cat([torch.arange(root + 1, device=device), root + tree.path_to(3)])
    plain.keep(kept)
    padded.keep(kept)
    long = torch.tensor(SEQ[41 : 41 + BLOCK_SIZES[-1] + 3], device=device)  # eager: past the largest block
    close(padded.extend(long, 4), plain.extend(long, 4))
    for runner in (plain, padded):
        runner.reserve(CAPACITY + 40)  # new buffers: graphs are captured again
    tokens = torch.tensor(SEQ[:3], device=device)
    close(padded.extend(tokens, 0), plain.extend(tokens, 0))
    for layer in range(plain.model.config.num_hidden_layers):
        for mine, theirs in zip(padded.backend.layer_kv(layer), plain.backend.layer_kv(layer), strict=True):
            close(mine[:, : plain.length], theirs[:, : plain.length])


def close_cpu(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)  # float32 summation order only


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_padded_blocks_equal_the_plain_forward(arch: str) -> None:
    plain, padded = runners(tiny_model(arch, seed=5, vocab_size=VOCAB))
    same_sequence(plain, padded, close_cpu)


def test_padding_rows_write_only_the_scratch_slot() -> None:
    model = tiny_model("llama", seed=5, vocab_size=VOCAB)
    _, padded = runners(model)
    decoder = padded.backend
    before = [k.clone() for k in decoder.layer_kv(0)]
    padded.extend(torch.tensor(SEQ[:3]))  # a block of 4: one padding row
    after = decoder.layer_kv(0)
    for old, new in zip(before, after, strict=True):
        assert not torch.equal(new[:, :3], old[:, :3])  # the real rows wrote their slots
        assert torch.equal(new[:, 3 : decoder.scratch], old[:, 3 : decoder.scratch])  # nothing else did
        assert not torch.equal(new[:, decoder.scratch], old[:, decoder.scratch])  # the padding wrote here


def test_a_generation_through_padded_decoders_is_the_plain_one() -> None:
    target = tiny_model("qwen2", seed=5, vocab_size=VOCAB)
    draft = tiny_model("qwen2", seed=6, vocab_size=VOCAB)
    expected = specexec.generate(target, None, SEQ[:8], method="ar", max_new_tokens=24).tokens
    original = ModelRunner._forward
    ModelRunner._forward = lambda self, native: GraphedDecoder(self.model, self.capacity, capture=False)
    try:
        out = specexec.generate(target, draft, SEQ[:8], method="specexec", budget=16, max_new_tokens=24)
    finally:
        ModelRunner._forward = original
    assert out.tokens == expected


# ---------------------------------------------------------------------------------------------------
# On a CUDA GPU: captured and replayed.


@needs_cuda
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_replayed_graphs_equal_the_plain_forward(arch: str) -> None:
    model = tiny_model(arch, seed=5, vocab_size=VOCAB).cuda()
    plain, graphed = runners(model, capture=True)
    same_sequence(plain, graphed, lambda a, b: torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3))
    assert graphed.backend.capture and graphed.backend.replays >= 4


@needs_cuda
def test_a_gpu_generation_replays_graphs_and_stays_exact() -> None:
    target = tiny_model("qwen2", seed=5, vocab_size=VOCAB).cuda()
    draft = tiny_model("qwen2", seed=6, vocab_size=VOCAB).cuda()
    assert isinstance(ModelRunner(target, 64).backend, GraphedDecoder)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed capture warns and runs eagerly: not here
        expected = specexec.generate(target, None, SEQ[:8], method="ar", max_new_tokens=24).tokens
    for method in ("specexec", "sd"):
        out = specexec.generate(target, draft, SEQ[:8], method=method, budget=16, max_new_tokens=24)
        assert out.tokens == expected, method
