"""int8/int4/w4a8 quantization: the kernels compute the quantized model (the dequantized weights; for w4a8
also the int8-rounded activations, row by row, whatever the number of rows), and every method is exact
relative to the quantized target's own greedy decoding and sampling distribution."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny_models import chi2_pvalue, hf_greedy, perturbed, tiny_model
from torch import nn

import specexec
from specexec.backends.torch.native import NativeDecoder
from specexec.backends.torch.quant import (
    LOW_BIT_MAX_ROWS,
    QuantError,
    QuantLinear,
    SharedInput,
    quant_label,
    quantize_model,
    w4a8_kernel,
    w4a8_reference,
)
from specexec.budget.costs import CostModel
from specexec.sampling import SamplingParams, probs_from_logits

# int4 and w4a8 need in_features % 64 == 0 and out_features % 16 == 0: hidden 64, vocab 96 fit.
SHAPE = dict(vocab_size=96, hidden_size=64, num_heads=4, num_kv_heads=2)
PROMPT = [3, 17, 42, 5, 9, 11, 60, 2, 17, 42]
NEW = 48


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_linear_computes_its_dequantized_weights(bits: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(128, 96, bias=True).to(dtype).requires_grad_(False)
    quant = QuantLinear(linear, f"int{bits}")
    error = (
        quant.dequantized.float() - linear.weight.float()
    ).abs().max() / linear.weight.float().abs().max()
    assert 0 < float(error) < (0.01 if bits == 8 else 0.1)  # it is quantized, and not garbage
    for rows in (1, LOW_BIT_MAX_ROWS, LOW_BIT_MAX_ROWS + 1, 17):  # the low-bit kernel, then the dense path
        x = torch.randn(2, rows, 128, dtype=dtype) if rows > 1 else torch.randn(1, 1, 128, dtype=dtype)
        expected = x.float() @ quant.dequantized.float().t() + linear.bias.float()
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(quant(x).float(), expected, atol=tolerance * 10, rtol=tolerance)


@pytest.mark.parametrize("shape", [(64, 16), (128, 96), (8960 // 35, 48)])  # K 256, a few groups
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4a8_kernel_is_its_reference_row_by_row(shape: tuple[int, int], dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    k, n = shape
    linear = nn.Linear(k, n, bias=True).to(dtype).requires_grad_(False)
    quant = QuantLinear(linear, "w4a8")
    x = torch.randn(19, k, dtype=dtype) * torch.rand(19, 1, dtype=dtype)  # 19 rows: 2 tiles of 8 and 3
    x[4, :64] = 0  # an all-zero group
    out = quant(x)
    assert out.dtype == dtype
    expected = w4a8_reference(x.float(), quant) + linear.bias.double()  # (19, N)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), expected.to(dtype).double(), atol=tolerance, rtol=tolerance)
    # Each row alone gives the same bits: a verified block equals one-token decoding.
    assert torch.equal(out, torch.cat([quant(x[i : i + 1]) for i in range(19)]))
    assert torch.equal(quant(x[None, 3:9]), out[None, 3:9])  # (1, T, K) as a model passes it
    # It is a real quantization of the layer: close to the float result, not equal.
    dense = F.linear(x.float(), linear.weight.float(), linear.bias.float())
    error = float((out.float() - dense).abs().max() / dense.abs().max())
    assert 1e-4 < error < 0.1


def test_w4a8_uses_amx_where_the_cpu_has_it() -> None:
    """Where AMX exists the block rows above (19 at once vs one at a time) compared its tiles with VNNI."""
    has_amx = "amx_int8" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else False
    if not has_amx:
        pytest.skip("no AMX on this CPU")
    assert w4a8_kernel().w4a8_enable_amx() == 1


def test_w4a8_portable_path_gives_the_same_bits_as_the_vector_path(monkeypatch) -> None:
    torch.manual_seed(1)
    quant = QuantLinear(nn.Linear(192, 32, bias=False).requires_grad_(False), "w4a8")
    x = torch.randn(11, 192)
    vector = quant(x)
    portable = w4a8_kernel("x86-64")
    assert portable.w4a8_has_vnni() == 0
    monkeypatch.setattr("specexec.backends.torch.quant.w4a8_kernel", lambda: portable)
    assert torch.equal(quant(x), vector)


def test_w4a8_without_a_compiler_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(QuantError, match="install gcc"):
        w4a8_kernel.__wrapped__()


def test_quantize_model_replaces_linears_and_the_head() -> None:
    model = tiny_model("qwen2", seed=0, **SHAPE)
    with torch.inference_mode():
        before = model(torch.tensor([PROMPT])).logits
    quantize_model(model, "int4")
    assert quant_label(model) == "int4"
    assert isinstance(model.get_output_embeddings(), QuantLinear)
    assert not any(type(m) is nn.Linear for m in model.modules())
    with torch.inference_mode():
        after = model(torch.tensor([PROMPT])).logits
    assert 0 < float((after - before).abs().max()) < float(before.abs().max())
    with pytest.raises(QuantError, match="already quantized"):
        quantize_model(model, "int8")
    with pytest.raises(QuantError, match="unknown quantization"):
        quantize_model(tiny_model("qwen2", seed=0, **SHAPE), "int3")
    assert quantize_model(plain := tiny_model("qwen2", seed=0, **SHAPE), "none") is plain
    assert quant_label(plain) == "none"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_w4a8_projections_sharing_an_input_run_as_one_call_with_the_same_bits(arch: str, monkeypatch) -> None:
    calls = []
    matmul = specexec.backends.torch.quant._w4a8_matmul
    monkeypatch.setattr(
        "specexec.backends.torch.quant._w4a8_matmul", lambda *a: calls.append(1) or matmul(*a)
    )
    shared = quantize_model(tiny_model(arch, seed=0, **SHAPE), "w4a8")
    with monkeypatch.context() as m:
        m.setattr("specexec.backends.torch.quant.share_inputs", lambda model: None)
        separate = quantize_model(tiny_model(arch, seed=0, **SHAPE), "w4a8")
    layers = shared.config.num_hidden_layers
    tokens = torch.tensor([PROMPT])
    with torch.inference_mode():
        calls.clear()
        expected = separate(tokens).logits
        assert len(calls) == 7 * layers + 1  # q, k, v, o, gate, up, down per layer, and the head
        calls.clear()
        got = shared(tokens).logits
        assert len(calls) == 4 * layers + 1  # q/k/v and gate/up in one call each
    assert torch.equal(got, expected)
    # A member called with another input, or twice with one, computes afresh.
    a, b = (QuantLinear(nn.Linear(64, n).requires_grad_(False), "w4a8") for n in (32, 48))
    x, y = torch.randn(3, 64), torch.randn(3, 64)
    with torch.inference_mode():
        ax, bx, by = a(x), b(x), b(y)
        SharedInput([a, b])
        assert a.shared is b.shared and a.qweight.data_ptr() == a.shared.qweight.data_ptr()
        for got, want in zip([a(x), b(y), a(x), a(x), b(x)], [ax, by, ax, ax, bx], strict=True):
            assert torch.equal(got, want)
        assert a.shared.input is None  # both served from x: nothing held


@pytest.mark.parametrize("mode", ["int4", "w4a8"])
def test_4_bit_modes_fall_back_to_int8_where_the_kernel_cannot_take_the_shape(mode: str) -> None:
    model = quantize_model(tiny_model("llama", seed=0, vocab_size=90, hidden_size=64), mode)
    head = model.get_output_embeddings()
    assert head.mode == "int8"  # 90 output rows: not a multiple of 16
    assert model.model.layers[0].mlp.up_proj.mode == mode
    assert quant_label(model) == mode


@functools.cache
def quantized_pair(arch: str, mode: str):
    target = quantize_model(tiny_model(arch, seed=0, **SHAPE), mode)
    draft = perturbed(tiny_model(arch, seed=0, **SHAPE), 0.01)
    return target, quantize_model(draft, mode)


CASES = {
    "ar": dict(method="ar"),
    "sd": dict(method="sd", budget=4),
    "dsl": dict(method="dsl", budget=20),
    "specinfer": dict(method="specinfer", budget=16),
    "specexec": dict(method="specexec", budget=32),
    "specexec-narrow": dict(method="specexec", budget=32, expand=2),
    "specexec-ngram": dict(method="specexec", budget=8, ngram=6),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", ["int8", "int4", "w4a8"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_is_the_quantized_targets_own_greedy(arch: str, mode: str, case: str) -> None:
    target, draft = quantized_pair(arch, mode)
    out = specexec.generate(target, draft, PROMPT, max_new_tokens=NEW, eos_token_id=[], **CASES[case])
    assert out.tokens == hf_greedy(target, PROMPT, NEW)
    if case != "ar":
        assert out.stats.tokens_per_step > 1.5  # the draft is used


def test_auto_budget_on_quantized_models_is_exact() -> None:
    target, draft = quantized_pair("llama", "int4")
    cost = CostModel({1: 0.02, 3: 0.03, 4: 0.06, 64: 0.08}, {1: 0.005, 3: 0.008, 4: 0.02, 64: 0.03})
    out = specexec.generate(
        target, draft, PROMPT, method="specexec", budget="auto", cost_model=cost, max_new_tokens=NEW
    )
    assert out.tokens == hf_greedy(target, PROMPT, NEW)


# -- sampling: the quantized engine draws from the quantized target's distribution --------------------------

P_THRESHOLD = 1e-4  # as in test_distribution
V = 16
SMALL = dict(vocab_size=V, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1)  # int4 fits: K % 64
SAMPLE_PROMPT = [3]
DRAWS = 1_200


@functools.cache
def sampling_models(mode: str):
    target = tiny_model("llama", seed=0, init_range=0.2, **SMALL)
    draft = tiny_model("llama", seed=7, init_range=0.6, **SMALL)
    plain_target = tiny_model("llama", seed=0, init_range=0.2, **SMALL)
    return quantize_model(target, mode), quantize_model(draft, mode), plain_target


def exact_joint(model) -> torch.Tensor:
    """P(x1, x2) of `model` at temperature 1, (V, V), by enumeration."""
    params = SamplingParams(1.0)
    with torch.inference_mode():
        logits = model(torch.tensor([SAMPLE_PROMPT + [a] for a in range(V)])).logits  # (V, 2, V)
    p1 = probs_from_logits(logits[0, 0], params)  # (V,)
    return p1[:, None] * probs_from_logits(logits[:, 1], params)


@functools.cache
def sampled_counts(method: str, mode: str) -> torch.Tensor:
    target, draft, _ = sampling_models(mode)
    args = {"sd": dict(budget=1), "specexec": dict(budget=6, expand=2, width=3)}[method]
    counts = torch.zeros(V, V)
    for i in range(DRAWS):
        out = specexec.generate(
            target, draft, SAMPLE_PROMPT, method=method, max_new_tokens=2, temperature=1.0, seed=i, **args
        )
        counts[tuple(out.tokens)] += 1
    return counts


@pytest.mark.parametrize(("method", "mode"), [("sd", "int4"), ("specexec", "int4"), ("specexec", "w4a8")])
def test_quantized_sampling_matches_the_quantized_target(method: str, mode: str) -> None:
    target, _, plain = sampling_models(mode)
    counts = sampled_counts(method, mode)
    assert chi2_pvalue(counts, exact_joint(target)) > P_THRESHOLD
    # Negative control: the same draws are recognisably not the unquantized model's distribution.
    assert chi2_pvalue(counts, exact_joint(plain)) < P_THRESHOLD


def block_forward(decoder: NativeDecoder, tokens: list[int], positions: list[int], start: int, allowed):
    slots = torch.arange(start, start + len(tokens))
    return decoder.forward(torch.tensor(tokens), torch.tensor(positions), slots, allowed, 0)  # (n, V)


def causal(start: int, n: int) -> torch.Tensor:
    return torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]  # (n, start + n)


def tree_rows_equal_path_decoding(
    model, n: int, attention_dtype: torch.dtype | None, reverse_prefix: bool = False
) -> bool:
    """After n prompt tokens, whether a 6-node tree's logits on one root-to-leaf path equal, bit for bit,
    those of decoding that path one token at a time. With `reverse_prefix`, the one-token decoder's
    prompt KV is moved to the reverse slot order first: the same keys, summed in another order."""
    prefix = [(7 * i + 3) % 96 for i in range(n)]
    tokens, parents = [5, 8, 9, 13, 21, 34], [-1, 0, 0, 1, 2, 4]  # two branches; node 5 under 0 -> 2 -> 4
    depths = [0, 1, 1, 2, 2, 3]
    allowed = torch.zeros(6, n + 6, dtype=torch.bool)
    allowed[:, :n] = True
    for node in range(6):
        ancestor = node
        while ancestor >= 0:
            allowed[node, n + ancestor] = True
            ancestor = parents[ancestor]
    path = [0, 2, 4, 5]
    tree, one_by_one = (NativeDecoder(model, n + 8, attention_dtype) for _ in range(2))
    for decoder in (tree, one_by_one):
        block_forward(decoder, prefix, list(range(n)), 0, causal(0, n))
    if reverse_prefix:
        one_by_one.gather(torch.arange(n).flip(0), 0)  # keys carry their rotary positions: same math
    tree_logits = block_forward(tree, tokens, [n + d for d in depths], n, allowed)[path]
    path_logits = torch.cat([
        block_forward(one_by_one, [tokens[node]], [n + i], n + i, causal(n + i, 1))
        for i, node in enumerate(path)
    ])  # fmt: skip
    return torch.equal(tree_logits, path_logits)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_w4a8_tree_rows_are_one_token_decoding_bit_for_bit(arch: str) -> None:
    """Under w4a8 every operation of the native forward gives a row the same bits whatever the block, the
    attention because it runs in float64: a tree node's logits equal those of decoding its path one token
    at a time, even with the prompt's keys summed in reverse order. Control: float32 attention over the
    reversed prompt gives other bits for some prompt lengths (float32 sums depend on their order on every
    machine; whether the kernels' own blockings differ between a tree and one token is up to the CPU, so
    that is not the control)."""
    model = quantize_model(tiny_model(arch, seed=0, **SHAPE), "w4a8")
    assert NativeDecoder(model, 8).attention_dtype == torch.float64
    lengths = (100, 140, 200, 300)
    assert all(tree_rows_equal_path_decoding(model, n, None) for n in lengths)
    assert all(tree_rows_equal_path_decoding(model, n, None, reverse_prefix=True) for n in lengths)
    reordered = [tree_rows_equal_path_decoding(model, n, torch.float32, reverse_prefix=True) for n in lengths]
    assert not all(reordered), reordered
