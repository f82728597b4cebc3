"""`ModelRunner`: slot-addressed KV cache forwards agree with plain Hugging Face forwards.

Every comparison is against `model(input_ids).logits` over the full sequence, with no cache at all, so a
wrong mask, position, slot or sliding window shows up as a logit difference far above float32 noise.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from specexec.backends.torch.native import NativeDecoder, forward_label, native_unsupported
from specexec.backends.torch.runner import HFForward, ModelRunner
from specexec.drafters.base import tree_forward
from specexec.tree import DraftTree

VOCAB = 96
ATOL = 1e-4  # logits are O(10) with these weights; float32 reassociation noise is ~1e-6
SEQ = [(7 * i + 3) % VOCAB for i in range(48)]  # 48 tokens: three times the sliding window of 16

# Mistral: every layer slides; Gemma2: softcapping, eager-only; Gemma3: mixed sliding/global on sdpa.
ARCHS = ["llama", "qwen2", "gemma2", "gemma3", "mistral"]


@pytest.fixture(autouse=True)
def inference_mode():
    with torch.inference_mode():  # as in the engine
        yield


_MODELS: dict = {}


def model_for(arch: str, attn: str | None = None):
    if (arch, attn) not in _MODELS:
        _MODELS[arch, attn] = tiny_model(arch, seed=11, vocab_size=VOCAB, attn_implementation=attn)
    return _MODELS[arch, attn]


def full_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens])).logits[0]  # (n, V)


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=1e-4)


def test_tiny_models_have_the_intended_attention() -> None:
    assert model_for("llama").config._attn_implementation == "sdpa"
    assert model_for("gemma3").config._attn_implementation == "sdpa"
    assert model_for("gemma2").config._attn_implementation == "eager"  # Gemma2 does not support sdpa
    assert model_for("llama", "eager").config._attn_implementation == "eager"
    for arch in ("gemma2", "gemma3"):
        config = model_for(arch).config
        assert config.sliding_window == 16
        assert set(config.layer_types) == {"sliding_attention", "full_attention"}
    assert model_for("mistral").config.sliding_window == 16


def test_sliding_window_changes_the_logits() -> None:
    """Test design: with 48 tokens the window must matter, or the sliding tests below prove nothing."""
    model = model_for("gemma3")
    wide = tiny_model("gemma3", seed=11, vocab_size=VOCAB, sliding_window=4096)
    assert torch.equal(model.lm_head.weight, wide.lm_head.weight)
    early = slice(0, 16)
    assert_logits_close(full_logits(model, SEQ)[early], full_logits(wide, SEQ)[early])
    assert (full_logits(model, SEQ)[32:] - full_logits(wide, SEQ)[32:]).abs().max() > 0.1


@pytest.mark.parametrize("attn", [None, "eager"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chunks", [(48,), (1, 47), (5, 11, 20, 12), (16, 16, 16), (30, 1, 1, 16)])
def test_extend_in_chunks_equals_full_forward(arch: str, attn: str | None, chunks: tuple[int, ...]) -> None:
    model = model_for(arch, attn)
    runner = ModelRunner(model, 64)
    pieces, start = [], 0
    for size in chunks:
        pieces.append(runner.extend(torch.tensor(SEQ[start : start + size]), logits_to_keep=0))
        start += size
        assert runner.length == start
    assert_logits_close(torch.cat(pieces), full_logits(model, SEQ))


def test_extend_keeps_last_rows() -> None:
    model = model_for("llama")
    runner = ModelRunner(model, 64)
    out = runner.extend(torch.tensor(SEQ[:10]))  # default: last row only
    assert out.shape == (1, VOCAB)
    out3 = runner.extend(torch.tensor(SEQ[10:20]), logits_to_keep=3)
    assert_logits_close(out, full_logits(model, SEQ[:10])[-1:])
    assert_logits_close(out3, full_logits(model, SEQ[:20])[-3:])


def branchy_tree(root: int) -> DraftTree:
    """Root with three children; two of them with children of their own; a depth-4 chain under one."""
    tree = DraftTree(root, 16)
    a = tree.add(torch.tensor([0, 0, 0]), torch.tensor([11, 12, 13]))  # 1, 2, 3
    b = tree.add(torch.tensor([int(a[0]), int(a[0]), int(a[2])]), torch.tensor([21, 22, 23]))  # 4, 5, 6
    c = tree.add(torch.tensor([int(b[1])]), torch.tensor([31]))  # 7
    tree.add(torch.tensor([int(c[0]), int(c[0])]), torch.tensor([41, 12]))  # 8, 9
    return tree


@pytest.mark.parametrize("attn", [None, "eager"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("prefix_len", [1, 6, 30])
def test_forward_tree_equals_sequential_paths(arch: str, attn: str | None, prefix_len: int) -> None:
    """Tree forward (positions = depth, ancestor mask) gives every node the logits of its own path."""
    model = model_for(arch, attn)
    prefix = SEQ[:prefix_len]
    runner = ModelRunner(model, 64)
    if prefix_len > 1:
        runner.extend(torch.tensor(prefix[:-1]))
    tree = branchy_tree(prefix[-1])
    root_slot = prefix_len - 1
    logits = tree_forward(runner, tree, torch.arange(tree.size), root_slot)
    assert runner.length == root_slot, "a tree forward commits nothing"
    for node in range(tree.size):
        path = tree.tokens[tree.path_to(node)].tolist()
        assert_logits_close(logits[node], full_logits(model, prefix + path)[-1])


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_tree_in_two_passes(arch: str) -> None:
    """Expanding a tree level by level (as the drafters do) reads the earlier levels' KV correctly."""
    model = model_for(arch)
    prefix = SEQ[:24]
    runner = ModelRunner(model, 64)
    runner.extend(torch.tensor(prefix[:-1]))
    tree = branchy_tree(prefix[-1])
    root_slot = len(prefix) - 1
    first = tree_forward(runner, tree, torch.arange(4), root_slot)  # root and depth 1
    rest = tree_forward(runner, tree, torch.arange(4, tree.size), root_slot)
    logits = torch.cat([first, rest])
    for node in range(tree.size):
        path = tree.tokens[tree.path_to(node)].tolist()
        assert_logits_close(logits[node], full_logits(model, prefix + path)[-1])


@pytest.mark.parametrize("attn", [None, "eager"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("prefix_len", "leaf"), [(6, 9), (6, 6), (20, 3), (30, 0)])
def test_keep_accepted_path_then_extend(arch: str, attn: str | None, prefix_len: int, leaf: int) -> None:
    """After a tree forward, keeping prefix + root + an accepted path (non-contiguous slots) leaves the
    cache exactly as a fresh prefill of that sequence would."""
    model = model_for(arch, attn)
    prefix = SEQ[:prefix_len]
    runner = ModelRunner(model, 64)
    runner.extend(torch.tensor(prefix[:-1]))
    tree = branchy_tree(prefix[-1])
    root_slot = prefix_len - 1
    tree_forward(runner, tree, torch.arange(tree.size), root_slot)
    path = tree.path_to(leaf)
    runner.keep(torch.cat([torch.arange(root_slot + 1), root_slot + path]))
    accepted = prefix + tree.tokens[path].tolist()
    assert runner.length == len(accepted)
    more = [5, 77, 2, 40, 13, 8, 61, 30, 19, 4]
    logits = runner.extend(torch.tensor(more), logits_to_keep=0)
    assert_logits_close(logits, full_logits(model, accepted + more)[len(accepted) :])
    # And a second tree on top of the kept cache.
    tree2 = branchy_tree(more[-1])
    root2 = len(accepted) + len(more) - 1
    logits2 = tree_forward(runner, tree2, torch.arange(tree2.size), root2)
    for node in (0, 4, 9):
        path2 = tree2.tokens[tree2.path_to(node)].tolist()
        assert_logits_close(logits2[node], full_logits(model, accepted + more + path2)[-1])


def test_keep_in_place_prefix_is_a_truncation() -> None:
    model = model_for("llama")
    runner = ModelRunner(model, 64)
    runner.extend(torch.tensor(SEQ[:20]))
    runner.keep(torch.arange(12))
    assert runner.length == 12
    logits = runner.extend(torch.tensor([9, 9, 1]), logits_to_keep=0)
    assert_logits_close(logits, full_logits(model, SEQ[:12] + [9, 9, 1])[12:])


def layer_kv(runner: ModelRunner) -> list[tuple[torch.Tensor, torch.Tensor]]:
    layers = runner.model.config.num_hidden_layers
    return [tuple(t.clone() for t in runner.backend.layer_kv(i)) for i in range(layers)]


@pytest.mark.parametrize(
    ("src", "dst_start"),
    [
        ([2, 3, 4, 5, 6], 1),  # overlapping, moving down
        ([1, 2, 3, 4, 5], 3),  # overlapping, moving up
        ([0, 1, 5, 9, 12], 0),  # a prefix already in place, then gathers over later slots
        ([12, 3, 7], 5),  # out of order, destination overlaps a source
        ([4, 5, 6], 4),  # already in place: nothing moves
    ],
)
@pytest.mark.parametrize("arch", ["gemma3", "llama"])  # Hugging Face's forward, the native one
def test_move(src: list[int], dst_start: int, arch: str) -> None:
    model = model_for(arch)
    runner = ModelRunner(model, 24)
    runner.extend(torch.tensor(SEQ[:16]))
    runner.forward_tree(  # positions differing from slots, so that slot_positions must move too
        torch.tensor(SEQ[16:20]),
        torch.tensor([40, 41, 41, 42]),
        torch.tensor([16, 17, 18, 19]),
        torch.ones(4, 20, dtype=torch.bool),
    )
    before = layer_kv(runner)
    positions = runner.slot_positions.clone()
    length = runner.length
    runner.move(torch.tensor(src), dst_start)
    after = layer_kv(runner)
    dst = list(range(dst_start, dst_start + len(src)))
    untouched = [s for s in range(24) if s not in dst]
    for (k0, v0), (k1, v1) in zip(before, after, strict=True):
        assert torch.equal(k1[:, dst], k0[:, src])
        assert torch.equal(v1[:, dst], v0[:, src])
        assert torch.equal(k1[:, untouched], k0[:, untouched])
        assert torch.equal(v1[:, untouched], v0[:, untouched])
    assert runner.slot_positions[dst].tolist() == positions[src].tolist()
    assert runner.length == length


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "mistral"])
def test_sliding_window_tree_past_the_window(arch: str) -> None:
    """Tree nodes 40+ positions in: sliding layers must see keys by position distance, not slot."""
    model = model_for(arch)
    prefix = SEQ[:40]
    runner = ModelRunner(model, 128)
    runner.extend(torch.tensor(prefix[:-1]))
    tree = DraftTree(prefix[-1], 41)
    # A deep chain (depth 20 > window) with a side branch at every level.
    node = 0
    for depth in range(20):
        new = tree.add(
            torch.tensor([node, node]), torch.tensor([(3 * depth) % VOCAB, (5 * depth + 1) % VOCAB])
        )
        node = int(new[0])
    logits = tree_forward(runner, tree, torch.arange(tree.size), len(prefix) - 1)
    for node in (0, 1, 2, 15, 16, 30, tree.size - 2, tree.size - 1):
        path = tree.tokens[tree.path_to(node)].tolist()
        assert_logits_close(logits[node], full_logits(model, prefix + path)[-1])


def test_capacity_overflow_raises() -> None:
    runner = ModelRunner(model_for("llama"), 8)
    runner.extend(torch.tensor(SEQ[:6]))
    with pytest.raises(RuntimeError, match="overflow"):
        runner.extend(torch.tensor(SEQ[6:10]))


def test_forward_choice() -> None:
    """The native forward where it computes the model exactly; Hugging Face's wherever it might not."""
    assert isinstance(ModelRunner(model_for("llama"), 8).backend, NativeDecoder)
    assert isinstance(ModelRunner(model_for("qwen2"), 8).backend, NativeDecoder)
    for arch in ("gemma2", "gemma3", "mistral"):  # other layers; a sliding window
        assert isinstance(ModelRunner(model_for(arch), 8).backend, HFForward)
    assert isinstance(ModelRunner(model_for("llama"), 8, native=False).backend, HFForward)
    assert forward_label(model_for("llama")) == "native, float32 attention"
    assert forward_label(model_for("gemma2")) == "hf"
    model = model_for("llama")
    handle = model.register_forward_hook(lambda *args: None)  # as simulated offloading does
    try:
        assert native_unsupported(model) == "hooks on the model's forward (simulated offloading)"
        assert isinstance(ModelRunner(model, 8).backend, HFForward)
    finally:
        handle.remove()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_native_tree_forward_matches_hugging_face(arch: str) -> None:
    """A tree block after a prefix: both forwards give the same logits, and the same KV at every slot."""
    model = model_for(arch)
    runners = [ModelRunner(model, 32, native=native) for native in (True, False)]
    tokens, positions = torch.tensor(SEQ[20:25]), torch.tensor([20, 21, 21, 22, 22])
    allowed = torch.ones(5, 25, dtype=torch.bool)
    allowed[:, 20:] = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0],
                                    [1, 0, 1, 0, 1]], dtype=torch.bool)  # fmt: skip
    logits = []
    for runner in runners:
        runner.extend(torch.tensor(SEQ[:20]))
        logits.append(runner.forward_tree(tokens, positions, torch.arange(20, 25), allowed))
    assert_logits_close(logits[0], logits[1])
    for (k0, v0), (k1, v1) in zip(layer_kv(runners[0]), layer_kv(runners[1]), strict=True):
        torch.testing.assert_close(k0[:, :25], k1[:, :25], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v0[:, :25], v1[:, :25], atol=1e-5, rtol=1e-5)
