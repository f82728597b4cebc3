"""--batch-invariant on the llama.cpp backend: a token's logits do not depend on the block it is verified
in, so every method's greedy output is plain decoding's own, bit for bit. On tiny GGUFs of the real
pair's tensor types (Q4_K and Q6_K from llama.cpp's own Q4_K_M quantizer), with the default mode as the
negative control."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import pytest
import torch
from tiny_gguf import write_random_gguf

import specexec
from specexec.backends.llamacpp import library
from specexec.backends.llamacpp.library import LlamaCppError, llama_cpp_library
from specexec.backends.llamacpp.model import LlamaCppModel
from specexec.backends.llamacpp.runner import KEPT_DROPPED_CELLS, LlamaCppRunner
from specexec.budget.costs import CostModel

LLAMA_FTYPE_MOSTLY_Q4_K_M = 15
PROMPT = [3, 17, 42, 7, 99, 5, 64, 12]
NEW = 40
# Flat costs: the auto budget drafts instead of deciding that speculation does not pay on tiny models.
FLAT = CostModel({1: 1.0, 1024: 1.2}, {1: 0.05, 128: 0.06})
METHODS = [
    dict(method="sd", budget=4),
    dict(method="dsl", budget="auto", cost_model=FLAT),
    dict(method="specinfer", budget=16, branches=4),
    dict(method="specexec", budget=8),
    dict(method="specexec", budget=96),  # past flash attention's 64-row tile and the tiled matmul's 8
    dict(method="specexec", budget="auto", cost_model=FLAT),
    dict(method="specinfer", budget=254, branches=254),  # every leaf sequence a batch-invariant context has
]


@functools.cache
def k_quant_gguf(folder: str, noise: float, layers: int = 2, ffn: int = 512) -> Path:
    """A tiny qwen2 GGUF in Q4_K_M (Q4_K and Q6_K tensors), quantized by llama.cpp from float32."""
    source = write_random_gguf(
        Path(folder) / f"f32-{noise}-{layers}-{ffn}.gguf", "qwen2", "f32", noise=noise, vocab=512, hidden=256,
        ffn=ffn, layers=layers,
    )  # fmt: skip
    llama_cpp = llama_cpp_library()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = 1
    dest = Path(folder) / f"q4_k_m-{noise}-{layers}-{ffn}.gguf"
    assert llama_cpp.llama_model_quantize(str(source).encode(), str(dest).encode(), ctypes.byref(params)) == 0
    return dest


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The target and a draft that agrees with it often, not always."""
    folder = str(tmp_path_factory.mktemp("k-quants"))
    return k_quant_gguf(folder, 0.0), k_quant_gguf(folder, 0.05)


def test_the_test_models_hold_the_real_pairs_tensor_types(ggufs) -> None:
    from gguf import GGUFReader

    types = {tensor.tensor_type.name for tensor in GGUFReader(ggufs[0]).tensors}
    assert {"Q4_K", "Q6_K"} <= types


def differing_blocks(model: LlamaCppModel, prefix: int) -> list[int]:
    """The block sizes k whose first row's logits differ from the same token's decoded alone, after
    `prefix` cached tokens."""
    tokens = torch.tensor((PROMPT * (prefix // len(PROMPT) + 1))[:prefix])
    block = torch.tensor((PROMPT[::-1] * 20)[:130])
    alone = LlamaCppRunner(model, prefix + 8, trees=False)
    alone.extend(tokens)
    expected = alone.extend(block[:1])
    found = []
    for k in (2, 4, 8, 16, 64, 130):
        runner = LlamaCppRunner(model, prefix + 256)
        runner.extend(tokens)
        n = runner.length
        positions = torch.arange(n, n + k)
        allowed = torch.ones(k, n + k, dtype=torch.bool).tril(n)  # a chain: row i sees rows <= i
        logits = runner.forward_tree(block[:k], positions, positions, allowed, logits_to_keep=k)
        if not torch.equal(logits[:1], expected):
            found.append(k)
    return found


@pytest.mark.parametrize("prefix", [8, 600])  # 600: flash attention splits one row's cells from 512 up
def test_a_rows_logits_do_not_depend_on_its_block(ggufs, prefix: int) -> None:
    model = LlamaCppModel(ggufs[0], threads=2, batch_invariant=True)
    assert differing_blocks(model, prefix) == []


def test_the_default_mode_gives_a_row_other_logits_in_a_block(ggufs) -> None:
    """The negative control: without the mode, llamafile's sgemm computes the attention of a block of
    rows in another order than one row's (repacked weights and the tiled matmul add their own)."""
    assert differing_blocks(LlamaCppModel(ggufs[0], threads=2), 8) != []


def assert_methods_give_ars_tokens(target, draft, methods: list[dict], new: int, distinct: int) -> list:
    """Every method's greedy tokens on PROMPT are `ar`'s on `target`, whose output has at least
    `distinct` different tokens (test design: not one repeated token); the methods' outputs."""
    reference = specexec.generate(target, None, PROMPT, method="ar", max_new_tokens=new).tokens
    assert len(set(reference)) >= distinct
    outputs = []
    for args in methods:
        out = specexec.generate(target, draft, PROMPT, max_new_tokens=new, **args)
        assert out.tokens == reference, args
        outputs.append(out)
    return outputs


def test_every_method_gives_plain_decodings_greedy_tokens(ggufs) -> None:
    target = LlamaCppModel(ggufs[0], threads=2, batch_invariant=True)
    draft = LlamaCppModel(ggufs[1], threads=1)
    outputs = assert_methods_give_ars_tokens(target, draft, METHODS, NEW, 8)
    for args, out in zip(METHODS, outputs, strict=True):
        if args["method"] == "specexec":
            assert out.stats.tokens_per_step > 1.2, args  # trees were verified, not single tokens


def test_dropped_cells_stay_taken_until_there_are_many(ggufs, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rejected nodes' cells are not freed (the next tree would fill the holes, below committed cells):
    the cache is laid out again, which frees them, only once more than KEPT_DROPPED_CELLS are taken, not
    after every tree (a copy of the cache each, across the network for a target on RPC workers)."""
    target = LlamaCppModel(ggufs[0], threads=2, batch_invariant=True)
    draft = LlamaCppModel(ggufs[1], threads=1)
    laid_out: list[int] = []
    compact = LlamaCppRunner._compact

    def counted(runner: LlamaCppRunner) -> None:
        laid_out.append(runner.dropped)
        compact(runner)

    monkeypatch.setattr(LlamaCppRunner, "_compact", counted)
    out = specexec.generate(target, draft, PROMPT, method="specexec", budget=96, max_new_tokens=NEW)
    assert out.stats.target_calls >= 8  # test design: many trees of up to 96 nodes
    assert 0 < len(laid_out) < out.stats.target_calls / 2
    assert all(dropped > KEPT_DROPPED_CELLS for dropped in laid_out)


def test_the_mode_must_come_before_the_processs_first_pass(monkeypatch) -> None:
    monkeypatch.delenv(library.TILED_MATMUL_SWITCH, raising=False)
    monkeypatch.setattr(library, "_contexts_made", True)
    with pytest.raises(LlamaCppError, match="before this process's first llama.cpp context"):
        library.batch_invariant_kernels()
    monkeypatch.setenv(library.TILED_MATMUL_SWITCH, "0")
    library.batch_invariant_kernels()  # already off: nothing to do


def test_the_torch_backend_refuses_the_mode(tmp_path: Path, capsys) -> None:
    from specexec.cli import main

    assert main(["generate", "--target", str(tmp_path), "--backend", "torch", "--batch-invariant", "x"]) == 1
    assert capsys.readouterr().err.strip() == (
        "specexec: error: --batch-invariant is for the llama.cpp backend (verification bit for bit as plain "
        "decoding)"
    )
