"""The llama.cpp backend: tree masks by sequence ids, path keeping, exactness of every method.

Tiny random GGUF models (tests/tiny_gguf.py: llama and qwen2, float32 and Q8_0) run in llama.cpp itself.
llama.cpp's batched logits may differ from its one-token logits in the last bits (the kernels' numerics
depend on the batch shape), so tree rows are compared with sequential decoding of each node's path up to
a tolerance, and greedy identity is asserted on these models, whose greedy margins are wide.
"""

from __future__ import annotations

import functools
import itertools
from pathlib import Path
from unittest import mock

import pytest
import torch
from tiny_gguf import on_storage, synced, write_random_gguf
from tiny_models import assert_cache_is_text_with_cut, chi2_pvalue

import specexec
from specexec.budget.costs import CostModel
from specexec.drafters.base import tree_forward
from specexec.engine import GenerationError
from specexec.sampling import SamplingParams, probs_from_logits
from specexec.tree import DraftTree

pytest.importorskip("llama_cpp", reason="the llama.cpp backend needs specexec[llamacpp]")

from specexec.backends.llamacpp.library import (
    MAX_SEQUENCES,  # noqa: E402
    LlamaCppError,  # noqa: E402
)
from specexec.backends.llamacpp.model import LlamaCppModel  # noqa: E402
from specexec.backends.llamacpp.runner import LlamaCppRunner  # noqa: E402

VARIANTS = [("llama", "f32"), ("qwen2", "f32"), ("llama", "q8_0"), ("qwen2", "q8_0")]
PROMPT = [3, 17, 42, 5, 9, 11, 60, 2]
NEW = 48
# Tree rows against one-token decoding of the same path, relative to the largest |logit|: batch-shape
# numerics only (the KV cache holds float16, activations meet Q8_0 weights quantized to 8 bits).
TOLERANCE = {"f32": 1e-3, "q8_0": 2e-2}


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf")


@functools.cache
def _model(folder: str, arch: str, weights: str, kind: str) -> LlamaCppModel:
    seed, noise = {"target": (0, 0.0), "perturbed": (0, 0.05), "random": (9, 0.0)}[kind]
    path = Path(folder) / f"{arch}-{weights}-{kind}.gguf"
    if not path.exists():
        write_random_gguf(path, arch, weights, seed=seed, noise=noise)
    return LlamaCppModel(path, threads=1)


@pytest.fixture
def model(gguf_dir: Path):
    return lambda arch, weights, kind="target": _model(str(gguf_dir), arch, weights, kind)


def sequential_logits(model: LlamaCppModel, tokens: list[int]) -> torch.Tensor:
    """Logits after each token of `tokens`, one llama_decode per token, (n, V)."""
    runner = LlamaCppRunner(model, len(tokens) + 8)
    return torch.cat([runner.extend(torch.tensor([t])) for t in tokens])


def random_tree(seed: int, size: int, vocab: int, root: int) -> DraftTree:
    """A tree of `size` nodes, each new node under a random earlier one."""
    gen = torch.Generator().manual_seed(seed)
    tree = DraftTree(root, size)
    for i in range(1, size):
        parent = torch.randint(0, i, (1,), generator=gen)
        tree.add(parent, torch.randint(0, vocab, (1,), generator=gen))
    return tree


def forward_whole_tree(runner, tree: DraftTree, root_slot: int) -> torch.Tensor:
    return tree_forward(runner, tree, torch.arange(tree.size), root_slot)


# -- the mask ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("arch", "weights"), VARIANTS)
def test_tree_rows_match_sequential_decoding_of_their_paths(model, arch: str, weights: str) -> None:
    target = model(arch, weights)
    tree = random_tree(0, 40, target.vocab_size, PROMPT[-1])
    runner = LlamaCppRunner(target, 128)
    runner.extend(torch.tensor(PROMPT[:-1]))
    logits = forward_whole_tree(runner, tree, len(PROMPT) - 1)  # (40, V)
    worst = 0.0
    for node in range(tree.size):
        path = tree.tokens[tree.path_to(node)].tolist()
        reference = sequential_logits(target, PROMPT + path)[-1]
        worst = max(worst, float((logits[node] - reference).abs().max() / reference.abs().max()))
        assert int(logits[node].argmax()) == int(reference.argmax()), node
    print(f"{arch}/{weights}: max |tree - sequential| / max |logit| = {worst:.2e}")
    assert worst < TOLERANCE[weights]


@pytest.mark.parametrize(("arch", "weights"), VARIANTS[:2])
def test_a_causal_mask_over_the_same_rows_differs(model, arch: str, weights: str) -> None:
    """Negative control: the same 40 nodes as one flat chain (every row sees all earlier rows) give other
    next-token choices, so agreement with the paths comes from the tree mask."""
    target = model(arch, weights)
    tree = random_tree(0, 40, target.vocab_size, PROMPT[-1])
    runner = LlamaCppRunner(target, 128)
    runner.extend(torch.tensor(PROMPT[:-1]))
    tree_logits = forward_whole_tree(runner, tree, len(PROMPT) - 1)
    flat = LlamaCppRunner(target, 128)
    flat_logits = flat.extend(torch.tensor(PROMPT[:-1] + tree.tokens[: tree.size].tolist()), tree.size)
    agree = (tree_logits.argmax(-1) == flat_logits.argmax(-1)).float().mean()
    assert agree < 0.7, float(agree)


@pytest.mark.parametrize(("arch", "weights"), VARIANTS[:1] + VARIANTS[2:3])
def test_keeping_a_path_continues_like_sequential_decoding(model, arch: str, weights: str) -> None:
    target = model(arch, weights)
    tree = random_tree(1, 30, target.vocab_size, PROMPT[-1])
    runner = LlamaCppRunner(target, 128)
    runner.extend(torch.tensor(PROMPT[:-1]))
    root = len(PROMPT) - 1
    forward_whole_tree(runner, tree, root)
    leaf = int(tree.depths[: tree.size].argmax())
    path = [0, *tree.path_to(leaf).tolist()]
    runner.keep(torch.cat([torch.arange(root), root + torch.tensor(path)]))
    assert runner.length == root + len(path)
    after = runner.extend(torch.tensor([7, 8]), 2)  # (2, V)
    tokens = PROMPT + tree.tokens[tree.path_to(leaf)].tolist() + [7, 8]
    reference = sequential_logits(target, tokens)[-2:]
    assert (after - reference).abs().max() < TOLERANCE[weights] * reference.abs().max()
    assert torch.equal(after.argmax(-1), reference.argmax(-1))


def committed_root(model, capacity: int) -> tuple[LlamaCppModel, LlamaCppRunner, int, DraftTree]:
    """A draft's runner as a step starts: the prompt committed, its last token the root of an empty tree
    of `capacity` nodes (target, runner, root slot, tree)."""
    target = model("llama", "f32")
    runner = LlamaCppRunner(target, 256)
    runner.extend(torch.tensor(PROMPT))  # the draft has the root committed
    tree = DraftTree(PROMPT[-1], capacity)
    tree.expanded[0] = True
    return target, runner, len(PROMPT) - 1, tree


def test_draft_rounds_with_pruning_match_sequential_decoding(model) -> None:
    """The draft's way: nodes forwarded a few at a time, pruned and renumbered (`move`) in between."""
    target, runner, root, tree = committed_root(model, 64)
    vocab = target.vocab_size

    gen = torch.Generator().manual_seed(3)
    frontier = tree.add(torch.zeros(4, dtype=torch.long), torch.randint(0, vocab, (4,), generator=gen))
    for round_ in range(4):
        logits = tree_forward(runner, tree, frontier, root)
        tree.expanded[frontier] = True
        for node, row in zip(frontier.tolist(), logits, strict=True):
            reference = sequential_logits(target, PROMPT + tree.tokens[tree.path_to(node)].tolist())[-1]
            assert (row - reference).abs().max() < TOLERANCE["f32"] * reference.abs().max(), (round_, node)
        children = tree.add(frontier.repeat(2), torch.randint(0, vocab, (2 * len(frontier),), generator=gen))
        # Drop every other leaf (an ancestor-closed set), renumbering the rest as the drafter does.
        keep = [n for n in range(tree.size) if n not in children.tolist()[1::2]]
        keep = torch.tensor(keep)
        runner.move(root + keep, root)
        tree.keep(keep)
        frontier = torch.nonzero(~tree.expanded[: tree.size]).flatten()
    assert runner.free_sequences  # pruned leaves gave their sequences back


def test_keeping_a_path_and_the_subtree_below_it_continues_like_sequential_decoding(model) -> None:
    """Drafting ahead: a path is committed together with the draft's subtree below its last node, which
    the next tree grows from; new nodes under carried ones read the carried KV, and the dropped nodes give
    their sequences back."""
    target, runner, root, tree = committed_root(model, 128)
    vocab = target.vocab_size

    gen = torch.Generator().manual_seed(5)
    frontier = torch.zeros(1, dtype=torch.long)
    for _ in range(4):  # every node gets three children; the first two of each are drafted on
        children = tree.add(
            frontier.repeat_interleave(3), torch.randint(0, vocab, (3 * len(frontier),), generator=gen)
        )
        frontier = children.reshape(-1, 3)[:, :2].flatten()[:6]
        tree_forward(runner, tree, frontier, root)
        tree.expanded[frontier] = True
    path = tree.path_to(int(frontier[0]))[:2]  # two accepted nodes; the second's subtree is kept
    head, nodes = tree.subtree(int(path[-1]))
    assert head.expanded[1 : head.size].any(), "test design: drafted nodes below the new root"
    runner.keep(torch.cat([torch.arange(root + 1), root + path]), subtree=root + nodes[1:])
    committed = PROMPT + tree.tokens[path].tolist()
    assert runner.length == len(committed)
    in_use = {info.sequence for info in runner.slots.values()}
    assert len(in_use) == int(head.expanded[1 : head.size].sum())  # a sequence per carried drafted node
    assert len(runner.free_sequences) == MAX_SEQUENCES - 1 - len(in_use)
    # The next step's new nodes, below every unexpanded carried node.
    below = torch.nonzero(~head.expanded[: head.size]).flatten()
    logits = tree_forward(runner, head, below, len(committed) - 1)
    for node, row in zip(below.tolist(), logits, strict=True):
        reference = sequential_logits(target, committed + head.tokens[head.path_to(node)].tolist())[-1]
        assert (row - reference).abs().max() < TOLERANCE["f32"] * reference.abs().max(), node
    runner.keep(torch.arange(runner.length))
    assert len(runner.free_sequences) == MAX_SEQUENCES - 1


def test_too_many_leaves_is_an_error_not_an_abort(model) -> None:
    target = model("llama", "f32")
    tree = DraftTree(PROMPT[-1], MAX_SEQUENCES + 2)
    tree.add(torch.zeros(MAX_SEQUENCES, dtype=torch.long), torch.arange(MAX_SEQUENCES) % 100)
    runner = LlamaCppRunner(target, 512)
    runner.extend(torch.tensor(PROMPT[:-1]))
    with pytest.raises(LlamaCppError, match="sequences"):
        forward_whole_tree(runner, tree, len(PROMPT) - 1)
    with pytest.raises(GenerationError, match="llama.cpp"):
        specexec.generate(target, target, PROMPT, method="specexec", budget=512, max_new_tokens=4)


def test_a_mask_that_is_not_a_tree_is_refused(model) -> None:
    runner = LlamaCppRunner(model("llama", "f32"), 64)
    runner.extend(torch.tensor(PROMPT))
    n = len(PROMPT)
    allowed = torch.ones(2, n + 2, dtype=torch.bool)
    allowed[0, n + 1] = False
    allowed[1, :2] = False  # does not see the whole committed prefix
    with pytest.raises(LlamaCppError, match="committed prefix"):
        runner.forward_tree(torch.tensor([1, 2]), torch.tensor([n, n + 1]), torch.tensor([n, n + 1]), allowed)


# -- every method, greedy ---------------------------------------------------------------------------------


def ar_reference(target: LlamaCppModel) -> list[int]:
    return specexec.generate(target, None, PROMPT, method="ar", max_new_tokens=NEW).tokens


METHODS = [
    dict(method="sd", budget=4),
    dict(method="sd", budget=2, lookahead_schedule="heuristic"),
    dict(method="dsl", budget=8),
    dict(method="dsl", budget="auto"),
    dict(method="specinfer", budget=16, branches=4),
    dict(method="specexec", budget=8),
    dict(method="specexec", budget=64),
    dict(method="specexec", budget="auto"),
    dict(method="specexec", budget=32, ngram=3),
]
# Flat costs: the auto budget drafts instead of deciding that speculation does not pay on tiny models.
FLAT = CostModel({1: 1.0, 1024: 1.2}, {1: 0.05, 128: 0.06})


@pytest.mark.parametrize(("arch", "weights"), VARIANTS)
@pytest.mark.parametrize("kind", ["target", "perturbed", "random"])
def test_every_method_reproduces_the_backends_greedy_decoding(model, arch, weights, kind) -> None:
    target, draft = model(arch, weights), model(arch, weights, kind)
    reference = ar_reference(target)
    assert len(set(reference)) >= 8  # test design: not one repeated token
    for args in METHODS:
        cost = {"cost_model": FLAT} if args["budget"] == "auto" else {}
        out = specexec.generate(target, draft, PROMPT, max_new_tokens=NEW, **args, **cost)
        assert out.tokens == reference, args
        if kind == "target" and args["method"] == "specexec":
            assert out.stats.tokens_per_step > 3, args  # the draft's tree was used, deep
        if kind == "perturbed":
            assert out.stats.tokens_per_step > 1.2, args


def test_a_context_grows_and_truncates_without_changing_logits(model, monkeypatch) -> None:
    from specexec.backends.llamacpp import runner as llamacpp

    monkeypatch.setattr(llamacpp, "CELL_BLOCK", 4)  # contexts in blocks of 4 cells, to grow often
    target = model("qwen2", "q8_0")
    tokens = torch.tensor(PROMPT * 5)
    whole = LlamaCppRunner(target, len(tokens)).extend(tokens, logits_to_keep=0)
    runner = LlamaCppRunner(target, 7)
    assert runner.capacity == 8
    small = runner.nbytes
    assert small > target.vocab_size * 4  # the logits reserve (one row per sequence) counts too
    runner.extend(tokens[:6])
    runner.reserve(19)  # a new, larger context; the cached tokens copied into it
    assert runner.capacity == 20 and runner.nbytes > small
    runner.extend(tokens[6:20])
    runner.reserve(21, most=30)
    assert runner.capacity == 32  # twice as many, rounded up to whole blocks
    runner.reserve(len(tokens))
    assert torch.equal(runner.extend(tokens[20:], logits_to_keep=0), whole[20:])
    runner.keep(torch.arange(10))  # truncated: the prefix a later prompt shares
    assert torch.equal(runner.extend(tokens[10:], logits_to_keep=0), whole[10:])
    assert llamacpp._in_blocks(1) == 4 and LlamaCppRunner(target, 1).capacity == 4


def test_a_block_split_into_batches_keeps_each_row_in_its_place(model, monkeypatch) -> None:
    """A block longer than a llama_decode batch: every batch's kept rows land where they belong, in the
    order asked for, whichever batches keep none."""
    from specexec.backends.llamacpp import runner as llamacpp

    target = model("qwen2", "q8_0")
    # A batch holds at least a row per sequence (llama.cpp asserts it when a context is made).
    monkeypatch.setattr(llamacpp, "BATCH", llamacpp.MAX_SEQUENCES)
    tokens = torch.tensor(PROMPT * 75)  # (600,): batches of 256, 256 and 88 tokens
    pieces = LlamaCppRunner(target, len(tokens))
    reference = torch.cat(
        [pieces.extend(tokens[a:b], logits_to_keep=0) for a, b in ((0, 100), (100, 400), (400, 600))]
    )
    whole = LlamaCppRunner(target, len(tokens)).extend(tokens, logits_to_keep=0)
    assert torch.equal(whole, reference)
    rows = torch.tensor([590, 3, 255])  # the last and first batches, out of order; the second keeps none
    kept = LlamaCppRunner(target, len(tokens)).extend(tokens, logits_to_keep=rows)
    assert torch.equal(kept, reference[rows])


def test_a_context_holds_one_sequence_until_its_first_tree(model) -> None:
    """llama.cpp reserves a logits row per sequence: plain decoding keeps one, and the first tree moves
    the committed tokens into a context with every sequence, its logits unchanged."""
    target = model("qwen2", "q8_0")
    tokens = torch.tensor(PROMPT * 2)
    whole = LlamaCppRunner(target, len(tokens) + 8).extend(tokens, logits_to_keep=0)
    assert LlamaCppRunner(target, len(tokens) + 8).sequences == MAX_SEQUENCES  # trees by default
    runner = LlamaCppRunner(target, len(tokens) + 8, trees=False)
    runner.extend(tokens[:-4])
    assert runner.sequences == 1
    plain = runner.nbytes
    n = len(tokens) - 4
    chain = runner.forward_tree(
        tokens[-4:], torch.arange(n, n + 4), torch.arange(n, n + 4), torch.ones(4, n + 4).tril(n).bool()
    )
    assert runner.sequences == MAX_SEQUENCES
    assert runner.nbytes - plain == (MAX_SEQUENCES - 1) * target.vocab_size * 4
    assert torch.equal(chain, whole[-4:])  # the copied prefix gives the same bits


def test_a_one_token_block_in_sequence_zero_leaves_nothing_behind(model) -> None:
    """Plain decoding writes its one-token blocks into the committed sequence itself; one that is not
    kept must leave no cell there, or the next token at that position would see it."""
    target = model("qwen2", "q8_0")
    n = len(PROMPT)

    def fresh(tokens: list[int]) -> torch.Tensor:
        return LlamaCppRunner(target, 32).extend(torch.tensor(tokens))

    def one(runner: LlamaCppRunner, token: int) -> torch.Tensor:
        block = torch.tensor([token])
        return runner.forward_tree(block, torch.tensor([n]), torch.tensor([n]), torch.ones(1, n + 1).bool())

    runner = LlamaCppRunner(target, 32, trees=False)
    runner.extend(torch.tensor(PROMPT))
    assert torch.equal(one(runner, 7), fresh(PROMPT + [7]))
    assert torch.equal(one(runner, 9), fresh(PROMPT + [9]))  # the same slot again: 7 is gone
    assert torch.equal(runner.extend(torch.tensor([11])), fresh(PROMPT + [11]))  # dropped: 9 is gone
    runner.keep(torch.arange(n))  # truncated: 11 is gone
    one(runner, 13)
    runner.keep(torch.arange(n + 1))  # committed
    assert runner.sequences == 1 and runner.length == n + 1
    assert torch.equal(runner.extend(torch.tensor([5])), fresh(PROMPT + [13, 5]))


def test_a_runner_starts_from_the_context_an_earlier_one_left_with_its_cache_emptied(model) -> None:
    """A context outlives its runner as a spare of its model (a new one costs up to 0.2 s): the next
    runner of the same shape takes it, and computes what a runner on a newly loaded model does."""
    target = model("llama", "q8_0")
    tokens = torch.tensor(PROMPT * 2)
    unused = LlamaCppModel(target.gguf, threads=1)  # no spares: every context it makes is new
    expected = LlamaCppRunner(unused, 40).extend(tokens, logits_to_keep=0)
    earlier = LlamaCppRunner(target, 40)
    earlier.extend(tokens[:5])
    forward_whole_tree(earlier, random_tree(3, 12, target.vocab_size, int(tokens[5])), 5)
    left = earlier.ctx
    del earlier
    runner = LlamaCppRunner(target, 40)
    assert runner.ctx == left
    assert torch.equal(runner.extend(tokens, logits_to_keep=0), expected)


def test_a_model_keeps_its_newest_spare_contexts_only(gguf_dir: Path) -> None:
    from specexec.backends.llamacpp.model import SPARE_CONTEXTS
    from specexec.backends.llamacpp.runner import CELL_BLOCK

    source = _model(str(gguf_dir), "qwen2", "f32", "target").gguf
    target = LlamaCppModel(source, threads=1)  # a model of its own: no spares yet
    runners = [LlamaCppRunner(target, i * CELL_BLOCK, trees=False) for i in range(1, SPARE_CONTEXTS + 2)]
    contexts = [r.ctx for r in runners]
    while runners:
        runners.pop(0)  # released oldest first
    assert target.take_context(CELL_BLOCK, 1) is None  # freed
    for i, ctx in enumerate(contexts[1:], start=2):
        assert target.take_context(i * CELL_BLOCK, 1) == ctx
        assert target.take_context(i * CELL_BLOCK, 1) is None  # taken
        target.give_context(ctx, i * CELL_BLOCK, 1)


@pytest.mark.parametrize(
    ("args", "sequences"),
    [(dict(method="ar"), 1), (dict(method="specexec", budget=16), MAX_SEQUENCES)],
    ids=["ar", "specexec"],
)
def test_plain_decoding_never_reserves_tree_sequences(model, monkeypatch, args, sequences) -> None:
    """ar keeps one sequence; a drafting generation makes its contexts with every sequence at once,
    rather than moving to them (a new context, about 0.1 s each) inside its first step."""
    from specexec.backends.llamacpp import runner as llamacpp
    from specexec.prefix_cache import PrefixCache

    moves = []
    rebuild = llamacpp.LlamaCppRunner._rebuild
    monkeypatch.setattr(
        llamacpp.LlamaCppRunner, "_rebuild", lambda self, *a: moves.append(a) or rebuild(self, *a)
    )
    target, draft = model("llama", "q8_0"), model("llama", "q8_0", "perturbed")
    cache = PrefixCache(1 << 30)  # keeps the runners, to look at them afterwards
    out = specexec.generate(target, draft, PROMPT, max_new_tokens=12, prefix_cache=cache, **args)
    assert out.tokens == ar_reference(target)[:12]
    (entry,) = cache._entries
    assert entry.target.sequences == sequences
    assert moves == []
    follow_up = PROMPT + out.tokens + [7, 8]  # the cached runner continues from its one sequence
    reused = specexec.generate(target, draft, follow_up, max_new_tokens=8, prefix_cache=cache, **args)
    assert reused.tokens == specexec.generate(target, draft, follow_up, max_new_tokens=8, **args).tokens


@pytest.mark.parametrize(
    "args", [dict(method="ar"), dict(method="specexec", budget=16)], ids=["ar", "specexec"]
)
def test_a_follow_up_reuses_the_cached_prefix(model, args) -> None:
    from specexec.prefix_cache import PrefixCache

    target, draft = model("llama", "q8_0"), model("llama", "q8_0", "perturbed")
    cache = PrefixCache(1 << 30)
    first = specexec.generate(target, draft, PROMPT, max_new_tokens=12, prefix_cache=cache, **args)
    turn = PROMPT + first.tokens + [7, 8, 9]
    reused = specexec.generate(target, draft, turn, max_new_tokens=24, prefix_cache=cache, **args)
    assert reused.stats.cached_tokens == len(PROMPT) + len(first.tokens) - 1
    assert reused.tokens == specexec.generate(target, draft, turn, max_new_tokens=24, **args).tokens


@pytest.mark.parametrize("method", ["specexec", "dsl"])
def test_a_draft_back_from_a_pause_skips_what_it_missed(model, method: str) -> None:
    """llama.cpp wants each sequence's positions consecutive: a draft that skips the tokens of its pause
    reads on at the next position, and its cache is the text with them cut out. Verification is flat
    but a draft forward over 4 tokens costs more than half a target pass, so where drafting has been
    losing it reads the last 3."""
    from specexec.budget.policy import catch_up_window
    from specexec.prefix_cache import PrefixCache

    target, draft = model("llama", "f32"), model("llama", "f32", "perturbed")
    dear_batches = CostModel({1: 1.0, 1024: 1.2}, {1: 0.05, 3: 0.5, 4: 0.8, 128: 0.9})
    assert catch_up_window(dear_batches) == 3
    learnt, cache = specexec.LearntPolicies(), PrefixCache(1 << 30)
    args = dict(method=method, budget="auto", cost_model=dear_batches, max_new_tokens=NEW, learnt=learnt)
    assert specexec.generate(target, draft, PROMPT, **args).stats.draft_calls > 0
    (policy,) = learnt._policies.values()
    gate = policy.gate
    gate.window = 10**6  # no later pause: one cut
    gate.paused, gate.history, gate.tokens, gate.seconds = 10, [], 1.0, 10.0  # losing
    out = specexec.generate(target, draft, PROMPT, prefix_cache=cache, **args)
    assert out.tokens == ar_reference(target)
    assert all(out.stats.tree_sizes[10:-1])

    (entry,) = cache._entries
    runner = entry.draft
    assert (runner.cut, runner.skipped) == (len(PROMPT) - 1, 11 - 3)
    assert_cache_is_text_with_cut(runner, entry.tokens, draft)


# -- a draft with a reduced head (--draft-vocab) -----------------------------------------------------------


@pytest.fixture
def reduced(gguf_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The test model and the same GGUF with a head of ids < 40 and 100 (padded to 64 rows)."""
    monkeypatch.setenv("SPECEXEC_CACHE", str(tmp_path / "cache"))

    def make(arch: str, weights: str, kind: str = "target") -> tuple[LlamaCppModel, LlamaCppModel]:
        full = _model(str(gguf_dir), arch, weights, kind)
        return full, LlamaCppModel(full.gguf, threads=1, vocab=40, always=[100])

    return make


@pytest.mark.parametrize(("arch", "weights"), [("llama", "f32"), ("qwen2", "q8_0")])
def test_a_reduced_head_scores_its_rows_as_the_full_head_does(reduced, arch: str, weights: str) -> None:
    full, small = reduced(arch, weights)
    kept = small.head
    assert kept.tolist() == [*range(63), 100] and small.head_rows == 64
    assert small.vocab_size == full.vocab_size
    assert small.cost_key() != full.cost_key()  # its own calibration
    # Inputs ids outside the head (>= 64 here) are read from the full embedding table.
    tokens = torch.tensor([*PROMPT, 120, 99, 64, 127])
    cut = torch.ones(full.vocab_size, dtype=torch.bool)
    cut[kept] = False
    for trees in (False, True):
        expected = LlamaCppRunner(full, 64, trees).extend(tokens, 0)  # (T, V)
        logits = LlamaCppRunner(small, 64, trees).extend(tokens, 0)
        assert torch.equal(logits[:, kept], expected[:, kept])
        assert torch.isneginf(logits[:, cut]).all()
    tree = random_tree(1, 24, full.vocab_size, PROMPT[-1])
    rows = []
    for model in (full, small):
        runner = LlamaCppRunner(model, 128)
        runner.extend(torch.tensor(PROMPT[:-1]))
        rows.append(forward_whole_tree(runner, tree, len(PROMPT) - 1)[:, kept])
    assert torch.equal(rows[0], rows[1])


def test_a_split_ggufs_draft_copies_are_the_one_files(reduced, tmp_path: Path) -> None:
    """The copies of a split GGUF (a first file of metadata only here) take their tensors from every file
    and are one file: the same logits as the copies of the model in one file."""
    full, small = reduced("qwen2", "q8_0")
    first = write_random_gguf(
        tmp_path / "split.gguf", "qwen2", "q8_0", split_max_tensors=10, metadata_first=True
    )
    split = LlamaCppModel(first, threads=1, vocab=40, always=[100])
    assert torch.equal(split.head, small.head)
    tokens = torch.tensor([*PROMPT, 120, 99])
    expected = LlamaCppRunner(small, 64).extend(tokens, 0)  # (T, V)
    assert torch.equal(LlamaCppRunner(split, 64).extend(tokens, 0), expected)
    # A requantized copy (llama.cpp's quantizer reads every file and writes one) too.
    requantized = [LlamaCppModel(path, threads=1, quant="q4_0") for path in (full.gguf, first)]
    one, parts = (LlamaCppRunner(model, 64).extend(tokens, 0) for model in requantized)
    assert torch.equal(parts, one)


def test_a_reduced_head_is_written_once(reduced, monkeypatch) -> None:
    from specexec.backends.llamacpp import draft_gguf

    first = reduced("llama", "f32")[1]
    monkeypatch.setattr(draft_gguf, "write_reduced_head_gguf", mock.Mock(side_effect=AssertionError))
    again = reduced("llama", "f32")[1]
    assert torch.equal(again.head, first.head)


def test_a_head_that_cannot_be_cut_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    import numpy as np
    from gguf import GGUFWriter

    monkeypatch.setenv("SPECEXEC_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "no-embedding.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("output.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(LlamaCppError, match="cannot write no-embedding.gguf with a smaller head"):
        LlamaCppModel(path, threads=1, vocab=4)
    assert not list((tmp_path / "cache" / "drafts").iterdir())  # nothing half-written


@pytest.mark.parametrize("kind", ["target", "perturbed"])
def test_every_method_is_exact_with_a_reduced_head_draft(model, reduced, kind: str) -> None:
    target, draft = model("qwen2", "q8_0"), reduced("qwen2", "q8_0", kind)[1]
    reference = ar_reference(target)
    assert any(t not in draft.head for t in reference)  # test design: the draft cannot propose them all
    for args in METHODS:
        cost = {"cost_model": FLAT} if args["budget"] == "auto" else {}
        out = specexec.generate(target, draft, PROMPT, max_new_tokens=NEW, **args, **cost)
        assert out.tokens == reference, args
        assert out.stats.tokens_per_step > 1.2, args  # the draft was used


# -- a draft requantized by llama.cpp (--draft-quant q8_0|q4_0) --------------------------------------------


def _types(gguf: Path) -> dict[str, str]:
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(gguf).tensors}


def test_a_requantized_draft_runs_q4_0_weights_and_leaves_its_gguf_alone(
    model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hashlib

    from specexec.backends.llamacpp import draft_gguf

    monkeypatch.setenv("SPECEXEC_CACHE", str(tmp_path / "cache"))
    source = model("qwen2", "f32", "perturbed").gguf
    before = hashlib.sha256(source.read_bytes()).hexdigest()
    draft = LlamaCppModel(source, threads=1, quant="q4_0")
    assert "Q4_0" in draft.weights and draft.quantization == "q4_0" and draft.head is None
    assert draft.cost_key() != model("qwen2", "f32", "perturbed").cost_key()  # its own calibration
    (folder,) = (tmp_path / "cache" / "drafts").iterdir()
    types = _types(folder / "model.gguf")
    matrices = {name: kind for name, kind in types.items() if name.endswith(".weight") and "norm" not in name}
    assert set(matrices.values()) - {"Q8_0"} == {"Q4_0"}, matrices  # the output layer may stay Q8_0
    assert hashlib.sha256(source.read_bytes()).hexdigest() == before
    monkeypatch.setattr(draft_gguf, "write_requantized_gguf", mock.Mock(side_effect=AssertionError))
    assert LlamaCppModel(source, threads=1, quant="q4_0").weights == draft.weights  # written once


@pytest.mark.parametrize("vocab", [0, 40])
def test_every_method_is_exact_with_a_requantized_draft(
    model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vocab: int
) -> None:
    monkeypatch.setenv("SPECEXEC_CACHE", str(tmp_path / "cache"))
    target = model("qwen2", "q8_0")
    draft = LlamaCppModel(
        model("qwen2", "q8_0", "perturbed").gguf, threads=1, vocab=vocab, always=[100], quant="q4_0"
    )
    assert "Q4_0" in draft.weights and (draft.head is not None) == bool(vocab)
    reference = ar_reference(target)
    for args in METHODS:
        cost = {"cost_model": FLAT} if args["budget"] == "auto" else {}
        out = specexec.generate(target, draft, PROMPT, max_new_tokens=NEW, **args, **cost)
        assert out.tokens == reference, args
        assert out.stats.tokens_per_step > 1.2, args  # the draft was used


def test_a_draft_copy_that_cannot_be_written_is_a_one_line_error(
    model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECEXEC_CACHE", str(tmp_path / "cache"))
    source = model("llama", "f32").gguf
    with pytest.raises(LlamaCppError, match="^--ram streams a target's own GGUF, not a draft's copy"):
        LlamaCppModel(source, threads=1, quant="q4_0", ram=0)
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(source.read_bytes()[: source.stat().st_size // 2])  # cut short
    with pytest.raises(LlamaCppError, match="^llama.cpp cannot requantize broken.gguf to Q4_0$"):
        LlamaCppModel(broken, threads=1, quant="q4_0")
    assert not list((tmp_path / "cache" / "drafts").iterdir())  # nothing half-written


def test_a_torch_draft_can_serve_a_llamacpp_target(model) -> None:
    """Backends are per model: the engine sees two runners, whatever drives them."""
    from tiny_models import tiny_model

    target = model("llama", "f32")
    draft = tiny_model("llama", seed=5, vocab_size=target.vocab_size)
    out = specexec.generate(target, draft, PROMPT, method="specexec", budget=16, max_new_tokens=NEW)
    assert out.tokens == ar_reference(target)


# -- every method, sampled ---------------------------------------------------------------------------------

V = 10
SAMPLE_PROMPT = [3]
SAMPLE_NEW = 3
DRAWS = 1_200
P_THRESHOLD = 1e-4
SAMPLE_METHODS = {
    "ar": dict(method="ar"),
    "sd": dict(method="sd", budget=2),
    "dsl": dict(method="dsl", budget=2, confidence_threshold=0.05),
    "specinfer": dict(method="specinfer", budget=8, branches=4),
    "specexec": dict(method="specexec", budget=12, expand=4, width=4),
    "specexec-auto": dict(method="specexec", budget="auto", cost_model=FLAT),
}


SAMPLING_MODES = ("resident", "streamed", "batch-invariant", "rpc")


@functools.cache
def sampling_pair(
    folder: str, mode: str = "resident", workers: tuple[str, ...] = ()
) -> tuple[LlamaCppModel, LlamaCppModel]:
    """The target as `mode` runs it, and the draft: "resident"; "streamed" from disk (`--ram 0`, a file
    of its own: a second model's mapping of the same file would hold its pages in RAM); "batch-invariant"
    (head size 32, what its 8-bit KV cache needs); "rpc", its two layers on `workers`."""
    hidden, layers = (128, 1) if mode == "batch-invariant" else (32, 2 if mode == "rpc" else 1)
    paths = [Path(folder) / f"small-{seed}-{mode}.gguf" for seed in (0, 7)]
    for path, seed, scale in zip(paths, (0, 7), (0.15, 0.5), strict=True):
        if not path.exists():  # logits grow with the hidden size: scaled back to the same spread
            synced(write_small_gguf(path, seed, scale * (32 / hidden) ** 0.5, hidden, layers))
    options = {
        "resident": {}, "streamed": {"ram": 0}, "batch-invariant": {"batch_invariant": True},
        "rpc": {"rpc": workers},
    }[mode]  # fmt: skip
    return LlamaCppModel(paths[0], threads=1, **options), LlamaCppModel(paths[1], threads=1)


def write_small_gguf(path: Path, seed: int, scale: float, hidden: int = 32, layers: int = 1) -> Path:
    """A 10-token vocabulary, spread-out distributions (the target) or sharper ones (the draft)."""
    return write_random_gguf(
        path,
        "llama",
        "f32",
        seed=seed,
        logit_scale=scale,
        vocab=V,
        hidden=hidden,
        ffn=2 * hidden,
        layers=layers,
    )


def exact_joint(target: LlamaCppModel, params: SamplingParams) -> torch.Tensor:
    """P(x1, x2, x3) under `params`, (V, V, V), from the backend's own logits."""
    p1 = probs_from_logits(sequential_logits(target, SAMPLE_PROMPT)[-1], params)
    joint = torch.zeros(V, V, V)
    for a, b in itertools.product(range(V), repeat=2):
        logits = sequential_logits(target, SAMPLE_PROMPT + [a, b])
        p2 = probs_from_logits(logits[-2], params)
        p3 = probs_from_logits(logits[-1], params)
        joint[a, b] = p1[a] * p2[b] * p3
    return joint


@pytest.mark.parametrize("mode", SAMPLING_MODES)
@pytest.mark.parametrize("method", list(SAMPLE_METHODS))
def test_every_method_samples_the_backends_distribution(
    gguf_dir: Path, method: str, mode: str, request: pytest.FixtureRequest
) -> None:
    if mode == "streamed" and not on_storage(gguf_dir):
        pytest.skip("the temporary folder is in memory (tmpfs): nothing can be streamed from it")
    workers = request.getfixturevalue("rpc_workers") if mode == "rpc" else ()
    target, draft = sampling_pair(str(gguf_dir), mode, workers)
    assert (target.stream is not None) == (mode == "streamed")
    assert target.batch_invariant == (mode == "batch-invariant") and (target.workers is not None) == (
        mode == "rpc"
    )
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    joint = exact_joint(target, params)
    assert float(joint.sum((1, 2)).max()) < 0.6  # test design: spread out
    counts = torch.zeros(V, V, V)
    accepted = 0
    for i in range(DRAWS):
        out = specexec.generate(
            target, draft, SAMPLE_PROMPT, max_new_tokens=SAMPLE_NEW, seed=1000 + i, temperature=1.0,
            **SAMPLE_METHODS[method],
        )  # fmt: skip
        counts[tuple(out.tokens)] += 1
        accepted += bool(out.stats.accepted and out.stats.accepted[0])
    if method != "ar":
        assert accepted > DRAWS // 20  # test design: drafts are partly accepted
    p12 = chi2_pvalue(counts.sum(2), joint.sum(2))
    p23 = chi2_pvalue(counts.sum(0), joint.sum(0))
    assert p12 > P_THRESHOLD and p23 > P_THRESHOLD, (p12, p23)


def test_sampling_negative_control(gguf_dir: Path) -> None:
    """The same statistic rejects specexec with a wrong acceptance rule (the cache walk following the
    first child when the target's sample is not in the tree) on this backend."""
    from test_distribution import biased_cache_walk

    target, draft = sampling_pair(str(gguf_dir))
    joint = exact_joint(target, SamplingParams(temperature=1.0, top_k=0, top_p=1.0))
    counts = torch.zeros(V, V, V)
    with mock.patch("specexec.methods.cache_walk", biased_cache_walk):
        for i in range(DRAWS):
            out = specexec.generate(
                target, draft, SAMPLE_PROMPT, max_new_tokens=SAMPLE_NEW, seed=1000 + i, temperature=1.0,
                **SAMPLE_METHODS["specexec"],
            )  # fmt: skip
            counts[tuple(out.tokens)] += 1
    p12 = chi2_pvalue(counts.sum(2), joint.sum(2))
    p23 = chi2_pvalue(counts.sum(0), joint.sum(0))
    assert min(p12, p23) < P_THRESHOLD, (p12, p23)


# -- choosing the backend, the command line ---------------------------------------------------------------


def test_auto_backend_is_llamacpp_for_gguf_sources_without_torch_only_options(tmp_path: Path) -> None:
    from specexec.backends.options import LoadOptions
    from specexec.models import ModelSourceError, choose_backend

    gguf = str(tmp_path / "m.gguf")
    assert choose_backend("auto", gguf, []) == "llamacpp"
    assert choose_backend("auto", "qwen2.5-coder-1.5b", []) == "llamacpp"
    assert choose_backend("auto", gguf, LoadOptions(quant="int8").given()) == "torch"
    assert choose_backend("auto", str(tmp_path), []) == "torch"  # a Hugging Face folder
    assert choose_backend("torch", gguf, []) == "torch"
    with pytest.raises(ModelSourceError, match="--quant w4a8 is for the torch backend"):
        choose_backend("llamacpp", gguf, LoadOptions(quant="w4a8").given())
    with pytest.raises(ModelSourceError, match="runs GGUF models"):
        choose_backend("llamacpp", str(tmp_path), [])


def test_generate_command_runs_on_llamacpp_and_names_the_backend(tokenized_gguf: Path, capsys) -> None:
    from specexec.cli import main

    args = ["generate", "--target", str(tokenized_gguf), "--draft", str(tokenized_gguf), "--threads", "1"]
    assert main([*args, "--method", "specexec", "--budget", "4", "--max-new-tokens", "6", "ab a"]) == 0
    err = capsys.readouterr().err
    assert "[specexec, llamacpp] 6 tokens" in err
    assert not (tokenized_gguf.parent / "cache" / "tiny").exists()  # the weights were not converted
    learnt = tokenized_gguf.parent / "cache" / "learnt"
    assert not learnt.exists()  # a fixed budget learns nothing
    assert "calibrated" not in err
    assert main([*args, "--budget", "auto", "--max-new-tokens", "6", "ab a"]) == 0
    assert len(list(learnt.glob("*.json"))) == 1  # what the auto budget learnt, for the next run
    # The first auto run measures this machine's costs before its first token, timed apart from the
    # generation ("6 tokens in 0.05 s"), which excludes it; the next run finds the calibration cached.
    first = capsys.readouterr().err.strip().splitlines()[-1]
    elapsed = float(first.split(" tokens in ")[1].split(" s ")[0])
    calibrated = float(first.split("calibrated in ")[1].split(" s ")[0])
    assert first.endswith("(once)") and calibrated > elapsed, first
    assert main([*args, "--max-new-tokens", "6", "ab a"]) == 0  # the default method and budget: auto
    assert "calibrated" not in capsys.readouterr().err
    assert main([*args, "--backend", "torch", "--method", "ar", "--max-new-tokens", "6", "ab a"]) == 0
    assert "[ar, torch] 6 tokens" in capsys.readouterr().err


def test_bench_command_runs_on_llamacpp_and_reports_its_weights(tokenized_gguf: Path) -> None:
    """The bench's report describes the GGUF's weights through the backend seam (it read a torch-only
    attribute once, and failed after every generation had run)."""
    import json

    from specexec.cli import main

    prompts = tokenized_gguf.parent / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "ab a"}) + "\n" + json.dumps({"prompt": "ba b"}) + "\n")
    out = tokenized_gguf.parent / "bench"
    models = ["--target", str(tokenized_gguf), "--draft", str(tokenized_gguf), "--backend", "llamacpp"]
    run = ["--prompts", str(prompts), "--max-new-tokens", "6", "--warmup-tokens", "2", "--threads", "1"]
    methods = ["--methods", "ar,specexec", "--budgets", "4", "--no-progress", "--out", str(out)]
    assert main(["bench", *models, *run, *methods, "--draft-quant", "q8_0"]) == 0
    rows = json.loads((out / "results.json").read_text())
    assert [row["label"] for row in rows] == ["ar", "specexec@4"]
    assert {row["machine"]["dtype"] for row in rows} == {LlamaCppModel(tokenized_gguf, threads=1).weights}
    assert "qwen2" in rows[0]["machine"]["dtype"] and all(row["identical_to_ar"] for row in rows)
    # The draft ran requantized to Q8_0, and the report says so.
    assert {row["machine"]["draft_quant"] for row in rows} == {"q8_0"}
    assert "Q8_0" in rows[0]["machine"]["draft_weights"]
    assert f"(draft {rows[0]['machine']['draft_weights']})" in (out / "results.md").read_text()


def test_llamacpp_errors_are_one_line(tokenized_gguf: Path, capsys) -> None:
    from specexec.cli import main

    target = ["--target", str(tokenized_gguf), "--draft", str(tokenized_gguf)]
    assert main(["generate", *target, "--backend", "llamacpp", "--dtype", "float32", "ab a"]) == 1
    assert main(["generate", *target, "--method", "specexec", "--budget", "400", "ab a"]) == 1
    assert main(["generate", *target, "--backend", "torch", "--draft-quant", "q4_0", "ab a"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        "specexec: error: --dtype float32 is for the torch backend; llama.cpp runs the GGUF's own weights",
        "specexec: error: budget 400 could make trees of more than the 255 leaves llama.cpp verifies in one "
        "pass; use a budget of at most 255",
        "specexec: error: --draft-quant q4_0 is for the llama.cpp backend (a GGUF draft requantized by "
        "llama.cpp)",
    ]


def _locked_bytes() -> int:
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmLck:"))) * 1024


def test_mlock_locks_the_weights_in_ram_and_nothing_else_does(tokenized_gguf: Path) -> None:
    before = _locked_bytes()
    plain = LlamaCppModel(tokenized_gguf, threads=1)
    assert _locked_bytes() == before  # the negative control
    del plain
    locked = LlamaCppModel(tokenized_gguf, threads=1, mlock=True)
    assert _locked_bytes() - before >= 0.9 * tokenized_gguf.stat().st_size
    del locked
    assert _locked_bytes() == before


def test_mlock_is_refused_with_ram_and_on_the_torch_backend(tokenized_gguf: Path, capsys) -> None:
    from specexec.cli import main

    target = ["--target", str(tokenized_gguf), "--method", "ar"]
    assert main(["generate", *target, "--mlock", "--ram", "0", "ab a"]) == 1
    assert main(["generate", *target, "--mlock", "--backend", "torch", "ab a"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "specexec: error: --mlock keeps every weight in RAM, --ram streams some from disk: choose one",
        "specexec: error: --mlock is for the llama.cpp backend (weights locked in RAM)",
    ]


def test_load_model_takes_a_backend(tokenized_gguf: Path) -> None:
    from specexec.models import ModelSourceError, load_model

    model = load_model(str(tokenized_gguf), backend="llamacpp", threads=1)
    assert isinstance(model, LlamaCppModel) and model.threads == 1
    assert isinstance(load_model(str(tokenized_gguf), backend="auto"), LlamaCppModel)
    assert not isinstance(load_model(str(tokenized_gguf), quant="int8", backend="auto"), LlamaCppModel)
    with pytest.raises(ModelSourceError, match="--quant int8 is for the torch backend"):
        load_model(str(tokenized_gguf), quant="int8", backend="llamacpp")
