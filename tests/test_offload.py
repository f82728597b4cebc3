"""Weight offloading on the CPU: the streaming path (host buffers and ring both in CPU memory) must give
exactly the plain model's logits and tokens, hold at most `ring_size` layers in the ring, split layers as
`gpu_memory` says, refuse bad input with one-line errors; `simulate_offload` must charge bytes / GB/s.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import io
import json
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
from accelerate import init_empty_weights
from tiny_models import tiny_model

import specexec
from specexec.backends.torch.devices import to_device
from specexec.backends.torch.layers import OffloadError, decoder_layers, weight_bytes
from specexec.backends.torch.offload import OffloadedLayer, choose_placement, offload_model, plan_resident
from specexec.backends.torch.simulated import simulate_offload
from specexec.sizes import SizeError, parse_size

PROMPT = [3, 17, 42, 5, 9, 11, 60, 2]
NEW = 24
LAYERS = 5  # odd, so a ring of 2 wraps onto different slots from one forward to the next
CPU = torch.device("cpu")


@functools.cache
def plain(arch: str):
    return tiny_model(arch, seed=0, num_layers=LAYERS)


def offloaded(arch: str, **kwargs):
    model = copy.deepcopy(plain(arch))
    return model, offload_model(model, device="cpu", **kwargs)


@functools.cache
def reference(arch: str, method: str) -> tuple[int, ...]:
    target = plain(arch)
    draft = None if method == "ar" else target
    return tuple(
        specexec.generate(target, draft, PROMPT, method=method, max_new_tokens=NEW, budget=16).tokens
    )


def layer_bytes(model) -> int:
    layer = decoder_layers(model)[0]
    return sum(t.numel() * t.element_size() for t in [*layer.parameters(), *layer.buffers()])


def logits(model) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([PROMPT])).logits


# ---------------------------------------------------------------------------------------------------
# Exactness.


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_offloaded_logits_equal_plain(arch: str) -> None:
    model, offloader = offloaded(arch)
    assert torch.equal(logits(model), logits(plain(arch)))
    assert offloader.streamed == list(range(LAYERS)) and offloader.resident == []


@pytest.mark.parametrize("method", specexec.METHODS)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_offloaded_generation_equals_plain(arch: str, method: str) -> None:
    model, offloader = offloaded(arch)
    draft = None if method == "ar" else plain(arch)  # the draft stays a plain model
    out = specexec.generate(model, draft, PROMPT, method=method, max_new_tokens=NEW, budget=16)
    assert tuple(out.tokens) == reference(arch, method)
    if method != "ar":
        assert out.stats.tokens_per_step > 2  # a self draft: the tree was really verified
    assert offloader.stats.misses == 0  # every layer was prefetched in time


@pytest.mark.parametrize("ring_size", [1, 3, LAYERS, LAYERS + 2])
def test_any_ring_size_is_exact(ring_size: int) -> None:
    model, offloader = offloaded("llama", ring_size=ring_size)
    out = specexec.generate(model, plain("llama"), PROMPT, method="specexec", max_new_tokens=NEW, budget=16)
    assert tuple(out.tokens) == reference("llama", "specexec")
    assert offloader.ring_size == min(ring_size, LAYERS)


def test_layer_list_still_behaves_like_a_list() -> None:
    model, offloader = offloaded("qwen2")
    layers = decoder_layers(model)
    assert len(layers) == LAYERS and len(layers[1:3]) == 2 and len(list(layers)) == LAYERS
    assert all(isinstance(layer, OffloadedLayer) for layer in layers)
    assert layers[2].self_attn is layers[2].inner.self_attn  # attributes reach the wrapped layer
    inner = [layer.inner for layer in layers]
    offloader.remove()
    assert [type(layer) for layer in layers] == [type(layer) for layer in inner]
    assert all(a is b for a, b in zip(layers, inner, strict=True))
    assert torch.equal(logits(model), logits(plain("qwen2")))  # a plain model again, same weights
    assert weight_bytes(model) == weight_bytes(plain("qwen2"))


# ---------------------------------------------------------------------------------------------------
# The ring.


@pytest.mark.parametrize("ring_size", [1, 2, 3])
def test_at_most_ring_size_layers_in_the_ring(ring_size: int) -> None:
    model, offloader = offloaded("llama", ring_size=ring_size)
    ranges = offloader.slot_ranges()
    layers = decoder_layers(model)

    def in_ring(module) -> bool:
        return any(lo <= p.data_ptr() < hi for p in module.parameters() for lo, hi in ranges)

    seen = []

    def check(module, args) -> None:
        # This layer computes from the ring; no more than ring_size layers point into it at any time.
        assert all(any(lo <= p.data_ptr() < hi for lo, hi in ranges) for p in module.parameters())
        materialised = sum(in_ring(layer.inner) for layer in layers)
        assert 1 <= materialised <= ring_size
        seen.append(materialised)

    handles = [layer.inner.register_forward_pre_hook(check) for layer in layers]
    loads_before = offloader.stats.loads
    forwards = 3
    for _ in range(forwards):
        logits(model)
    for handle in handles:
        handle.remove()
    assert len(seen) == forwards * LAYERS
    assert not any(in_ring(layer.inner) for layer in layers)  # between forwards: host views only
    assert len(ranges) == ring_size  # the ring's buffers, and nothing else on the "device"
    assert offloader.ring_bytes == ring_size * offloader.slot_bytes
    assert offloader.stats.peak_live_layers == 1
    # Each forward moves every streamed layer exactly once (the prefetch wraps into the next forward).
    assert offloader.stats.loads - loads_before == forwards * LAYERS
    assert offloader.stats.misses == 0


def test_a_failed_forward_leaves_a_working_ring() -> None:
    model, offloader = offloaded("llama")
    layers = decoder_layers(model)

    def boom(module, args):
        raise RuntimeError("boom")

    handle = layers[2].inner.register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        logits(model)
    handle.remove()
    assert torch.equal(logits(model), logits(plain("llama")))
    assert offloader.stats.peak_live_layers == 1


# ---------------------------------------------------------------------------------------------------
# --gpu-memory: resident layers first, the rest stream.


def test_gpu_memory_keeps_leading_layers_resident() -> None:
    probe, probe_offloader = offloaded("llama")
    fixed, per_layer = probe_offloader.weights_bytes, layer_bytes(plain("llama"))
    assert probe_offloader.slot_bytes >= per_layer
    slot = probe_offloader.slot_bytes
    # Room for the fixed part, a ring of 2 and two resident layers (plus a little).
    budget = fixed + 2 * slot + 2 * per_layer + 100
    model, offloader = offloaded("llama", gpu_memory=budget)
    assert offloader.resident == [0, 1] and offloader.streamed == [2, 3, 4]
    layers = decoder_layers(model)
    assert not isinstance(layers[0], OffloadedLayer) and isinstance(layers[2], OffloadedLayer)
    assert offloader.weights_bytes + offloader.ring_bytes <= budget
    assert weight_bytes(model) == 3 * slot  # only streamed layers move per forward
    out = specexec.generate(model, plain("llama"), PROMPT, method="specexec", max_new_tokens=NEW, budget=16)
    assert tuple(out.tokens) == reference("llama", "specexec")


def test_gpu_memory_that_holds_everything_streams_nothing() -> None:
    model, offloader = offloaded("qwen2", gpu_memory="1GiB")
    assert offloader.resident == list(range(LAYERS)) and offloader.streamed == []
    assert offloader.ring_bytes == 0 and weight_bytes(model) == 0
    assert torch.equal(logits(model), logits(plain("qwen2")))


def test_plan_resident() -> None:
    dense, streamed = [100] * 4, [100] * 4
    plan = functools.partial(plan_resident, dense, streamed, fixed_bytes=50, ring_size=2)
    assert plan(gpu_memory=None) == 0
    assert plan(gpu_memory=450) == 4  # everything fits: no ring
    assert plan(gpu_memory=449) == 1  # 50 + 1 resident + ring of 2 (2 resident would need 450)
    assert plan(gpu_memory=350) == 1
    assert plan(gpu_memory=349) == 0
    assert plan(gpu_memory=250) == 0
    with pytest.raises(OffloadError, match="too small"):
        plan(gpu_memory=249)
    # Encoded layers: the ring holds 4-bit slots, plus one dense scratch layer.
    encoded = functools.partial(
        plan_resident, dense, [30] * 4, fixed_bytes=50, ring_size=2, scratch_bytes=[100] * 4
    )
    assert encoded(gpu_memory=260) == 0  # 50 + ring 2 x 30 + scratch 100 = 210
    assert encoded(gpu_memory=360) == 1
    assert encoded(gpu_memory=410) == 2
    assert encoded(gpu_memory=450) == 4


# ---------------------------------------------------------------------------------------------------
# Bad input: ValueError subclasses with one-line messages.


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert isinstance(err.value, ValueError) and message and "\n" not in message
    return message


def test_bad_input_is_refused() -> None:
    model = copy.deepcopy(plain("llama"))
    with pytest.raises(OffloadError) as err:
        offload_model(model, device="cpu", ring_size=0)
    assert "ring size" in one_line(err)
    with pytest.raises(OffloadError) as err:
        offload_model(model, device="cpu", gpu_memory=layer_bytes(model) - 1)
    assert "too small" in one_line(err)
    with pytest.raises(OffloadError) as err:
        offload_model(model, device="cpu", gpu_memory="lots")
    one_line(err)
    with pytest.raises(OffloadError) as err:
        offload_model(model, device="cpu", codec="int3")
    one_line(err)
    assert isinstance(decoder_layers(model)[0], type(decoder_layers(plain("llama"))[0]))  # untouched
    offload_model(model, device="cpu")
    with pytest.raises(OffloadError) as err:
        offload_model(model, device="cpu")
    assert "already offloaded" in one_line(err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_offload_without_cuda_is_refused() -> None:
    model = copy.deepcopy(plain("llama"))
    with pytest.raises(OffloadError) as err:
        offload_model(model)  # the --offload default device: the GPU
    assert "CUDA" in one_line(err) and "--simulate-offload-gbps" in str(err.value)
    with pytest.raises(OffloadError) as err:
        offload_model(model, device="cuda")
    one_line(err)


# ---------------------------------------------------------------------------------------------------
# On a CUDA GPU (skipped elsewhere): side-stream copies, ordered against compute by events only, must not
# change a logit. CI has no GPU; these passed on a lent H200 (docs/benchmarks.md), before CUDA graphs.

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("ring_size", [1, 2, LAYERS + 2])
@pytest.mark.parametrize("method", specexec.METHODS)
def test_offloaded_on_the_gpu_equals_the_resident_model(method: str, ring_size: int) -> None:
    cuda = torch.device("cuda")
    resident = copy.deepcopy(plain("llama")).to(cuda)
    model = copy.deepcopy(plain("llama"))
    offloader = offload_model(model, device=cuda, ring_size=ring_size)
    ids = torch.tensor([PROMPT], device=cuda)
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, resident(ids).logits)
    draft = None if method == "ar" else resident
    settings = dict(method=method, max_new_tokens=NEW, budget=16)
    expected = specexec.generate(resident, draft, PROMPT, **settings).tokens
    assert specexec.generate(model, draft, PROMPT, **settings).tokens == expected
    assert offloader.stats.misses == 0


@needs_cuda
def test_slow_copies_on_the_gpu_are_waited_for() -> None:
    """Layers of 140 MB, whose copies take milliseconds while an 8-token forward computes in microseconds:
    a missing wait would run a layer on the previous occupant of its slot and change the logits."""
    cuda = torch.device("cuda")
    big = tiny_model("qwen2", seed=3, num_layers=LAYERS, hidden_size=2048, num_heads=16, num_kv_heads=4)
    resident = copy.deepcopy(big).to(cuda)
    offloader = offload_model(big, device=cuda, ring_size=2)
    ids = torch.tensor([PROMPT], device=cuda)
    with torch.inference_mode():
        for _ in range(3):  # later forwards start from the prefetches the previous one issued
            assert torch.equal(big(ids).logits, resident(ids).logits)
    out = specexec.generate(big, resident, PROMPT, method="specexec", max_new_tokens=NEW, budget=16)
    assert out.tokens == specexec.generate(resident, None, PROMPT, method="ar", max_new_tokens=NEW).tokens
    assert offloader.stats.misses == 0


def test_parse_size() -> None:
    assert parse_size("20GiB") == 20 * 2**30
    assert parse_size("1.5 GB") == 1_500_000_000
    assert parse_size("512M") == 512 * 2**20
    assert parse_size("4096") == 4096
    for bad in ("", "GiB", "-1GiB", "0", "12 parsecs"):
        with pytest.raises(SizeError) as err:
            parse_size(bad)
        one_line(err)


def test_choose_placement() -> None:
    gib = 2**30
    assert choose_placement(10 * gib, []) == "cpu"
    assert choose_placement(10 * gib, [80 * gib]) == "gpu"
    assert choose_placement(100 * gib, [80 * gib, 80 * gib]) == "device_map"
    assert choose_placement(100 * gib, [80 * gib]) == "offload"
    assert choose_placement(200 * gib, [80 * gib, 80 * gib]) == "offload"


# ---------------------------------------------------------------------------------------------------
# Building from the meta device, and 4-bit codecs.


def test_meta_built_model_is_filled_in_place() -> None:
    source = plain("qwen2")
    weights = dict(source.named_parameters())
    with init_empty_weights(include_buffers=False):
        model = type(source)._from_config(source.config, dtype=torch.float32)
    model.eval()

    def fill(name: str, out: torch.Tensor) -> None:
        out.copy_(weights[name])

    offload_model(model, device="cpu", meta_init=fill)
    assert torch.equal(logits(model), logits(source))
    with init_empty_weights(include_buffers=False):
        empty = type(source)._from_config(source.config, dtype=torch.float32)
    with pytest.raises(OffloadError) as err:
        offload_model(empty, device="cpu")
    assert "meta" in one_line(err)
    resident = to_device(type(source)._from_config(source.config, dtype=torch.float32), CPU)
    assert resident.device == CPU


class HalfCodec:
    """A test codec: weights stored as bfloat16 (two parts: the high and low byte planes)."""

    name = "half-test"

    def encodes(self, name, tensor):
        return name.endswith("weight") and tensor.dim() == 2

    def part_specs(self, shape, dtype):
        return [(tuple(shape), torch.bfloat16), ((1,), torch.float32)]

    def encode(self, tensor):
        return [tensor.to(torch.bfloat16), torch.ones(1)]

    def decode(self, parts, out):
        out.copy_(parts[0].to(out.dtype) * parts[1])


def rounded_copy(model, codec) -> torch.nn.Module:
    """The plain model with every encoded weight replaced by decode(encode(weight))."""
    copy_ = copy.deepcopy(model)
    with torch.no_grad():
        for layer in decoder_layers(copy_):
            for name, param in layer.named_parameters():
                if codec.encodes(name, param):
                    codec.decode(codec.encode(param.data), param.data)
    return copy_


@pytest.mark.parametrize("codec_name", ["half-test", "nf4"])
def test_encoded_layers_match_the_decoded_model(codec_name: str) -> None:
    if codec_name == "nf4":
        if importlib.util.find_spec("bitsandbytes") is None:
            pytest.skip("bitsandbytes is not installed")
        from specexec.backends.torch.codec import NF4Codec

        codec = NF4Codec()
    else:
        codec = HalfCodec()
    expected = rounded_copy(plain("llama"), codec)
    model = copy.deepcopy(plain("llama"))
    offloader = offload_model(model, device="cpu", codec=codec)
    assert offloader.scratch_bytes > 0
    if codec_name == "nf4":
        assert weight_bytes(model) < weight_bytes(plain("llama")) / 3  # 4.5 bits instead of 32
    assert torch.equal(logits(model), logits(expected))
    for method in ("ar", "specexec"):
        draft = None if method == "ar" else expected
        ours = specexec.generate(model, draft, PROMPT, method=method, max_new_tokens=NEW, budget=16)
        theirs = specexec.generate(expected, draft, PROMPT, method=method, max_new_tokens=NEW, budget=16)
        assert ours.tokens == theirs.tokens
    offloader.remove()  # back to plain (decoded) weights
    assert torch.equal(logits(model), logits(expected))


# ---------------------------------------------------------------------------------------------------
# Simulated offload.


def test_simulate_offload_charges_bytes_over_bandwidth() -> None:
    model = copy.deepcopy(plain("llama"))
    nbytes = weight_bytes(model)
    assert nbytes == LAYERS * layer_bytes(model)
    seconds = 0.15
    handle = simulate_offload(model, gbps=nbytes / seconds / 1e9)
    assert "simulated" in handle.label
    start = time.perf_counter()
    logits(model)
    assert time.perf_counter() - start >= seconds
    out = specexec.generate(model, None, PROMPT, method="ar", max_new_tokens=3)
    assert out.stats.target_seconds >= 3 * seconds  # the engine's own timing sees it, unchanged
    assert handle.calls >= 4
    handle.remove()
    start = time.perf_counter()
    logits(model)
    assert time.perf_counter() - start < seconds
    with pytest.raises(OffloadError) as err:
        simulate_offload(model, gbps=0)
    one_line(err)


# ---------------------------------------------------------------------------------------------------
# The GPU check script, in its CPU dry-run mode.


def test_gpu_benchmark_dry_run(tmp_path: Path) -> None:
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_offload.py"
    spec = importlib.util.spec_from_file_location("gpu_offload", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(bench)
    finally:
        del sys.modules[spec.name]
    tokens = tmp_path / "results.json"
    rows = [
        {"method": "ar", "budget": None, "tokens_per_step": 1.0},
        {"method": "specexec", "budget": 64, "tokens_per_step": 8.0, "draft_calls": 40, "target_calls": 10},
        {"method": "specexec", "budget": 4096, "tokens_per_step": 9.0, "draft_calls": 90, "target_calls": 10},
    ]
    tokens.write_text(json.dumps(rows))
    out = tmp_path / "gpu.json"
    printed = io.StringIO()
    with redirect_stdout(printed):
        bench.main(["--dry-run", "--json", str(out), "--tokens-per-step", str(tokens)])
    result = json.loads(out.read_text())
    assert result["dry_run"] is True
    assert set(result["forward"]) == {"llama-13b", "qwen2.5-1.5b"}
    assert result["launch_bound"]["profiled_cpu_seconds"] > 0 and result["launch_bound"]["run"]["new_tokens"]
    labels = [run["label"] for run in result["engine"]]
    assert labels[:2] == ["ar, offloaded", "specexec@8, offloaded"] and "accelerate" in labels[2]
    projected = result["projection"]["rows"]
    assert all(row["projected"] and row["tok_per_s"] > 0 for row in projected)
    assert [row["label"] for row in projected][:3] == [
        "ar offloaded",
        "ar, accelerate cpu_offload",
        "specexec@64 offloaded",
    ]
    assert "specexec@4096 offloaded" not in [row["label"] for row in projected]  # outside 64-2048
    assert projected[-1]["label"].startswith("specexec auto")
    assert projected[2]["draft_passes_per_step"] == 4.0
    text = printed.getvalue().rstrip()
    assert "PROJECTED" in text and "DRY RUN" in text
    assert text.splitlines()[-1].endswith(("PASS", "FAIL"))  # the goals table comes last
